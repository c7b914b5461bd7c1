"""Compute straggler: rank 1 does extra work inside optimizer.step.

    torchrun --nproc-per-node 2 examples/scenarios/optimizer_straggler.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

if __name__ == "__main__":
    delay = ms()
    run(Scenario(optimizer_delay_s=lambda rank: delay if rank == 1 else 0.0))
