"""Full (global) tensors from a sharded checkpoint, on one process, no process group.

No DCP here: only ``meta.sharded`` (``ckpt.format.sharded``) and the reader, so that
``CheckpointReader.state()`` of a sharded checkpoint needs nothing from ``ckpt.dcp``.

``full_tensor`` reads only the file chunks that hold the named tensor's saved chunks
(each verified against its digest); ``full_state`` rebuilds the nested state (by the
saved key paths) with every global tensor and value.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from .errors import FormatError, StateMismatchError
from .format import dtypes
from .format.sharded import ShardedLayout, decode_layout

__all__ = ["full_tensor", "full_state"]


class _Reader(Protocol):
    """What this module needs of a ``ckpt.CheckpointReader`` (which calls it from
    ``state()``): typed structurally, so that this module never imports the reader."""

    path: str
    manifest: Any

    def tensor(self, key: str, *, part: str | None = ..., verify: bool = ...) -> torch.Tensor: ...

    def tree(self, part: str | None = ..., *, verify: bool = ...) -> Mapping[str, Any]: ...


def _layout(reader: _Reader) -> ShardedLayout:
    return decode_layout(reader.manifest, path=reader.path)


def full_tensor(reader: _Reader, fqn: str, *, verify: bool = True, layout: ShardedLayout | None = None) -> torch.Tensor:
    layout = layout or _layout(reader)
    rec = layout.tensors.get(fqn)
    if rec is None:
        raise StateMismatchError(f"no tensor {fqn!r} in this sharded checkpoint", path=reader.path, key=fqn)
    out = torch.empty(rec.shape, dtype=dtypes.torch_dtype(rec.dtype))
    for c in rec.chunks:
        src = reader.tensor(c.key, part=c.part, verify=verify)
        dst = out
        for dim, (o, n) in enumerate(zip(c.offsets, c.sizes)):
            dst = dst.narrow(dim, o, n)
        dst.copy_(src)
    return out


def _set(root: dict[Any, Any], path: tuple[Any, ...], value: Any, where: str) -> None:
    cur: Any = root
    for seg, nxt in zip(path[:-1], path[1:]):
        if isinstance(cur, dict):
            cur = cur.setdefault(seg, [] if isinstance(nxt, int) else {})
        elif isinstance(cur, list) and isinstance(seg, int):
            while len(cur) <= seg:
                cur.append(None)
            if cur[seg] is None:
                cur[seg] = [] if isinstance(nxt, int) else {}
            cur = cur[seg]
        else:
            raise FormatError(f"key path {list(path)} does not fit the tree", path=None, key=where)
    last = path[-1]
    if isinstance(cur, list) and isinstance(last, int):
        while len(cur) <= last:
            cur.append(None)
        cur[last] = value
    else:
        cur[last] = value


def full_state(reader: _Reader, *, verify: bool = True) -> dict[str, Any]:
    """The whole state as nested trees of global tensors (memory: the full state)."""
    layout = _layout(reader)
    out: dict[Any, Any] = {}
    trees: dict[str, Any] = {}
    for fqn in sorted(set(layout.tensors) | set(layout.values)):
        path = layout.paths.get(fqn, (fqn,))
        if fqn in layout.tensors:
            value: Any = full_tensor(reader, fqn, verify=verify, layout=layout)
        else:
            part = layout.values[fqn].part
            if part not in trees:
                trees[part] = reader.tree(part, verify=verify)["state"].get("values", {})
            value = trees[part][fqn]
        _set(out, tuple(path) or (fqn,), value, fqn)
    return out
