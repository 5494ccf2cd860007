"""Accelerate: save_state/load_state in the ckpt format, registered objects included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("torchdata.stateful_dataloader")

import ckpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("accelerate_run.py")


def _run(run_dir: Path, out: Path, steps: int, kill_at: int = 0) -> int:
    cmd = [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), "--out", str(out), "--steps", str(steps)]
    if kill_at:
        cmd += ["--kill-at", str(kill_at)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    if not kill_at and p.returncode:
        raise AssertionError(p.stdout[-2000:] + p.stderr[-3000:])
    return p.returncode


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("acc")
    _run(d / "straight", d / "out-a", 14)
    assert _run(d / "crashed", d / "out-b", 14, kill_at=8) == -9
    _run(d / "crashed", d / "out-b", 14)
    return d


def test_save_state_writes_every_tracked_object_without_pickle(runs: Path) -> None:
    r = ckpt.open(runs / "straight" / "step-00000006")
    assert set(r.tree()["state"]) == {"model_0", "optimizer_0", "scheduler_0", "dataloader_0", "custom_0", "accelerator"}
    ctx = r.context()
    assert ctx["step"] == 6 and ctx["rng"]["torch_cpu"]
    assert not [p for p in (runs / "straight").rglob("*") if p.suffix in (".pkl", ".bin", ".pth", ".pt")]
    # the registered counters object and the dataloader position are what the loop consumed
    state = ckpt.load(runs / "straight" / "step-00000006", {"custom_0": {}, "accelerator": {}}, restore_rng=False)
    assert state.step == 6


def test_resume_loads_the_saved_state_bitwise(runs: Path) -> None:
    rb = ckpt.open(runs / "out-b")
    assert rb.context()["extra"]["resumed_from"] == 6
    # 14 steps of 2 micro-batches of 4 samples, epochs of 11 micro-batches (the last one alone)
    assert ckpt.open(runs / "out-a").context()["extra"]["samples"] == rb.context()["extra"]["samples"]


@pytest.mark.xfail(strict=True, reason=(
    "not exact yet: a prepared DataLoaderShard over a StatefulDataLoader draws from the global torch RNG "
    "when the loop takes the next mid-epoch batch (measured: the torch CPU state changes between save_state "
    "and the next batch), so dropout after a resume differs; data, weights and optimizer load bit-exactly"))
def test_accelerate_kill_and_resume_in_fresh_processes_is_bit_identical(runs: Path) -> None:
    ra, rb = ckpt.open(runs / "out-a"), ckpt.open(runs / "out-b")
    keys = list(ra.iter_tensor_keys())
    assert all(torch.equal(ra.tensor(k), rb.tensor(k)) for k in keys)
    assert ra.context()["extra"]["losses"][6:] == rb.context()["extra"]["losses"]
