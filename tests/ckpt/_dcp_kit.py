"""Hand-built DCP checkpoints (``.metadata`` + one ``.distcp``) for hostile-input tests.

DCP's own writer cannot produce a gap, an overlap or a lying size, so these tests write
the items with ``torch.save`` and pickle a ``Metadata`` whose fields they choose (pickle
only on the test side: the package reads it through its restricted unpickler)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

Chunks = list[tuple[tuple[int, ...], torch.Tensor]]


def write_dcp(d: Path, tensors: dict[str, tuple[tuple[int, ...], Chunks]], values: dict[str, Any] | None = None,
              mutate: Callable[[Metadata], None] | None = None) -> Path:
    """``tensors``: fqn -> (global size, [(chunk offsets, chunk tensor)]). ``mutate`` edits
    the Metadata before it is pickled (to make it lie)."""
    d.mkdir(parents=True, exist_ok=True)
    blob = io.BytesIO()
    storage: dict[MetadataIndex, _StorageInfo] = {}
    sdm: dict[str, Any] = {}

    def put(key: MetadataIndex, obj: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        storage[key] = _StorageInfo("__0_0.distcp", blob.tell(), len(buf.getvalue()))
        blob.write(buf.getvalue())

    for fqn, v in (values or {}).items():
        sdm[fqn] = BytesStorageMetadata()
        put(MetadataIndex(fqn), v)
    for fqn, (size, chunks) in tensors.items():
        dtype = chunks[0][1].dtype if chunks else torch.float32
        cms = []
        for i, (off, t) in enumerate(chunks):
            cms.append(ChunkStorageMetadata(torch.Size(off), t.shape))
            put(MetadataIndex(fqn, off, i), t.clone())
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), cms)
    md = Metadata(state_dict_metadata=sdm, planner_data={k: (k,) for k in sdm}, storage_data=storage)
    if mutate is not None:
        mutate(md)
    (d / "__0_0.distcp").write_bytes(blob.getvalue())
    (d / ".metadata").write_bytes(pickle.dumps(md))
    return d


def rows(t: torch.Tensor, *cuts: int) -> Chunks:
    """``t`` cut along dim 0 at ``cuts``, as (offsets, chunk) pairs."""
    edges = [0, *cuts, t.shape[0]]
    return [((a,) + (0,) * (t.dim() - 1), t[a:b]) for a, b in zip(edges, edges[1:])]
