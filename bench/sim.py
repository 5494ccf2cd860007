"""The long run of the fault simulator (``make fuzz``): trials over every write path.

    python bench/sim.py [--trials N] [--seed S] [--path NAME ...] [--fault KIND]

Prints one line per trial (the full report and the command that reproduces it for a
trial that breaks an invariant) and a table per write path: trials, faults injected,
invariant violations. Exit status 1 when any invariant broke. See tests/sim/harness.py.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.sim.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
