"""Memory creep: every step retains another tensor (process RSS grows on CPU).

    torchrun --nproc-per-node 2 examples/scenarios/memory_creep.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

if __name__ == "__main__":
    delay = ms()
    run(Scenario(leak_bytes_per_step=lambda rank: 4 * 1024 * 1024))
