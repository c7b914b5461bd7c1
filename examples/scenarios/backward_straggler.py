"""Backward straggler: rank 1's backward pass is slower; DDP's all-reduce spreads the delay over every rank's step time.

    torchrun --nproc-per-node 2 examples/scenarios/backward_straggler.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

if __name__ == "__main__":
    delay = ms()
    run(Scenario(backward_delay_s=lambda rank, step: delay if rank == 1 else 0.0))
