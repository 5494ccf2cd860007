"""replay.watchdog: a multi-process run that stops making progress names itself.

The runs' timing-free waits (tests/runs/common/stuck_run.py drives a three-rank gloo run)
end on events; these tests show the two ways a rank can fail mid-collective end the run
with a non-zero exit and without a hang, and that a hang leaves its evidence: which rank
stopped, where each other rank waits, every process's stacks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from replay.errors import HangError
from replay.watchdog import Watchdog, beat, hang_bound, waiting_in
import hangs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
# the stall the watchdog waits for in these runs: 10x and more a rank's longest quiet wait
# between heartbeats (joining gloo; while it starts up, its CPU time counts as progress),
# times CKPT_TIMEOUT_SCALE
STALL_S = hang_bound(2.0, floor_s=30.0)


def _stuck_run(tmp_path: Path, fault: str) -> subprocess.CompletedProcess[str]:
    # a hang detector for the harness itself: the watchdog plus its stacks wait (< 15 s)
    # plus the start-up, many times over
    return hangs.run([sys.executable, str(HERE / "stuck_run.py"), str(tmp_path / "watch"), fault, str(STALL_S)],
                     capture_output=True, text=True, cwd=ROOT, bound_s=hang_bound(30.0) + 4 * STALL_S,
                     env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_a_rank_stopped_mid_collective_is_named_with_every_process_stacks(tmp_path: Path) -> None:
    p = _stuck_run(tmp_path, "stop")
    assert p.returncode == 3, p.stdout + p.stderr  # HangError, not a hang and not a pass
    watch = tmp_path / "watch"
    report = (watch / "hang.txt").read_text()
    assert f"hang: no progress for {STALL_S:.0f} s" in p.stdout and str(watch / "hang.txt") in p.stdout
    lines = {ln.split()[0]: ln for ln in report.splitlines()[3:] if ln.strip()}
    # the stopped rank: alive, silent, no stacks (it cannot answer); the others wait for it
    assert "NO STACKS" in lines["rank2"] and "all_reduce step" in lines["rank2"]
    assert "rank2 (no stacks: stopped?" in p.stdout
    for r in ("rank0", "rank1"):
        assert "waiting in all_reduce (from stuck_run.py" in lines[r] and "NO STACKS" not in lines[r]
        stacks = (watch / f"{r}.stacks").read_text()
        assert "in all_reduce" in stacks and "in rank_main" in stacks
    assert (watch / "orchestrator.stacks").read_text().count("File ") > 0  # the orchestrator's own threads
    assert "exit codes" not in p.stdout


@pytest.mark.slow
def test_a_rank_killed_mid_collective_ends_the_run_non_zero_without_a_hang(tmp_path: Path) -> None:
    p = _stuck_run(tmp_path, "kill")
    # gloo tells the survivors their peer is gone: they fail, the run sees it on their exits
    assert p.returncode == 1, p.stdout + p.stderr
    assert "rank2 killed at all_reduce step" in p.stdout and "'rank2': -9" in p.stdout
    assert "'rank0': 1" in p.stdout and "'rank1': 1" in p.stdout
    assert not (tmp_path / "watch").exists()  # no hang: no evidence left behind


def test_threads_watchdog_dumps_this_process_and_names_the_thread(tmp_path: Path) -> None:
    gate = threading.Event()
    t = threading.Thread(target=gate.wait, name="waiter", daemon=True)
    t.start()
    dog = Watchdog(tmp_path / "w", stall_s=0.3, name="main", kill=False)
    dog.watch("waiter")
    try:
        with dog, pytest.raises(HangError, match=r"stuck: waiter .*hang\.txt") as e:
            dog.wait(lambda: False)
    finally:
        gate.set()
    assert e.value.report == str(tmp_path / "w" / "hang.txt")
    assert "in wait" in (tmp_path / "w" / "main.stacks").read_text()
    assert dog.report is not None and dog.report.stuck == ["waiter"]


def test_progress_keeps_it_quiet_and_beats_are_a_no_op_unarmed(tmp_path: Path) -> None:
    n = [0]
    dog = Watchdog(tmp_path / "w", stall_s=0.5, progress=lambda: n[0])
    with dog:
        for _ in range(30):  # progress every 0.05 s for 1.5 s: three stall bounds, no firing
            n[0] += 1
            dog.fired.wait(0.05)
    assert not dog.fired.is_set() and not (tmp_path / "w").exists()
    beat("nothing")  # this process was never armed


def test_waiting_in_names_the_public_call_and_its_caller() -> None:
    dump = ('# rank0 pid 1\nCurrent thread 0x1 (most recent call first):\n'
            '  File "/x/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
            '  File "/x/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
            '  File "/w/train.py", line 38 in step\n')
    assert waiting_in(dump) == "all_reduce (from train.py:38 step)"
    assert waiting_in('Current thread 0x1:\n  File "/w/a.py", line 1 in f\n') == ""


def test_hang_bound_is_generous_and_scaled() -> None:
    from ckpt.knobs import override

    assert hang_bound(3.0) == 120.0 and hang_bound(30.0) == 300.0
    with override(timeout_scale=4.0):
        assert hang_bound(30.0) == 1200.0
    with pytest.raises(ValueError):
        Watchdog("/nonexistent", stall_s=0)
