"""HF ``CkptTrainer`` with epoch saves and DataLoader worker processes never hangs.

``save_strategy="epoch"`` with ``dataloader_num_workers=2`` hung 2 of 2 times (issue 25):
each epoch's iterator forks its workers while the previous epoch's asynchronous save is
written. The run lives in a git checkout, so the commit capture is exercised too.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ckpt"))

import ckpt  # noqa: E402
from _hang_kit import PRELUDE, git_checkout, run_script  # noqa: E402
from ckpt.manager import list_checkpoints  # noqa: E402

EPOCHS = 5

TRAIN = PRELUDE + textwrap.dedent("""
    import os
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed
    from ckpt.integrations.hf import CkptTrainer

    class Augmented(torch.utils.data.Dataset):
        def __init__(self, n, seq, vocab):
            self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(5))
            self.vocab = vocab

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            # random augmentation in the worker: shift every token by a random offset
            x = (self.x[i] + torch.randint(0, self.vocab, ())) % self.vocab
            return {"input_ids": x, "labels": x}

    torch.set_num_threads(1)
    set_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=101, n_positions=32, bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(
        output_dir=os.path.join(sys.argv[1], "hf-out"), num_train_epochs=int(sys.argv[2]),
        per_device_train_batch_size=4, learning_rate=2e-3, save_strategy="epoch", logging_steps=1,
        dataloader_num_workers=2, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = CkptTrainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=Augmented(24, 16, 101),
                          ckpt_dir=sys.argv[1])
    trainer.train()
    print("completed", trainer.state.global_step)
""")


@pytest.mark.slow
def test_epoch_saves_with_dataloader_workers_complete(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    sha = git_checkout(repo)
    script = repo / "train.py"
    script.write_text(TRAIN)
    run = tmp_path / "run"
    out = run_script(script, str(run), str(EPOCHS), cwd=repo)
    assert f"completed {EPOCHS * 6}" in out  # 24 samples, 4 per step: 6 steps an epoch
    records = [r for r in list_checkpoints(run) if r.committed]
    assert records and records[-1].step == EPOCHS * 6
    reader = ckpt.open(records[-1].path)
    reader.verify()
    assert reader.context()["commit"]["sha"] == sha
