"""Wait straggler: rank 1 does host work between backward and optimizer.step, in no measured phase.

    torchrun --nproc-per-node 2 examples/scenarios/wait_straggler.py --steps 60

DDP's all-reduce makes rank 0 wait for it in the next step's backward, so the
step times stay equal; rank 1's own extra time lies in its wait slot.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

if __name__ == "__main__":
    delay = ms()
    run(Scenario(between_delay_s=lambda rank: delay if rank == 1 else 0.0))
