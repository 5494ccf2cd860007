"""Lightning checkpoints in the ckpt format: a ``CheckpointIO`` plugin and its RNG callback.

Usage (the lines a user adds)::

    from ckpt.integrations.lightning import CkptCheckpointIO, CkptModelCheckpoint

    io = CkptCheckpointIO()
    every = CkptModelCheckpoint(dirpath="runs/a", every_n_train_steps=50, save_top_k=-1)
    trainer = L.Trainer(plugins=[io], callbacks=[io.rng_callback, every])
    trainer.fit(model, loader, ckpt_path="last")   # the newest checkpoint in runs/a that verifies

``ckpt_path="last"``: Lightning asks each ``ModelCheckpoint`` for its "last" checkpoints
(files named ``last*.ckpt``, which exist only with ``save_last``). ``CkptModelCheckpoint``
(a ``ModelCheckpoint`` whose default file name is ``step-{step:08d}``) answers with the
newest checkpoint of its directory that verifies, by step, falling back past damaged ones
(each named in a ``ResumeFallbackWarning``), as ``CheckpointManager.resume()`` does; with
none, Lightning starts afresh. A plain ``ModelCheckpoint`` with ``save_last=True`` works
too (Lightning picks its ``last.ckpt``, damaged or not). Any path works as before.

Resume refusals: with ``io.rng_callback`` in the callbacks, a checkpoint whose weights do
not fit the module (another shape; a missing or unexpected key under ``strict_loading``)
is refused with ``ResumeMismatchError`` naming the key, both shapes and the checkpoint,
before anything is loaded; the run's checkpoints are untouched (Lightning would otherwise
raise its own ``load_state_dict`` error). A config other than the checkpoint's (``config=``,
by default the module's ``hparams``) is named in one ``ConfigChangedWarning``.

Every checkpoint Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) becomes
a ckpt checkpoint directory at the path Lightning chose: the whole checkpoint dict
(weights, optimizer and scheduler states, loop progress, callback states, hparams,
the ``StatefulDataLoader`` position Lightning puts in the loop state) as a pickle-free
tree, plus the RNG streams (Python, numpy, torch CPU, CUDA) of the saving process, which
Lightning itself does not save. Loading reads it back verified.

Why a callback too: Lightning loads the checkpoint before it creates the data iterator,
and creating it draws from the global RNG. ``io.rng_callback`` restores the saved streams
at the first ``on_train_epoch_start`` or ``on_train_batch_start`` after a load, whichever
comes first: resumed mid-epoch, Lightning skips the epoch-start hook and the iterator
exists by the first batch, which is where the saved run stood; resumed at an epoch
boundary, the next epoch's iterator is created after its epoch-start hook, as in the
saved run.

Checkpoint names may hold only ``A-Z a-z 0-9 . _ -`` (Lightning's default
``epoch=0-step=5.ckpt`` has ``=``): give ``ModelCheckpoint`` a filename as above.

Exact (tested in fresh processes): model, optimizer, scheduler, loop state, data position
(``torchdata.stateful_dataloader.StatefulDataLoader``), RNG, for a checkpoint taken
mid-epoch. Not exact yet: a checkpoint taken at the last batch of an epoch. The epoch
count and the data order are right (the exhausted loader state is marked finished on
load), but the global torch RNG ends one draw short: Lightning creates the next epoch's
iterator (one base-seed draw) before any hook a callback can restore in. Not supported yet: ``ckpt_path="hpc"``,
``storage_options``, async checkpointing, sharded strategies (FSDP/DeepSpeed), more than
one process.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ..errors import CkptError, ResumeMismatchError, UnsupportedValueError
from ..format.tree import TensorRef
from ..manager import ResumeFallbackWarning, warn_config_changed
from ..reader import CheckpointReader
from ..storage import resolve

__all__ = ["CkptCheckpointIO", "CkptModelCheckpoint"]


class _RestoreRNG(Callback):
    def __init__(self, io: CkptCheckpointIO) -> None:
        self._io = io

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Lightning calls setup before it restores a checkpoint: the IO can then check
        # the checkpoint against the module before anything is loaded.
        self._io._module = weakref.ref(pl_module)

    def _restore(self) -> None:
        from ..context.rng import restore_rng

        pending, self._io._pending_rng = self._io._pending_rng, None
        if pending is not None:
            rng, path = pending
            restore_rng(rng, None, path=path)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._restore()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._restore()


def _mark_exhausted_loader_state(checkpoint: dict[str, Any]) -> bool:
    """Mark the data-loader state of a checkpoint taken at the last batch of an epoch as
    finished.

    Lightning's prefetching fetcher has not seen ``StopIteration`` when it saves after the
    epoch's last batch, so a ``StatefulDataLoader`` state says "all batches yielded" but
    not "finished". Restored as is, the next iterator replays the empty remainder and
    Lightning counts one extra, empty epoch. Marked finished, the next iterator starts the
    next epoch with the sampler's generator continued, as in the saved run.
    """
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not isinstance(fit, dict):
        return False
    progress = fit.get("epoch_loop.batch_progress")
    states = (fit.get("state_dict") or {}).get("combined_loader")
    if not (isinstance(progress, dict) and progress.get("is_last_batch") and isinstance(states, list) and states):
        return False
    if all(isinstance(s, dict) and "_iterator_finished" in s for s in states):
        for s in states:
            s["_iterator_finished"] = True
        return True
    return False


class CkptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` writing and reading ckpt checkpoints.

    Options (keyword-only): ``config`` (recorded with its hash in every checkpoint),
    ``exactness`` (``"warn"``, ``"strict"``, ``"off"``: environment check on load).
    """

    def __init__(self, *, config: Any = None, exactness: str = "warn") -> None:
        super().__init__()
        self.config = config
        self.exactness = exactness
        self._pending_rng: tuple[Any, str] | None = None
        self._module: Callable[[], Any] = lambda: None  # the LightningModule, once set up
        #: add to ``Trainer(callbacks=[...])``: restores the saved RNG at the right moment
        self.rng_callback = _RestoreRNG(self)

    def _config(self, checkpoint: Mapping[str, Any] | None = None) -> Any:
        """``config=``, else the module's hparams (Lightning's record of the run's config)
        when they have a canonical form (a module passed as an hparam has none)."""
        if self.config is not None:
            return self.config
        if checkpoint is not None:
            hp = checkpoint.get("hyper_parameters")
        else:
            module = self._module()
            hp = dict(module.hparams) if module is not None and getattr(module, "hparams", None) else None
        if not hp:
            return None
        from ..context.config import canonicalize

        try:
            canonicalize(hp)
        except UnsupportedValueError:
            return None
        return hp

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"CkptCheckpointIO does not support storage_options (got {storage_options!r})")
        from ..errors import UnsafePathError
        from ..format.manifest import check_name
        from ..writer import save

        try:
            check_name(os.path.basename(os.fspath(path)), what="checkpoint directory")
        except UnsafePathError:
            raise UnsafePathError(
                f"checkpoint name {os.path.basename(os.fspath(path))!r} has characters the ckpt format does not allow "
                "in a name (only A-Z a-z 0-9 . _ -): use ModelCheckpoint(filename='step-{step:08d}', "
                "auto_insert_metric_name=False)",
                path=os.fspath(path),
            ) from None
        step = checkpoint.get("global_step")
        # RNG is captured now, at Lightning's save point (after the optimizer step).
        save(os.fspath(path), {"checkpoint": checkpoint}, step=step if isinstance(step, int) else None,
             config=self._config(checkpoint), overwrite=True)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        from .._torchio import load_into

        reader = CheckpointReader(os.fspath(path))
        module = self._module()
        if module is not None:
            _check_fits(reader, module)
        target: dict[str, Any] = {"checkpoint": {}}
        result = load_into(reader, target, map_location=map_location,
                           restore_rng_state=False, exactness=self.exactness)
        warn_config_changed(result.path, result.context, self._config(), stacklevel=2)
        rng = result.context.get("rng")
        self._pending_rng = (rng, result.path) if rng is not None else None
        checkpoint = target["checkpoint"]
        _mark_exhausted_loader_state(checkpoint)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        storage, p = resolve(path)
        if storage.isdir(p):  # never torn: renamed away first, or MANIFEST first on an object store
            storage.commit.remove_checkpoints(os.path.dirname(p), [p], durable=False)


def _check_fits(reader: CheckpointReader, module: Any) -> None:
    """Refuse, before anything is loaded, a checkpoint whose weights do not fit ``module``:
    a shape or dtype torch's ``load_state_dict`` would refuse after the whole load, and,
    under ``strict_loading``, a missing or unexpected key. Reads only the structure file."""
    saved = reader.tree()["state"].get("checkpoint")
    weights = saved.get("state_dict") if isinstance(saved, dict) else None
    if not isinstance(weights, dict):
        return  # not a Lightning checkpoint of a module: Lightning says so itself
    entries = {t.key: t for t in reader.part().tensors}
    live = module.state_dict()
    where = "checkpoint/state_dict"
    for key, ref in weights.items():
        cur = live.get(key)
        entry = entries.get(ref.key) if isinstance(ref, TensorRef) else None
        if entry is None or not isinstance(cur, torch.Tensor):
            continue
        if tuple(cur.shape) != tuple(entry.shape):
            raise ResumeMismatchError(
                f"cannot resume from {reader.path}: {key!r} is {entry.dtype}{list(entry.shape)} in the checkpoint, "
                f"{str(cur.dtype).replace('torch.', '')}{list(cur.shape)} in {type(module).__name__}: the module does "
                "not fit this checkpoint (another shape). Nothing was loaded and the run's checkpoints are untouched; "
                "build the module the run was saved with, or train the new one in another directory",
                path=reader.path, key=f"{where}/{key}", saved_shape=list(entry.shape), target_shape=list(cur.shape),
                saved_dtype=entry.dtype, target_dtype=str(cur.dtype),
            )
    if getattr(module, "strict_loading", True):
        missing, unexpected = sorted(set(live) - set(weights)), sorted(set(weights) - set(live))
        if missing or unexpected:
            raise ResumeMismatchError(
                f"cannot resume from {reader.path}: {type(module).__name__} does not fit this checkpoint: missing "
                f"{missing[:10]}, unexpected {unexpected[:10]}. Nothing was loaded and the run's checkpoints are "
                "untouched; build the module the run was saved with, or train the new one in another directory",
                path=reader.path, key=f"{where}/{(missing or unexpected)[0]}",
            )


def _newest_valid(paths: Iterable[str]) -> str | None:
    """The newest of these checkpoint directories (by saved step, then modification
    time) that verifies; damaged ones are skipped, each in a ``ResumeFallbackWarning``."""
    found: list[tuple[int, float, str]] = []
    for p in paths:
        if not os.path.isfile(os.path.join(p, "MANIFEST")):
            continue
        try:
            reader = CheckpointReader(p)
            step = reader.step if reader.step is not None else -1
            found.append((int(step), os.stat(p).st_mtime, p))
        except (CkptError, OSError) as e:
            warnings.warn(f"skipping {p}: {type(e).__name__}: {e}", ResumeFallbackWarning, stacklevel=3)
    for _, _, p in sorted(found, reverse=True):
        try:
            CheckpointReader(p).verify()
        except (CkptError, OSError) as e:
            warnings.warn(f"skipping {p}: {type(e).__name__}: {e}", ResumeFallbackWarning, stacklevel=3)
            continue
        return p
    return None


class CkptModelCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` for ``CkptCheckpointIO``: file names ``step-{step:08d}`` by
    default (characters the ckpt format allows), and ``trainer.fit(ckpt_path="last")``
    resumes from the newest checkpoint of its directory that verifies (by step; damaged
    ones are skipped with a ``ResumeFallbackWarning``; none: a fresh start)."""

    def __init__(self, *args: Any, filename: str | None = "step-{step:08d}", auto_insert_metric_name: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, filename=filename, auto_insert_metric_name=auto_insert_metric_name, **kwargs)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        # Lightning's hook for ckpt_path="last" (it picks the newest of what every
        # ModelCheckpoint returns). The directory is resolved as ModelCheckpoint does
        # (before setup, dirpath may still be unresolved).
        directory = self.dirpath if self.dirpath is not None else self._ModelCheckpoint__resolve_ckpt_dir(trainer)
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            return set()
        found = _newest_valid(os.path.join(directory, n) for n in sorted(os.listdir(directory)))
        return {os.path.normpath(found)} if found is not None else set()
