"""Node straggler: every rank of node 1 has a slow collate (a slow disk or a busy
CPU on that host), node 0 is fast. Expected: NODE_STRAGGLER naming node 1, and
no per-rank straggler verdicts for its ranks (the node verdict covers them).

Two nodes of 2 ranks; on one machine, give each node its own relay port (on
real hosts each node has its own loopback, so the default port serves):

    TRACEML_RELAY_PORT=29766 torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
        --master-addr 127.0.0.1 --master-port 29500 examples/scenarios/node_straggler.py --steps 60 &
    TRACEML_RELAY_PORT=29767 torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 \\
        --master-addr 127.0.0.1 --master-port 29500 examples/scenarios/node_straggler.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

SLOW_NODE = 1

if __name__ == "__main__":
    delay = ms()
    # torchrun's GROUP_RANK is the node rank: the same number the daemon uses to tell nodes apart.
    node = int(os.environ.get("GROUP_RANK", "0"))
    run(Scenario(collate_delay_s=lambda rank: delay if node == SLOW_NODE else 0.0))
