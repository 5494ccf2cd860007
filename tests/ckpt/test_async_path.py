"""The asynchronous save path: a two-thread staging copy, a lower-priority save thread.

The step slowdown and the stall are measured in bench/async_save.py; these tests pin
what the speed-ups must not change: the staged bytes are the live bytes at the step
boundary however the copy is split, and only the save thread (never the loop's) runs
at a lower priority.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import staging
from ckpt.knobs import override
from ckpt.manager import CheckpointManager
from ckpt.staging import Staging
from ckpt.storage import LocalStorage
from tests.sim.faultfs import FaultyStorage
import hangs


@pytest.mark.parametrize("threshold", [0, 1, 1 << 40])
def test_the_staging_copy_is_exact_however_it_is_split(monkeypatch: pytest.MonkeyPatch, threshold: int) -> None:
    monkeypatch.setattr(staging, "_PARALLEL_COPY_MIN", threshold)
    g = torch.Generator().manual_seed(1)
    # odd sizes, so the halves split inside a tensor; an alias, a view, a non-contiguous one
    base = torch.randn(1001, generator=g)
    tree = {
        "a": torch.randn(77, generator=g),
        "b": base,
        "tied": base,
        "t": torch.randn(33, 17, generator=g).t(),
        "ints": torch.arange(12345, dtype=torch.int16),
        "empty": torch.empty(0),
        "nested": [torch.randn(3, generator=g), {"x": torch.ones(999, dtype=torch.float64)}],
    }
    st = Staging()
    frozen, stats = st.snapshot(tree)
    assert frozen["b"] is frozen["tied"]
    for key in ("a", "b", "t", "ints", "empty"):
        assert torch.equal(frozen[key], tree[key]), key
        assert frozen[key].numel() == 0 or frozen[key].data_ptr() != tree[key].data_ptr()
    assert torch.equal(frozen["nested"][1]["x"], tree["nested"][1]["x"])
    base.add_(1)  # the live state moves on; the snapshot does not
    assert not torch.equal(frozen["b"], base)
    again, _ = st.snapshot(tree)  # the same buffer, reused, holds the new values
    assert torch.equal(again["b"], base) and st.allocations == 1
    assert stats.nbytes >= sum(t.numel() * t.element_size() for t in (tree["a"], base, tree["t"], tree["ints"]))


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _records_priority(seen: list[int]) -> FaultyStorage:
    """Each file a save creates records the priority of the thread that creates it."""

    def record(i: int, op: str, path: str) -> None:
        if op == "create":
            seen.append(_nice())

    return FaultyStorage(LocalStorage(), on_op=record)


def test_only_an_async_save_thread_runs_at_a_lower_priority(tmp_path: Path) -> None:
    model = torch.nn.Linear(16, 16)
    loop = _nice()
    seen: list[int] = []
    with override(save_thread_nice=7):
        mgr = CheckpointManager(tmp_path / "a", {"model": model}, async_save=True, signals=(), storage=_records_priority(seen))
        mgr.save(1)
        mgr.wait()
        mgr.close()
    assert seen and set(seen) == {min(19, loop + 7)}, seen
    assert _nice() == loop  # the loop's thread is untouched
    seen = []
    with override(save_thread_nice=7):
        mgr = CheckpointManager(tmp_path / "s", {"model": model}, async_save=False, signals=(), storage=_records_priority(seen))
        mgr.save(1)  # a blocking save runs in the loop's thread: never reprioritised
        mgr.close()
    assert set(seen) == {loop} and _nice() == loop
    for run in ("a", "s"):
        assert torch.equal(ckpt.open(tmp_path / run / "step-00000001").state()["model"]["weight"], model.weight)


EXIT_WITH_A_SAVE_IN_FLIGHT = """
import sys, torch
from ckpt.manager import CheckpointManager
mgr = CheckpointManager(sys.argv[1], {"w": torch.arange(1 << 20, dtype=torch.float32)}, async_save=True, signals=())
mgr.save(1)
mgr.save(2)   # waits for step 1, then hands step 2 to the worker
print("leaving", flush=True)
# no wait(), no close(): the interpreter exits with step 2 in flight
"""


@pytest.mark.slow
def test_interpreter_exit_waits_for_the_save_in_flight_and_an_idle_worker_does_not_hold_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    p = hangs.run([sys.executable, "-c", EXIT_WITH_A_SAVE_IN_FLIGHT, str(tmp_path / "run")], capture_output=True,
                  text=True, bound_s=hangs.hang_s(30), env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["leaving"]
    r = ckpt.open(tmp_path / "run" / "step-00000002")
    r.verify()
    assert torch.equal(r.state()["w"], torch.arange(1 << 20, dtype=torch.float32))
