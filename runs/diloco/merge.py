"""Averaging the learners' outer gradients (pseudo-gradients) of one fragment.

``mean``: the weighted mean of the outer gradients. ``rda``, radial-directional
averaging (Decoupled DiLoCo): norms and directions are averaged separately. The merged
vector's norm is the weighted mean of the norms, and its direction is the normalised
weighted mean of the directions, so learners that disagree in direction do not shrink
the step the way a plain mean does. A fragment is one vector (all its tensors together).
Pure functions of float64 tensors, so the merge is bit-reproducible.

The same two averages serve a learner's *model update* (``model_update``): when a
merged fragment arrives, the learner has moved on from ``base``, the global fragment it
last adopted (its own update, ``theta_local - base``), and so has the syncer (the global
update, ``Theta_new - base``). ``replace`` adopts ``Theta_new``; ``mean`` and ``rda``
average the two updates with weights ``alpha`` and ``1 - alpha`` and step from ``base``:
``mean`` is Streaming DiLoCo's mixing ``alpha * theta_local + (1 - alpha) * Theta_new``;
``rda`` keeps the weighted mean of the two updates' norms, so when they disagree in
direction the step is not shortened the way the plain mix shortens it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["average", "mean_average", "rda_average", "model_update"]


def mean_average(grads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    total = math.fsum(weights)
    if total <= 0.0:
        return [torch.zeros(t.shape, dtype=torch.float64) for t in grads[0]]
    out = []
    for j in range(len(grads[0])):
        acc = torch.zeros(grads[0][j].shape, dtype=torch.float64)
        for w, g in zip(weights, grads):
            acc += (w / total) * g[j]
        out.append(acc)
    return out


def _norm(g: Sequence[torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float((t * t).sum()) for t in g))


def rda_average(grads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    total = math.fsum(weights)
    norms = [_norm(g) for g in grads]
    radius = math.fsum((w / total) * n for w, n in zip(weights, norms))
    # directions of the non-zero outer gradients; a zero one has none and adds none
    dirs = mean_average([[t / n for t in g] for g, n in zip(grads, norms) if n > 0.0],
                        [w for w, n in zip(weights, norms) if n > 0.0]) if any(n > 0.0 for n in norms) else None
    if dirs is None:
        return [torch.zeros(t.shape, dtype=torch.float64) for t in grads[0]]
    dn = _norm(dirs)
    if dn == 0.0:  # the directions cancel out exactly: no direction to step in
        return [torch.zeros_like(t) for t in dirs]
    return [(radius / dn) * t for t in dirs]


def average(kind: str, grads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """The merged outer gradient of one fragment (float64), by ``kind`` ("mean" or "rda")."""
    if kind == "mean":
        return mean_average(grads, weights)
    if kind == "rda":
        return rda_average(grads, weights)
    raise ValueError(f"unknown merge {kind!r}")


def model_update(kind: str, alpha: float, base: Sequence[torch.Tensor], local: Sequence[torch.Tensor],
                 merged: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """A learner's fragment after a merged fragment arrives (module docstring), in the
    local tensors' dtype, and the norm of the step it takes from ``base`` (float64)."""
    if kind == "replace":
        step = [m.to(torch.float64) - b.to(torch.float64) for b, m in zip(base, merged)]
        return [m.clone() for m in merged], _norm(step)
    mine = [x.to(torch.float64) - b.to(torch.float64) for b, x in zip(base, local)]
    glob = [m.to(torch.float64) - b.to(torch.float64) for b, m in zip(base, merged)]
    step = average(kind, [mine, glob], [alpha, 1.0 - alpha])
    return [(b.to(torch.float64) + u).to(x.dtype) for b, u, x in zip(base, step, local)], _norm(step)
