"""The one ``torch.distributed`` adapter for checkpoints.

Save protocol (every rank calls :meth:`DistributedCheckpointer.save` for the same path,
in the same order):

1. Rank 0 creates the temporary directory (``writer.begin``) and broadcasts its path.
2. Every rank writes its own part ``rank-NNNNN``: its RNG streams and data-loader state
   always, and its state entries. Entries named in ``replicated`` (weights and optimizer
   state that DDP keeps identical on every rank) are written once, by rank 0; the other
   ranks store a ``writer.Replicated("rank-00000")`` reference in their place.
3. Each rank sends rank 0 its ``PartEntry.to_dict()`` (or the error that stopped it).
4. Rank 0 commits only when every rank has written; otherwise it aborts, removing the
   temporary directory. It broadcasts the outcome, so every rank returns or raises
   together, then all ranks meet at a barrier.

Nothing here pickles: records travel as msgpack bytes inside uint8 tensors (we do not
use ``gather_object``/``broadcast_object_list``, which pickle).

Load: each rank reads its own part; ``Replicated`` entries resolve to rank 0's bytes.
A world size other than the saving one is named as an exactness difference by
``load_into`` (reduction order changes, so numerics cannot be bit-identical).

Collectives run on groups the checkpointer creates for itself (gloo, which handles CPU
tensors on any backend's job), so a save running in a background thread never
interleaves with the training loop's own collectives on the default group.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import msgpack
import torch
import torch.distributed as dist

from .context.record import SaveContext
from .errors import CkptError
from ._partfiles import Reuse
from .format.manifest import Manifest, part_record
from .knobs import knobs
from .save_options import SaveOptions, options_from
from .storage import Storage, first_errno, resolve
from .writer import PendingCheckpoint, Replicated, abort, begin, commit, part_name_for_rank, write_part_with

__all__ = ["DistributedCheckpointer", "DistributedSaveError", "is_distributed"]


class DistributedSaveError(CkptError, RuntimeError):
    """A rank failed to write its part; nothing was committed."""


def is_distributed() -> bool:
    """Whether a process group of more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _error_record(e: BaseException) -> dict[str, Any]:
    return {"error": f"{type(e).__name__}: {e}", "errno": first_errno(e)}


def _unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


#: the options of a collective save (every rank writes one part)
DISTRIBUTED_SAVE_SUPPORTS = frozenset({"overwrite", "compress", "dedup", "dedup_from", "reuse", "part_manifests"})


class DistributedCheckpointer:
    """Per-rank parts, replicated entries written once, commit by rank 0 after all ranks.

    Create it on every rank at the same point of the program (it creates process
    groups, a collective call).
    """

    def __init__(self, *, io_group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedCheckpointer needs an initialised torch.distributed process group")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = io_group if io_group is not None else dist.new_group(backend="gloo")

    # -- byte collectives (pickle-free) ---------------------------------------------------
    def broadcast_bytes(self, payload: bytes | None, src: int = 0) -> bytes:
        n = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(n, src=src, group=self.group)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        if self.rank == src and payload:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if buf.numel():
            dist.broadcast(buf, src=src, group=self.group)
        return bytes(buf.numpy().tobytes()) if buf.numel() else b""

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        n = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self.group)
        width = max(int(s.item()) for s in sizes)
        mine = torch.zeros(max(width, 1), dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = [torch.zeros(max(width, 1), dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(bufs, mine, group=self.group)
        return [bytes(b[: int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes)]

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    # -- save -----------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike[str],
        state: Mapping[str, Any],
        *,
        replicated: Sequence[str] = (),
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
        compress: Any = None,
        reuse: Reuse | None = None,
        dedup: bool = False,
        part_manifests: bool | None = None,
        options: SaveOptions | None = None,
    ) -> Manifest | None:
        """Collective save. Returns the manifest on rank 0 and ``None`` elsewhere.

        ``step`` ... ``code_dir``: this rank's part's context (``ckpt.context.record.SaveContext``).
        ``options`` (``ckpt.SaveOptions``, or the same as keywords): ``overwrite``;
        ``compress``, ``reuse`` (this rank's part of the previous checkpoint), ``dedup_from``
        (that checkpoint's directory) and ``dedup`` as for ``ckpt.write_part`` (format 2.0);
        ``part_manifests``: list parts by reference (default: when the job has more ranks
        than ``CKPT_INLINE_PARTS_MAX``). ``this_rank_only`` is refused (``SaveOptionError``):
        every rank writes its part.
        """
        opts = options_from(options, where="DistributedCheckpointer.save", path=os.fspath(path), overwrite=overwrite,
                            compress=compress, reuse=reuse, dedup=dedup, part_manifests=part_manifests)
        context = SaveContext(step=step, config=config, data=data, generators=generators, rng=rng, extra=extra,
                              lineage=lineage, code_dir=code_dir)
        return self.save_with(path, state, context, replicated=replicated, meta=meta, storage=storage, options=opts)

    def save_with(
        self,
        path: str | os.PathLike[str],
        state: Mapping[str, Any],
        context: SaveContext,
        *,
        replicated: Sequence[str] = (),
        meta: Mapping[str, Any] | None = None,
        storage: Storage | None = None,
        options: SaveOptions = SaveOptions(),
    ) -> Manifest | None:
        """:meth:`save` for a caller that has built the records already (the manager's
        save thread): ``context`` and ``options`` are passed on unchanged."""
        options.refuse_unsupported(DISTRIBUTED_SAVE_SUPPORTS, "DistributedCheckpointer.save",
                                   "every rank writes its own part of one checkpoint", path=os.fspath(path))
        storage, final = resolve(path, storage)
        overwrite = options.overwrite
        part_manifests = options.part_manifests
        if part_manifests is None:
            part_manifests = self.world_size > knobs().inline_parts_max
            options = dataclasses.replace(options, part_manifests=part_manifests)
        # 1. rank 0 creates the temporary directory
        if self.rank == 0:
            try:
                pending = begin(final, overwrite=overwrite, storage=storage, part_manifests=part_manifests)
                msg = _pack({"tmp": pending.tmp_dir, "tag": pending.tag})
            except Exception as e:  # noqa: BLE001 - every rank must hear about it
                msg = _pack(_error_record(e))
        else:
            msg = None
        got = _unpack(self.broadcast_bytes(msg))
        if "error" in got:
            raise DistributedSaveError(f"rank 0 could not start the save: {got['error']}", path=final, errno=got.get("errno"))
        # overwrite travels with the pending record: the commit enforces it atomically.
        pending = PendingCheckpoint(
            final=final, tmp_dir=got["tmp"], overwrite=overwrite, tag=got.get("tag", ""), part_manifests=part_manifests
        )

        # 2. every rank writes its part
        missing = [k for k in replicated if k not in state]
        my_state: dict[str, Any] = {}
        for key, obj in state.items():
            # The reference names rank 0's part: its bytes are the ones written.
            my_state[key] = Replicated(part_name_for_rank(0)) if (key in replicated and self.rank != 0) else obj
        try:
            if missing:
                raise CkptError(f"replicated entries {missing} are not in the state", path=final)
            part = write_part_with(pending, part_name_for_rank(self.rank), my_state, context, storage=storage, options=options)
            report = _pack({"part": part.to_dict()})
        except Exception as e:  # noqa: BLE001
            report = _pack(_error_record(e))

        # 3. gather the part records, 4. rank 0 commits only if all ranks wrote
        reports = [_unpack(b) for b in self.all_gather_bytes(report)]
        manifest: Manifest | None = None
        if self.rank == 0:
            errors = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if "error" in rep]
            errnos = [rep["errno"] for rep in reports if rep.get("errno") is not None]
            if errors:
                abort(pending, storage=storage)
                outcome = _pack({"error": "; ".join(errors), "errno": errnos[0] if errnos else None})
            else:
                try:
                    parts = [part_record(rep["part"]) for rep in reports]
                    manifest = commit(pending, parts, step=context.step, meta=meta, storage=storage)
                    outcome = _pack({"ok": manifest.id})
                except Exception as e:  # noqa: BLE001
                    abort(pending, storage=storage)
                    rec = _error_record(e)
                    outcome = _pack({"error": f"rank 0 commit: {rec['error']}", "errno": rec["errno"]})
        else:
            outcome = None
        result = _unpack(self.broadcast_bytes(outcome))
        self.barrier()
        if "error" in result:
            # errno travels so a caller can tell "disk full" (the manager then frees
            # space by retention before its next save) from other failures.
            raise DistributedSaveError(f"distributed save failed, nothing committed: {result['error']}", path=final, errno=result.get("errno"))
        return manifest

    # -- load -----------------------------------------------------------------------------
    def load(
        self,
        path: str | os.PathLike[str],
        state: Mapping[str, Any] | None,
        *,
        data: Any = None,
        generators: Mapping[str, Any] | None = None,
        restore_rng: bool = True,
        verify: bool = True,
        exactness: str = "warn",
        map_location: Any = None,
    ) -> Any:
        """Load this rank's part (``Replicated`` entries resolve to rank 0's bytes)."""
        from ._load import load_into
        from .reader import CheckpointReader

        reader = CheckpointReader(path)
        return load_into(
            reader,
            state,
            part=part_name_for_rank(self.rank),
            data=data,
            generators=generators,
            map_location=map_location,
            restore_rng_state=restore_rng,
            verify=verify,
            exactness=exactness,
        )
