"""Lightning with ``CkptCheckpointIO``: ``ckpt_path="last"`` resumes from the newest
checkpoint that verifies; a module that does not fit is refused before anything is loaded
and the run is left as it was; a changed hparam is named (issue 25 item 3). Real Lightning
classes, in this process."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from ckpt.errors import ResumeMismatchError, StateMismatchError  # noqa: E402
from ckpt.integrations.lightning import CkptCheckpointIO, CkptModelCheckpoint  # noqa: E402
from ckpt.manager import ConfigChangedWarning, ResumeFallbackWarning  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(self.trainer.global_step)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _fit(run_dir: Path, steps: int, *, ckpt_path: Any = "last", **hp: Any) -> Tiny:
    torch.manual_seed(0)
    model = Tiny(**hp)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(40, 3, generator=g), torch.randn(40, 1, generator=g))
    io = CkptCheckpointIO()
    every = CkptModelCheckpoint(dirpath=run_dir, every_n_train_steps=3, save_top_k=-1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[io], callbacks=[io.rng_callback, every],
                         logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return model


def _tree(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_last_resumes_from_the_newest_valid_checkpoint(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _fit(tmp_path, 6)  # "last" with an empty directory: a fresh start, as Lightning does
    assert first.seen[0] == 0
    # the checkpoints, and the step ledger (issue 25: Lightning run directories keep one)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger", "step-00000003.ckpt", "step-00000006.ckpt"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = _fit(tmp_path, 9)
    assert again.seen == [6, 7, 8]  # resumed at step 6, not trained from step 0
    # damage the newest: "last" falls back to the newest that verifies
    data = next((tmp_path / "step-00000009.ckpt").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        after = _fit(tmp_path, 9)
    assert after.seen == [6, 7, 8]
    skipped = [str(w.message) for w in rec if issubclass(w.category, ResumeFallbackWarning)]
    assert len(skipped) == 1 and "step-00000009.ckpt" in skipped[0] and "ChecksumMismatchError" in skipped[0]


def test_a_module_of_another_shape_is_refused_and_the_run_is_untouched(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(tmp_path, 6)
    before = _tree(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ResumeMismatchError) as ei:
            _fit(tmp_path, 12, hidden=16)
    e = ei.value
    assert e.path == str(tmp_path / "step-00000006.ckpt") and e.key == "checkpoint/state_dict/net.0.weight"
    assert e.context["saved_shape"] == [8, 3] and e.context["target_shape"] == [16, 3]
    assert "float32[8, 3]" in str(e) and "float32[16, 3]" in str(e)
    assert _tree(tmp_path) == before  # no checkpoint replaced, none added, none removed


def test_a_changed_hparam_is_one_warning_naming_it(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(tmp_path, 3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _fit(tmp_path, 6, lr=0.05)
    msgs = [str(w.message) for w in rec if issubclass(w.category, ConfigChangedWarning)]
    assert len(msgs) == 1 and msgs[0].endswith("lr: 0.01 -> 0.05"), msgs
    assert "step-00000003.ckpt" in msgs[0]


def test_a_plain_model_checkpoint_with_save_last_resumes_from_its_last(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(steps: int) -> Tiny:
        torch.manual_seed(0)
        model = Tiny()
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(40, 3, generator=g), torch.randn(40, 1, generator=g))
        io = CkptCheckpointIO()
        every = ModelCheckpoint(dirpath=tmp_path, filename="step-{step:08d}", auto_insert_metric_name=False,
                                every_n_train_steps=3, save_top_k=-1, save_last=True)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[io],
                             callbacks=[io.rng_callback, every], logger=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path="last")
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(6)
        assert (tmp_path / "last.ckpt" / "MANIFEST").is_file()
        assert fit(8).seen == [6, 7]


def test_ranks_holding_different_copies_of_a_replicated_parameter_are_refused_at_save(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``CkptModelParallelStrategy`` saves rank 0's full state dict: a parameter replicated
    outside its mesh (here plain tensors in a world of 2) must be the same on every rank,
    else the other rank would resume from rank 0's copy. The ranks' records travel through
    ``gather_to_all``; here the other rank's is the record of a module with other weights.
    The 2-process run is ``test_trainer_multiproc.py``."""
    import ckpt.integrations.lightning as L

    torch.manual_seed(0)
    mine, theirs = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    sent: list[Any] = []
    monkeypatch.setattr(L, "gather_to_all", lambda record: (sent.append(record), [record, record])[1])
    L._refuse_independent_replicas(theirs, 2, "runs/x/step-4")  # equal copies: saved
    monkeypatch.setattr(L, "gather_to_all", lambda record: [record, sent[0]])
    with pytest.raises(StateMismatchError, match="rank 1 holds another 'weight' than rank 0") as e:
        L._refuse_independent_replicas(mine, 2, "runs/x/step-4")
    assert e.value.path == "runs/x/step-4" and e.value.context["ranks"] == [0, 1]
    assert "data_parallel_size=2, tensor_parallel_size=1" in str(e.value)
    monkeypatch.setattr(L, "gather_to_all", lambda record: pytest.fail("one process gathers nothing"))
    L._refuse_independent_replicas(mine, 1, "runs/x/step-4")
