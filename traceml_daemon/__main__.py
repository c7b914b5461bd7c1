"""``python -m traceml_daemon`` is the ``traceml-daemon`` command."""

from traceml_daemon.commands.cli import main

raise SystemExit(main())
