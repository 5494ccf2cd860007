"""Sharded training state (DTensor: FSDP2, tensor parallel) as ckpt checkpoints, through DCP.

``torch.distributed.checkpoint`` plans sharded saves and resharding loads; this package
is its storage backend and pickle-free planners (spec/sharded-format.md)::

    import torch.distributed.checkpoint as dcp
    import ckpt.dcp
    dcp.save(state, storage_writer=ckpt.dcp.StorageWriter(path), planner=ckpt.dcp.SavePlanner())
    dcp.load(state, storage_reader=ckpt.dcp.StorageReader(path), planner=ckpt.dcp.LoadPlanner())

``ckpt.save``/``ckpt.load`` route states holding DTensors (and checkpoints with
``meta.sharded``) here on their own. Importing ``ckpt.dcp`` alone does not import torch (``ckpt inspect`` reads layouts);
the storage classes and planners load it on first use.
"""

from __future__ import annotations

from typing import Any

from ..format.sharded import ShardedLayout, decode_layout, is_sharded

__all__ = ["StorageWriter", "StorageReader", "SavePlanner", "LoadPlanner", "ShardedLayout", "decode_layout", "is_sharded"]

_LAZY = {
    "StorageWriter": "storage",
    "StorageReader": "storage",
    "SavePlanner": "planner",
    "LoadPlanner": "planner",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckpt.dcp' has no attribute {name!r}")
