"""One random-kill trial run of a trainer integration, as a user of that trainer writes it.

Run as a fresh process by ``test_trainer_trials.py`` and ``bench/trainer_trials.py``:
a tiny GPT-style model (token and position embeddings, one causal transformer layer with
dropout, a head) on synthetic tokens; a shuffled loader with ``num_workers=2`` whose
dataset augments at random in the workers (torch and Python RNGs); warmup then linear
decay; gradient accumulation 2; gradient clipping; bf16 autocast on CPU; a save every 4
optimizer steps; 6 optimizer steps per epoch (48 samples, micro-batches of 4).

``--kill K --where W`` SIGKILLs the process: ``step`` at the end of optimizer step K
(before that step's save), ``save`` right after the save of step K was made (K a
multiple of 4), ``micro`` in the middle of step K+1's accumulation (after its first
micro-batch's backward). Without ``--kill`` the run resumes from its run directory (if
anything is there) and trains to ``--steps``, then writes the final model, optimizer and
scheduler, the RNG and every micro-batch loss it computed to ``--out`` (``ckpt.save``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import ckpt  # noqa: E402

VOCAB, SEQ, N, MICRO, ACCUM, SAVE_EVERY, WARMUP = 32, 8, 48, 4, 2, 4, 3


class Augmented(torch.utils.data.Dataset):
    """Synthetic tokens; each read replaces ~15% of the tokens at random (torch RNG) and
    rolls the sequence by a random offset (Python RNG): random augmentation in the workers."""

    def __init__(self) -> None:
        self.x = torch.randint(0, VOCAB, (N, SEQ + 1), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.x[i].clone()
        mask = torch.rand(SEQ + 1) < 0.15
        x[mask] = torch.randint(0, VOCAB, (int(mask.sum()),))
        x = torch.roll(x, random.randrange(3))
        return {"input_ids": x[:-1], "labels": x[1:]}


class TinyGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 16)
        self.pos = torch.nn.Embedding(SEQ, 16)
        self.block = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
        logits = self.head(self.block(h, src_mask=causal, is_causal=True))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
        return out


def warmup_decay(total: int) -> Any:
    def f(s: int) -> float:
        return (s + 1) / WARMUP if s < WARMUP else max(0.0, (total - s) / (total - WARMUP))
    return f


class Killer:
    """Where this run dies (``--kill``/``--where``) and the losses it computed."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.k, self.where = a.kill, a.where
        self.losses: list[float] = []

    def micro(self, loss: torch.Tensor, global_step: int) -> None:
        """Called after each micro-batch's forward; ``global_step``: optimizer steps done."""
        if self.where == "micro" and self.k and global_step == self.k and len(self.losses) % ACCUM == 1:
            self.die()  # step K+1's first micro-batch is done, its second not
        self.losses.append(float(loss.detach().float()))

    def step_end(self, step: int) -> None:
        if self.where == "step" and step == self.k:
            self.die()

    def saved(self, step: int) -> None:
        if self.where == "save" and step == self.k:
            self.die()

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def write_out(a: argparse.Namespace, killer: Killer, state: dict[str, Any], step: int, resumed_from: int | None) -> None:
    ckpt.save(a.out, state, step=step,
              extra={"losses": [x.hex() for x in killer.losses], "resumed_from": resumed_from})


# -- HF ------------------------------------------------------------------------------------
def run_hf(a: argparse.Namespace, killer: Killer) -> None:
    from transformers import TrainerCallback, TrainingArguments, set_seed

    from ckpt.integrations.hf import CkptTrainer

    class Hooks(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            killer.step_end(state.global_step)

        def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            killer.saved(state.global_step)

    class Trial(CkptTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            killer.micro(loss[0] if return_outputs else loss, self.state.global_step)
            return loss

    set_seed(0)
    model = TinyGPT()
    args = TrainingArguments(
        output_dir=os.path.join(a.run_dir, "hf-out"), use_cpu=True, bf16=True, seed=0,
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, max_steps=a.steps,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=WARMUP, max_grad_norm=1.0,
        save_strategy="steps", save_steps=SAVE_EVERY, save_total_limit=10, logging_steps=1, report_to=[],
        dataloader_num_workers=2, disable_tqdm=True, remove_unused_columns=False,
    )
    t = Trial(model=model, args=args, train_dataset=Augmented(), ckpt_dir=a.run_dir, callbacks=[Hooks()])
    t.train()
    write_out(a, killer, {"model": model, "optim": t.optimizer.optimizer if hasattr(t.optimizer, "optimizer")
                          else t.optimizer, "sched": t.lr_scheduler}, t.state.global_step, t.ckpt_resumed_from)


# -- Lightning -----------------------------------------------------------------------------
def run_lightning(a: argparse.Namespace, killer: Killer) -> None:
    import lightning.pytorch as pl

    from ckpt.integrations.lightning import CkptCheckpointIO, CkptModelCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyGPT()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.net(**batch)["loss"]
            killer.micro(loss, self.trainer.global_step)
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % ACCUM == 0:
                killer.step_end(self.trainer.global_step)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay(a.steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class IO(CkptCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            killer.saved(int(checkpoint["global_step"]))

    pl.seed_everything(0, verbose=False)
    module = Module()
    io = IO()
    every = CkptModelCheckpoint(dirpath=a.run_dir, every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=1, precision="bf16-mixed",
                         accumulate_grad_batches=ACCUM, gradient_clip_val=1.0, plugins=[io],
                         callbacks=[io.rng_callback, every], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, make_loader(a), ckpt_path="last")
    resumed = trainer.ckpt_path
    write_out(a, killer, {"model": module.net, "optim": trainer.optimizers[0],
                          "sched": trainer.lr_scheduler_configs[0].scheduler}, trainer.global_step,
              None if resumed is None else ckpt.open(resumed).step)


def make_loader(a: argparse.Namespace) -> Any:
    if a.loader == "resumable":
        from ckpt.data import ResumableLoader

        return ResumableLoader(Augmented(), seed=3, global_batch_size=MICRO, num_workers=2, drop_last=False)
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckpt.integrations.stateful_data import WorkerRNG

    # "stateful": as documented (the workers' RNG in the loader state); "stateful-plain": without;
    # "stateful-main": no workers, the augmentation in the wrapper's own main-process streams
    # (as documented); "stateful-main-plain": no workers, drawing from the global RNG
    ds = WorkerRNG(Augmented()) if a.loader in ("stateful", "stateful-main") else Augmented()
    workers = 0 if a.loader.startswith("stateful-main") else 2
    return StatefulDataLoader(ds, batch_size=MICRO, shuffle=True, num_workers=workers)


# -- Accelerate ----------------------------------------------------------------------------
def run_accelerate(a: argparse.Namespace, killer: Killer, write: Any = None) -> None:
    """``write``: how the final state is written (``trainer_multiproc.py``: one part per rank)."""
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from ckpt.integrations.accelerate import CkptAccelerator
    from ckpt.manager import checkpoint_name, list_checkpoints

    set_seed(0)
    acc = CkptAccelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUM,
                          dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay(a.steps))
    loader = make_loader(a)
    if a.loader != "resumable":
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    else:  # ckpt's loader shards by rank itself: registered, not prepared
        model, opt, sched = acc.prepare(model, opt, sched)
        acc.register_for_checkpointing(loader)
    done = [r for r in list_checkpoints(a.run_dir) if r.committed]
    step, resumed_from = 0, None
    if done:
        res = acc.load_state(done[-1].path, defer_rng=True)
        it = acc.resumed_iter(loader, res)
        step = resumed_from = res.step
    else:
        it = iter(loader)
    micro: list[Any] = []
    while step < a.steps:
        for batch in it:
            micro.append(batch)
            with acc.accumulate(model):
                loss = model(**batch)["loss"]
                killer.micro(loss, step)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if not acc.sync_gradients:
                continue
            step += 1
            acc.ledger_step(step, batch=micro, loss=sum(float(x) for x in killer.losses[-ACCUM:]))
            micro = []
            killer.step_end(step)
            if step % SAVE_EVERY == 0:
                acc.save_state(os.path.join(a.run_dir, checkpoint_name(step)), step=step)
                killer.saved(step)
            if step == a.steps:
                break
        it = iter(loader)
    acc.end_training()
    (write or write_out)(a, killer, {"model": acc.unwrap_model(model), "optim": opt.optimizer, "sched": sched.scheduler},
              step, resumed_from)


# -- the trial: a straight run, a killed run, its resume, compared -----------------------------
def command(trainer: str, loader: str, run_dir: str, out: str, steps: int, kill: int = 0, where: str = "step") -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--trainer", trainer, "--loader", loader,
           "--run-dir", run_dir, "--out", out, "--steps", str(steps)]
    return cmd + (["--kill", str(kill), "--where", where] if kill else [])


def launch(cmd: list[str], *, expect_kill: bool) -> str:
    """Run one process (hang-bounded by tests/hangs.py: past the bound its stacks are
    dumped and the test fails naming the hang; never a timing verdict); returns its stderr."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import hangs

    p = hangs.run(cmd, bound_s=hangs.hang_s(60.0, floor_s=600.0))
    if expect_kill and p.returncode == -signal.SIGKILL:
        return p.stderr
    if p.returncode != 0 or expect_kill:
        warned = "\n".join(line for line in p.stderr.splitlines() if "Warning" in line)
        raise RuntimeError(f"{' '.join(cmd[2:])}: exit {p.returncode}\nwarnings:\n{warned[:3000]}\n"
                           f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.stderr


def draw(rng: random.Random, steps: int) -> tuple[int, str]:
    """A kill point: after a save, at a step end, or mid-accumulation."""
    where = rng.choice(("save", "step", "micro"))
    if where == "save":
        return rng.choice(range(SAVE_EVERY, steps, SAVE_EVERY)), where
    return rng.randrange(SAVE_EVERY, steps), where  # after the first save: the resume has something to resume


def differences(straight: str, resumed: str) -> list[str]:
    """Everything that is not bit-identical between the straight run and the resumed one."""
    ra, rb = ckpt.open(straight), ckpt.open(resumed)
    ea, eb = ra.context()["extra"], rb.context()["extra"]
    out = []
    start = eb["resumed_from"] or 0
    la, lb = ea["losses"][ACCUM * start:], eb["losses"]
    if la != lb:
        first = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
        out.append(f"losses differ from micro-batch {ACCUM * start + first} (resumed from step {start})")
    keys = list(ra.iter_tensor_keys())
    if keys != list(rb.iter_tensor_keys()):
        out.append("tensor keys differ")
    else:
        out += [k for k in keys if not torch.equal(ra.tensor(k), rb.tensor(k))]
    if ra.step != rb.step:
        out.append(f"final step {ra.step} != {rb.step}")
    if ra.context()["rng"] != rb.context()["rng"]:
        out.append("RNG differs at the end")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=("hf", "lightning", "accelerate"), required=True)
    p.add_argument("--loader", choices=("resumable", "stateful", "stateful-plain", "stateful-main", "stateful-main-plain"), default="resumable")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--kill", type=int, default=0)
    p.add_argument("--where", choices=("step", "save", "micro"), default="step")
    a = p.parse_args()
    torch.set_num_threads(1)
    killer = Killer(a)
    {"hf": run_hf, "lightning": run_lightning, "accelerate": run_accelerate}[a.trainer](a, killer)


if __name__ == "__main__":
    main()
