"""Writing checkpoints: ``save`` for one process, ``begin/write_part/commit`` for many.

How a save is published is the storage's commit protocol (``storage.commit``,
``ckpt.storage.commit``): on a filesystem every part is written into a temporary sibling
directory that is renamed into place after MANIFEST (spec/checkpoint-format.md §10); on
an object store MANIFEST is put last, conditionally (spec/object-storage.md). This module
builds the parts and the MANIFEST; it never branches on the backend.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

import msgpack

from . import __version__
from ._gc import paused as gc_paused
from .context.config import canonical_config, config_hash
from .context.record import SaveContext, lineage_of
from .context.env import capture_env
from .context.provenance import capture_commit
from .context.rng import capture_rng, rng_kinds
from .context.topology import capture_topology
from .errors import CkptError, DistributedUsageError, FormatError, UnsupportedValueError
from .format import dtypes
from .format.codec import packb, value_limit, zstd_compress
from .format.digest import digest_bytes
from .format.manifest import (
    V1,
    V2,
    FileEntry,
    Manifest,
    PartEntry,
    PartRef,
    TensorEntry,
    check_name,
    content_id,
    encode_manifest,
    encode_part_manifest,
    part_record,
    uses_v2,
)
from .format.safetensors import build_header_rows
from .format.tree import EXT_DEVICE, EXT_DTYPE, EXT_REPLICA, EXT_TENSOR, render_path, to_wire
from .knobs import knobs
from .storage import PendingCheckpoint, Recovery, Storage, resolve
from .storage import commit as _protocol
from .storage.commit import is_complete as _is_complete
from . import _helpers, _linkcheck, _partfiles
from ._partfiles import Compress, Reuse, reuse_from
from .save_options import SaveOptions, options_from
from ._tensorbytes import tensor_memoryview

__all__ = [
    "PendingCheckpoint",
    "Replicated",
    "begin",
    "write_part",
    "write_part_with",
    "commit",
    "abort",
    "save",
    "part_name_for_rank",
    "recover",
    "Recovery",
    "Reuse",
    "reuse_from",
    "SaveOptions",
]

_R = TypeVar("_R")

@dataclass(frozen=True, slots=True)
class Replicated:
    """Marks a state entry whose bytes live in another part (replicated weights written once)."""

    part: str


def part_name_for_rank(rank: int) -> str:
    return f"rank-{rank:05d}"


def begin(
    path: str | os.PathLike[str], *, overwrite: bool = False, storage: Storage | None = None, part_manifests: bool = False
) -> PendingCheckpoint:
    """Start a save (``storage.commit.begin``: a temporary directory on a filesystem).
    ``part_manifests``: every part is written
    with a part manifest and listed by reference in the MANIFEST (format 2.0 §V.5: a job
    of many ranks keeps its MANIFEST small and its commit cheap)."""
    storage, final = resolve(path, storage)
    check_name(os.path.basename(final), what="checkpoint directory", path=final)
    pending = storage.commit.begin(final, overwrite=overwrite)
    return dataclasses.replace(pending, part_manifests=True) if part_manifests else pending


def abort(pending: PendingCheckpoint, *, storage: Storage | None = None) -> None:
    """Abandon a checkpoint begun with ``begin``: its temporary files are removed, nothing is committed."""
    storage, _ = resolve(pending.final, storage)
    storage.commit.abort(pending)


# --- flattening a state tree --------------------------------------------------------


def _escape(seg: Any) -> str:
    # '/' separates key segments; escape it (and '%') so distinct paths stay distinct.
    s = seg if type(seg) is str else str(seg)
    if "%" in s or "/" in s:
        return s.replace("%", "%25").replace("/", "%2F")
    return s


class _Collector:
    """Hook for ``to_wire``: assigns tensor keys and de-duplicates aliased tensors.

    Runs once per tensor, so a state of thousands of small tensors pays for every
    attribute read here: each record keeps what the writer needs later (dtype name,
    shape, byte count), read from the tensor once.
    """

    def __init__(self, prefix: str) -> None:
        import torch

        self._torch = torch
        self._strided = torch.strided
        self.prefix = prefix
        #: (key, cpu contiguous tensor) per stored tensor, in the order met
        self.tensors: list[tuple[str, Any]] = []
        #: key -> (dtype name, shape, nbytes, itemsize), read from the tensor once
        self.meta: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        self._by_view: dict[tuple, str] = {}
        self._keys: set[str] = set()
        self.counts: dict[str, list[int]] = {}  # top-level entry -> [n tensors, bytes]
        self.tops: dict[str, str] = {}  # tensor key -> its top-level entry (compress= by entry)

    def __call__(self, obj: Any, path: tuple[Any, ...]) -> msgpack.ExtType | None:
        torch = self._torch
        if isinstance(obj, torch.Tensor):
            return msgpack.ExtType(EXT_TENSOR, self._add(obj, path).encode("utf-8"))
        if isinstance(obj, torch.dtype):
            try:
                return msgpack.ExtType(EXT_DTYPE, dtypes.dtype_name(obj).encode())
            except KeyError:
                raise UnsupportedValueError(f"dtype {obj} has no persisted name", key=render_path(path)) from None
        if isinstance(obj, torch.device):
            return msgpack.ExtType(EXT_DEVICE, str(obj).encode())
        if isinstance(obj, Replicated):
            check_name(obj.part, what="part")
            return msgpack.ExtType(EXT_REPLICA, obj.part.encode())
        return None

    def _add(self, t: Any, path: tuple[Any, ...]) -> str:
        if t.layout != self._strided:
            raise UnsupportedValueError(f"tensor layout {t.layout} is not supported", key=render_path(path))
        device = t.device
        if t.is_quantized or device.type == "meta":
            raise UnsupportedValueError("quantized and meta tensors cannot be stored", key=render_path(path))
        try:
            dname = dtypes.dtype_name(t.dtype)
        except KeyError:
            raise UnsupportedValueError(f"tensor dtype {t.dtype} cannot be stored", key=render_path(path)) from None
        shape = tuple(t.shape)
        numel = t.numel()
        conj, neg = t.is_conj(), t.is_neg()
        # The same view reached twice (tied weights, an optimizer aliasing a param) is
        # stored once and restored as one tensor object.
        view = (device, t.data_ptr(), shape, t.stride(), t.dtype, conj, neg)
        if numel > 0:
            hit = self._by_view.get(view)
            if hit is not None:
                return hit
        key = "/".join([self.prefix, *map(_escape, path)]) if self.prefix else "/".join(map(_escape, path))
        # Distinct paths can render alike (int key 1 and str key "1"); keys must be
        # unique in the manifest, and the tree refers to them by name, so suffix.
        if key in self._keys:
            base, n = key, 0
            while key in self._keys:
                n += 1
                key = f"{base}~{n}"
        self._keys.add(key)
        src = t
        if conj:
            src = src.resolve_conj()
        if neg:
            src = src.resolve_neg()
        if device.type != "cpu":
            src = src.to("cpu")
        if not src.is_contiguous():
            src = src.contiguous()
        itemsize = dtypes.itemsize(dname)
        nbytes = numel * itemsize
        self.tensors.append((key, src))
        self.meta[key] = (dname, shape, nbytes, itemsize)
        if numel > 0:
            self._by_view[view] = key
        top = str(path[0]) if path else ""
        self.tops[key] = top
        c = self.counts.get(top)
        if c is None:
            c = self.counts[top] = [0, 0]
        c[0] += 1
        c[1] += nbytes
        return key


def tensor_view_key(t: Any) -> tuple[Any, ...]:
    """Identity of a tensor *view*: equal keys hold the same values in the same memory.

    The address of the first element with shape, strides and dtype fixes the memory a
    view covers; is_conj/is_neg are part of it: x and x.conj() share memory and
    strides but hold different values. (The writer's collector builds the same tuple
    inline.)
    """
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.is_conj(), t.is_neg())


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _holding_part_lock(fn: Callable[..., _R]) -> Callable[..., _R]:
    """``write_part`` runs holding the save's part lock shared (``Commit.part_lock``): the
    commit takes it exclusively, so that no part adds a file after the commit."""

    @functools.wraps(fn)
    def locked(pending: PendingCheckpoint, *args: Any, storage: Storage | None = None, **kw: Any) -> _R:
        resolved, _ = resolve(pending.final, storage)
        with resolved.commit.part_lock(pending, exclusive=False):
            return fn(pending, *args, storage=storage, **kw)

    return locked


#: the options a part's writer uses; ``this_rank_only`` is its caller's (``ckpt.save``
#: checked it), and ``overwrite``/``part_manifests`` are the pending save's (see _part_supports)
WRITE_PART_SUPPORTS = frozenset({"compress", "dedup", "dedup_from", "reuse", "this_rank_only"})


def _part_supports(opts: SaveOptions, pending: PendingCheckpoint) -> frozenset[str]:
    ok = set(WRITE_PART_SUPPORTS)
    if opts.reuse is not None and opts.dedup_from is not None:
        ok -= {"reuse", "dedup_from"}
    if opts.overwrite == pending.overwrite:
        ok.add("overwrite")
    if opts.part_manifests in (None, pending.part_manifests):
        ok.add("part_manifests")
    return frozenset(ok)


def write_part(
    pending: PendingCheckpoint,
    name: str,
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    config: Any = None,
    data: Any = None,
    generators: Mapping[str, Any] | None = None,
    rng: bool | Mapping[str, Any] = True,
    extra: Any = None,
    lineage: Mapping[str, Any] | None = None,
    code_dir: str | None = None,
    storage: Storage | None = None,
    compress: Compress = None,
    reuse: Reuse | None = None,
    dedup: bool = False,
    options: SaveOptions | None = None,
) -> PartEntry:
    """Write one part (a process's share) into ``pending.tmp_dir``; durable on return.

    ``step`` ... ``code_dir``: the part's context (``ckpt.context.record.SaveContext``).
    ``options`` (or the keywords ``compress``, ``reuse``, ``dedup``; ``ckpt.SaveOptions``):
    ``compress`` encodes tensors (BPZ1 byte planes + zstd, format 2.0): ``True`` for every
    float tensor of at least 64 KiB, a list of top-level entry names, or a callable
    ``(key, dtype name, nbytes) -> bool``. ``reuse``: the same part of the previous
    checkpoint of the run, whose unchanged files are shared by hard link instead of written
    (format 2.0 dedup; implies ``dedup``); ``dedup_from``: that checkpoint's directory
    instead. ``dedup``: record a digest of every tensor so a later save can share this
    one's files. ``overwrite`` and ``part_manifests`` belong to the save (``begin``): given
    here they must agree with ``pending``. Raises ``SaveOptionError`` for any other option,
    and ``DistributedUsageError`` when the checkpoint was committed or aborted before the
    part could be written.
    """
    context = SaveContext(step=step, config=config, data=data, generators=generators, rng=rng, extra=extra,
                          lineage=lineage, code_dir=code_dir)
    opts = options_from(options, where="ckpt.write_part", path=pending.final, compress=compress, reuse=reuse, dedup=dedup)
    return write_part_with(pending, name, state, context, storage=storage, options=opts)  # type: ignore[return-value]


@_holding_part_lock
def write_part_with(
    pending: PendingCheckpoint,
    name: str,
    state: Mapping[str, Any],
    context: SaveContext,
    *,
    storage: Storage | None = None,
    options: SaveOptions = SaveOptions(),
) -> PartEntry | PartRef:
    """:func:`write_part` for a caller that has built the records already (the collective
    save, the DCP writer, the manager's save thread): ``context`` and ``options`` are
    passed on unchanged. A part reference when ``pending`` lists parts by reference."""
    part, _ = _write_part(pending, name, state, context, storage=storage, options=options, defer_fsync=False)
    return part


def _write_part(
    pending: PendingCheckpoint,
    name: str,
    state: Mapping[str, Any],
    context: SaveContext,
    *,
    storage: Storage | None,
    options: SaveOptions,
    defer_fsync: bool,
) -> tuple[PartEntry | PartRef, list[Any]]:
    """``write_part``'s work. With ``defer_fsync`` (a fused commit, spec §10.7) the files
    of a small part are sealed, not closed: their sinks are returned, open, for the commit
    to close (fsync) together with MANIFEST's and the directory's fsyncs. Otherwise the
    list is empty and the part is durable on return."""
    storage, _ = resolve(pending.final, storage)
    options.refuse_unsupported(
        _part_supports(options, pending), "ckpt.write_part",
        "overwrite and part_manifests are the save's, given to ckpt.begin (this one's differ); reuse and "
        "dedup_from name one source, give one", path=pending.final)
    compress = options.compress
    reuse = options.reuse
    if options.dedup_from is not None:
        reuse = reuse_from(options.dedup_from, name, storage=storage)
    dedup = options.dedup or options.dedup_from is not None
    check_name(name, what="part")
    if not isinstance(state, Mapping):
        raise UnsupportedValueError("state must be a mapping of name -> Stateful or tree", key="<root>")
    # Walking the state builds thousands of small objects: no cyclic GC meanwhile (ckpt._gc).
    with gc_paused():
        collector = _Collector("")
        wire_state: dict[str, Any] = {}
        entry_types: dict[str, str] = {}
        for key, obj in state.items():
            if not isinstance(key, str) or not key or key.startswith("@"):
                raise UnsupportedValueError("top-level state keys must be non-empty str not starting with '@'", key=str(key))
            if _stateful(obj):
                sd = obj.state_dict()
                entry_types[key] = _type_name(obj)
            else:
                sd = obj
                entry_types[key] = "tree"
            wire_state[key] = to_wire(sd, collector, (key,))
        data_state = None
        data = context.data
        if data is not None:
            if not callable(getattr(data, "state_dict", None)):
                raise UnsupportedValueError("data must have state_dict()", key="@data")
            data_state = to_wire(data.state_dict(), collector, ("@data",))
        config = context.config
        cfg_bytes = canonical_config(config) if config is not None else None
        # A Mapping is a state captured earlier by capture_rng: an async save snapshots the
        # RNG at the step boundary and writes it later, while the loop draws on.
        rng = context.rng
        rng_state = dict(rng) if isinstance(rng, Mapping) else (capture_rng(context.generators) if rng else None)
        topo = capture_topology()
        commit_info = capture_commit(context.code_dir)
        env = capture_env()
        recorded = {
            "step": context.step,
            "rng": rng_state,
            "data": data_state,
            "data_type": _type_name(data) if data is not None else None,
            "config": None if cfg_bytes is None else {"canonical": cfg_bytes, "hash": config_hash(config)},
            "topology": topo,
            "commit": commit_info,
            "env": env,
            "lineage": dict(context.lineage or {}),
            "extra": to_wire(context.extra, collector, ("@extra",)) if context.extra is not None else None,
            "entry_types": entry_types,
        }
    k = knobs()
    files: list[FileEntry] = []
    placed: list[tuple[str, TensorEntry]] = []  # (file name, entry): indices are set at the end
    layout = _partfiles.plan(name, collector.tensors, collector.tops, compress=compress, reuse=reuse, dedup=dedup,
                             storage=storage, file_name=pending.file_name)
    recording = layout.dedup
    # Shared files first (format-2.md §V.4): a file that cannot be linked, or whose bytes
    # are not what its MANIFEST says (§V.4.6), is written below.
    for fe, entries in _partfiles.link_shared(name, layout, pending.tmp_dir, storage, file_name=pending.file_name):
        files.append(fe)
        placed.extend((fe.name, e) for e in entries)
    plain = layout.plain
    # A fused commit only for a small part with local sinks that can be sealed (§10.7);
    # part manifests are fsynced on their own before the commit, so their parts never are.
    defer_fsync = (defer_fsync and not pending.part_manifests
                   and sum(m[2] for m in collector.meta.values()) <= _protocol.FUSED_COMMIT_MAX)
    unsynced: list[Any] = []  # sealed sinks the commit closes (defer_fsync)
    closing: _helpers.Pending | None = None
    tsize, tdigests = 0, b""
    if plain:
        # Largest element size first (stable): every tensor then starts at a multiple of
        # its element size, as stock safetensors lays files out, so readers can map it.
        meta = collector.meta
        plain.sort(key=lambda kt: -meta[kt[0]][3])
        fname = layout.plain_name
        header, offsets = build_header_rows(
            [(key, *meta[key][:3]) for key, _ in plain], {"format": "pt", "writer": f"ckpt-replay {__version__}"}
        )
        at = len(files) + 1  # its index once the state file is listed first (below)
        digests_of = layout.digests
        tsink = storage.create(os.path.join(pending.tmp_dir, fname), k.chunk_size)
        try:
            tsink.write(header)
            write = tsink.write
            for (key, t), off in zip(plain, offsets):
                dname, shape, nbytes, _ = meta[key]
                write(tensor_memoryview(t, nbytes))
                placed.append((fname, TensorEntry(key, dname, shape, at, off, nbytes, digests_of.get(key))))
            sealed = tsink.seal() if defer_fsync else None
            if sealed is not None:
                tsize, tdigests = sealed
                unsynced.append(tsink)
        except BaseException:
            tsink.discard()
            raise
        if sealed is None:
            # Its last digests and its fsync run on a helper thread while this one writes
            # the next files; all are durable before this function returns (§10.7).
            closing = _helpers.run(tsink.close)
        files.append(FileEntry(fname, "tensors", 0, k.chunk_size, b""))  # filled in once closed or sealed
    plain_written = bool(plain)
    try:
        packed = _partfiles.write_packed(layout, pending.tmp_dir, storage)
        if packed is not None:
            files.append(packed[0])
            placed.extend((packed[0].name, e) for e in packed[1])
        # the layout holds staging copies alive until here; drop them now.
        del layout, plain
        raw = packb({"state": wire_state, "context": recorded})
        if len(raw) > k.max_state_raw_bytes:
            raise UnsupportedValueError(f"structure of part {name!r} is {len(raw)} bytes, above the limit", key="<root>")
        comp = zstd_compress(raw)
        codec: str | None = "zstd"
        if len(raw) > value_limit(len(comp)):
            # compresses so well that a reader could not tell it from a decompression bomb
            # (spec §7.1: a value at most value_ratio times the file): stored as it is.
            comp, codec = raw, None
        sname = pending.file_name(name, ".state.msgpack.zst" if codec else ".state.msgpack")
        sink = storage.create(os.path.join(pending.tmp_dir, sname), k.chunk_size)
        try:
            sink.write(comp)
            sealed = sink.seal() if defer_fsync else None
            if sealed is not None:
                size, digests = sealed
                unsynced.append(sink)
            else:
                size, digests = sink.close()
        except BaseException:
            sink.discard()
            raise
    except BaseException:
        for u in unsynced:
            u.discard()
        raise
    finally:
        if closing is not None:
            try:
                tsize, tdigests = closing.join()
            except BaseException:
                tsink.discard()
                raise
    if plain_written:
        i = next(i for i, f in enumerate(files) if f.name == fname)
        files[i] = FileEntry(fname, "tensors", tsize, k.chunk_size, tdigests)
    if recording:
        # Their digests were computed from the bytes written: a later dedup save may share
        # them on the budget of format-2.md §V.4.6, not after a full re-hash.
        for f in files:
            if f.origin is None:
                _linkcheck.record_written(storage, os.path.join(pending.tmp_dir, f.name))
    # The state file comes first so readers can find the structure without scanning.
    files.insert(0, FileEntry(sname, "state", size, k.chunk_size, digests, codec, len(raw) if codec else None))
    index = {f.name: i for i, f in enumerate(files)}
    tensors = [e if e.file == index[fn] else dataclasses.replace(e, file=index[fn]) for fn, e in placed]
    summary = {
        "step": context.step,
        "entries": {key: _entry_summary(state[key], entry_types[key], collector.counts.get(key, [0, 0])) for key in wire_state},
        "rng": rng_kinds(rng_state) if rng_state else [],
        "data": None if data is None else {"type": recorded["data_type"], "state": _preview(data_state)},
        "config_hash": recorded["config"]["hash"] if recorded["config"] else None,
        "commit": commit_info,
        "topology": topo,
        "env": {key: env.get(key) for key in ("python", "torch", "cuda", "cudnn", "deterministic_algorithms", "num_threads", "ckpt_replay")},
        "lineage": recorded["lineage"],
    }
    part = PartEntry(name, tuple(files), tuple(tensors), summary)
    if pending.part_manifests:
        return _write_part_manifest(pending, part, storage), unsynced
    return part, unsynced


def _write_part_manifest(pending: PendingCheckpoint, part: PartEntry, storage: Storage) -> PartRef:
    """The part's detail in its own file (format-2.md §V.5.1), durable; the committer gets
    only the short reference."""
    blob = encode_part_manifest(part, V2)
    mname = pending.file_name(part.name, ".part")
    _write_whole(storage, os.path.join(pending.tmp_dir, mname), blob)
    return PartRef(part.name, mname, len(blob), digest_bytes(blob), tuple((f.name, f.size) for f in part.files))


def _write_whole(storage: Storage, path: str, blob: bytes) -> tuple[int, bytes]:
    """One small file in one write, durable (fsync) on return: (size, chunk digests)."""
    sink = storage.create(path, max(knobs().chunk_size, 4096))
    try:
        sink.write(blob)
        return sink.close()
    except BaseException:
        sink.discard()
        raise


def _check_replica_chains(parts: Sequence[PartEntry | PartRef], where: str) -> None:
    """Refuse a commit whose REPLICA entries a reader would refuse (spec §9): each must
    reach, within MAX_REPLICA_HOPS, a part of this commit that holds the entry's data.
    A part listed by reference keeps its entries in its part manifest; a chain that
    reaches one is left to the reader, which checks it against that manifest."""
    from ._statecheck import MAX_REPLICA_HOPS

    names = {p.name for p in parts}
    entries = {p.name: (p.summary.get("entries") or {}) for p in parts if isinstance(p, PartEntry)}
    for pname, es in entries.items():
        for ename, e in es.items():
            cur, hops = pname, 0
            while isinstance(e, dict) and isinstance(e.get("replica_of"), str):
                nxt = e["replica_of"]
                hops += 1
                if hops > MAX_REPLICA_HOPS:
                    raise FormatError(f"entry {ename!r} of part {pname!r} is a REPLICA chain of more than "
                                      f"{MAX_REPLICA_HOPS} hops (or a cycle); readers refuse it: name the part "
                                      "that holds the data", path=where, key=ename)
                if nxt not in names:
                    raise FormatError(f"entry {ename!r} of part {cur!r} is a REPLICA of part {nxt!r}, which this "
                                      "commit does not hold", path=where, key=ename)
                if nxt not in entries:
                    break  # a part by reference: its reader checks the rest
                if ename not in entries[nxt]:
                    raise FormatError(f"entry {ename!r} of part {cur!r} is a REPLICA of part {nxt!r}, which lacks "
                                      "it", path=where, key=ename)
                cur, e = nxt, entries[nxt][ename]


def _entry_summary(obj: Any, type_name: str, counts: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type_name, "tensors": counts[0], "bytes": counts[1]}
    if isinstance(obj, Replicated):
        out["replica_of"] = obj.part  # its bytes (and its type) are in that part (spec §4.6)
    return out


def _preview(wire: Any) -> Any:
    """A small, plain-scalar view of the data state for ``ckpt inspect``."""
    if isinstance(wire, dict):
        out = {}
        for k, v in list(wire.items())[:16]:
            if isinstance(v, (int, float, str, bool)) or v is None:
                out[str(k)] = v
        return out
    return None


def commit(
    pending: PendingCheckpoint,
    parts: Sequence[PartEntry | PartRef | Mapping[str, Any]],
    *,
    kind: str = "checkpoint",
    step: int | None = None,
    meta: Mapping[str, Any] | None = None,
    storage: Storage | None = None,
) -> Manifest:
    """Write MANIFEST last and publish the checkpoint (``storage.commit.publish``: on a
    filesystem fsync and rename the temporary directory into place; on an object store
    put MANIFEST last, conditionally, spec/object-storage.md).

    ``parts`` are what :func:`write_part` returned, or their ``to_dict()`` form (which
    crosses process boundaries as plain data). The MANIFEST is format 1.0 unless a part
    uses a 2.0 feature (packed or shared files, tensor digests, a part reference)."""
    return _commit(pending, parts, kind=kind, step=step, meta=meta, storage=storage)


_write_part_locked = _holding_part_lock(_write_part)


def _commit(
    pending: PendingCheckpoint,
    parts: Sequence[PartEntry | PartRef | Mapping[str, Any]],
    *,
    kind: str = "checkpoint",
    step: int | None = None,
    meta: Mapping[str, Any] | None = None,
    storage: Storage | None = None,
    unsynced: Sequence[Any] = (),
) -> Manifest:
    """``commit``; ``unsynced``: sealed sinks of the parts (``_write_part(defer_fsync=True)``),
    closed (fsynced) here, together with MANIFEST when the checkpoint is small enough for
    a fused commit (§10.7), else before MANIFEST is created."""
    storage, _ = resolve(pending.final, storage)
    parts = [p if isinstance(p, (PartEntry, PartRef)) else part_record(dict(p)) for p in parts]
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise CkptError(f"duplicate part names {names}", path=pending.final)
    if step is None and parts and isinstance(parts[0], PartEntry):
        step = parts[0].summary.get("step")
    # Sorting parts by name makes the manifest independent of arrival order.
    ordered = tuple(sorted(parts, key=lambda p: p.name))
    _check_replica_chains(ordered, pending.final)
    manifest = Manifest(
        id=content_id(ordered),
        kind=kind,
        step=step,
        created_at=time.time(),
        package_version=__version__,
        parts=ordered,
        meta=dict(meta or {}),
        version=V2 if uses_v2(ordered) else V1,
    )
    with gc_paused():
        blob = encode_manifest(manifest)
    if unsynced and _protocol.files_total(ordered) > _protocol.FUSED_COMMIT_MAX:
        # Too large to commit fused (recovery re-hashes only a copy up to the limit): the
        # parts become durable now, as write_part's would have, before MANIFEST exists.
        _helpers.together([s.close for s in unsynced])
        unsynced = ()
    storage.commit.publish(pending, blob, ordered, unsynced=unsynced)
    return manifest


# --- crash recovery -------------------------------------------------------------------

def is_complete(path: str, *, storage: Storage | None = None) -> bool:
    """A committed copy whatever its name: its MANIFEST decodes (own digest included),
    every file it names is a regular file of the declared size, and, for a copy small
    enough to have been committed fused, every chunk matches its digest
    (``ckpt.storage.commit.is_complete``)."""
    storage, path = resolve(path, storage)
    return _is_complete(storage, path)


def recover(parent: str | os.PathLike[str], *, names: Callable[[str], bool] | None = None, storage: Storage | None = None) -> Recovery:
    """Clean a directory of checkpoints after a crash, never losing a complete copy.

    For each final name (accepted by ``names``, default any valid name) that has no
    committed checkpoint (no MANIFEST) but has a complete temporary copy, the copy is
    renamed back: the new one of an interrupted save (``.tmp-<name>-<hex>``) first, else
    the old one of an interrupted overwrite (``.tmp-<name>-<hex>.old``). Then every
    ``.tmp-*`` entry is removed, except copies of a name whose restore failed.

    A temporary directory a live writer may still commit is left alone (spec §10.4): one
    whose ``flock`` is held (a part being written, a commit in progress: the kernel drops
    it when its holder dies) is neither restored nor removed, and one that changed within
    ``orphan_grace_s`` is not removed (a save between its steps holds no lock). The
    directories acted on are held locked meanwhile, so a writer that comes back finds
    them gone and fails with a documented error. On an object store the same rules are
    applied to prefixes (spec/object-storage.md §O.6).
    """
    storage, root = resolve(parent, storage)
    return storage.commit.recover(root, names=names)


#: the options of a one-process save (``ckpt.save``)
SAVE_SUPPORTS = frozenset({"overwrite", "compress", "dedup", "dedup_from", "this_rank_only"})


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint (what ``save`` returns); the manifest is left out of its repr."""

    path: str
    id: str
    step: int | None
    bytes: int
    manifest: Manifest = field(repr=False)


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    config: Any = None,
    data: Any = None,
    step: int | None = None,
    generators: Mapping[str, Any] | None = None,
    extra: Any = None,
    run_id: str | None = None,
    resumed_from: str | None = None,
    code_dir: str | None = None,
    overwrite: bool = False,
    meta: Mapping[str, Any] | None = None,
    this_rank_only: bool = False,
    storage: Storage | None = None,
    compress: Compress = None,
    dedup_from: str | os.PathLike[str] | None = None,
    dedup: bool = False,
    options: SaveOptions | None = None,
) -> CheckpointInfo:
    """Save all seven fields of one process's training state, atomically.

    One process, one part. Under an initialised process group with more than one rank
    this refuses (``DistributedUsageError``): every rank would write part
    ``rank-00000`` to one path. Use ``ckpt.distributed.DistributedCheckpointer.save``
    (every rank calls it) or ``CheckpointManager``; a deliberate single-writer save
    from one rank passes ``this_rank_only=True``.

    ``options`` (``ckpt.SaveOptions``, or the same as keywords): ``compress`` stores
    tensors encoded (format 2.0; see :func:`write_part`). Stock safetensors cannot read
    encoded tensors; uncompressed is the default. ``dedup_from``: an earlier checkpoint of
    the same run directory: files whose tensors are unchanged are shared by hard link, not
    written (format 2.0 §V.4). ``dedup``: record tensor digests so that a later save can
    share this one's files. ``reuse`` and ``part_manifests`` are refused
    (``SaveOptionError``): this save writes one part, listed inline.
    """
    opts = options_from(options, where="ckpt.save", path=os.fspath(path), overwrite=overwrite,
                        this_rank_only=this_rank_only, compress=compress, dedup_from=dedup_from, dedup=dedup)
    opts.refuse_unsupported(SAVE_SUPPORTS, "ckpt.save", "one process writes one part, listed inline; share "
                            "the files of an earlier checkpoint with dedup_from=", path=os.fspath(path))
    if not opts.this_rank_only:
        _refuse_under_process_group(path)
    context = SaveContext(step=step, config=config, data=data, generators=generators, extra=extra,
                          lineage=lineage_of(run_id, resumed_from), code_dir=code_dir)
    storage, path = resolve(path, storage)
    pending = begin(path, overwrite=opts.overwrite, storage=storage)
    unsynced: list[Any] = []
    try:
        # One part, written and committed in one call: a small one commits fused (§10.7).
        part, unsynced = _write_part_locked(pending, part_name_for_rank(0), state, context, storage=storage,
                                            options=opts, defer_fsync=True)
        manifest = _commit(pending, [part], step=step, meta=meta, storage=storage, unsynced=unsynced)
    except BaseException:
        for u in unsynced:
            u.discard()
        abort(pending, storage=storage)
        raise
    return CheckpointInfo(pending.final, manifest.id, step, manifest.total_bytes, manifest)


def _refuse_under_process_group(path: Any) -> None:
    import sys

    # Only look if torch.distributed is already imported: no process group otherwise,
    # and importing it here would make every save pay for it.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if world > 1:
        raise DistributedUsageError(
            f"ckpt.save under a process group of {world} ranks (this is rank {dist.get_rank()}): every rank would write "
            "part rank-00000 to one path. Call ckpt.distributed.DistributedCheckpointer().save(...) on every rank, "
            "or use CheckpointManager; pass this_rank_only=True if exactly one rank saves its own state here",
            path=os.fspath(path),
        )
