"""The read layer: every SQL statement that reads a traceml database lives here.

Readers (the TUI, ``summary`` through ``store.reader``, ``compare``, ``launch``, ``export``,
the ``/metrics`` collector) call these functions and write no SQL of their own,
so one place says how each table is read and which index each read uses
(``tests/traceml_daemon/store/test_query_plans.py`` checks every one).

One job per module:

* ``connect``: read-only connections, schema version, tables present, commit watch;
* ``runs``: which run (latest session and attempt), its parallelism and time bounds, other nodes' progress (``launch``);
* ``steps``: step and status rows: recent windows, tails by rowid, counts, samples, ranges;
* ``series``: a rank's step or scalar series aggregated into buckets in SQL;
* ``history``: the whole-run history tables (``store.history``) and whether they exist;
* ``samples``: host, GPU and process samples;
* ``detail``: a rank's deep dive: scalars, layers, models;
* ``spans``: user spans and instants;
* ``delivery``: delivery counters, as the summary defines rows and batches lost;
* ``whole_run``: every step and scalar of one run, exact, for ``compare``.

Rank identity (``RankRow``) and the analysis engine's input (``RunData`` over a
whole run or each rank's newest steps) are ``store.reader``'s: it builds them
from these modules.
"""
