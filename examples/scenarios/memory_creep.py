"""Memory creep: rank 1 retains another 4 MiB tensor every step (its process RSS
grows on CPU); rank 0 does not. Expected: CREEP_EARLY or CREEP_CONFIRMED
naming rank 1 alone.

    torchrun --nproc-per-node 2 examples/scenarios/memory_creep.py --steps 150
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, run  # noqa: E402

LEAKING_RANK = 1

if __name__ == "__main__":
    # One leaking rank, not all: the verdict must name the culprit, not just see a creep somewhere.
    run(Scenario(leak_bytes_per_step=lambda rank: 4 * 1024 * 1024 if rank == LEAKING_RANK else 0))
