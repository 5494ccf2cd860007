"""The guarded training run, as a replayable entry point: ``main(rec)``.

``rec.config`` (all optional): ``run_dir`` (checkpoints and the step ledger; a forced or
verified replay uses a fresh directory of its own), ``steps``, ``seed``, ``batch``,
``n_seqs``, ``lr``, ``every`` (checkpoint interval), ``spike_at`` and ``spike_len`` (the
corrupted window: global batches of epoch 0; ``spike_len`` 0 injects nothing),
``guard`` (false: no guard), ``window``, ``z_threshold``, ``policy``, ``skip_after``,
``warmup`` (routing warmup batches), ``max_rollbacks``, ``threads`` (torch intra-op threads
during the run, default 1).

The fault is decided once and taped (``rec.maybe_inject``), so a forced replay corrupts
the same window. Everything else a replay must reproduce is on the tape: every step's
sample ids, loss bits and RNG digests, parameter digests every 10 steps, each checkpoint,
and the guard's episode (spike, rollback, routing, warmup, routing replays).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import ckpt
from ckpt.data import EpochOrder, ResumableLoader
from ckpt.guard import GuardConfig, LossGuard
from runs.common.tiny_lm import CorpusDataset, make_corpus, unlikely_corpus
from runs.common.tiny_moe import MoEConfig, TinyMoE

__all__ = ["main", "Outcome", "DEFAULTS"]

DEFAULTS: dict[str, Any] = {
    "steps": 48, "seed": 1, "batch": 16, "n_seqs": 1024, "lr": 1e-2, "every": 10, "spike_at": 40, "spike_len": 2,
    "guard": True, "window": 16, "z_threshold": 6.0, "policy": "skip", "skip_after": 1, "warmup": 4,
    "max_rollbacks": 3, "threads": 1,
}


@dataclass
class Outcome:
    """What a run did (the entry point's return value: ``ReplayResult.value`` in a replay)."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    rollbacks: list[Any] = field(default_factory=list)
    eval_loss: float = float("nan")
    used: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    cached: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    replayed: list[tuple[int, int, str, bytes]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    ledger: str = ""
    corrupted: list[int] = field(default_factory=list)


HELD_OUT = 64


def _text(cfg: dict[str, Any]) -> torch.Tensor:
    """The training corpus and, after it, ``HELD_OUT`` held-out sequences of the same process."""
    return make_corpus(int(cfg["n_seqs"]) + HELD_OUT, MoEConfig().seq_len, MoEConfig().vocab, seed=int(cfg["seed"]))


def _corpus(cfg: dict[str, Any], window: list[int]) -> torch.Tensor:
    corpus = _text(cfg)[: int(cfg["n_seqs"])].clone()
    if window:
        bad = unlikely_corpus(cfg["n_seqs"], MoEConfig().seq_len, MoEConfig().vocab, seed=cfg["seed"])
        order = EpochOrder(cfg["n_seqs"], cfg["seed"], 0)
        for s in window:
            for p in range(s * cfg["batch"], (s + 1) * cfg["batch"]):
                corpus[order.index(p)] = bad[order.index(p)]
    return corpus


def main(rec: Any) -> Outcome:
    cfg = {**DEFAULTS, **rec.config}
    # The model is tiny: a second intra-op thread only contends (badly, on a loaded box).
    # Set for the run and put back after it; a run and its replay use the same count.
    threads = torch.get_num_threads()
    torch.set_num_threads(int(cfg["threads"]))
    try:
        return _run(rec, cfg)
    finally:
        torch.set_num_threads(threads)


def _run(rec: Any, cfg: dict[str, Any]) -> Outcome:
    seed = int(cfg["seed"])
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)  # taped with the other streams: a fresh process must start where the recording did
    # The fault, decided once: the global batches of epoch 0 whose samples are corrupted.
    window = rec.maybe_inject("corrupt_batches", "data", lambda: list(
        range(int(cfg["spike_at"]), int(cfg["spike_at"]) + int(cfg["spike_len"]))) if cfg["spike_len"] else None) or []
    corpus = _corpus(cfg, window)
    model = TinyMoE()
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg["lr"]))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = ResumableLoader(CorpusDataset(corpus), seed=seed, global_batch_size=int(cfg["batch"]))
    scratch = None
    if rec.mode == "record" and cfg.get("run_dir"):
        run_dir = str(cfg["run_dir"])
    else:  # a replay re-executes into a directory of its own, never over the recording's
        run_dir = scratch = tempfile.mkdtemp(prefix="rollback-replay-")
    # A fixed run id: it is in every checkpoint's lineage, so the checkpoints (and the
    # content ids the rollback event names) are the same bytes in a replay.
    mgr = ckpt.CheckpointManager(run_dir, {"model": model, "optim": opt, "sched": sched}, data=loader,
                                 every_steps=int(cfg["every"]), retention=ckpt.RetentionPolicy(keep_last=2),
                                 signals=(), run_id=str(cfg.get("run_id", f"rollback-{seed}")))
    guard = None
    if cfg["guard"]:
        gcfg = GuardConfig(window=int(cfg["window"]), z_threshold=float(cfg["z_threshold"]), policy=cfg["policy"],
                           skip_after=int(cfg["skip_after"]), warmup_batches=int(cfg["warmup"]),
                           max_rollbacks=int(cfg["max_rollbacks"]))
        guard = LossGuard(mgr, gcfg, tape=rec, model=model, forward=model.loss)
    out = Outcome(corrupted=list(window), ledger=os.path.join(run_dir, "ledger"))
    rec.watch(model)
    mgr.save(0)  # a spike always has a target
    rec.checkpoint("step-00000000", "step-00000000")
    step, total = 0, int(cfg["steps"])
    try:
        while step < total:
            for batch in loader:
                info = loader.last_batch
                with rec.step(step + 1):
                    rec.batch(list(info.indices))
                    loss = model.loss(batch)
                    for name, layer in (("blocks.0.moe", model.moe_layers[0]), ("blocks.1.moe", model.moe_layers[1])):
                        out.used[(info.epoch, info.step, name)] = layer.last_experts.clone()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                    step += 1
                    rec.loss(loss)
                    out.losses.append((step, loss.item()))
                    if guard is not None:
                        rb = guard.after_step(step, loss=loss, batch=batch)
                    else:
                        mgr.after_step(step, loss=loss, batch=batch)
                        rb = None
                    if rb is None and step % int(cfg["every"]) == 0:
                        rec.checkpoint(f"step-{step:08d}", f"step-{step:08d}")
                if rb is not None:
                    out.rollbacks.append(rb)
                    if guard is not None and guard.routing is not None:
                        out.cached.update(guard.routing.cache)
                    step = rb.step
                    break
                if step >= total:
                    break
        mgr.wait()
        out.checkpoints = [r.name for r in mgr.checkpoints()]
        if guard is not None and guard.routing is not None:
            out.replayed = list(guard.routing.replayed)
        out.eval_loss = evaluate(model, cfg)
    finally:
        if guard is not None:
            guard.close()
        mgr.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


def evaluate(model: TinyMoE, cfg: dict[str, Any]) -> float:
    """Loss on the held-out sequences (same bigram process, never trained on), with every
    RNG stream left where it was."""
    held_out = _text(cfg)[-HELD_OUT:]
    with torch.no_grad(), ckpt.rng.isolated():
        return float(model.loss(held_out))
