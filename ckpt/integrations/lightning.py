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
too (Lightning picks its ``last.ckpt``, damaged or not). An explicit path is loaded as given.

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
right after Lightning loaded the data loaders' states and before it creates their
iterator (Lightning has no hook in between; the callback wraps the fit loop's
``_load_combined_loader_states``): a restored ``StatefulDataLoader`` first builds the
iterator of its state (a base-seed draw the saved run never made, replaced by the saved
base seed), then the streams are restored, so that the next batches, read in the main
process, and, for a checkpoint taken after an epoch's last batch, the next epoch's fresh
iterator (whose base-seed draw the saved run did make) draw as in the saved run. A loader
without a state (none to load) gets the streams at the first ``on_train_epoch_start`` or
``on_train_batch_start``, whichever comes first.

Random augmentation: exact in the main process (``num_workers=0``), and in
``StatefulDataLoader`` workers when the dataset is wrapped in
``ckpt.integrations.stateful_data.WorkerRNG`` (a restored worker otherwise reseeds its
streams from the base seed: not exact mid-epoch); ``ckpt.data.ResumableLoader`` reseeds
per sample (exact).

The step ledger: ``io.rng_callback`` keeps one in ``<ModelCheckpoint dirpath>/ledger``
(``ckpt.ledger.Ledger``): per optimizer step the step's micro-batches, the sum of their
losses, the RNG streams and, every ``ledger_params_every`` steps, a parameter digest.
After a resume the re-executed steps are compared with the earlier records; an inexact
resume is reported in a ``ResumeVerificationWarning`` naming the first step that differs,
what differs and the likely cause (``verify_resume="strict"`` raises instead).

Exact (random-kill trials in fresh processes, ``tests/integrations/test_trainer_trials.py``):
model, optimizer, scheduler, loop state, data position (``StatefulDataLoader``,
``ResumableLoader``), RNG, with gradient accumulation, clipping, bf16 autocast, worker
processes, for checkpoints mid-epoch and after an epoch's last batch.

More than one process (``strategy="ddp"``; ``tests/integrations/test_trainer_multiproc.py``,
2 gloo processes, the whole job SIGKILLed): Lightning hands the checkpoint to the plugin on
rank 0 only, so ``io.rng_callback`` gathers every rank's RNG streams and data-loader states
into it (``on_save_checkpoint``, pickle-free byte collectives) and each rank restores its
own; each rank keeps its ledger in ``<dirpath>/ledger/rank-NNNNN``. A checkpoint saved by
another number of processes is refused with ``ResumeMismatchError`` (never called exact).
FSDP2: ``CkptModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` (a
``ModelParallelStrategy`` that saves full state dicts through this plugin and loads them
back onto the shards; N processes) resumes exactly in the 2-process trials, with either
loader. Lightning's default sizes (``"auto"``: one data-parallel group per node, tensor
parallelism within it) with a module sharded over the data-parallel mesh only make each
rank of a node train its own replica from its own batches; the full state dict would hold
rank 0's, so the first save refuses it (``StateMismatchError`` naming the parameter).
A ``StatefulDataLoader`` under more than one process: Lightning shards its sampler through
a ``DistributedSamplerWrapper`` that draws a new order at every ``iter()``; the callback
saves per rank the RNG streams the current order was drawn from and draws it again from
them while the restored iterator is built (``_sampler_order``), and after an epoch-end
checkpoint sets the next epoch on the sampler before Lightning builds that epoch's
iterator: exact mid-epoch and after an epoch's last batch. A resumed ``ModelCheckpoint``
does not save the step it resumed from again (it did, mid-accumulation, over the
checkpoint resumed from). Not supported yet: ``ckpt_path="hpc"``, ``storage_options``,
async checkpointing, DeepSpeed and Lightning's own ``FSDPStrategy``.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from ..errors import CkptError, ResumeMismatchError, StateMismatchError, UnsupportedValueError
from ..format.tree import TensorRef
from ..manager import ResumeFallbackWarning, warn_config_changed
from ..reader import CheckpointReader
from ..storage import resolve
from . import _sampler_order
from ._ranks import gather_to_all, refuse_world_change, world

__all__ = ["CkptCheckpointIO", "CkptModelCheckpoint", "CkptModelParallelStrategy"]

# the checkpoint-dict entry holding every rank's RNG streams and data-loader states
# (Lightning hands the checkpoint to the CheckpointIO on rank 0 only)
_RANKS = "ckpt_ranks"


class _RestoreRNG(Callback):
    """Restores the saved RNG at the point the saved run stood, and keeps the step ledger:
    one record per optimizer step (the step's micro-batches, the sum of their losses, the
    RNG streams, a periodic parameter digest); after a resume the re-executed steps are
    compared with what the ledger recorded before (``ResumeVerificationWarning`` naming the
    likely cause when they differ)."""

    def __init__(self, io: CkptCheckpointIO) -> None:
        self._io = io
        self._trainer: Callable[[], Any] = lambda: None
        self._batches: list[Any] = []
        self._losses: list[float] = []
        self._recorded = -1

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Lightning calls setup before it restores a checkpoint: the IO can then check
        # the checkpoint against the module before anything is loaded.
        self._io._module = weakref.ref(pl_module)
        self._trainer = weakref.ref(trainer)
        fit_loop = getattr(trainer, "fit_loop", None)
        load = getattr(fit_loop, "_load_combined_loader_states", None)
        if callable(load) and not getattr(load, "_ckpt_wrapped", False):
            fit_loop._load_combined_loader_states = self._wrap_loader_restore(fit_loop, load)

    def _wrap_loader_restore(self, fit_loop: Any, load: Callable[[], None]) -> Callable[[], None]:
        """Lightning loads the data loaders' states and at once creates their iterator (no
        hook in between). A ``StatefulDataLoader`` builds the iterator of a restored state
        with one base-seed draw from the global RNG that the saved run never made, and, for
        a state saved after an epoch's last batch, a fresh iterator for the next epoch right
        after it, whose draw the saved run did make. So once the states are loaded, the
        restored iterators are built (``state_dict()`` builds one) and the saved streams are
        restored: the next-epoch iterator, the main-process reads and the step all draw
        from the streams as the saved run did."""

        def load_then_restore() -> None:
            loaders = [] if fit_loop._combined_loader is None else list(fit_loop._combined_loader.flattened)
            # before any iter(): the orders a DistributedSamplerWrapper draws are recorded
            _sampler_order.install(loaders)
            loading = bool(fit_loop.restarting and fit_loop._combined_loader_states_to_load)
            load()
            orders, self._io._pending_orders = self._io._pending_orders, None
            if not loading or self._io._pending_rng is None:
                return
            from lightning.fabric.utilities.data import _set_sampler_epoch

            epoch = fit_loop.epoch_progress.current
            _sampler_order.pin(loaders, orders)
            try:
                for dl in loaders:
                    state = getattr(dl, "next_iter_state", None)
                    if isinstance(state, dict) and callable(getattr(dl, "state_dict", None)):
                        # the iterator is built before Lightning sets the samplers' epoch (a
                        # DistributedSampler's order depends on it): set it first, as Lightning will
                        _set_sampler_epoch(dl, epoch.processed)
                        dl.state_dict()
                        if state.get("_iterator_finished") is True and epoch.processed < epoch.started:
                            # saved after the epoch's last batch, before Lightning counted the
                            # epoch: it builds the next epoch's iterator right after this and
                            # only then counts the epoch and sets the samplers' epoch
                            _set_sampler_epoch(dl, epoch.processed + 1)
            finally:
                # the next epoch's draws continue from where the saved order left them
                _sampler_order.unpin(loaders)
            self._restore()

        load_then_restore._ckpt_wrapped = True  # type: ignore[attr-defined]
        return load_then_restore

    def _ledger(self) -> Any:
        """The ledger of the run directory (the ``ModelCheckpoint``'s), made at first need."""
        io, trainer = self._io, self._trainer()
        if io.ledger is None and io.ledger_enabled and trainer is not None:
            directory = getattr(getattr(trainer, "checkpoint_callback", None), "dirpath", None)
            if directory is None:
                return None  # no ModelCheckpoint: no run directory to keep a ledger in
            from ..ledger import Ledger

            ledger_dir = os.path.join(os.fspath(directory), "ledger")
            rank, size = world()
            if size > 1:  # one tape directory per rank, as CheckpointManager keeps them
                ledger_dir = os.path.join(ledger_dir, f"rank-{rank:05d}")
            io.ledger = Ledger(ledger_dir, params=trainer.lightning_module,
                               params_every=io.ledger_params_every, verify=io.verify_resume)  # type: ignore[arg-type]
        return io.ledger

    def _restore(self) -> None:
        from ..context.rng import restore_rng

        pending, self._io._pending_rng = self._io._pending_rng, None
        if pending is not None:
            rng, path, step = pending
            restore_rng(rng, None, path=path)
            ledger = self._ledger()
            if ledger is not None:
                ledger.resumed(step, source=os.path.basename(path))
            self._recorded = step

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Every rank builds the checkpoint dict; only rank 0's reaches the CheckpointIO.
        # Each rank's RNG streams and data-loader states (its own shard, its own
        # workers' streams) travel to it here, so that each rank resumes its own.
        rank, size = world()
        if size <= 1:
            return
        from ..context.rng import capture_rng

        fit = (checkpoint.get("loops") or {}).get("fit_loop")
        loaders = (fit.get("state_dict") or {}).get("combined_loader") if isinstance(fit, dict) else None
        combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
        # the streams each rank's DistributedSamplerWrapper drew its current order from
        orders = _sampler_order.saved_orders([] if combined is None else combined.flattened)
        checkpoint[_RANKS] = {"world_size": size,
                              "ranks": gather_to_all({"rng": capture_rng(), "loaders": loaders, "orders": orders})}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # the loops are restored by now: the last step a record exists for (or 0)
        self._recorded = int(trainer.global_step)
        self._batches, self._losses = [], []
        # A ModelCheckpoint forgets, in a fresh process, the step it saved last: with gradient
        # accumulation, the first resumed micro-batch ends with global_step still at the step
        # resumed from, and every_n_train_steps saved that step again, over the checkpoint
        # resumed from, mid-accumulation (that micro-batch's gradient not in it): a second
        # kill before the next save then resumed inexactly (measured, 1 and 2 processes).
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            if isinstance(callback, ModelCheckpoint) and hasattr(callback, "_last_global_step_saved"):
                callback._last_global_step_saved = max(int(callback._last_global_step_saved), self._recorded)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._restore()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._restore()
        ledger = self._io.ledger
        if ledger is not None and self._recorded >= 0:
            ledger.step_done(self._recorded)  # after the step and its save: where a harness kills

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batches.append(batch)
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(float(loss.detach().double().item()))
        step = int(trainer.global_step)
        if step == self._recorded:
            return  # mid-accumulation: the optimizer step is not done
        ledger = self._ledger()
        if ledger is not None:
            ledger.step(step, batch=self._batches, loss=sum(self._losses) if self._losses else None, done=False)
        self._batches, self._losses, self._recorded = [], [], step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        ledger, self._io.ledger = self._io.ledger, None
        if ledger is not None:
            ledger.close()


def checkpoint_step(target: Mapping[str, Any]) -> int | None:
    step = (target.get("checkpoint") or {}).get("global_step")
    return step if isinstance(step, int) else None


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
    ``exactness`` (``"warn"``, ``"strict"``, ``"off"``: environment check on load),
    ``ledger`` (keep the step ledger in ``<checkpoint directory>/ledger``, default True),
    ``ledger_params_every`` (a parameter digest every N steps), ``verify_resume``
    (``"warn"``, ``"strict"``, ``"off"``: what an inexact resume does).
    """

    def __init__(self, *, config: Any = None, exactness: str = "warn", ledger: bool = True,
                 ledger_params_every: int = 10, verify_resume: str = "warn") -> None:
        super().__init__()
        self.config = config
        self.exactness = exactness
        self.ledger_enabled = ledger
        self.ledger_params_every = ledger_params_every
        self.verify_resume = verify_resume
        #: the step ledger of this fit (``ckpt.ledger.Ledger``), once training started
        self.ledger: Any = None
        self._pending_rng: tuple[Any, str, int] | None = None
        # this rank's sampler-order streams (``_sampler_order``), until the loaders are restored
        self._pending_orders: Any = None
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
        _, size = world()
        if size > 1 and _RANKS not in checkpoint:
            raise UnsupportedValueError(
                f"CkptCheckpointIO under {size} processes needs io.rng_callback in Trainer(callbacks=[...]): only rank 0 "
                "saves, and the callback brings it the other ranks' RNG streams and data-loader states",
                path=os.fspath(path),
            )
        # RNG is captured now, at Lightning's save point (after the optimizer step); under
        # more than one process, rank 0 alone writes (every rank's streams are in _RANKS).
        save(os.fspath(path), {"checkpoint": checkpoint}, step=step if isinstance(step, int) else None,
             config=self._config(checkpoint), overwrite=True, this_rank_only=size > 1)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        from .._load import load_into

        reader = CheckpointReader(os.fspath(path))
        module = self._module()
        if module is not None:
            _check_fits(reader, module)
        target: dict[str, Any] = {"checkpoint": {}}
        result = load_into(reader, target, map_location=map_location,
                           restore_rng_state=False, exactness=self.exactness)
        warn_config_changed(result.path, result.context, self._config(), stacklevel=2)
        rng = result.context.get("rng")
        step = result.step if isinstance(result.step, int) else int(checkpoint_step(target) or 0)
        checkpoint = target["checkpoint"]
        rng, self._pending_orders = _this_rank(checkpoint, rng, result.path)
        self._pending_rng = (rng, result.path, step) if rng is not None else None
        _mark_exhausted_loader_state(checkpoint)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        storage, p = resolve(path)
        if storage.isdir(p):  # never torn: renamed away first, or MANIFEST first on an object store
            storage.commit.remove_checkpoints(os.path.dirname(p), [p], durable=False)


def _this_rank(checkpoint: dict[str, Any], rng: Any, path: str) -> tuple[Any, Any]:
    """Put this rank's data-loader states in the loop state and return its RNG streams
    and sampler-order streams (every rank reads the one checkpoint rank 0 wrote; None
    under one process). Another world size is refused."""
    ranks = checkpoint.pop(_RANKS, None)
    rank, size = world()
    saved = int(ranks["world_size"]) if isinstance(ranks, dict) else 1
    refuse_world_change(path, saved, size, how=(
        "Resume with the number of processes (devices x num_nodes) it was saved with, or train this world in "
        "another directory."))
    if not isinstance(ranks, dict):
        return rng, None
    mine = ranks["ranks"][rank]
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if mine.get("loaders") is not None and isinstance(fit, dict) and isinstance(fit.get("state_dict"), dict):
        fit["state_dict"]["combined_loader"] = mine["loaders"]
    return mine["rng"], mine.get("orders")


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


class CkptModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel on DTensors) whose
    checkpoints go through ``CkptCheckpointIO``.

    Lightning's strategy writes DCP shards with ``torch.save`` metadata by default and
    loads without its ``CheckpointIO``. This one saves full state dicts (Lightning
    gathers them: ``save_distributed_checkpoint=False``) through the plugin on rank 0,
    every rank's RNG and loader states included (``io.rng_callback``), and loads a ckpt
    checkpoint through the plugin on every rank, then scatters the weights and the
    optimizer state onto this job's shards as Lightning does for a full checkpoint.

    For FSDP2 over every process give the sizes: ``data_parallel_size=<processes>,
    tensor_parallel_size=1`` (exact in 2-process random-kill trials on CPU/gloo). Lightning's
    ``"auto"`` sizes are one data-parallel group per node and tensor parallelism within it:
    parameters sharded over the data-parallel mesh only are then replicated across a node's
    ranks with nothing keeping the copies equal, and a save that finds them different is
    refused (``StateMismatchError``) rather than writing rank 0's copy as everyone's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.pop("save_distributed_checkpoint", False):
            raise ValueError("CkptModelParallelStrategy saves full state dicts through CkptCheckpointIO "
                             "(save_distributed_checkpoint=True is Lightning's own DCP format)")
        super().__init__(*args, save_distributed_checkpoint=False, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # ModelParallelStrategy refuses a path that is a directory, which every ckpt
        # checkpoint is (Lightning saves a step again after a resume): the plugin, on
        # rank 0, replaces it atomically
        path = self.broadcast(filepath)
        assert self.model is not None
        _refuse_independent_replicas(self.model, self.world_size, os.fspath(path))
        super(ModelParallelStrategy, self).save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        path = os.fspath(self.broadcast(checkpoint_path))
        if not os.path.isfile(os.path.join(path, "MANIFEST")):
            return super().load_checkpoint(path, weights_only=weights_only)
        from lightning.fabric.strategies.model_parallel import (
            _load_raw_module_state,
            _rekey_optimizer_state_if_needed,
        )
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        checkpoint = self.checkpoint_io.load_checkpoint(path)
        assert self.lightning_module is not None and self.model is not None
        strict = self.lightning_module.strict_loading
        _load_raw_module_state(checkpoint.pop("state_dict"), self.model, world_size=self.world_size, strict=strict)
        options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=strict)
        for i, optimizer in enumerate(self.optimizers):
            state = _rekey_optimizer_state_if_needed(checkpoint["optimizer_states"][i], self.model)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)
        return checkpoint


def _mesh_coordinate(p: Any) -> tuple[int, list[int]]:
    """The size of the mesh a parameter is spread over (1 for a plain tensor) and this
    rank's coordinate on it."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not callable(getattr(p, "to_local", None)):
        return 1, []
    return int(mesh.size()), list(mesh.get_coordinate() or [])


def _refuse_independent_replicas(model: torch.nn.Module, world_size: int, path: str) -> None:
    """Refuse a full-state-dict save that would hold one rank's copy of state that other
    ranks hold differently.

    A parameter spread over a mesh smaller than the world (a plain tensor, or a DTensor
    on the data-parallel mesh while the tensor-parallel dimension holds more than one
    rank, as Lightning's ``"auto"`` sizes give on one node) is replicated on the ranks
    outside its mesh, and nothing keeps those copies equal but identical inputs. The full
    state dict is gathered on rank 0's copy, so a rank whose copy differs would resume
    from another rank's weights: not exact, and silently so. A collective (every rank
    saves); only run when such a parameter exists, so FSDP2 over the whole world and
    2-D meshes pay nothing."""
    if world_size <= 1:
        return
    narrow = [(name, p) for name, p in model.named_parameters() if _mesh_coordinate(p)[0] < world_size]
    if not narrow:
        return
    from ..context.digest import tensor_digest

    mine = {name: [_mesh_coordinate(p)[1], tensor_digest(p)] for name, p in narrow}
    everyone = gather_to_all(mine)
    for name in mine:
        first: dict[tuple[int, ...], int] = {}
        for rank, record in enumerate(everyone):
            coordinate, digest = tuple(record[name][0]), record[name][1]
            seen = first.setdefault(coordinate, rank)
            if everyone[seen][name][1] != digest:
                size = _mesh_coordinate(dict(narrow)[name])[0]
                raise StateMismatchError(
                    f"cannot save {path}: rank {rank} holds another {name!r} than rank {seen}, although the parameter "
                    f"is spread over {size} of the {world_size} processes, so each holds a full copy of its shard: "
                    "the ranks train independent replicas and the checkpoint would hold only one of them. For FSDP2 "
                    f"over every process use CkptModelParallelStrategy(data_parallel_size={world_size}, "
                    "tensor_parallel_size=1) (Lightning's 'auto' sizes make one data-parallel group per node); with "
                    "tensor parallelism, give every rank of a tensor-parallel group the same batches",
                    path=path, key=name, ranks=[seen, rank], mesh_size=size, world_size=world_size,
                )
