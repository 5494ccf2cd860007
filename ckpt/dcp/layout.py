"""``meta.sharded``: how global tensors are cut into the parts' chunks (spec/sharded-format.md §S.3).

Pure (no torch): records, their msgpack-ready wire form, and the reader's checks. The
inspect and verify commands use it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Mapping

from ..errors import FormatError, UnsupportedVersionError
from ..format import dtypes
from ..format.manifest import Manifest

__all__ = ["LAYOUT_VERSION", "Chunk", "TensorRecord", "ValueRecord", "ShardedLayout", "box_name", "decode_layout", "is_sharded"]

LAYOUT_VERSION = 1
_MAX_DIM = 1 << 62


@dataclass(frozen=True, slots=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    part: str
    key: str

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass(frozen=True, slots=True)
class TensorRecord:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * dtypes.itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class ValueRecord:
    fqn: str
    part: str


@dataclass(frozen=True, slots=True)
class ShardedLayout:
    """A sharded checkpoint's global layout (``meta.sharded``, spec/sharded-format.md): the world
    size, every tensor's global shape and chunks per rank, the plain values, and the mesh."""

    world_size: int
    tensors: Mapping[str, TensorRecord]
    values: Mapping[str, ValueRecord]
    paths: Mapping[str, tuple[Any, ...]]
    mesh: Mapping[str, Any] | None = None
    placements: Mapping[str, tuple[str, ...]] | None = None
    dcp_version: str | None = None

    def to_wire(self) -> dict[str, Any]:
        entries: list[Any] = []
        for fqn in sorted(set(self.tensors) | set(self.values)):
            if fqn in self.tensors:
                t = self.tensors[fqn]
                entries.append(["tensor", fqn, t.dtype, list(t.shape), [[list(c.offsets), list(c.sizes), c.part, c.key] for c in t.chunks]])
            else:
                entries.append(["value", fqn, self.values[fqn].part])
        return {
            "version": LAYOUT_VERSION,
            "world_size": self.world_size,
            "entries": entries,
            "paths": {k: list(v) for k, v in sorted(self.paths.items())},
            "mesh": dict(self.mesh) if self.mesh is not None else None,
            "placements": {k: list(v) for k, v in sorted((self.placements or {}).items())},
            "dcp_version": self.dcp_version,
        }


def box_name(offsets: tuple[int, ...] | list[int]) -> str:
    """Name of a chunk inside its fqn's map in the part's ``shards`` entry (§S.2)."""
    return ",".join(str(int(o)) for o in offsets)


def is_sharded(manifest: Manifest) -> bool:
    """Whether a checkpoint's MANIFEST holds a sharded (DCP) layout (``meta.sharded``)."""
    return isinstance(manifest.meta, Mapping) and "sharded" in manifest.meta


def _int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _ints(v: Any, n: int | None, lo: int, hi: int) -> bool:
    return isinstance(v, list) and (n is None or len(v) == n) and len(v) <= 64 and all(_int(x, lo, hi) for x in v)


def _overlap(a: Chunk, b: Chunk) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _check_tiling(t: TensorRecord, where: str, path: str | None) -> None:
    total = 0
    for c in t.chunks:
        total += c.numel
    if total != prod(t.shape):
        raise FormatError(f"chunks cover {total} elements, the tensor has {prod(t.shape)}", path=path, key=where)
    # Sweep along dimension 0 (0-d tensors have one chunk of one element: nothing to do).
    if not t.shape:
        if len(t.chunks) != 1:
            raise FormatError("a 0-d tensor has exactly one chunk", path=path, key=where)
        return
    live = [c for c in t.chunks if c.numel > 0]
    live.sort(key=lambda c: c.offsets[0])
    active: list[Chunk] = []
    for c in live:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > c.offsets[0]]
        for a in active:
            if _overlap(a, c):
                raise FormatError(f"chunks at {list(a.offsets)} and {list(c.offsets)} overlap", path=path, key=where)
        active.append(c)


def decode_layout(manifest: Manifest, *, path: str | None = None) -> ShardedLayout:
    """Validate ``meta.sharded`` against the manifest (§S.3 rules 1-3) and return it."""
    raw = manifest.meta.get("sharded") if isinstance(manifest.meta, Mapping) else None
    base = "meta.sharded"
    if not isinstance(raw, Mapping):
        raise FormatError("not a sharded checkpoint (no meta.sharded map)", path=path, key=base)
    ver = raw.get("version")
    if not _int(ver, 1, 1 << 31):
        raise FormatError("version must be a positive int", path=path, key=f"{base}.version")
    if ver > LAYOUT_VERSION:
        raise UnsupportedVersionError(f"sharded layout version {ver} is newer than this reader ({LAYOUT_VERSION})", path=path, key=f"{base}.version")
    ws = raw.get("world_size")
    if not _int(ws, 1, 1 << 24):
        raise FormatError("world_size must be an int >= 1", path=path, key=f"{base}.world_size")
    parts = {p.name: {t.key: t for t in p.tensors} for p in manifest.parts}
    for r in range(ws):
        if f"rank-{r:05d}" not in parts:
            raise FormatError(f"part rank-{r:05d} is missing (world_size {ws})", path=path, key=f"{base}.world_size")
    entries = raw.get("entries")
    if not isinstance(entries, list):
        raise FormatError("entries must be an array", path=path, key=f"{base}.entries")
    tensors: dict[str, TensorRecord] = {}
    values: dict[str, ValueRecord] = {}
    for i, e in enumerate(entries):
        where = f"{base}.entries[{i}]"
        if not isinstance(e, list) or len(e) < 3 or e[0] not in ("tensor", "value") or not isinstance(e[1], str) or not e[1]:
            raise FormatError("entry must be ['tensor'|'value', fqn, ...]", path=path, key=where)
        fqn = e[1]
        if fqn in tensors or fqn in values:
            raise FormatError(f"duplicate fqn {fqn!r}", path=path, key=where)
        if e[0] == "value":
            if len(e) != 3 or e[2] not in parts:
                raise FormatError(f"value {fqn!r} names no existing part", path=path, key=where)
            values[fqn] = ValueRecord(fqn, e[2])
            continue
        if len(e) != 5:
            raise FormatError("tensor entry must have 5 elements", path=path, key=where)
        _, _, dtype, shape, chunks = e
        if not isinstance(dtype, str) or dtype not in dtypes.DTYPES:
            raise FormatError(f"unknown dtype {dtype!r}", path=path, key=f"{where}.dtype")
        if not _ints(shape, None, 0, _MAX_DIM):
            raise FormatError("shape must be an array of at most 64 ints in [0, 2^62]", path=path, key=f"{where}.shape")
        if not isinstance(chunks, list) or not chunks:
            raise FormatError("chunks must be a non-empty array", path=path, key=f"{where}.chunks")
        recs = []
        for j, c in enumerate(chunks):
            cw = f"{where}.chunks[{j}]"
            if not (isinstance(c, list) and len(c) == 4 and _ints(c[0], len(shape), 0, _MAX_DIM) and _ints(c[1], len(shape), 0, _MAX_DIM)):
                raise FormatError("chunk must be [offsets, sizes, part, key] with one offset and size per dimension", path=path, key=cw)
            off, siz, part, key = c
            if any(o + s > d for o, s, d in zip(off, siz, shape)):
                raise FormatError(f"chunk box {off}+{siz} exceeds the shape {shape}", path=path, key=cw)
            if part not in parts or not isinstance(key, str) or key not in parts[part]:
                raise FormatError(f"chunk names tensor {key!r} of part {part!r}, which does not exist", path=path, key=cw)
            te = parts[part][key]
            if te.dtype != dtype or list(te.shape) != list(siz):
                raise FormatError(f"tensor {key!r} of part {part!r} is {te.dtype}{list(te.shape)}, the chunk says {dtype}{siz}", path=path, key=cw)
            recs.append(Chunk(tuple(off), tuple(siz), part, key))
        rec = TensorRecord(fqn, dtype, tuple(shape), tuple(recs))
        _check_tiling(rec, where, path)
        tensors[fqn] = rec
    paths_raw = raw.get("paths") or {}
    if not isinstance(paths_raw, Mapping) or not all(isinstance(k, str) and isinstance(v, list) and all(isinstance(s, (str, int)) for s in v) for k, v in paths_raw.items()):
        raise FormatError("paths must map fqn to an array of str or int", path=path, key=f"{base}.paths")
    mesh = raw.get("mesh")
    if mesh is not None and not isinstance(mesh, Mapping):
        raise FormatError("mesh must be a map or nil", path=path, key=f"{base}.mesh")
    pl = raw.get("placements") or {}
    if not isinstance(pl, Mapping):
        raise FormatError("placements must be a map", path=path, key=f"{base}.placements")
    dv = raw.get("dcp_version")
    return ShardedLayout(
        world_size=ws,
        tensors=tensors,
        values=values,
        paths={k: tuple(v) for k, v in paths_raw.items()},
        mesh=dict(mesh) if mesh is not None else None,
        placements={str(k): tuple(str(x) for x in v) for k, v in pl.items() if isinstance(v, list)},
        dcp_version=dv if isinstance(dv, str) else None,
    )
