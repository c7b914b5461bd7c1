"""The analysis engine: pure functions from run data to verdicts (stdlib only, no I/O)."""
