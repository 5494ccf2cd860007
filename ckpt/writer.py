"""Writing checkpoints: ``save`` for one process, ``begin/write_part/commit`` for many.

Commit protocol (spec/checkpoint-format.md §10): every part is written into a
temporary sibling directory ``.tmp-<name>-<random>``; each file is fsynced as it is
closed; MANIFEST is written last and fsynced, then the temporary directory is
fsynced, renamed to its final name, and the parent directory fsynced. A crash before
the rename leaves only a temporary directory, which no reader accepts; a crash after
it leaves a complete checkpoint.

Publishing is atomic in both modes. Without ``overwrite`` the rename refuses an
existing target in the same system call (``renameat2(RENAME_NOREPLACE)``), so two
writers racing for one name cannot both win. With ``overwrite`` the new directory and
the old one swap names in one call (``RENAME_EXCHANGE``); where that is unsupported,
the old one is first renamed to ``.tmp-<name>-<hex>.old``, and :func:`recover` puts a
complete copy back under the final name after a crash between the two renames. At
every instant at least one complete copy of the checkpoint exists.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

import msgpack

from . import __version__
from ._gc import paused as gc_paused
from ._locks import flock_bounded, unlock_and_close
from .context.config import canonical_config, config_hash
from .context.env import capture_env
from .context.provenance import capture_commit
from .context.rng import capture_rng, rng_kinds
from .context.topology import capture_topology
from .errors import CheckpointExistsError, CkptError, DistributedUsageError, FormatError, SaveConflictError, UnsupportedValueError
from .format import dtypes
from .format.codec import packb, value_limit, zstd_compress
from .format.digest import digest_bytes
from .format.manifest import (
    MANIFEST_NAME,
    TMP_PREFIX,
    V1,
    V2,
    FileEntry,
    Manifest,
    PartEntry,
    PartList,
    PartRef,
    TensorEntry,
    check_name,
    content_id,
    decode_manifest,
    encode_manifest,
    encode_part_manifest,
    part_record,
    uses_v2,
)
from .format.safetensors import build_header_rows
from .format.tree import EXT_DEVICE, EXT_DTYPE, EXT_REPLICA, EXT_TENSOR, render_path, to_wire
from .knobs import knobs
from .storage import PendingCheckpoint, Recovery, Storage, commits_by_manifest, resolve
from . import _helpers, _linkcheck, _partfiles
from ._partfiles import Compress, Reuse, reuse_from
from ._ranges import RangeWalker
from ._tensorbytes import tensor_memoryview

__all__ = [
    "PendingCheckpoint",
    "Replicated",
    "begin",
    "write_part",
    "commit",
    "abort",
    "save",
    "part_name_for_rank",
    "recover",
    "Recovery",
    "Reuse",
    "reuse_from",
]

_R = TypeVar("_R")

#: A checkpoint whose files total at most this many bytes may be committed *fused*
#: (spec §10.7): its part files sealed, not yet fsynced, when MANIFEST is created, and
#: every fsync of the commit issued together. Recovery re-hashes a temporary copy this
#: small before publishing it (§10.3), since its MANIFEST may be durable before its files.
FUSED_COMMIT_MAX = 64 << 20

#: suffix of a replaced checkpoint moved aside (fallback overwrite, §10)
OLD_SUFFIX = ".old"
#: suffix of a checkpoint being deleted on purpose (retention)
DEL_SUFFIX = ".del"

def tmp_name(name: str, suffix: str = "") -> str:
    """``.tmp-<name>-<12 hex>[suffix]``: a sibling no reader accepts (§3)."""
    return f"{TMP_PREFIX}{name}-{secrets.token_hex(6)}{suffix}"


@dataclass(frozen=True, slots=True)
class Replicated:
    """Marks a state entry whose bytes live in another part (replicated weights written once)."""

    part: str


def part_name_for_rank(rank: int) -> str:
    return f"rank-{rank:05d}"


def begin(
    path: str | os.PathLike[str], *, overwrite: bool = False, storage: Storage | None = None, part_manifests: bool = False
) -> PendingCheckpoint:
    """Create the temporary directory of a save. ``part_manifests``: every part is written
    with a part manifest and listed by reference in the MANIFEST (format 2.0 §V.5: a job
    of many ranks keeps its MANIFEST small and its commit cheap)."""
    storage, final = resolve(path, storage)
    parent, name = os.path.split(final)
    check_name(name, what="checkpoint directory", path=final)
    if commits_by_manifest(storage):  # an object store: no temporary directory (§10.6)
        pending = storage.begin(final, overwrite=overwrite)  # type: ignore[attr-defined]
        return dataclasses.replace(pending, part_manifests=True) if part_manifests else pending
    storage.makedirs(parent)
    if storage.exists(final) and not overwrite:
        # Early refusal only; commit() enforces it atomically (another writer may
        # commit this name while we write).
        raise CheckpointExistsError("a checkpoint already exists here; pass overwrite=True to replace it", path=final)
    tmp = os.path.join(parent, tmp_name(name))
    storage.mkdir(tmp)
    return PendingCheckpoint(final=final, tmp_dir=tmp, overwrite=overwrite, part_manifests=part_manifests)


def abort(pending: PendingCheckpoint, *, storage: Storage | None = None) -> None:
    storage, _ = resolve(pending.final, storage)
    if commits_by_manifest(storage):
        storage.abort(pending)  # type: ignore[attr-defined]
        return
    storage.remove_tree(pending.tmp_dir)


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


def _local_dir_lock(pending: PendingCheckpoint, storage: Storage, *, exclusive: bool) -> int | None:
    """Lock the temporary directory of ``pending`` (``flock`` on the directory itself): part
    writers hold it shared, the committer exclusively. Returns the descriptor, to be given
    to ``unlock_and_close`` (a close alone would leave the lock to any DataLoader worker
    forked while it was held: ckpt._locks; a dead process's lock goes with it), or None
    where there is no local directory (an object store commits by MANIFEST and ignores
    unnamed objects). The wait is bounded (``knobs().lock_timeout_s``, WaitTimeoutError).

    Why: a part's files are written through open descriptors, which follow the directory
    when the commit renames it. A writer still running when a commit went ahead without its
    part (a snapshot that left a participant out) would add files that the committed MANIFEST
    does not name, and the committed checkpoint would no longer open (UnexpectedFileError)."""
    if commits_by_manifest(storage) or getattr(storage, "scheme", "file") != "file":
        return None
    if exclusive:
        gone: CkptError = SaveConflictError(
            "the checkpoint's temporary directory is gone before its commit: another process removed it "
            "(a cleanup of the run directory), or it was already committed or aborted; nothing was committed",
            path=pending.tmp_dir)
    else:
        gone = DistributedUsageError(
            "the checkpoint's temporary directory is gone: it was committed or aborted before this "
            "part was written (a part written after the commit is not part of it), or another process's "
            "cleanup removed it", path=pending.final)
    try:
        fd = os.open(pending.tmp_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise gone from None
    try:
        what = ("the temporary directory, for the part writers still in flight" if exclusive
                else "the temporary directory, for the commit in progress")
        flock_bounded(fd, exclusive=exclusive, timeout_s=knobs().lock_timeout_s, what=what, path=pending.tmp_dir)
        try:
            st = os.stat(pending.tmp_dir)
        except FileNotFoundError:
            st = None
        held = os.fstat(fd)
        if st is None or (st.st_dev, st.st_ino) != (held.st_dev, held.st_ino):
            raise gone
    except BaseException:
        unlock_and_close(fd)
        raise
    return fd


def _drop_unnamed(pending: PendingCheckpoint, storage: Storage, parts: Sequence[PartEntry | PartRef]) -> None:
    """Before a local commit: remove what the parts being committed do not name (a part left
    out of this commit: its writer died mid-write, or was left out while writing). The
    directory must hold exactly the files the MANIFEST names (spec §10.3)."""
    named = {n for n, _, _ in PartList(parts).file_sizes()} | {MANIFEST_NAME}
    for entry in storage.listdir(pending.tmp_dir):
        if entry not in named:
            path = os.path.join(pending.tmp_dir, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                storage.remove_tree(path)
            else:
                os.unlink(path)


def _holding_part_lock(fn: Callable[..., _R]) -> Callable[..., _R]:
    """``write_part`` runs holding the temporary directory's shared lock (``_local_dir_lock``)."""

    @functools.wraps(fn)
    def locked(pending: PendingCheckpoint, *args: Any, storage: Storage | None = None, **kw: Any) -> _R:
        resolved, _ = resolve(pending.final, storage)
        fd = _local_dir_lock(pending, resolved, exclusive=False)
        try:
            return fn(pending, *args, storage=storage, **kw)
        finally:
            if fd is not None:
                unlock_and_close(fd)

    return locked


@_holding_part_lock
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
) -> PartEntry:
    """Write one part (a process's share) into ``pending.tmp_dir``; durable on return.

    ``compress``: encode tensors (BPZ1 byte planes + zstd, format 2.0): ``True`` for every
    float tensor of at least 64 KiB, a list of top-level entry names, or a callable
    ``(key, dtype name, nbytes) -> bool``. ``reuse``: the same part of the previous
    checkpoint of the run, whose unchanged files are shared by hard link instead of written
    (format 2.0 dedup; implies ``dedup``). ``dedup``: record a digest of every tensor so a
    later save can share this one's files. Raises ``DistributedUsageError`` when the
    checkpoint was committed or aborted before the part could be written.
    """
    part, _ = _write_part(
        pending, name, state, step=step, config=config, data=data, generators=generators, rng=rng, extra=extra,
        lineage=lineage, code_dir=code_dir, storage=storage, compress=compress, reuse=reuse, dedup=dedup,
        defer_fsync=False,
    )
    return part  # type: ignore[return-value]


def _write_part(
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
    defer_fsync: bool,
) -> tuple[PartEntry | PartRef, list[Any]]:
    """``write_part``'s work. With ``defer_fsync`` (a fused commit, spec §10.7) the files
    of a small part are sealed, not closed: their sinks are returned, open, for the commit
    to close (fsync) together with MANIFEST's and the directory's fsyncs. Otherwise the
    list is empty and the part is durable on return."""
    storage, _ = resolve(pending.final, storage)
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
        if data is not None:
            if not callable(getattr(data, "state_dict", None)):
                raise UnsupportedValueError("data must have state_dict()", key="@data")
            data_state = to_wire(data.state_dict(), collector, ("@data",))
        cfg_bytes = canonical_config(config) if config is not None else None
        # A Mapping is a state captured earlier by capture_rng: an async save snapshots the
        # RNG at the step boundary and writes it later, while the loop draws on.
        rng_state = dict(rng) if isinstance(rng, Mapping) else (capture_rng(generators) if rng else None)
        topo = capture_topology()
        commit_info = capture_commit(code_dir)
        env = capture_env()
        context = {
            "step": step,
            "rng": rng_state,
            "data": data_state,
            "data_type": _type_name(data) if data is not None else None,
            "config": None if cfg_bytes is None else {"canonical": cfg_bytes, "hash": config_hash(config)},
            "topology": topo,
            "commit": commit_info,
            "env": env,
            "lineage": dict(lineage or {}),
            "extra": to_wire(extra, collector, ("@extra",)) if extra is not None else None,
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
                   and sum(m[2] for m in collector.meta.values()) <= FUSED_COMMIT_MAX)
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
            seal = getattr(tsink, "seal", None) if defer_fsync else None
            if seal is not None:
                tsize, tdigests = seal()
                unsynced.append(tsink)
        except BaseException:
            tsink.discard()
            raise
        if seal is None:
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
        raw = packb({"state": wire_state, "context": context})
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
            seal = getattr(sink, "seal", None) if defer_fsync else None
            if seal is not None:
                size, digests = seal()
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
        "step": step,
        "entries": {key: _entry_summary(state[key], entry_types[key], collector.counts.get(key, [0, 0])) for key in wire_state},
        "rng": rng_kinds(rng_state) if rng_state else [],
        "data": None if data is None else {"type": context["data_type"], "state": _preview(data_state)},
        "config_hash": context["config"]["hash"] if context["config"] else None,
        "commit": commit_info,
        "topology": topo,
        "env": {key: env.get(key) for key in ("python", "torch", "cuda", "cudnn", "deterministic_algorithms", "num_threads", "ckpt_replay")},
        "lineage": context["lineage"],
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
    """Write MANIFEST last, fsync, and rename the temporary directory into place (on an
    object store: put MANIFEST last, conditionally, spec/object-storage.md).

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
    if unsynced and (commits_by_manifest(storage) or files_total(manifest) > FUSED_COMMIT_MAX):
        _close_together(list(unsynced))  # the strict order: every part file durable before MANIFEST
        unsynced = ()
    if commits_by_manifest(storage):
        storage.publish(pending, blob)  # type: ignore[attr-defined]
        return manifest
    # exclusive: waits for part writers still in flight, so none adds a file after the rename
    fd = _local_dir_lock(pending, storage, exclusive=True)
    try:
        if fd is not None:
            _drop_unnamed(pending, storage, ordered)
        _check_named(pending, storage, ordered)
        _write_manifest_and_publish(pending, storage, blob, unsynced)
    finally:
        if fd is not None:
            unlock_and_close(fd)
    return manifest


def _check_named(pending: PendingCheckpoint, storage: Storage, parts: Sequence[PartEntry | PartRef]) -> None:
    """Before a local commit: every file the MANIFEST will name is a regular file of its
    declared size (one lstat each). Another process may have removed a file of this save
    (a cleanup of the run directory); committing would name a file that is not there."""
    for fname, fsize, _ in PartList(parts).file_sizes():
        path = os.path.join(pending.tmp_dir, fname)
        try:
            st = storage.lstat(path)
        except FileNotFoundError:
            raise SaveConflictError("a file of this save was removed before its commit (another process "
                                    "cleaned the run directory?); nothing was committed", path=path) from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != fsize:
            raise SaveConflictError(f"a file of this save is not the regular file of {fsize} bytes it was written "
                                    "as (another process replaced it); nothing was committed", path=path)


def files_total(manifest: Manifest) -> int:
    """Bytes of every file a MANIFEST names (MANIFEST itself not counted): what decides
    whether a checkpoint may be committed fused, and whether recovery re-hashes a copy."""
    return sum(size for _, size, _ in manifest.parts.file_sizes())


def _close_together(sinks: list[Any], also: Callable[[], Any] | None = None) -> None:
    """Close (fsync) ``sinks`` and run ``also`` at the same time: every one but the last
    on a helper thread, the last on this one, so the waits overlap (fsync releases the GIL,
    and a journaling filesystem serves fsyncs issued together with one journal commit).
    Returns once all are done; raises the first error after all have finished."""
    calls: list[Callable[[], Any]] = [s.close for s in sinks] + ([also] if also is not None else [])
    if not calls:
        return
    waits = [_helpers.run(fn) for fn in calls[:-1]]
    error: BaseException | None = None
    try:
        calls[-1]()
    except BaseException as e:
        error = e
    for w in waits:
        try:
            w.join()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def _write_manifest_and_publish(pending: PendingCheckpoint, storage: Storage, blob: bytes, unsynced: Sequence[Any] = ()) -> None:
    sink = storage.create(os.path.join(pending.tmp_dir, MANIFEST_NAME), max(knobs().chunk_size, 4096))
    try:
        sink.write(blob)
        # Hand MANIFEST's bytes to the kernel now (a local sink gathers small writes
        # until close): from here on, a process killed at any point leaves a complete
        # temporary copy that recovery can publish (§10.3).
        flush = getattr(sink, "flush", None)
        if flush is not None:
            flush()
        # MANIFEST's fsync and the directory's (which now lists every file, MANIFEST
        # included) have no order between them, only both before the rename (§10.7); in a
        # fused commit neither have the part files' fsyncs: all are issued together and
        # cost one wait.
        _close_together([*unsynced, sink], also=lambda: storage.fsync_dir(pending.tmp_dir))
    except BaseException:
        sink.discard()
        raise
    _publish(pending, storage)


def _publish(pending: PendingCheckpoint, storage: Storage) -> None:
    """Give the complete temporary directory its final name (§10 steps 5-6)."""
    final, tmp = pending.final, pending.tmp_dir
    parent = os.path.dirname(final)
    try:
        storage.rename_noreplace(tmp, final)
    except FileExistsError:
        if not pending.overwrite:
            raise CheckpointExistsError(
                "a checkpoint already exists here (committed while this one was written); pass overwrite=True to replace it",
                path=final,
            ) from None
    else:
        storage.fsync_dir(parent)
        return
    # overwrite: the final name holds the old checkpoint.
    if storage.exchange(tmp, final):
        # One atomic swap: the final name always holds a complete copy (old, then new).
        storage.fsync_dir(parent)
        # The removal needs no fsync of its own (§10.7): if a crash undoes it, the old
        # copy is back under a temporary name, beside a committed final name, and
        # recovery removes it as redundant.
        storage.remove_tree(tmp)  # now the old checkpoint
        return
    # No exchange on this filesystem: move the old aside, then the new into place. A
    # crash in between leaves both complete under temporary names; recover() renames
    # one back (spec §10), so cleanup never deletes the only complete copy.
    aside = os.path.join(parent, tmp_name(os.path.basename(final), OLD_SUFFIX))
    storage.rename_dir(final, aside)
    try:
        storage.rename_noreplace(tmp, final)
    except BaseException:
        # Someone took the name in between: put the old one back if we still can.
        try:
            storage.rename_noreplace(aside, final)
        except OSError:
            pass
        raise
    storage.fsync_dir(parent)
    storage.remove_tree(aside)  # no fsync needed: see the exchange case above


# --- crash recovery -------------------------------------------------------------------

_TMP_RE = re.compile(r"^\.tmp-(?P<name>.+)-[0-9a-f]{12}(?P<suffix>\.old|\.del)?$")


def is_complete(path: str, *, storage: Storage | None = None) -> bool:
    """A committed copy whatever its name: its MANIFEST decodes (own digest included)
    and every file it names is a regular file of the declared size; this tells a whole
    copy from a torn save. A copy whose files total at most ``FUSED_COMMIT_MAX`` may have
    been committed fused, its MANIFEST durable before its files (§10.7), so its files'
    chunks are re-hashed too (cheap at that size); a larger copy's files were durable
    before its MANIFEST existed, and its digests are left to the load that verifies them."""
    storage, path = resolve(path, storage)
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        st = storage.lstat(mpath)
        if not stat.S_ISREG(st.st_mode) or st.st_size > knobs().max_manifest_bytes + 64:
            return False
        man = decode_manifest(storage.read(mpath, 0, st.st_size), path=mpath)
        for fname, fsize, _ in man.parts.file_sizes():
            fst = storage.lstat(os.path.join(path, fname))
            if not stat.S_ISREG(fst.st_mode) or fst.st_size != fsize:
                return False
        if files_total(man) <= FUSED_COMMIT_MAX:
            return _content_intact(storage, path, man)
    except (OSError, CkptError):
        return False
    return True


def _content_intact(storage: Storage, path: str, man: Manifest) -> bool:
    """Every chunk of every file listed in ``man`` matches its digest (a part listed by
    reference: its part manifest's digest; its files were durable before it, §10.7).
    Through the one range walker, in bounded pieces; raises CkptError on a mismatch."""
    for part in man.parts.listed():
        if isinstance(part, PartRef):
            blob = storage.read(os.path.join(path, part.manifest), 0, part.manifest_size)
            if digest_bytes(blob) != part.manifest_digest:
                return False
            continue
        for f in part.files:
            fpath = os.path.join(path, f.name)
            handle = storage.open_read(fpath)
            try:
                RangeWalker(fpath, f, handle.pread_into, verify=True).walk([], whole=True)
            finally:
                handle.close()
    return True


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
    if commits_by_manifest(storage):
        return storage.recover(root, names=names)  # type: ignore[attr-defined]
    try:
        entries = sorted(storage.listdir(root))
    except FileNotFoundError:
        return Recovery((), ())
    held: dict[str, int] = {}  # temporary directories this call locked (none is in use)
    try:
        return _recover_local(storage, root, entries, names, held)
    finally:
        for fd in held.values():
            unlock_and_close(fd)  # explicit unlock: a worker forked meanwhile shares the lock


def _claim(path: str) -> tuple[int | None, float]:
    """Lock a temporary directory exclusively without waiting: (descriptor, mtime), or
    (None, 0) while a writer holds it (or it is not a directory we can lock)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None, 0.0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd, os.fstat(fd).st_mtime
    except OSError:
        os.close(fd)  # never locked by us: nothing to release
        return None, 0.0


def _recover_local(storage: Storage, root: str, entries: list[str], names: Callable[[str], bool] | None,
                   held: dict[str, int]) -> Recovery:
    cutoff = time.time() - knobs().orphan_grace_s
    tmps: list[str] = []
    young: set[str] = set()
    for t in (n for n in entries if n.startswith(TMP_PREFIX)):
        path = os.path.join(root, t)
        if not os.path.isdir(path) or os.path.islink(path):
            tmps.append(t)  # not a directory: nothing writes into it
            continue
        fd, mtime = _claim(path)
        if fd is None:
            continue  # a live writer's: not ours to touch
        held[t] = fd
        tmps.append(t)
        if mtime >= cutoff:
            young.add(t)
    by_name: dict[str, list[tuple[int, str]]] = {}
    for t in tmps:
        m = _TMP_RE.match(t)
        if not m or m.group("suffix") == DEL_SUFFIX:
            continue
        name = m.group("name")
        try:
            check_name(name, what="checkpoint directory")
        except CkptError:
            continue
        if names is not None and not names(name):
            continue
        # Preference: the new copy (its save had finished writing) before the old one.
        by_name.setdefault(name, []).append((1 if m.group("suffix") == OLD_SUFFIX else 0, t))
    restored: list[tuple[str, str]] = []
    keep: set[str] = set()
    for name, cands in sorted(by_name.items()):
        final = os.path.join(root, name)
        if storage.isfile(os.path.join(final, MANIFEST_NAME)):
            continue  # committed under its final name: the copies are redundant
        for _, t in sorted(cands):
            if not is_complete(os.path.join(root, t), storage=storage):
                continue
            try:
                storage.rename_noreplace(os.path.join(root, t), final)
            except OSError:
                # Something else sits under the final name: touch none of the copies.
                keep.update(c for _, c in cands)
                break
            storage.fsync_dir(root)
            restored.append((t, name))
            break
    removed = []
    done = {t for t, _ in restored}
    for t in tmps:
        if t in done or t in keep or t in young:
            continue
        storage.remove_tree(os.path.join(root, t))
        removed.append(t)
    # No fsync for the removals (§10.7): a removal a crash undoes leaves a temporary
    # name, which no reader accepts and the next recovery removes again.
    return Recovery(tuple(restored), tuple(removed))


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
) -> CheckpointInfo:
    """Save all seven fields of one process's training state, atomically.

    One process, one part. Under an initialised process group with more than one rank
    this refuses (``DistributedUsageError``): every rank would write part
    ``rank-00000`` to one path. Use ``ckpt.distributed.DistributedCheckpointer.save``
    (every rank calls it) or ``CheckpointManager``; a deliberate single-writer save
    from one rank passes ``this_rank_only=True``.

    ``compress``: store tensors encoded (format 2.0; see :func:`write_part`). Stock
    safetensors cannot read encoded tensors; uncompressed is the default.
    ``dedup_from``: an earlier checkpoint of the same run directory: files whose tensors
    are unchanged are shared by hard link, not written (format 2.0 §V.4). ``dedup``:
    record tensor digests so that a later save can share this one's files.
    """
    if not this_rank_only:
        _refuse_under_process_group(path)
    storage, path = resolve(path, storage)
    pending = begin(path, overwrite=overwrite, storage=storage)
    unsynced: list[Any] = []
    try:
        reuse = reuse_from(dedup_from, part_name_for_rank(0), storage=storage) if dedup_from is not None else None
        # One part, written and committed in one call: a small one commits fused (§10.7).
        part, unsynced = _write_part_locked(
            pending,
            part_name_for_rank(0),
            state,
            compress=compress,
            reuse=reuse,
            dedup=dedup or dedup_from is not None,
            step=step,
            config=config,
            data=data,
            generators=generators,
            extra=extra,
            lineage={"run_id": run_id, "resumed_from": resumed_from},
            code_dir=code_dir,
            storage=storage,
            defer_fsync=True,
        )
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
