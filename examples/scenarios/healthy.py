"""Healthy run: nothing injected; no warn or critical verdict expected.

The batch is large enough that compute dominates the step, as in a real job:
at the other scenarios' batch of 128 the 2-rank gloo all-reduce on a 2-core
CPU takes 30-48% of a 5 ms step, and WAIT_HEAVY would be a true finding. Part of
each step is the host waiting (``device_wait_s``), as on a GPU: two ranks of
pure CPU compute saturate a 2-core machine, and HOST_CPU_SATURATED (a median of
97.5% busy, seen in CI) would be a true finding too.

    torchrun --nproc-per-node 2 examples/scenarios/healthy.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, run  # noqa: E402

if __name__ == "__main__":
    run(Scenario(batch=1024, device_wait_s=0.02))
