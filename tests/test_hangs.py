"""The suite's hang bound reaches every process of a hung command, sessions of their own
included (tests/hangs.py), and fails the test instead of waiting for ever."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import _pytest.outcomes
import pytest

import hangs

# A launcher that starts a worker in a session of its own (as torchrun starts each rank),
# both holding the captured pipes, and both hang: a signal to the launcher's group alone
# would leave the worker, and with it the pipes, open for ever.
_LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; print('worker up', flush=True); time.sleep(3600)"],
                     start_new_session=True)
    print("launcher up", flush=True)
    time.sleep(3600)
""")


def test_a_hung_command_with_a_worker_in_its_own_session_fails_naming_the_hang() -> None:
    t0 = time.monotonic()
    with pytest.raises(_pytest.outcomes.Failed, match="HANG") as e:
        hangs.run([sys.executable, "-c", _LAUNCHER], bound_s=3.0)
    assert "launcher up" in str(e.value)
    # with py-spy installed (the test extra), both processes' native stacks are in the report
    native = str(e.value).split("--- native stacks")[1]
    if "py-spy is not installed" not in native:
        assert native.count("==== pid ") == 2 and native.count("sleep") >= 2, native
    # the worker is gone too: nothing of the command is left running
    assert not [line for line in os.popen("ps -eo args").read().splitlines() if "worker up" in line]
    assert time.monotonic() - t0 < hangs.hang_s(60.0)  # a hang bound of its own, not a speed verdict
