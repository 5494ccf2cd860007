"""A small GPT-style training script with a divergence that can be planted at a known step,
module and phase (``PLANT`` environment variable), for ``ckpt bisect`` tests.

    python plant_script.py --out RUN --steps 12          # a run with its ledger and checkpoints
    --entry plant_script:target                           # the bisect target of this script

PLANT (read when the model is built): ``noise`` (blocks.1.mix's forward adds noise from
the OS: a nondeterministic op), ``stream`` (the dropout ``drop`` draws from another
generator), ``threads`` (the same noise, only with more than one intra-op thread: what a
parallel reduction does), ``layer`` (blocks.0.act is another activation), ``backward`` (blocks.1.gate's
backward scales its gradient), ``optimizer`` (an extra decay after each step). PLANT_STEP: the
first step where the plant acts (default 1).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import ckpt
from ckpt.bisect import Target

VOCAB, DIM, CTX = 32, 16, 8


class _ScaledGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class Gate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.planted = False

    def forward(self, x):
        return _ScaledGrad.apply(x, 1.5 if self.planted else 1.0)


class Mix(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)
        self.noisy = False
        self.threaded = False  # nondeterministic only with more than one intra-op thread

    def forward(self, x):
        y = self.lin(x)
        if self.noisy or (self.threaded and torch.get_num_threads() > 1):
            noise = int.from_bytes(os.urandom(2), "little") / 65536.0 * 1e-6
            y = y + noise
        return y


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = Mix()
        self.act = torch.nn.GELU()
        self.gate = Gate()

    def forward(self, x):
        return x + self.gate(self.act(self.mix(x)))


class Drop(torch.nn.Module):
    """Dropout; planted, it draws its mask from a generator of its own, not the global one."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.other = torch.Generator().manual_seed(99)
        self.stream = False

    def forward(self, x):
        if not self.training:
            return x
        if self.stream:
            keep = torch.rand(x.shape, generator=self.other) >= self.p
            return x * keep / (1 - self.p)
        return F.dropout(x, self.p, True)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.drop = Drop(0.1)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.drop(x))


def _plant(model: Tiny, opt: torch.optim.Optimizer, on: bool) -> None:
    what = os.environ.get("PLANT", "")
    model.blocks[1].mix.noisy = on and what == "noise"
    model.blocks[1].mix.threaded = on and what == "threads"
    model.drop.stream = on and what == "stream"
    model.blocks[1].gate.planted = on and what == "backward"
    if on and what == "layer":
        model.blocks[0].act = torch.nn.GELU(approximate="tanh")
    # another update rule: an extra decay after each step (a post-step hook, as an EMA or a
    # weight clamp would be; hyperparameters in param_groups come back from the checkpoint)
    if on and what == "optimizer" and not getattr(opt, "_planted", False):
        opt._planted = True

        def extra_decay(o, *_):
            with torch.no_grad():
                for g in o.param_groups:
                    for p in g["params"]:
                        p.mul_(1 - 1e-4)

        opt.register_step_post_hook(extra_decay)


def build():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = torch.randint(0, VOCAB, (512,), generator=torch.Generator().manual_seed(1))
    return model, opt, data


class Batches:
    """Index-based batching: random windows drawn from the global RNG (resumable through it)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __call__(self):
        ix = torch.randint(0, len(self.data) - CTX - 1, (4,))
        x = torch.stack([self.data[i : i + CTX] for i in ix])
        y = torch.stack([self.data[i + 1 : i + CTX + 1] for i in ix])
        return x, y


def train_step(model, opt, batch):
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def target() -> Target:
    model, opt, data = build()
    _plant(model, opt, True)
    return Target(state={"model": model, "optim": opt}, step=lambda b: train_step(model, opt, b), next_batch=Batches(data))


def train(out: str, steps: int) -> None:
    model, opt, data = build()
    plant_at = int(os.environ.get("PLANT_STEP", "1"))
    batches = Batches(data)
    mgr = ckpt.CheckpointManager(out, {"model": model, "optim": opt}, every_steps=3, ledger_params_every=1,
                                 retention=ckpt.RetentionPolicy(keep_last=100))
    for step in range(1, steps + 1):
        _plant(model, opt, step >= plant_at)
        batch = batches()
        loss = train_step(model, opt, batch)
        mgr.after_step(step, batch=batch, loss=loss)
    mgr.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    train(a.out, a.steps)
