"""A tiny GPT-2 trained by ``CkptTrainer``; run as a fresh process by test_hf_trainer.py.

``--kill-at K`` SIGKILLs the process right after optimizer step K (a crash, no cleanup).
At the end each rank writes its final model, optimizer, scheduler, RNG and the per-step
log to ``--out``/rank-R with ``ckpt.save``, for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments, set_seed  # noqa: E402

import ckpt  # noqa: E402
from ckpt.integrations.hf import CkptTrainer  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class KillAt(TrainerCallback):
    """SIGKILL after optimizer step ``step``; with ``settled``, only once the saves started
    so far have committed (the resume point is then known, not a race with the async save)."""

    def __init__(self, step: int, settled: bool = False) -> None:
        self.step = step
        self.settled = settled
        self.trainer: CkptTrainer | None = None

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            if self.settled and self.trainer is not None and self.trainer._ckpt_mgr is not None:
                self.trainer._ckpt_mgr.wait()
            os.kill(os.getpid(), signal.SIGKILL)


class Watch(TrainerCallback):
    """What the resume did, seen from inside the loop: whether the resumed epoch was served
    by the positioned loader, and that no function of transformers was ever replaced."""

    def __init__(self) -> None:
        import accelerate
        import transformers.trainer as tt

        self.tt, self.original = tt, accelerate.skip_first_batches
        self.untouched = True
        self.positioned_steps = 0
        self.trainer: CkptTrainer | None = None

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.untouched &= self.tt.skip_first_batches is self.original
        if self.trainer is not None and self.trainer._ckpt_positioned is not None:
            self.positioned_steps += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--kill-settled", action="store_true", help="kill only once the saves in flight committed")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    set_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=101, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)  # dropout 0.1 everywhere: RNG matters at every step
    args = TrainingArguments(
        output_dir=os.path.join(a.run_dir, "hf-out"),
        max_steps=a.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        ddp_backend="gloo" if world > 1 else None,
    )
    # 44 samples, 4 per micro-batch per rank, 2 micro-batches per step: the epoch has
    # 11 (1 rank) or 5 (2 ranks) micro-batches, an odd count, so every epoch ends with a
    # partial accumulation step and the run crosses several epoch ends.
    watch, kill = Watch(), KillAt(a.kill_at, a.kill_settled)
    trainer = CkptTrainer(model=model, args=args, train_dataset=Tokens(44, 16, 101), ckpt_dir=a.run_dir,
                          callbacks=[watch, *([kill] if a.kill_at else [])])
    watch.trainer = kill.trainer = trainer
    trainer.train()
    rank = args.process_index
    log = [{k: v for k, v in e.items() if k in ("loss", "grad_norm", "learning_rate", "epoch", "step")}
           for e in trainer.state.log_history if "loss" in e]
    ckpt.save(os.path.join(a.out, f"rank-{rank}"),
              {"model": model, "optim": trainer.optimizer.optimizer, "sched": trainer.lr_scheduler},
              step=trainer.state.global_step, extra={"log": log, "epoch": trainer.state.epoch,
                                                      "resumed_from": trainer.ckpt_resumed_from,
                                                      "untouched": watch.untouched,
                                                      "positioned_steps": watch.positioned_steps},
              this_rank_only=world > 1)  # each rank writes its own final state, to its own path


if __name__ == "__main__":
    main()
