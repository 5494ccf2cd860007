"""Is this state sharded? A torch-free probe (``ckpt.save`` asks it on every call)."""

from __future__ import annotations

import sys
from typing import Any, Mapping

__all__ = ["holds_dtensor"]


def holds_dtensor(state: Any) -> bool:
    """True when a module, optimizer or tensor in ``state`` is a DTensor. Cheap: without
    ``torch.distributed.tensor`` imported there can be no DTensor, so nothing is walked."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None or not isinstance(state, Mapping):
        return False
    import torch

    DTensor = mod.DTensor
    for obj in state.values():
        if isinstance(obj, torch.nn.Module):
            if any(isinstance(p, DTensor) for p in obj.parameters()):
                return True
        elif isinstance(obj, torch.optim.Optimizer):
            if any(isinstance(p, DTensor) for g in obj.param_groups for p in g["params"]):
                return True
        elif isinstance(obj, DTensor):
            return True
        elif isinstance(obj, Mapping) and holds_dtensor(obj):
            return True
    return False
