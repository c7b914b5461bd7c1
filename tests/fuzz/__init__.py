"""A fuzzer that speaks the wire protocol to the real daemon and relay (hostile input)."""
