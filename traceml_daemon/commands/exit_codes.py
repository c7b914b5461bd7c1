"""Exit codes of ``compare`` and ``validate``, so a CI job can gate on them."""

from __future__ import annotations

OK = 0  # no divergence, no regression, nothing damaged
USAGE = 1  # the command line was wrong
IO_ERROR = 2  # a database or spool missing or unreadable
VALIDATION = 3  # a file is damaged or holds what no traceml writer stores
DIVERGED = 4  # compare: the runs' logged scalars or fingerprints differ
REGRESSION = 5  # compare: step time median slower beyond --fail-on-regression PCT

VALIDATE_EPILOG = (
    "exit codes: 0 success, 1 usage error, 2 I/O error (missing or unreadable input), "
    "3 validation failure (the first bad object is named)"
)
COMPARE_EPILOG = (
    "exit codes: 0 success (no divergence, no regression), 1 usage error, 2 I/O error (a missing or "
    "unreadable database, an unknown session), 3 validation failure (a damaged database), 4 divergence "
    "detected (logged scalars or fingerprints differ beyond --ulp; wins over 5), 5 step time median "
    "slower than A by more than --fail-on-regression PCT"
)
