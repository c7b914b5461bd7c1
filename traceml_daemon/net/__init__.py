"""The network shell: listener, peer sessions, acknowledgements, the inbound byte bounds, the event loop."""
