"""ckpt: exact, verifiable, pickle-free PyTorch checkpoints.

One checkpoint holds all seven fields, written together and loaded together:
weights, optimizer state, RNG state, data offsets, config hash, cluster topology and
commit SHA (plus an environment fingerprint and lineage)::

    import ckpt
    ckpt.save("run/step-00000100", {"model": model, "optim": opt}, config=cfg, data=loader, step=100)
    info = ckpt.load("run/step-00000100", {"model": model, "optim": opt}, data=loader)
    r = ckpt.open("run/step-00000100")          # lazy: r.manifest, r.context(), r.tensor("model/fc.weight")

Importing ``ckpt`` does not import torch; the torch-facing functions load it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import CkptError  # noqa: E402
from .format.manifest import TMP_PREFIX  # noqa: E402
from .reader import CheckpointReader  # noqa: E402
from .save_options import SaveOptions  # noqa: E402
from .stateful import Stateful  # noqa: E402

__all__ = [
    "__version__",
    "save",
    "SaveOptions",
    "load",
    "open",
    "begin",
    "write_part",
    "commit",
    "abort",
    "PendingCheckpoint",
    "Stateful",
    "CheckpointReader",
    "CkptError",
    "LoadResult",
    "CheckpointManager",
    "RetentionPolicy",
    "apply_retention",
    "list_checkpoints",
    "checkpoint_name",
    "latest",
    "TMP_PREFIX",
    "errors",
    "data",
    "rng",
    "ledger",
    "diff",
    "guard",
    "stream",
]

if TYPE_CHECKING:  # pragma: no cover
    from ._load import LoadResult
    from .manager import CheckpointManager, RetentionPolicy, apply_retention, checkpoint_name, latest, list_checkpoints
    from .writer import CheckpointInfo, PendingCheckpoint, abort, begin, commit, write_part


def save(path: Any, state: Any, *, options: "SaveOptions | None" = None, ledger: bool = True,
         **kwargs: Any) -> "CheckpointInfo":
    """Save all seven fields of the training state, atomically (``ckpt.writer.save``).

    A state whose modules, optimizers or tensors are DTensors (FSDP2, tensor parallel)
    is sharded: every rank calls ``save`` with its own shards and the checkpoint is
    written through DCP, one part per rank (``ckpt.dcp``, spec/sharded-format.md).

    ``options`` (:class:`SaveOptions`, or its fields as keywords: ``compress=``,
    ``dedup=``, ...) is passed on unchanged; an option the chosen path does not support
    (``compress`` for sharded state) raises ``SaveOptionError`` naming it.

    ``ledger``: feed the default step ledger (``ckpt.ledger.auto``): from the first
    save or load on, every optimizer step is recorded in ``ledger/`` next to the
    checkpoint, and a later ``ckpt.load`` that resumes the run verifies the re-run steps.
    ``False`` (or ``CKPT_AUTO_LEDGER=0`` for the process) leaves it out. Like any save,
    it refuses to replace an existing checkpoint unless ``overwrite=True``.
    """
    from .dcp.integration_probe import holds_dtensor

    if holds_dtensor(state):  # --- sharded state hook (ckpt.dcp) ---
        from .dcp.integration import save_sharded

        return save_sharded(path, state, options=options, **kwargs)
    from .writer import save as _save

    if ledger:
        from .ledger.auto import before_save

        mark = before_save(path, state, kwargs)
        if mark:
            kwargs["meta"] = {**(kwargs.get("meta") or {}), **mark}
    return _save(path, state, options=options, **kwargs)


def open(path: Any, **kwargs: Any) -> CheckpointReader:  # noqa: A001 - mirrors the builtin on purpose
    """Open a committed checkpoint lazily (reads MANIFEST only)."""
    return CheckpointReader(path, **kwargs)


def load(
    path: Any,
    state: Any = None,
    *,
    part: str | None = None,
    data: Any = None,
    generators: Any = None,
    map_location: Any = None,
    restore_rng: bool = True,
    verify: bool = True,
    exactness: str = "warn",
    cast: bool = False,
    ledger: bool = True,
) -> "LoadResult":
    """Load a checkpoint into ``state`` in place (the resume path). All or nothing.

    Tensors are filled in their existing storage; a saved tensor whose target has
    another dtype or shape raises ``StateMismatchError`` naming the key and both
    (``cast=True`` converts a dtype difference; shapes must always match). Saved
    tensors with no target tensor are created fresh (moved with ``map_location``).
    Every check, and the hash of every chunk, happens before any target is written:
    after an error the targets are as they were (the one exception,
    ``CheckpointChangedError``, means a file was modified during the load). Modules
    whose ``state_dict()`` does not share their live storage are restored through
    ``load_state_dict``. RNG streams are restored last. ``exactness`` compares the
    saving environment with this one: ``strict`` refuses, ``warn`` names every
    difference, ``off`` skips the check.

    ``ledger``: when an optimizer step follows, this load is a resume, verified by the
    default step ledger (``ckpt.ledger.auto``; ``False`` leaves it out): the re-run steps
    are compared with what the run recorded before, and one line says the verdict.
    ``restore_rng=False`` holds the streams back: restore them with
    ``ckpt.rng.restore_rng(result.context["rng"])`` right before the first step.
    """
    from ._load import load_into

    reader = CheckpointReader(path)
    from .format.manifest import is_sharded

    if part is None and is_sharded(reader.manifest):
        # A sharded checkpoint (spec/sharded-format.md): DCP reshards onto this job's
        # shards, whatever the saving world size.
        from .dcp.integration import load_sharded

        return load_sharded(reader, state, data=data, generators=generators, restore_rng=restore_rng, verify=verify, exactness=exactness)
    if part is None and len(reader.parts) > 1:
        part = _default_part(reader)
    result = load_into(
        reader,
        state,
        part=part,
        data=data,
        generators=generators,
        map_location=map_location,
        restore_rng_state=restore_rng,
        verify=verify,
        exactness=exactness,
        cast=cast,
    )
    if ledger and part is None:
        from .ledger.auto import after_load

        after_load(path, state, result, restore_rng=restore_rng)
    return result


def _default_part(reader: CheckpointReader) -> str:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"rank-{rank:05d}"


_LAZY = {
    "begin": ("writer", "begin"),
    "write_part": ("writer", "write_part"),
    "commit": ("writer", "commit"),
    "abort": ("writer", "abort"),
    "PendingCheckpoint": ("writer", "PendingCheckpoint"),
    "LoadResult": ("_load", "LoadResult"),
    "CheckpointManager": ("manager", "CheckpointManager"),
    "RetentionPolicy": ("manager", "RetentionPolicy"),
    "apply_retention": ("manager", "apply_retention"),
    "list_checkpoints": ("manager", "list_checkpoints"),
    "checkpoint_name": ("manager", "checkpoint_name"),
    "latest": ("manager", "latest"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{mod}", __name__), attr)
        globals()[name] = value
        return value
    if name in ("errors", "data", "rng", "ledger", "diff", "guard", "stream"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
