"""Input bound: every rank's collate function is slow.

    torchrun --nproc-per-node 2 examples/scenarios/input_bound.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

if __name__ == "__main__":
    delay = ms()
    run(Scenario(collate_delay_s=lambda rank: delay))
