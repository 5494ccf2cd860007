"""A tiny transformer run that exercises everything exact resume must restore.

Entry point for ``ckpt check-resume --entry runs.basic.resume_tiny:train`` (contract:
``ckpt.testing.resume_entry``). It has dropout (global torch RNG in the main process), AdamW,
a warmup-cosine ``LambdaLR``, gradient accumulation over 2 micro-batches, a shuffled
``ckpt.data.ResumableLoader`` with 2 workers whose samples are randomly augmented with
Python, numpy and torch RNG, a token counter, and DDP over gloo when
``ctx.world_size > 1`` (model, optimizer and scheduler are replicated: written once).

Options (``ctx.options``), to break it on purpose in tests:
``omit=<entry>`` leaves an entry out of the checkpoint (e.g. ``omit=sched``);
``workers=<n>`` sets the loader's worker count (default 2).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from ckpt.data import ResumableLoader
from runs.common.tiny_lm import warmup_cosine

__all__ = ["train", "TinyTransformer", "AugmentedTokens"]

VOCAB = 16
SEQ = 8
N_SAMPLES = 64
MICRO_BATCH = 4  # global samples per micro-batch
ACCUM = 2


class AugmentedTokens:
    """Map-style token sequences; each read applies a random augmentation (masking,
    a shift and a noise channel) drawn from all three global RNGs."""

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)  # the clean sample is a pure function of i
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        mask = torch.rand(SEQ + 1) < 0.15
        tokens = torch.where(mask, torch.zeros_like(tokens), tokens)
        tokens = (tokens + random.randint(0, 1)) % VOCAB
        noise = torch.tensor(np.random.normal(size=SEQ), dtype=torch.float32)
        return {"x": tokens[:-1], "y": tokens[1:], "noise": noise}


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.noise_proj = nn.Linear(1, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.noise_proj(noise.unsqueeze(-1))
        return self.head(self.block(h))


def train(ctx: Any) -> None:
    # One intra-op thread: the model is tiny, and two loader workers share the cores.
    torch.set_num_threads(1)
    torch.manual_seed(ctx.seed)
    model: nn.Module = TinyTransformer()
    if ctx.world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    # Per-rank RNG streams (dropout), so restoring each rank's own state matters.
    torch.manual_seed(ctx.seed * 1000 + ctx.rank + 1)
    random.seed(ctx.seed * 1000 + ctx.rank + 2)
    np.random.seed(ctx.seed * 1000 + ctx.rank + 3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, ctx.steps))
    loader = ResumableLoader(
        AugmentedTokens(),
        seed=ctx.seed,
        global_batch_size=MICRO_BATCH,
        num_workers=int(ctx.options.get("workers", 2)),
        multiprocessing_context="fork",
    )
    counters = {"tokens": 0, "micro_steps": 0}
    state = {"model": model, "optim": opt, "sched": sched, "counters": counters}
    ctx.watch(state)
    state = {k: v for k, v in state.items() if k != ctx.options.get("omit")}
    replicated = [k for k in ("model", "optim", "sched") if k in state] if ctx.world_size > 1 else []
    mgr = ctx.manager(state, data=loader, config={"steps": ctx.steps, "accum": ACCUM, "schedule": "warmup_cosine"}, replicated=replicated)
    mgr.resume()
    step = mgr.start_step
    batches = iter(loader)
    while step < ctx.steps:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(ACCUM):
            try:
                batch = next(batches)
            except StopIteration:  # epoch boundary: the next iter() starts the next epoch
                batches = iter(loader)
                batch = next(batches)
            logits = model(batch["x"], batch["noise"])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1)) / ACCUM
            loss.backward()
            total += loss.detach()
            counters["tokens"] += int(batch["x"].numel())
            counters["micro_steps"] += 1
        opt.step()
        sched.step()
        step += 1
        mgr.after_step(step)
        ctx.report(step, total)
        if mgr.should_stop:
            break
    ctx.finish()
