"""AdamW over named parameters, as a Stateful whose state is plain tensors by name.

``torch.optim``'s constructor imports ``torch._dynamo`` on first use: several seconds of
start-up in every worker process on a loaded two-core machine, for nothing this run uses.
This one is the textbook update (decoupled weight decay, bias-corrected moments), and its
state is a tree (``step`` and the two moments by parameter name), which checkpoints,
snapshot parts and peer recoveries carry as is.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

__all__ = ["AdamW"]


class AdamW:
    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self.params = dict(named)
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.steps = 0
        self.m = {n: torch.zeros_like(p, memory_format=torch.contiguous_format) for n, p in self.params.items()}
        self.v = {n: torch.zeros_like(p, memory_format=torch.contiguous_format) for n, p in self.params.items()}

    @torch.no_grad()
    def step(self) -> None:
        b1, b2 = self.betas
        self.steps += 1
        bc1 = 1 - b1 ** self.steps
        bc2 = math.sqrt(1 - b2 ** self.steps)
        for n, p in self.params.items():
            g = p.grad
            if g is None:
                continue
            if self.weight_decay:
                p.mul_(1 - self.lr * self.weight_decay)
            m, v = self.m[n], self.v[n]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, (v.sqrt() / bc2).add_(self.eps), value=-self.lr / bc1)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.steps, "m": self.m, "v": self.v}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        if set(d["m"]) != set(self.m) or set(d["v"]) != set(self.v):
            raise ValueError("optimizer state names differ from this optimizer's parameters")
        with torch.no_grad():
            for n in self.m:
                self.m[n].copy_(d["m"][n])
                self.v[n].copy_(d["v"][n])
        self.steps = int(d["step"])

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the state, the step included, in a fixed order (for digests)."""
        out = [("step", torch.tensor(self.steps, dtype=torch.int64))]
        out += [(f"m.{n}", t) for n, t in self.m.items()]
        out += [(f"v.{n}", t) for n, t in self.v.items()]
        return out
