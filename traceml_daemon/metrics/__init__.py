"""The Prometheus endpoint: collect a snapshot from the running daemon and render it."""
