"""Step capture on the training thread: the pieces the Tracer composes.

Each module has one job (patches for one source of phase time, the device
event pool, model description ...). Everything here runs inside user code,
so every entry point is wrapped by the caller's error gate and kept cheap.
"""
