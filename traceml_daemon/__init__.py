"""TraceML daemon: ingest, storage, diagnosis, summary, export and the TUI.

Importing this package is cheap and never imports torch.
"""

__version__ = "0.1.0"
