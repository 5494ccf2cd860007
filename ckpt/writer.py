"""Writing checkpoints: ``save`` for one process, ``begin/write_part/commit`` for many.

Commit protocol (spec/checkpoint-format.md §5): every part is written into a
temporary sibling directory ``.tmp-<name>-<random>``; each file is fsynced as it is
closed; MANIFEST is written last and fsynced, then the temporary directory is
fsynced, renamed to its final name, and the parent directory fsynced. A crash before
the rename leaves only a temporary directory, which no reader accepts; a crash after
it leaves a complete checkpoint. Existing checkpoints are never touched.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import msgpack

from . import __version__
from .context.config import canonical_config, config_hash
from .context.env import capture_env
from .context.provenance import capture_commit
from .context.rng import capture_rng, rng_kinds
from .context.topology import capture_topology
from .errors import CheckpointExistsError, CkptError, UnsupportedValueError
from .format import dtypes
from .format.codec import packb, zstd_compress
from .format.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    PartEntry,
    TensorEntry,
    check_name,
    content_id,
    encode_manifest,
)
from .format.safetensors import TensorSlot, build_header
from .format.tree import EXT_DEVICE, EXT_DTYPE, EXT_REPLICA, EXT_TENSOR, render_path, to_wire
from .knobs import knobs
from .storage import Storage, local

__all__ = ["PendingCheckpoint", "Replicated", "begin", "write_part", "commit", "abort", "save", "part_name_for_rank"]

TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class PendingCheckpoint:
    """A checkpoint being written. Rebuild it in another process from the two paths."""

    final: str
    tmp_dir: str


@dataclass(frozen=True, slots=True)
class Replicated:
    """Marks a state entry whose bytes live in another part (replicated weights written once)."""

    part: str


def part_name_for_rank(rank: int) -> str:
    return f"rank-{rank:05d}"


def begin(path: str | os.PathLike[str], *, overwrite: bool = False, storage: Storage = local) -> PendingCheckpoint:
    final = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(final)
    check_name(name, what="checkpoint directory", path=final)
    os.makedirs(parent, exist_ok=True)
    if os.path.lexists(final) and not overwrite:
        raise CheckpointExistsError("a checkpoint already exists here; pass overwrite=True to replace it", path=final)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{secrets.token_hex(6)}")
    storage.mkdir(tmp)
    return PendingCheckpoint(final=final, tmp_dir=tmp)


def abort(pending: PendingCheckpoint, *, storage: Storage = local) -> None:
    storage.remove_tree(pending.tmp_dir)


# --- flattening a state tree --------------------------------------------------------


def _escape(seg: Any) -> str:
    # '/' separates key segments; escape it (and '%') so distinct paths stay distinct.
    return str(seg).replace("%", "%25").replace("/", "%2F")


class _Collector:
    """Hook for ``to_wire``: assigns tensor keys and de-duplicates aliased tensors."""

    def __init__(self, prefix: str) -> None:
        import torch

        self._torch = torch
        self.prefix = prefix
        self.tensors: list[tuple[str, Any]] = []  # (key, cpu contiguous tensor)
        self._by_view: dict[tuple, str] = {}
        self._keys: set[str] = set()
        self.counts: dict[str, list[int]] = {}  # top-level entry -> [n tensors, bytes]

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
        torch = self._torch
        where = render_path(path)
        if t.layout != torch.strided:
            raise UnsupportedValueError(f"tensor layout {t.layout} is not supported", key=where)
        if t.is_quantized or t.device.type == "meta":
            raise UnsupportedValueError("quantized and meta tensors cannot be stored", key=where)
        try:
            dname = dtypes.dtype_name(t.dtype)
        except KeyError:
            raise UnsupportedValueError(f"tensor dtype {t.dtype} cannot be stored", key=where) from None
        # The same view reached twice (tied weights, an optimizer aliasing a param) is
        # stored once and restored as one tensor object.
        view = tensor_view_key(t)
        if t.numel() > 0 and view in self._by_view:
            return self._by_view[view]
        key = "/".join([self.prefix, *(_escape(p) for p in path)]) if self.prefix else "/".join(_escape(p) for p in path)
        # Distinct paths can render alike (int key 1 and str key "1"); keys must be
        # unique in the manifest, and the tree refers to them by name, so suffix.
        base, n = key, 0
        while key in self._keys:
            n += 1
            key = f"{base}~{n}"
        self._keys.add(key)
        src = t.detach()
        if src.is_conj():
            src = src.resolve_conj()
        if src.is_neg():
            src = src.resolve_neg()
        if src.device.type != "cpu":
            src = src.to("cpu")
        if not src.is_contiguous():
            src = src.contiguous()
        self.tensors.append((key, src))
        if t.numel() > 0:
            self._by_view[view] = key
        top = str(path[0]) if path else ""
        c = self.counts.setdefault(top, [0, 0])
        c[0] += 1
        c[1] += src.numel() * src.element_size()
        return key


def tensor_view_key(t: Any) -> tuple[Any, ...]:
    """Identity of a tensor *view*: equal keys hold the same values in the same memory.

    is_conj/is_neg are part of it: x and x.conj() share storage, offset and strides
    but hold different values.
    """
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )


def tensor_memoryview(t: Any) -> memoryview:
    """Zero-copy view of a CPU contiguous tensor's bytes (no numpy needed)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


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
    storage: Storage = local,
) -> PartEntry:
    """Write one part (a process's share) into ``pending.tmp_dir``; durable on return."""
    check_name(name, what="part")
    if not isinstance(state, Mapping):
        raise UnsupportedValueError("state must be a mapping of name -> Stateful or tree", key="<root>")
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
    tensors: list[TensorEntry] = []
    if collector.tensors:
        # Largest element size first (stable): every tensor then starts at a multiple of
        # its element size, as stock safetensors lays files out, so readers can map it.
        collector.tensors.sort(key=lambda kt: -kt[1].element_size())
        fname = f"{name}.safetensors"
        slots = [TensorSlot(key, dtypes.dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for key, t in collector.tensors]
        header, offsets = build_header(slots, {"format": "pt", "writer": f"ckpt-replay {__version__}"})
        sink = storage.create(os.path.join(pending.tmp_dir, fname), k.chunk_size)
        try:
            sink.write(header)
            for (key, t), slot, off in zip(collector.tensors, slots, offsets):
                sink.write(tensor_memoryview(t))
                tensors.append(TensorEntry(key, slot.dtype, slot.shape, 0, off, slot.nbytes))
            size, digests = sink.close()
        except BaseException:
            sink.discard()
            raise
        files.append(FileEntry(fname, "tensors", size, k.chunk_size, digests))
        # collector.tensors holds staging copies alive until here; drop them now.
    raw = packb({"state": wire_state, "context": context})
    if len(raw) > k.max_state_raw_bytes:
        raise UnsupportedValueError(f"structure of part {name!r} is {len(raw)} bytes, above the limit", key="<root>")
    comp = zstd_compress(raw)
    sname = f"{name}.state.msgpack.zst"
    sink = storage.create(os.path.join(pending.tmp_dir, sname), k.chunk_size)
    try:
        sink.write(comp)
        size, digests = sink.close()
    except BaseException:
        sink.discard()
        raise
    # The state file comes first so readers can find the structure without scanning.
    files.insert(0, FileEntry(sname, "state", size, k.chunk_size, digests, "zstd", len(raw)))
    if tensors:
        tensors = [TensorEntry(t.key, t.dtype, t.shape, 1, t.offset, t.nbytes) for t in tensors]
    summary = {
        "step": step,
        "entries": {key: {"type": entry_types[key], "tensors": collector.counts.get(key, [0, 0])[0], "bytes": collector.counts.get(key, [0, 0])[1]} for key in wire_state},
        "rng": rng_kinds(rng_state) if rng_state else [],
        "data": None if data is None else {"type": context["data_type"], "state": _preview(data_state)},
        "config_hash": context["config"]["hash"] if context["config"] else None,
        "commit": commit_info,
        "topology": topo,
        "env": {key: env.get(key) for key in ("python", "torch", "cuda", "cudnn", "deterministic_algorithms", "num_threads", "ckpt_replay")},
        "lineage": context["lineage"],
    }
    return PartEntry(name, tuple(files), tuple(tensors), summary)


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
    parts: Sequence[PartEntry],
    *,
    kind: str = "checkpoint",
    step: int | None = None,
    meta: Mapping[str, Any] | None = None,
    storage: Storage = local,
) -> Manifest:
    """Write MANIFEST last, fsync, and rename the temporary directory into place."""
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise CkptError(f"duplicate part names {names}", path=pending.final)
    if step is None and parts:
        step = parts[0].summary.get("step")
    # Sorting parts by name makes the manifest independent of arrival order.
    ordered = tuple(sorted(parts, key=lambda p: p.name))
    manifest = Manifest(
        id=content_id(ordered),
        kind=kind,
        step=step,
        created_at=time.time(),
        package_version=__version__,
        parts=ordered,
        meta=dict(meta or {}),
    )
    blob = encode_manifest(manifest)
    sink = storage.create(os.path.join(pending.tmp_dir, MANIFEST_NAME), max(knobs().chunk_size, 4096))
    try:
        sink.write(blob)
        sink.close()
    except BaseException:
        sink.discard()
        raise
    storage.fsync_dir(pending.tmp_dir)
    parent = os.path.dirname(pending.final)
    if os.path.lexists(pending.final):
        # overwrite=True: move the old one aside first; a crash in between leaves the
        # old checkpoint intact under a temporary name and the new one complete.
        trash = os.path.join(parent, f"{TMP_PREFIX}old-{os.path.basename(pending.final)}-{secrets.token_hex(6)}")
        storage.rename_dir(pending.final, trash)
        storage.rename_dir(pending.tmp_dir, pending.final)
        storage.fsync_dir(parent)
        storage.remove_tree(trash)
    else:
        storage.rename_dir(pending.tmp_dir, pending.final)
    storage.fsync_dir(parent)
    return manifest


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    path: str
    id: str
    step: int | None
    bytes: int
    manifest: Manifest


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
    storage: Storage = local,
) -> CheckpointInfo:
    """Save all seven fields of one process's training state, atomically.

    A state holding DTensors (FSDP2, tensor parallel) is sharded: every rank calls
    ``save`` and the checkpoint is written through DCP (``ckpt.dcp``), one part per rank.
    """
    # --- sharded state hook (ckpt.dcp) ---
    from .dcp.integration_probe import holds_dtensor

    if holds_dtensor(state):
        from .dcp.integration import save_sharded

        lineage = {"run_id": run_id, "resumed_from": resumed_from}
        return save_sharded(
            path, state, config=config, data=data, step=step, generators=generators, extra=extra,
            lineage=lineage, code_dir=code_dir, overwrite=overwrite, meta=meta, storage=storage,
        )
    # --- end sharded state hook ---
    pending = begin(path, overwrite=overwrite, storage=storage)
    try:
        part = write_part(
            pending,
            part_name_for_rank(0),
            state,
            step=step,
            config=config,
            data=data,
            generators=generators,
            extra=extra,
            lineage={"run_id": run_id, "resumed_from": resumed_from},
            code_dir=code_dir,
            storage=storage,
        )
        manifest = commit(pending, [part], step=step, meta=meta, storage=storage)
    except BaseException:
        abort(pending, storage=storage)
        raise
    return CheckpointInfo(pending.final, manifest.id, step, manifest.total_bytes, manifest)
