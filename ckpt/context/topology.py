"""Cluster topology, read from torch.distributed and the device APIs when initialised."""

from __future__ import annotations

import socket
from typing import Any

from ..knobs import local_launch

__all__ = ["capture_topology"]


def capture_topology() -> dict[str, Any]:
    import torch

    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    local_rank, local_world_size = local_launch()
    out: dict[str, Any] = {
        "distributed": bool(initialised),
        "world_size": dist.get_world_size() if initialised else 1,
        "rank": dist.get_rank() if initialised else 0,
        "local_rank": local_rank,
        "local_world_size": local_world_size,
        "backend": str(dist.get_backend()) if initialised else None,
        "hostname": socket.gethostname(),
        "device_kind": "cpu",
        "device_count": 0,
        "device_names": [],
    }
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        out["device_kind"] = "cuda"
        out["device_count"] = n
        out["device_names"] = [torch.cuda.get_device_name(i) for i in range(n)]
    return out
