"""Healthy run: nothing injected; no warn or critical verdict expected.

The batch is large enough that compute dominates the step, as in a real job:
at the other scenarios' batch of 128 the 2-rank gloo all-reduce on a 2-core
CPU takes 30-48% of a 5 ms step, and WAIT_HEAVY would be a true finding.

    torchrun --nproc-per-node 2 examples/scenarios/healthy.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, run  # noqa: E402

if __name__ == "__main__":
    run(Scenario(batch=1024))
