"""Errors raised by the pure protocol code; I/O shells decide what they mean."""


class ProtocolError(ValueError):
    """The peer sent something that breaks the protocol (bad frame, bad message)."""


class FrameTooLarge(ProtocolError):
    """A frame header declared more bytes than the configured cap.

    Raised from the 4-byte header alone, before any of the body is buffered.
    """

    def __init__(self, declared: int, cap: int) -> None:
        super().__init__(f"frame of {declared} bytes exceeds the cap of {cap} bytes")
        self.declared = declared
        self.cap = cap
