"""Input straggler: rank 1's collate function is slow, the others are fast.

    torchrun --nproc-per-node 2 examples/scenarios/input_straggler.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

if __name__ == "__main__":
    delay = ms()
    run(Scenario(collate_delay_s=lambda rank: delay if rank == 1 else 0.0))
