"""Hang: rank 1 sleeps forever in backward at step 5; the others wait in the all-reduce.

    torchrun --nproc-per-node 2 examples/scenarios/hang.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

if __name__ == "__main__":
    delay = ms()
    run(Scenario(backward_delay_s=lambda rank, step: 10**6 if (rank == 1 and step == 5) else 0.0))
