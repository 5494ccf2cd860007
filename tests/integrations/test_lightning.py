"""Lightning: ``Trainer(plugins=[CkptCheckpointIO()])`` writes ckpt checkpoints and a run
SIGKILLed mid-run resumes bit-identically in a fresh process (``lightning_run.py``:
9 batches per epoch, ModelCheckpoint every 3 steps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import hangs

pytest.importorskip("lightning.pytorch")
pytest.importorskip("torchdata.stateful_dataloader")

import ckpt  # noqa: E402

# multi-process runs, subprocesses or heavy imports: `make check` leaves them out
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("lightning_run.py")
STEPS = 14


def _run(run_dir: Path, out: Path, kill_at: int = 0) -> int:
    cmd = [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), "--out", str(out), "--steps", str(STEPS)]
    if kill_at:
        cmd += ["--kill-at", str(kill_at)]
    p = hangs.run(cmd, cwd=ROOT, capture_output=True, text=True, bound_s=hangs.hang_s(24))
    if not kill_at and p.returncode:
        raise AssertionError(p.stdout[-2000:] + p.stderr[-3000:])
    return p.returncode


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lightning")
    _run(d / "run", d / "out")
    return d


def _kill_and_compare(straight: Path, tmp_path: Path, kill_at: int, resumed_from: int) -> None:
    assert _run(tmp_path / "run", tmp_path / "out", kill_at) == -9
    _run(tmp_path / "run", tmp_path / "out")
    ra, rb = ckpt.open(straight / "out"), ckpt.open(tmp_path / "out")
    keys = list(ra.iter_tensor_keys())
    assert keys == list(rb.iter_tensor_keys()) and keys
    differ = [k for k in keys if not torch.equal(ra.tensor(k), rb.tensor(k))]
    assert differ == [], f"differ after resume: {differ}"
    ea, eb = ra.context()["extra"], rb.context()["extra"]
    assert eb["resumed_from"] == resumed_from
    assert ea["losses"][resumed_from:] == eb["losses"] and ea["epoch"] == eb["epoch"]
    assert ra.context()["rng"] == rb.context()["rng"]


@pytest.mark.slow
def test_lightning_kill_mid_epoch_and_resume_is_bit_identical(straight: Path, tmp_path: Path) -> None:
    _kill_and_compare(straight, tmp_path, kill_at=8, resumed_from=6)
    r = ckpt.open(straight / "run" / "step-00000006.ckpt")
    saved = r.tree()["state"]["checkpoint"]
    # Lightning's whole dict, pickle-free: loops (with the dataloader position), optimizer, hparams
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "hyper_parameters", "global_step"} <= set(saved)
    assert saved["global_step"] == 6 and r.context()["rng"]["torch_cpu"]
    assert r.context()["config"]["hash"].startswith("sha256:")  # the module's hparams


@pytest.mark.slow
def test_lightning_checkpoint_at_an_epoch_end(straight: Path, tmp_path: Path) -> None:
    # regression (issue 25): Lightning built the next epoch's iterator (a base-seed draw)
    # from the unrestored RNG, and the streams were restored one draw short
    _kill_and_compare(straight, tmp_path, kill_at=11, resumed_from=9)


def test_lightning_default_checkpoint_names_are_refused_with_the_fix(tmp_path: Path) -> None:
    from ckpt.errors import UnsafePathError
    from ckpt.integrations.lightning import CkptCheckpointIO

    with pytest.raises(UnsafePathError, match="auto_insert_metric_name=False"):
        CkptCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "epoch=0-step=1.ckpt")
    assert not list(tmp_path.iterdir())


def test_load_returns_the_saved_dict_and_defers_rng(tmp_path: Path) -> None:
    from ckpt.integrations.lightning import CkptCheckpointIO

    io = CkptCheckpointIO()
    sd = {"w": torch.arange(6.0).reshape(2, 3)}
    ck = {"state_dict": sd, "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}],
          "global_step": 7, "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}}, "hparams_name": "kwargs"}
    io.save_checkpoint(ck, tmp_path / "c.ckpt")
    before = torch.get_rng_state()
    torch.rand(3)
    back = io.load_checkpoint(tmp_path / "c.ckpt")
    assert torch.equal(back["state_dict"]["w"], sd["w"]) and back["global_step"] == 7
    assert back["optimizer_states"][0]["state"][0]["step"].item() == 3.0  # int keys survive
    assert not torch.equal(torch.get_rng_state(), before)  # not restored at load ...
    io.rng_callback.on_train_batch_start(None, None, None, 0)
    assert torch.equal(torch.get_rng_state(), before)  # ... but at the first training batch
    io.remove_checkpoint(tmp_path / "c.ckpt")
    assert not (tmp_path / "c.ckpt").exists()
