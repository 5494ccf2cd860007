"""``ckpt.save``/``ckpt.load`` for states holding DTensors (FSDP2, tensor parallel).

This is the sharded path of ``ckpt``'s own save and load, which they route here; it
is not a third-party trainer integration (those live in ``ckpt/integrations/``), and
converting DCP's own checkpoints is ``ckpt.convert.dcp``.

Each rank calls the same function with its own modules and optimizers (as under
torchrun). Modules and optimizers go through ``get_model_state_dict`` /
``get_optimizer_state_dict`` (sharded, keyed by fqn) and back through the ``set_*``
counterparts, so optimizer state is keyed by parameter name, not by position, and
reshards with the parameters. Everything else: ``state_dict()`` of a Stateful, or the
tree itself.

Context on load (spec/sharded-format.md §S.4): rank ``r`` restores part ``rank-r``'s
RNG streams when the saving job had that rank; a new rank derives its streams from the
checkpoint id and its rank. Data state comes from the rank's part, or ``rank-00000``.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace
from typing import Any, Mapping, NoReturn

import torch
import torch.distributed as dist

from ..context.record import SaveContext, lineage_of
from ..errors import CkptError, StateMismatchError
from ..reader import CheckpointReader
from ..save_options import SaveOptions, options_from
from ..storage import Storage, resolve
from ..writer import CheckpointInfo, abort, part_name_for_rank
from .integration_probe import holds_dtensor
from ..format.sharded import decode_layout

__all__ = ["holds_dtensor", "save_sharded", "save_sharded_with", "load_sharded", "new_rank_seed", "dcp_load", "restore_rank_rng", "raise_failed_save", "unwrap_checkpoint_error"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _owner(opt: torch.optim.Optimizer, modules: Mapping[str, torch.nn.Module], name: str) -> torch.nn.Module:
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in modules.values():
        if ids <= {id(p) for p in m.parameters()}:
            return m
    raise StateMismatchError(f"optimizer {name!r}: no module entry of the state holds all its parameters", key=name)


def _dcp_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.nn.Module]]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    out: dict[str, Any] = {}
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            out[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            out[name] = get_optimizer_state_dict(_owner(obj, modules, name), obj)
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            out[name] = obj.state_dict()
        else:
            out[name] = obj
    return out, modules


def unwrap_checkpoint_error(e: BaseException) -> BaseException:
    """DCP wraps every rank's failure into one ``CheckpointException``; hand back our own
    error (the first ``CkptError`` of the lowest failing rank) when there is one."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, Mapping):
        for r in sorted(failures):
            exc = failures[r][0] if isinstance(failures[r], tuple) else failures[r]
            if isinstance(exc, CkptError):
                return exc
    return e


#: the options of a sharded save: DCP writes the shards, as format 1.0 parts
SHARDED_SAVE_SUPPORTS = frozenset({"overwrite"})


def refuse_sharded_options(opts: SaveOptions, path: str, where: str = "the sharded save (DTensor state)") -> None:
    """``SaveOptionError`` for the options a sharded save does not support (before any rank writes)."""
    opts.refuse_unsupported(SHARDED_SAVE_SUPPORTS, where, "sharded (DTensor) state is written through DCP, one plain "
                            "part per rank, collectively: no compression, no dedup, no single-rank save", path=path)


def save_sharded(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    config: Any = None,
    data: Any = None,
    step: int | None = None,
    generators: Mapping[str, Any] | None = None,
    rng: bool | Mapping[str, Any] = True,
    extra: Any = None,
    lineage: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    resumed_from: str | None = None,
    code_dir: str | None = None,
    overwrite: bool = False,
    meta: Mapping[str, Any] | None = None,
    this_rank_only: bool = False,
    storage: Storage | None = None,
    compress: Any = None,
    dedup_from: str | os.PathLike[str] | None = None,
    dedup: bool = False,
    options: SaveOptions | None = None,
) -> CheckpointInfo:
    """Collective: every rank calls it with its own shards. Commits once, atomically.

    Takes ``ckpt.save``'s arguments; ``run_id``/``resumed_from`` become the lineage unless
    ``lineage`` is given. Of the save options (``ckpt.SaveOptions``) only ``overwrite`` is
    supported: DCP lays the shards out (spec/sharded-format.md), so ``compress``, ``dedup``,
    ``dedup_from``, ``reuse`` and ``part_manifests`` are refused with ``SaveOptionError``,
    and so is ``this_rank_only`` (every rank writes its shards, collectively).
    """
    opts = options_from(options, where="the sharded save (DTensor state)", path=os.fspath(path), overwrite=overwrite,
                        this_rank_only=this_rank_only, compress=compress, dedup_from=dedup_from, dedup=dedup)
    context = SaveContext(step=step, config=config, data=data, generators=generators, rng=rng, extra=extra,
                          lineage=lineage_of(run_id, resumed_from) if lineage is None else lineage, code_dir=code_dir)
    return save_sharded_with(path, state, context, meta=meta, storage=storage, options=opts)


def save_sharded_with(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    context: SaveContext,
    *,
    meta: Mapping[str, Any] | None = None,
    storage: Storage | None = None,
    options: SaveOptions = SaveOptions(),
) -> CheckpointInfo:
    """:func:`save_sharded` for a caller that has built the records already (the manager):
    ``context`` and ``options`` are passed on unchanged."""
    refuse_sharded_options(options, os.fspath(path))
    import torch.distributed.checkpoint as dcp

    from .planner import SavePlanner
    from .storage import StorageWriter

    storage, path = resolve(path, storage)
    sd, _ = _dcp_state(state)
    writer = StorageWriter.with_context(path, context, meta=meta, overwrite=options.overwrite, storage=storage)
    try:
        dcp.save(sd, storage_writer=writer, planner=SavePlanner())
    except BaseException as e:
        raise_failed_save(writer, e)
    reader = CheckpointReader(writer.path, storage=storage)
    m = reader.manifest
    return CheckpointInfo(reader.path, m.id, m.step, m.total_bytes, m)


def raise_failed_save(writer: Any, e: BaseException) -> NoReturn:
    """Raise what a failed DCP save through ``writer`` (a ``ckpt.dcp.StorageWriter``) means,
    after removing the temporary directory its coordinator opened: nothing was renamed into
    place, and the other ranks have stopped writing (DCP gathered them)."""
    pending = writer.pending
    if pending is not None and (pending.tag or writer.storage.isdir(pending.tmp_dir)):
        abort(pending, storage=writer.storage)
    err = unwrap_checkpoint_error(e)
    if err is not e:
        raise err from None
    if isinstance(e, Exception) and not isinstance(e, CkptError):
        # e.g. gloo's "Connection closed by peer" when a rank died mid-save
        from ..distributed import DistributedSaveError

        raise DistributedSaveError(f"sharded save failed, nothing committed: {type(e).__name__}: {e}", path=writer.path) from e
    raise e


def new_rank_seed(checkpoint_id: str, rank: int) -> int:
    """§S.4 new-rank rule: first 8 bytes (LE u64) of xxh3-128("<id>/rank-<r>")."""
    import xxhash

    return int.from_bytes(xxhash.xxh3_128_digest(f"{checkpoint_id}/rank-{rank}".encode())[:8], "little")


def _seed_new_rank(seed: int, generators: Mapping[str, Any] | None) -> list[str]:
    random.seed(seed)
    done = ["python"]
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
        done.append("numpy")
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
    done.append("torch_cpu")
    for name, g in (generators or {}).items():
        g.manual_seed(seed)
        done.append(f"generator:{name}")
    return done


def load_sharded(
    reader: CheckpointReader,
    state: Mapping[str, Any] | None,
    *,
    data: Any = None,
    generators: Mapping[str, Any] | None = None,
    restore_rng: bool = True,
    verify: bool = True,
    exactness: str = "warn",
) -> Any:
    """Collective when a process group is up; works on one process without one (M = 1)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from .._load import load_into

    layout = decode_layout(reader.manifest, path=reader.path)
    rank = _rank()
    own = rank < layout.world_size
    part = part_name_for_rank(rank if own else 0)
    # Context first (the exactness gate refuses before any tensor is touched; data
    # state restored); RNG is restored last, below.
    result = load_into(reader, {}, part=part, data=data, restore_rng_state=False, verify=verify, exactness=exactness)
    state = state or {}
    sd, modules = _dcp_state(state)
    dcp_load(reader, sd, verify=verify)
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, sd[name])
        elif isinstance(obj, torch.optim.Optimizer):
            set_optimizer_state_dict(_owner(obj, modules, name), obj, sd[name])
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(sd[name])
        elif isinstance(obj, dict) and isinstance(sd[name], dict) and sd[name] is not obj:
            obj.clear()
            obj.update(sd[name])
    restored = restore_rank_rng(reader, result.context.get("rng"), generators) if restore_rng else []
    return replace(result, restored_rng=tuple(restored))


def dcp_load(reader: CheckpointReader, state_dict: dict[str, Any], *, verify: bool = True) -> None:
    """``dcp.load`` of an opened checkpoint into ``state_dict`` (collective), through our
    reader and the pickle-free planner; our own error when a rank failed with one."""
    import torch.distributed.checkpoint as dcp

    from .planner import LoadPlanner
    from .storage import StorageReader

    sreader = StorageReader(reader.path, verify=verify, storage=reader.storage)
    sreader._reader = reader
    try:
        dcp.load(state_dict, storage_reader=sreader, planner=LoadPlanner())
    except BaseException as e:
        err = unwrap_checkpoint_error(e)
        if err is e:
            raise
        raise err from None


def restore_rank_rng(reader: CheckpointReader, saved: Mapping[str, Any] | None, generators: Mapping[str, Any] | None = None) -> list[str]:
    """§S.4: this rank's saved streams (``saved``: its part's context ``rng``) when the saving
    job had this rank; a rank it did not have seeds its streams by the new-rank rule."""
    from ..context.rng import restore_rng as _restore_rng

    rank = _rank()
    if rank >= decode_layout(reader.manifest, path=reader.path).world_size:
        return _seed_new_rank(new_rank_seed(reader.manifest.id, rank), generators)
    return _restore_rng(saved, generators, path=reader.path) if saved is not None else []
