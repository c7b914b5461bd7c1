"""Incomplete signals: model.forward(x) is called directly, so module hooks never
fire and the forward phase is never measured (backward still is). Expected:
INCOMPLETE_DATA naming forward on every rank, and no bound verdict.

    torchrun --nproc-per-node 2 examples/scenarios/incomplete.py --steps 60
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Scenario, run  # noqa: E402

if __name__ == "__main__":
    run(Scenario(call_forward_directly=True))
