"""The schema's migration steps, one module per version, in the order they apply.

``MIGRATIONS[i]`` brings a database from version i to i + 1 (store/migrate.py
applies them). A new version adds a module here, appends its name to ``_STEPS`` and
bumps ``schema.SCHEMA_VERSION``; a released step is never edited. Steps read the
current declaration from store/schema.py, which imports nothing from here.
"""

from __future__ import annotations

import importlib

# The steps' modules, in the order they apply (declared once: the list is the order).
_STEPS = tuple(
    importlib.import_module(f"{__name__}.{name}")
    for name in (
        "v01_base",
        "v02_history",
        "v03_write_clustered",
        "v04_rank_groups",
        "v05_reservoir_size",
        "v06_identity_columns",
        "v07_quarantine",
        "v08_output",
        "v09_spans_rollouts_profiles",
        "v10_fsdp2",
        "v11_fingerprints",
        "v12_fingerprint_sums",
        "v13_device_timed",
    )
)

MIGRATIONS: list[list[str]] = [step.statements() for step in _STEPS]
