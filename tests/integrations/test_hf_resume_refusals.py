"""HF ``CkptTrainer``: a resume whose model does not fit the run is refused before a step is
taken and the old run's checkpoints survive byte for byte; a changed model config or
learning rate is one warning naming the keys (issue 25: "the same data loss as the issue
on trust, inside HF"). In this process, synchronous saves, a 2-layer GPT-2 of 64 wide."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from ckpt.errors import ResumeMismatchError  # noqa: E402
from ckpt.integrations.hf import CkptTrainer  # noqa: E402
from ckpt.manager import ConfigChangedWarning  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randint(0, 50, (16, 8), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _train(run_dir: Path, steps: int, *, n_layer: int = 2, dropout: float = 0.1, lr: float = 1e-3) -> CkptTrainer:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=50, n_positions=8, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=dropout)
    args = TrainingArguments(output_dir=str(run_dir / "hf-out"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=lr, save_strategy="steps", save_steps=2, save_total_limit=1, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, logging_steps=100)
    trainer = CkptTrainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens(), ckpt_dir=run_dir,
                          ckpt_async=False)
    trainer.train()
    return trainer


def _tree(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.relative_to(run_dir).parts[0].startswith("step-")}


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004"]  # save_total_limit=1
    return tmp_path


@pytest.mark.slow
def test_another_model_shape_is_refused_and_the_run_survives(run: Path) -> None:
    before = _tree(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ResumeMismatchError) as ei:
            _train(run, 8, n_layer=3)
    e = ei.value
    assert e.path == str(run / "step-00000004") and e.key.startswith("model/transformer.h.2.")
    assert "is float32[" in str(e)  # the shape of the key the checkpoint lacks
    assert "the config differs too: model.n_layer: 2 -> 3" in str(e)
    # never trained from step 0, never saved (retention would have deleted step 4 at step 2)
    assert _tree(run) == before


@pytest.mark.slow
def test_a_changed_dropout_and_learning_rate_are_named_in_one_warning(run: Path) -> None:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer = _train(run, 6, dropout=0.2, lr=2e-3)
    assert trainer.ckpt_resumed_from == 4
    msgs = [str(w.message) for w in rec if issubclass(w.category, ConfigChangedWarning)]
    assert len(msgs) == 1, msgs
    assert "model.resid_pdrop: 0.1 -> 0.2" in msgs[0] and "training.learning_rate: 0.001 -> 0.002" in msgs[0]
    assert "training.max_steps: 4 -> 6" in msgs[0]


@pytest.mark.slow
def test_an_unchanged_resume_warns_nothing_about_config(run: Path) -> None:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer = _train(run, 4)
    assert trainer.ckpt_resumed_from == 4
    assert not [w for w in rec if issubclass(w.category, ConfigChangedWarning)], [str(w.message) for w in rec]


@pytest.mark.slow
def test_a_save_killed_after_it_was_complete_is_resumed_not_restarted(run: Path) -> None:
    """Regression (seen twice under load in the random-kill trials): a run SIGKILLed in its
    save's last moments leaves the complete copy under its temporary name. ``train()``
    decided whether to resume from the committed checkpoints alone, before the manager's
    recovery published that copy, so it trained again from step 0 and then refused to
    save over the recovered step ("step 4 is already saved"). Now the copy counts."""
    (run / "step-00000004").rename(run / ".tmp-step-00000004-0123456789ab")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _train(run, 6)
    assert trainer.ckpt_resumed_from == 4 and trainer.state.global_step == 6


def test_may_resume_counts_committed_checkpoints_and_complete_temporary_copies(tmp_path: Path) -> None:
    from ckpt.manager.listing import may_resume

    assert not may_resume(tmp_path / "absent") and not may_resume(tmp_path)
    (tmp_path / ".tmp-notes-0123456789ab").mkdir()  # not a step's copy
    (tmp_path / "step-00000002").mkdir()  # no MANIFEST: not committed
    assert not may_resume(tmp_path)
    (tmp_path / ".tmp-step-00000004-0123456789ab.old").mkdir()
    assert may_resume(tmp_path)
