"""The single-process demo: train a tiny transformer, checkpoint it, inspect, verify,
and prove that resuming from a mid-run checkpoint reproduces the run bit for bit.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

import ckpt
from ckpt.data import ResumableLoader
from runs.common.procs import worker_threads
from runs.common.tiny_lm import CorpusDataset, TinyConfig, TinyLM, make_corpus, warmup_cosine

__all__ = ["DemoConfig", "Shell", "run"]


class Shell(Protocol):
    """How the demo shows ``ckpt ls`` and ``ckpt inspect``: the command line passes its own
    renderers in, so this run never imports the CLI (dependencies point down)."""

    def ls(self, run_dir: str) -> list[str]: ...

    def inspect(self, path: str) -> str: ...


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 300
    save_every: int = 100
    resume_from_step: int = 200
    seed: int = 1234
    batch: int = 16
    lr: float = 3e-3
    n_seqs: int = 1024


def _build(cfg: DemoConfig, corpus: torch.Tensor):
    torch.manual_seed(cfg.seed)
    model = TinyLM(TinyConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(20, cfg.steps))
    loader = ResumableLoader(CorpusDataset(corpus), seed=cfg.seed, global_batch_size=cfg.batch)
    return model, opt, sched, loader


def _train(model, opt, sched, loader, start: int, stop: int, on_step: Callable[[int, float], None]) -> list[float]:
    losses: list[float] = []
    step = start
    model.train()
    while step < stop:
        for batch in loader:
            loss = model.loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            on_step(step, losses[-1])
            if step >= stop:
                break
    return losses


def run(out_dir: str, cfg: DemoConfig = DemoConfig(), echo: Callable[[str], None] = print, progress: bool = False,
        *, shell: Shell | None = None) -> dict:
    run_dir = os.path.join(out_dir, "checkpoints")
    os.makedirs(run_dir, exist_ok=True)
    corpus = make_corpus(cfg.n_seqs, TinyConfig().seq_len, TinyConfig().vocab, seed=cfg.seed)
    model, opt, sched, loader = _build(cfg, corpus)
    state = {"model": model, "optim": opt, "sched": sched}
    saved: dict[int, str] = {}
    t0 = time.perf_counter()

    def on_step(step: int, loss: float) -> None:
        if progress and (step % 10 == 0 or step == cfg.steps):
            # a bar on stderr (the caller enables it only on a terminal): stdout is the report
            n = 30 * step // cfg.steps
            sys.stderr.write(f"\r  training [{'#' * n}{'.' * (30 - n)}] step {step}/{cfg.steps}  loss {loss:.4f}")
            if step == cfg.steps:
                sys.stderr.write("\n")
            sys.stderr.flush()
        if step % cfg.save_every == 0:
            path = os.path.join(run_dir, f"step-{step:08d}")
            ckpt.save(path, state, config=asdict(cfg), data=loader, step=step, run_id="demo", overwrite=True,
                      ledger=False)  # the demo checks its resume itself, bit for bit
            saved[step] = path

    echo(f"training a {sum(p.numel() for p in model.parameters())}-parameter transformer for {cfg.steps} steps")
    losses = _train(model, opt, sched, loader, 0, cfg.steps, on_step)
    train_s = time.perf_counter() - t0
    echo(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f} in {train_s:.1f} s; {len(saved)} checkpoints")

    last = saved[max(saved)]
    if shell is not None:
        echo("\n$ ckpt ls " + run_dir)
        for line in shell.ls(run_dir):
            echo("  " + line)
        echo("\n$ ckpt inspect " + last)
        echo(shell.inspect(last))
    valid = True
    for path in sorted(saved.values()):
        try:
            ckpt.open(path).verify()  # every chunk re-hashed, as `ckpt ls --deep` does
        except ckpt.CkptError as e:
            valid = False
            echo(f"  {os.path.basename(path)}: {e}")
    echo("\n$ ckpt verify " + last)
    rep = ckpt.open(last).verify()
    echo(f"  ok: {rep.files} files, {rep.chunks} chunks, {rep.bytes} bytes re-hashed")

    # Resume from the mid-run checkpoint in fresh objects, with the RNG disturbed, and
    # train to the end: every parameter, optimizer tensor and loss must match bit for bit.
    mid = saved[cfg.resume_from_step]
    model2, opt2, sched2, loader2 = _build(cfg, corpus)
    torch.manual_seed(999)
    info = ckpt.load(mid, {"model": model2, "optim": opt2, "sched": sched2}, data=loader2, ledger=False)
    losses2 = _train(model2, opt2, sched2, loader2, cfg.resume_from_step, cfg.steps, lambda _s, _l: None)
    same_losses = losses2 == losses[cfg.resume_from_step :]
    same_params = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    same_opt = all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])
    echo(f"\nresumed from {os.path.basename(mid)} (restored rng: {', '.join(info.restored_rng)}) and trained to step {cfg.steps}:")
    echo(f"  losses bit-identical:     {'yes' if same_losses else 'NO'} ({len(losses2)} steps)")
    echo(f"  parameters bit-identical: {'yes' if same_params else 'NO'}")
    echo(f"  optimizer bit-identical:  {'yes' if same_opt else 'NO'}")
    echo(f"\noutput directory: {os.path.abspath(out_dir)}")
    echo("next:")
    for cmd in (f"ckpt ls {run_dir}", f"ckpt inspect {last}", f"ckpt diff {saved[min(saved)]} {last}"):
        echo(f"  {cmd}")
    return {
        "checkpoints": sorted(saved.values()),
        "valid": valid,
        "losses_identical": same_losses,
        "params_identical": same_params,
        "optim_identical": same_opt,
        "final_loss": losses[-1],
        "checks": [("checkpoints valid", valid), ("losses bit-identical", same_losses),
                   ("parameters bit-identical", same_params), ("optimizer bit-identical", same_opt)],
    }


def main(out_dir: str, *, quick: bool, echo: Callable[[str], None], progress: bool,
         options: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """``ckpt demo basic`` (the registry's entry point, :data:`runs.DEMOS`)."""
    steps = int(options.get("steps", 300))
    save_every = max(steps // 3, 1)
    cfg = DemoConfig(steps=steps, save_every=save_every, resume_from_step=2 * save_every)
    # One intra-op thread, as every run's worker has (runs.common.procs): torch's default
    # pool spin-waits, and beside four CPU hogs on two cores the demo took over 20 minutes
    # with it (about 10% of a core). The caller's setting is restored after the run.
    threads = torch.get_num_threads()
    worker_threads()
    try:
        return run(out_dir, cfg, echo=echo, progress=progress, shell=options.get("shell"))["checks"]
    finally:
        torch.set_num_threads(threads)
