"""Lightning checkpoints in the ckpt format: a ``CheckpointIO`` plugin and its RNG callback.

Usage (the lines a user adds)::

    from ckpt.integrations.lightning import CkptCheckpointIO

    io = CkptCheckpointIO()
    every = ModelCheckpoint(dirpath="runs/a", filename="step-{step:08d}", auto_insert_metric_name=False,
                            every_n_train_steps=50, save_top_k=-1)
    trainer = L.Trainer(plugins=[io], callbacks=[io.rng_callback, every])
    trainer.fit(model, loader, ckpt_path=newest)   # a path that ModelCheckpoint wrote

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
iterator (one base-seed draw) before any hook a callback can restore in. Not supported yet: ``ckpt_path="last"``/``"hpc"`` lookups (pass the path),
``storage_options``, async checkpointing, sharded strategies (FSDP/DeepSpeed), more than
one process.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback

from ..reader import CheckpointReader
from ..storage import commits_by_manifest, resolve

__all__ = ["CkptCheckpointIO"]


class _RestoreRNG(Callback):
    def __init__(self, io: CkptCheckpointIO) -> None:
        self._io = io

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
        #: add to ``Trainer(callbacks=[...])``: restores the saved RNG at the right moment
        self.rng_callback = _RestoreRNG(self)

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
             config=self.config, overwrite=True)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        from .._torchio import load_into

        target: dict[str, Any] = {"checkpoint": {}}
        result = load_into(CheckpointReader(os.fspath(path)), target, map_location=map_location,
                           restore_rng_state=False, exactness=self.exactness)
        rng = result.context.get("rng")
        self._pending_rng = (rng, result.path) if rng is not None else None
        checkpoint = target["checkpoint"]
        _mark_exhausted_loader_state(checkpoint)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        storage, p = resolve(path)
        if commits_by_manifest(storage):  # an object store: MANIFEST first, then the objects
            storage.remove_checkpoint(p)
        elif storage.isdir(p):
            storage.remove_tree(p)
