"""Healthy run: nothing injected; no warn or critical verdict expected.

    torchrun --nproc-per-node 2 examples/scenarios/healthy.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, ms, run  # noqa: E402

if __name__ == "__main__":
    delay = ms()
    run(Scenario())
