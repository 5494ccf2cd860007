"""Our format as a DCP storage backend: ``StorageWriter`` and ``StorageReader``.

``dcp.save(state, storage_writer=StorageWriter(path))`` writes one ckpt checkpoint
(spec/sharded-format.md): the coordinator opens the temporary directory during global
planning, every rank writes its own part (its chunks as safetensors, digests computed
while writing, fsynced, plus the part's full context), and the coordinator commits the
MANIFEST, with DCP's metadata as ``meta.sharded``, only after every rank's part is
durable. ``dcp.load(state, storage_reader=StorageReader(path))`` reads, for each
requested box, only the file chunks of the saved chunks it overlaps, each verified.
"""

from __future__ import annotations

import os
import threading

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch.futures import Future
from torch.distributed.checkpoint import StorageReader as _DcpReader
from torch.distributed.checkpoint import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..context import prime as prime_context
from ..context.record import SaveContext
from ..errors import CkptError, FormatError, StateMismatchError
from ..format import dtypes
from ..format.manifest import PartEntry
from ..reader import CheckpointReader
from ..storage import Storage, resolve
from ..writer import PendingCheckpoint, begin, commit, part_name_for_rank, tensor_memoryview, tensor_view_key, write_part_with
from ..format.sharded import Chunk, ShardedLayout, TensorRecord, ValueRecord, box_name, decode_layout
from .planner import set_value

__all__ = ["StorageWriter", "StorageReader", "to_dcp_metadata"]

_PART_INDEX = "@ckpt-part"  # fqn of the one extra WriteResult per rank that carries its part record


@dataclass(frozen=True)
class _Assignment:
    """What the coordinator hands each rank with the plan: where to write, as which part."""

    tmp_dir: str
    part: str
    tag: str = ""  # file-name tag of an object-store save (PendingCheckpoint.tag)


@dataclass(frozen=True)
class Location:
    """Where a chunk or value lives: a part and (for tensors) its tensor key."""

    part: str
    key: str | None


@dataclass(frozen=True)
class _PartDone:
    record: dict[str, Any]
    mesh: dict[str, Any] | None
    placements: dict[str, list[str]]


def _layout_of(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any] | None, dict[str, list[str]]]:
    """The mesh and per-fqn placements of the DTensors in a (flattened) state dict."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return None, {}
    mesh: dict[str, Any] | None = None
    placements: dict[str, list[str]] = {}
    for fqn, v in state_dict.items():
        if isinstance(v, DTensor):
            placements[fqn] = [_placement(p) for p in v.placements]
            if mesh is None:
                dm = v.device_mesh
                mesh = {"shape": list(dm.shape), "dim_names": list(dm.mesh_dim_names) if dm.mesh_dim_names else None}
    return mesh, placements


def _placement(p: Any) -> str:
    """Spelling of §S.3 (not torch's repr, which changes between releases)."""
    if p.is_shard():
        return f"Shard({p.dim})"
    if p.is_replicate():
        return "Replicate()"
    if p.is_partial():
        return f"Partial({getattr(p, 'reduce_op', 'sum')})"
    return type(p).__name__


class StorageWriter(_DcpWriter):
    """A DCP storage writer that writes one ckpt checkpoint at ``path``.

    The keyword options are the context fields of ``ckpt.save`` (each rank passes its own
    ``data``, ``generators``, ``extra``; ``rng`` as there; one record,
    ``ckpt.context.record.SaveContext``, for :meth:`with_context`). With ``rng=True`` the streams
    are captured when the save is requested (the writer is made, or DCP resets it for the
    next checkpoint on the requesting thread), not when the part is written: ``async_save``
    writes on a thread of its own while training draws on.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        config: Any = None,
        data: Any = None,
        generators: Mapping[str, Any] | None = None,
        rng: bool | Mapping[str, Any] = True,
        extra: Any = None,
        lineage: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        code_dir: str | None = None,
        storage: Storage | None = None,
    ) -> None:
        super().__init__()
        self._start(path, SaveContext(step=step, config=config, data=data, generators=generators, rng=rng, extra=extra,
                                      lineage=lineage, code_dir=code_dir), meta=meta, overwrite=overwrite, storage=storage)

    @classmethod
    def with_context(
        cls,
        path: str | os.PathLike[str],
        context: SaveContext,
        *,
        meta: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        storage: Storage | None = None,
    ) -> StorageWriter:
        """A writer for a caller that has built the context already (the sharded save):
        ``context`` is passed on unchanged (its RNG captured now when it asks for that)."""
        writer = cls.__new__(cls)  # the keywords of __init__ are this record's fields
        _DcpWriter.__init__(writer)
        writer._start(path, context, meta=meta, overwrite=overwrite, storage=storage)
        return writer

    def _start(self, path: str | os.PathLike[str], context: SaveContext, *, meta: Mapping[str, Any] | None,
               overwrite: bool, storage: Storage | None) -> None:
        self._explicit_storage = storage
        self._storage, self.path = resolve(path, storage)
        self._asked = context  # rng=True: captured again for each save this writer is reused for
        self._context = context
        self._requester = threading.get_ident()
        self._snapshot_rng()
        self._meta = dict(meta or {})
        self._overwrite = overwrite
        # DCP's async_save writes on a thread of its own: git runs here, on the caller's
        # thread, not there (ckpt.context.provenance).
        prime_context(context.code_dir)
        self.is_coordinator = False
        self.rank = 0
        self.pending: PendingCheckpoint | None = None  # set on the coordinator once planning opened it
        self.manifest: Any = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @property
    def storage(self) -> Storage:
        """The storage backend the checkpoint is written to (resolved from the path)."""
        return self._storage

    def _snapshot_rng(self) -> None:
        self._context = self._asked.with_rng_now()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._storage, self.path = resolve(checkpoint_id, self._explicit_storage)
        if threading.get_ident() == self._requester:
            # a writer reused for the next save; DCP's async thread resets it too, too late
            self._snapshot_rng()
        self.pending = None
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator only, before any rank writes: open the temporary
        # directory here and hand its name to every rank with its plan.
        self.pending = begin(self.path, overwrite=self._overwrite, storage=self._storage)
        return [replace(p, storage_data=_Assignment(self.pending.tmp_dir, part_name_for_rank(i), self.pending.tag)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assign = plan.storage_data
        if not isinstance(assign, _Assignment):
            raise CkptError("plan carries no ckpt assignment (was prepare_global_plan of this writer run?)", path=self.path)
        shards: dict[str, dict[str, torch.Tensor]] = {}
        values: dict[str, Any] = {}
        results: list[WriteResult] = []
        seen: set[tuple] = set()
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                lookup = getattr(planner, "lookup_object", None)
                if lookup is None:
                    raise CkptError(f"value {fqn!r}: planner {type(planner).__name__} has no lookup_object", path=self.path)
                values[fqn] = lookup(item.index)
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=Location(assign.part, None)))
                continue
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise CkptError(f"tensor item {fqn!r} resolved to {type(t).__name__}", path=self.path)
            t = t.detach()
            # Two fqns sharing one view would be stored once under the first key
            # (writer de-duplication); chunk keys must be the documented ones, so copy.
            view = tensor_view_key(t)
            if t.numel() and view in seen:
                t = t.clone()
            seen.add(view)
            offsets = tuple(item.tensor_data.chunk.offsets) if item.tensor_data is not None else (0,) * t.dim()
            box = box_name(offsets)
            shards.setdefault(fqn, {})[box] = t
            key = "/".join(_escape(s) for s in ("shards", fqn, box))
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(), storage_data=Location(assign.part, key)))
        pending = PendingCheckpoint(final=self.path, tmp_dir=assign.tmp_dir, tag=assign.tag)
        part = write_part_with(pending, assign.part, {"shards": shards, "values": values}, self._context,
                               storage=self._storage)
        mesh, placements = _layout_of(getattr(planner, "state_dict", {}) or {})
        results.append(WriteResult(index=MetadataIndex(_PART_INDEX), size_in_bytes=0, storage_data=_PartDone(part.to_dict(), mesh, placements)))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.pending is None:
            raise CkptError("finish without a pending checkpoint", path=self.path)
        parts: list[PartEntry] = []
        locations: dict[MetadataIndex, Location] = {}
        mesh: dict[str, Any] | None = None
        placements: dict[str, list[str]] = {}
        for rank_results in results:
            for wr in rank_results:
                if isinstance(wr.storage_data, _PartDone):
                    parts.append(PartEntry.from_dict(wr.storage_data.record))
                    mesh = mesh or wr.storage_data.mesh
                    placements.update(wr.storage_data.placements)
                else:
                    locations[wr.index] = wr.storage_data
        if len(parts) != len(results):
            raise CkptError(f"{len(results)} ranks wrote, {len(parts)} part records arrived", path=self.path)
        layout = _layout_from_dcp(metadata, locations, len(results), mesh, placements, self.path)
        meta = {**self._meta, "sharded": layout.to_wire()}
        self.manifest = commit(self.pending, parts, step=self._context.step, meta=meta, storage=self._storage)


def _escape(seg: str) -> str:
    # §7.4 escaping (the writer's rule), so the chunk key is the one write_part assigns.
    return seg.replace("%", "%25").replace("/", "%2F")


def _layout_from_dcp(
    md: Metadata,
    locations: Mapping[MetadataIndex, Location],
    world_size: int,
    mesh: dict[str, Any] | None,
    placements: dict[str, list[str]],
    path: str,
) -> ShardedLayout:
    tensors: dict[str, TensorRecord] = {}
    values: dict[str, ValueRecord] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, BytesStorageMetadata):
            loc = locations.get(MetadataIndex(fqn))
            if loc is None:
                raise CkptError(f"no rank wrote value {fqn!r}", path=path, key=fqn)
            values[fqn] = ValueRecord(fqn, loc.part)
            continue
        dname = dtypes.dtype_name(sm.properties.dtype)
        chunks = []
        for c in sm.chunks:
            loc = locations.get(MetadataIndex(fqn, c.offsets))
            if loc is None or loc.key is None:
                raise CkptError(f"no rank wrote chunk {list(c.offsets)} of {fqn!r}", path=path, key=fqn)
            chunks.append(Chunk(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes), loc.part, loc.key))
        chunks.sort(key=lambda c: c.offsets)
        tensors[fqn] = TensorRecord(fqn, dname, tuple(int(x) for x in sm.size), tuple(chunks))
    paths = md.planner_data if isinstance(md.planner_data, Mapping) else {}
    return ShardedLayout(
        world_size=world_size,
        tensors=tensors,
        values=values,
        paths={str(k): tuple(v) for k, v in paths.items()},
        mesh=mesh,
        placements=placements,
        dcp_version=md.version,
    )


def to_dcp_metadata(layout: ShardedLayout) -> Metadata:
    """DCP's Metadata for a layout, with our Locations as its storage_data."""
    sdm: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, Location] = {}
    for fqn, t in layout.tensors.items():
        sdm[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtypes.torch_dtype(t.dtype)),
            size=torch.Size(t.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in t.chunks],
        )
        for c in t.chunks:
            storage_data[MetadataIndex(fqn, c.offsets)] = Location(c.part, c.key)
    for fqn, v in layout.values.items():
        sdm[fqn] = BytesStorageMetadata()
        storage_data[MetadataIndex(fqn)] = Location(v.part, None)
    return Metadata(
        state_dict_metadata=sdm,
        planner_data={k: tuple(v) for k, v in layout.paths.items()},
        storage_data=storage_data,
        version=layout.dcp_version,
    )


class StorageReader(_DcpReader):
    """A DCP storage reader for a committed ckpt checkpoint with ``meta.sharded``."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True, storage: Storage | None = None) -> None:
        super().__init__()
        self._explicit_storage = storage
        self._storage, self.path = resolve(path, storage)
        self.verify = verify
        self._reader: CheckpointReader | None = None
        self._layout: ShardedLayout | None = None
        self._metadata: Metadata | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._storage, self.path = resolve(checkpoint_id, self._explicit_storage)
        self._reader = self._layout = self._metadata = None

    @property
    def reader(self) -> CheckpointReader:
        if self._reader is None:
            self._reader = CheckpointReader(self.path, storage=self._storage)
        return self._reader

    @property
    def layout(self) -> ShardedLayout:
        if self._layout is None:
            self._layout = decode_layout(self.reader.manifest, path=self.reader.path)
        return self._layout

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return to_dcp_metadata(self.layout)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        layout = self.layout
        reader = self.reader
        md = self._metadata if self._metadata is not None else to_dcp_metadata(layout)
        storage_data: Mapping[MetadataIndex, Location] = md.storage_data
        # Group by saved chunk: each chunk's tensor is read (chunk-verified) once.
        by_chunk: dict[tuple[str, str], list[Any]] = {}
        trees: dict[str, Any] = {}
        for item in plan.items:
            loc = storage_data.get(item.storage_index)
            if not isinstance(loc, Location):
                raise FormatError(f"no saved location for {item.storage_index.fqn!r} at {list(item.storage_index.offset or ())}", path=reader.path, key=item.storage_index.fqn)
            if item.type == LoadItemType.BYTE_IO:
                if loc.part not in trees:
                    trees[loc.part] = reader.tree(loc.part, verify=self.verify)["state"]
                vals = trees[loc.part].get("values")
                fqn = item.storage_index.fqn
                if not isinstance(vals, dict) or fqn not in vals:
                    raise FormatError(f"part {loc.part!r} holds no value {fqn!r}", path=reader.path, key=fqn)
                set_value(planner, item, vals[fqn])
            else:
                by_chunk.setdefault((loc.part, loc.key or ""), []).append(item)
        by_part: dict[str, dict[str, list[Any]]] = {}
        for (part, key), items in by_chunk.items():
            by_part.setdefault(part, {})[key] = items
        for part, keymap in by_part.items():
            self._read_part(reader, part, keymap, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_part(self, reader: CheckpointReader, part: str, keymap: Mapping[str, list[Any]], planner: LoadPlanner) -> None:
        """Read the wanted chunks of one part. A saved chunk that one request covers whole
        is read straight into the destination shard; others into a scratch tensor, then
        narrowed and copied. A part wanted whole is streamed in file order (one read and
        one hash pass)."""
        pe = reader.part(part)
        entries = {t.key: t for t in pe.tensors}
        dests: dict[str, memoryview] = {}
        direct: list[tuple[Any, torch.Tensor]] = []
        scratch: list[tuple[torch.Tensor, list[Any]]] = []
        for key, items in keymap.items():
            te = entries.get(key)
            if te is None:
                raise FormatError(f"part {part!r} has no tensor {key!r}", path=reader.path, key=key)
            dtype = dtypes.torch_dtype(te.dtype)
            if len(items) == 1:
                item = items[0]
                dest = planner.resolve_tensor(item).detach()
                whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == tuple(te.shape)
                if whole and dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous() and tuple(dest.shape) == tuple(te.shape):
                    dests[key] = tensor_memoryview(dest)
                    direct.append((item, dest))
                    continue
            buf = torch.empty(te.shape, dtype=dtype)
            dests[key] = tensor_memoryview(buf)
            scratch.append((buf, items))
        if set(keymap) == set(entries):
            reader.stream_part_into(pe, lambda t: dests[t.key], verify=self.verify)
        else:
            for key in keymap:
                reader.read_tensor_bytes_into(pe, entries[key], dests[key], verify=self.verify)
        for item, dest in direct:
            planner.commit_tensor(item, dest)
        for buf, items in scratch:
            for item in items:
                view = buf
                for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                    view = view.narrow(dim, o, n)
                dest = planner.resolve_tensor(item).detach()
                if dest.shape != view.shape:
                    raise StateMismatchError(f"{item.dest_index.fqn!r}: saved box {list(view.shape)} vs target {list(dest.shape)}", path=reader.path, key=item.dest_index.fqn)
                dest.copy_(view)
                planner.commit_tensor(item, dest)
