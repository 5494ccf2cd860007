"""Per-rank state of a data-parallel job, for trainers that save from one rank only.

Lightning's strategies hand the checkpoint to its ``CheckpointIO`` on rank 0 alone, so
every other rank's RNG streams and data-loader position would be lost (each rank draws
its own dropout masks and reads its own shard). :func:`gather_to_all` collects one
record per rank on every rank through byte collectives (no pickle: msgpack with tensors
as raw bytes), so that rank 0 writes them all and each rank reads its own back.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

__all__ = ["world", "gather_to_all", "refuse_world_change"]

_EXT_TENSOR, _EXT_TUPLE = 1, 2


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb([str(t.dtype).removeprefix("torch."), list(t.shape), raw]))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    raise TypeError(f"cannot send a {type(obj).__name__} between ranks (tensors, tuples and msgpack values only)")


def _ext(code: int, data: bytes) -> Any:
    if code == _EXT_TENSOR:
        dtype, shape, raw = msgpack.unpackb(data, raw=False)
        dt = getattr(torch, dtype)
        if not raw:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape).clone()
    if code == _EXT_TUPLE:
        return tuple(_unpack(data))
    return msgpack.ExtType(code, data)


def _pack(obj: Any) -> bytes:
    # tuples go through ``default`` (strict_types), so they come back as tuples
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)


_CHECKPOINTERS: dict[int, Any] = {}


def _channel() -> Any:
    """The checkpointer's own gloo group (created once per job, on every rank at the
    first gather: a collective at the same point of the program on each rank)."""
    from ..distributed import DistributedCheckpointer

    key = id(dist.distributed_c10d._get_default_group())
    if key not in _CHECKPOINTERS:
        _CHECKPOINTERS[key] = DistributedCheckpointer()
    return _CHECKPOINTERS[key]


def gather_to_all(record: Any) -> list[Any]:
    """Every rank's ``record`` (a tree of msgpack values, tuples and tensors), in rank
    order, on every rank. A collective: every rank calls it at the same point."""
    return [_unpack(b) for b in _channel().all_gather_bytes(_pack(record))]


def refuse_world_change(path: str, saved: int, now: int, *, how: str) -> None:
    """A resume at another world size cannot be exact (another data split, another
    reduction order, ranks whose streams were never saved): refused, never called exact."""
    if saved == now:
        return
    from ..errors import ResumeMismatchError

    raise ResumeMismatchError(
        f"cannot resume from {path}: it was saved by {saved} process(es), this run has {now}. A resume at another "
        f"world size is not exact (each rank's data shard, RNG streams and the gradient reduction order change); "
        f"nothing was loaded and the run's checkpoints are untouched. {how}",
        path=path, key="world_size", saved_world_size=saved, world_size=now,
    )
