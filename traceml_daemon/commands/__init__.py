"""The command line: one module per subcommand, `cli` dispatches."""
