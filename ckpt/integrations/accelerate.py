"""``Accelerator.save_state``/``load_state`` in the ckpt format (no pickle).

Usage::

    from ckpt.integrations.accelerate import CkptAccelerator   # instead of accelerate.Accelerator

    acc = CkptAccelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    acc.register_for_checkpointing(counters)
    ...
    acc.ledger_step(step, batch=micro_batches, loss=loss)      # after each optimizer step (the ledger)
    acc.save_state("runs/a/step-00000100", step=100)          # at an optimizer-step boundary
    ...
    res = acc.load_state("runs/a/step-00000100", defer_rng=True)
    it = acc.resumed_iter(loader, res)   # the RNG is restored where the saved run stood

Or call the functions ``save_state(accelerator, path)`` / ``load_state(accelerator, path)``
on a plain ``Accelerator``. Accelerate's own ``save_state`` writes optimizer, scheduler,
sampler, RNG and registered objects with ``torch.save``/pickle; these write one ckpt
checkpoint holding:

* every prepared model (``model_0``...), optimizer (``optimizer_0``...), scheduler,
  the grad scaler when there is one;
* every prepared dataloader that has ``state_dict()`` (``dataloader_0``...: a
  ``StatefulDataLoader`` under ``use_stateful_dataloader=True``); a prepared dataloader
  without one is refused, since its position would silently be lost;
* every object given to ``register_for_checkpointing`` (``custom_0``...);
* ``accelerator.step`` (the gradient-accumulation counter), RNG (Python, numpy, torch
  CPU, CUDA), config hash, environment, as every ckpt checkpoint.

Exact (random-kill trials in fresh processes, ``tests/integrations/test_trainer_trials.py``)
with a prepared ``StatefulDataLoader`` (mid-epoch and after an epoch's last batch; random
augmentation in workers or in the main process with the dataset wrapped in
``ckpt.integrations.stateful_data.WorkerRNG``)
or a registered ``ckpt.data.ResumableLoader``,
with ``accumulate``, clipping, bf16 autocast. Resume through ``resumed_iter``. Not exact:
random augmentation in the main process (``num_workers=0``) drawing from the global RNG
(without ``WorkerRNG``) with a prepared
``StatefulDataLoader`` resumed mid-epoch: Accelerate's ``DataLoaderShard`` fetches one
batch ahead, so the saved run drew the next batch's augmentation before the step's own
draws, and the checkpoint holds the position before that batch (the ledger reports it). The run
directory keeps the step ledger (``CkptAccelerator``: ``ledger_step`` per optimizer step).

A checkpoint that does not fit the prepared objects (a model of another shape, a missing
entry) is refused by ``load_state`` with ``ResumeMismatchError`` (key, both shapes,
checkpoint) before anything is written; ``save_state`` never replaces a checkpoint unless
``overwrite=True``. Pass the run's config to both (``config=``): ``load_state`` names what
changed in one ``ConfigChangedWarning``.

More than one process (data parallel: ``MULTI_CPU``, ``MULTI_GPU``...; every rank calls
``save_state``/``load_state``): each rank writes its own part (its RNG streams, data-loader
position, registered objects, ``accelerator.step``); models, optimizers and schedulers,
identical on every rank, are written once by rank 0. Exact in 2-process random-kill trials
under ``torchrun`` (``tests/integrations/test_trainer_multiproc.py``, the whole job SIGKILLed),
a prepared ``StatefulDataLoader`` included, mid-epoch and after an epoch's last batch:
Accelerate shards its batch sampler (``BatchSamplerShard``), so the loader's state lacks
torchdata's ``RandomSampler`` generator; each rank's ``dataloader_N`` entry keeps the
generator's state from before the current iterator drew its permutation
(``_sampler_order``), and the first iterator built after the load starts from it.
Each rank keeps its ledger in ``<run directory>/ledger/rank-NNNNN``. A checkpoint saved by
another number of processes is refused with ``ResumeMismatchError`` (never called exact).

Not supported yet: DeepSpeed/FSDP/Megatron plugins (and on CPU Accelerate drops an FSDP plugin:
it enables FSDP only for GPU-like distributed types, so a CPU run is plain DDP), XLA/NPU/MPS RNG.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator

from ..errors import ResumeMismatchError, StateMismatchError, UnsupportedValueError
from ..reader import CheckpointReader
from . import _sampler_order

__all__ = ["CkptAccelerator", "save_state", "load_state", "restore_rng", "resumed_iter"]


def _inner(obj: Any, attr: str) -> Any:
    # AcceleratedOptimizer.optimizer / AcceleratedScheduler.scheduler: the torch objects
    return getattr(obj, attr, obj)


# distributed types whose prepared model and optimizer are the same on every rank (DDP)
_DATA_PARALLEL = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                  "MULTI_HPU")


# the key of the order generator's state in a prepared loader's saved state
_ORDER = "ckpt_order_generator"


class _LoaderWithOrder:
    """A prepared loader's state plus the state its sampler's generator had before the
    current iterator drew its order (``_sampler_order``: under more than one process
    Accelerate's ``BatchSamplerShard`` hides that generator from the loader's own state).
    Loaded, the next iterator built starts from it."""

    def __init__(self, loader: Any, draws: _sampler_order.IteratorDraws) -> None:
        self._loader = loader
        self._draws = draws

    def state_dict(self) -> dict[str, Any]:
        state = self._loader.state_dict()
        if self._draws.before is None or not isinstance(state, dict):
            return state
        return {**state, _ORDER: self._draws.before}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = state.pop(_ORDER, None)  # absent from checkpoints of earlier versions
        self._loader.load_state_dict(state)
        if isinstance(saved, torch.Tensor):
            self._draws.pinned = saved


def _state(acc: Accelerator) -> dict[str, Any]:
    kind = acc.state.distributed_type.value
    if kind not in _DATA_PARALLEL:
        raise NotImplementedError(f"ckpt.integrations.accelerate does not support {kind} yet (data parallel only)")
    state: dict[str, Any] = {}
    for i, m in enumerate(acc._models):
        state[f"model_{i}"] = acc.unwrap_model(m)
    for i, o in enumerate(acc._optimizers):
        state[f"optimizer_{i}"] = _inner(o, "optimizer")
    for i, s in enumerate(acc._schedulers):
        state[f"scheduler_{i}"] = _inner(s, "scheduler")
    for i, d in enumerate(acc._dataloaders):
        # Accelerate's DataLoaderShard always has state_dict(); it works only when it
        # wraps a StatefulDataLoader (use_stateful_dataloader=True).
        stateful = getattr(d, "use_stateful_dataloader", True) is not False
        if not (stateful and callable(getattr(d, "state_dict", None)) and callable(getattr(d, "load_state_dict", None))):
            raise UnsupportedValueError(
                f"prepared dataloader {i} ({type(d).__name__}) has no state_dict(): its position cannot be saved. "
                "Use Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))",
                key=f"dataloader_{i}",
            )
        draws = _sampler_order.record_iterators(d)
        state[f"dataloader_{i}"] = d if draws is None else _LoaderWithOrder(d, draws)
    for i, c in enumerate(acc._custom_objects):
        state[f"custom_{i}"] = c
    if acc.scaler is not None:
        state["scaler"] = acc.scaler
    state["accelerator"] = {"step": int(acc.step)}
    return state


def save_state(accelerator: Accelerator, path: str | os.PathLike[str], *, step: int | None = None,
               config: Any = None, overwrite: bool = False) -> Any:
    """Write everything ``accelerator`` tracks to one ckpt checkpoint at ``path``.

    Call it at an optimizer-step boundary (after ``optimizer.step()`` and
    ``scheduler.step()``, outside gradient accumulation). Returns ``CheckpointInfo``.
    """
    from ..writer import save

    state = _state(accelerator)
    if accelerator.num_processes > 1:
        return _save_collective(accelerator, path, state, step=step, config=config, overwrite=overwrite)
    return save(path, state, step=step, config=config, overwrite=overwrite)


def _checkpointer(accelerator: Accelerator) -> Any:
    """The accelerator's ``DistributedCheckpointer`` (its own gloo group), made at the first
    save or load: every rank calls those at the same point of the program."""
    from ..distributed import DistributedCheckpointer

    cp = getattr(accelerator, "_ckpt_checkpointer", None)
    if cp is None:
        cp = DistributedCheckpointer()
        accelerator._ckpt_checkpointer = cp  # type: ignore[attr-defined]
    return cp


def _save_collective(accelerator: Accelerator, path: str | os.PathLike[str], state: dict[str, Any], *,
                     step: int | None, config: Any, overwrite: bool) -> Any:
    """Every rank writes its part (its RNG streams, data-loader position, counters);
    models, optimizers and schedulers, identical on every rank under data parallelism,
    are written once, by rank 0. Returns ``CheckpointInfo`` on every rank."""
    from ..writer import CheckpointInfo

    replicated = [k for k in state if k.startswith(("model_", "optimizer_", "scheduler_"))]
    cp = _checkpointer(accelerator)
    manifest = cp.save(path, state, replicated=replicated, step=step, config=config, overwrite=overwrite)
    mid = cp.broadcast_bytes(manifest.id.encode() if manifest is not None else None).decode()
    return CheckpointInfo(os.fspath(path), mid, step, manifest.total_bytes if manifest is not None else 0, manifest)


def load_state(accelerator: Accelerator, path: str | os.PathLike[str], *, defer_rng: bool = False,
               exactness: str = "warn", config: Any = None) -> Any:
    """Load a checkpoint written by :func:`save_state` into the prepared objects, in place.

    RNG streams are restored last; with ``defer_rng=True`` they are not, and
    :func:`restore_rng` puts them back (call it right after creating the dataloader
    iterator, which draws from the RNG). Returns the ``LoadResult``. A checkpoint that
    does not fit the prepared objects raises ``ResumeMismatchError`` (nothing written);
    ``config``, the resuming run's, is compared with the saved one (``ConfigChangedWarning``).
    """
    from .._load import load_into
    from ..manager import warn_config_changed

    from ..writer import part_name_for_rank
    from ._ranks import refuse_world_change

    state = _state(accelerator)
    counters = state["accelerator"]
    reader = CheckpointReader(path)
    refuse_world_change(reader.path, len(reader.parts), accelerator.num_processes, how=(
        "Launch it with the number of processes it was saved with, or train this world in another directory."))
    try:
        result = load_into(reader, state, part=part_name_for_rank(accelerator.process_index),
                           restore_rng_state=not defer_rng, exactness=exactness)
    except StateMismatchError as e:
        if isinstance(e, ResumeMismatchError):
            raise
        raise ResumeMismatchError(
            f"cannot resume from {reader.path}: the prepared objects do not fit this checkpoint: {e.message}. "
            "Nothing was loaded; build the model the run was saved with, or save the new one elsewhere",
            path=e.path or reader.path, key=e.key, **e.context,
        ) from e
    accelerator.step = int(counters["step"])
    warn_config_changed(result.path, result.context, config, stacklevel=3)
    return result


def restore_rng(result: Any) -> list[str]:
    """Restore the RNG streams of a ``load_state(..., defer_rng=True)`` result."""
    from ..context.rng import restore_rng as _restore

    return _restore(result.context["rng"], None, path=result.path)


def _restored_stateful(loader: Any) -> Any:
    """The ``StatefulDataLoader`` under ``loader`` (prepared or not) holding a restored state
    its next iterator will start from, else None."""
    base = getattr(loader, "base_dataloader", loader)
    if isinstance(getattr(base, "next_iter_state", None), dict) and callable(getattr(base, "state_dict", None)):
        return base
    return None


def resumed_iter(loader: Any, result: Any) -> Iterator[Any]:
    """Iterate ``loader`` from its restored position with the RNG of ``load_state(...,
    defer_rng=True)`` restored at the point the saved run stood.

    A ``StatefulDataLoader`` (prepared or not) builds the iterator of a restored state with
    one base-seed draw from the global RNG, which the restored base seed then replaces;
    the saved run made no such draw. Mid-epoch the next batches are then read (in the main
    process with ``num_workers=0``, drawing from the global RNG). Saved right after the
    last batch of an epoch, the restored iterator is finished and ``iter()`` builds a
    fresh one for the next epoch at once, drawing its base seed as the saved run's next
    ``iter()`` did. So this builds the restored iterator first (``state_dict()`` builds
    it), then restores the streams, then iterates: every later draw is the saved run's.

    Other loaders (``ckpt.data.ResumableLoader``, whose position and order draw nothing
    from the global RNG): the first batch is fetched, then the streams are restored (a
    prepared dataloader sets itself up, drawing from the RNG, at its first batch).

    Random augmentation: in ``StatefulDataLoader`` workers it is exact when the dataset is
    wrapped in ``ckpt.integrations.stateful_data.WorkerRNG`` (the workers' streams are then
    part of the loader state; in the main process it draws from the wrapper's own streams,
    likewise saved); ``ckpt.data.ResumableLoader`` reseeds per sample (exact); drawing from
    the global RNG in the main process of a prepared loader, mid-epoch, it is not (see the
    module docstring).
    """
    return _resumed_iter(loader, lambda: restore_rng(result))


def _resumed_iter(loader: Any, restore: Callable[[], Any]) -> Iterator[Any]:
    restored = _restored_stateful(loader)
    if restored is not None:
        # Builds the restored iterator now (its base-seed draw is replaced by the restored
        # one; the saved run made no such draw), so that the streams restored next are
        # the ones the next batches, or the next epoch's fresh iterator, draw from.
        restored.state_dict()
        restore()
        yield from iter(loader)
        return
    it = iter(loader)
    try:
        first = next(it)
    except StopIteration:
        restore()
        return
    restore()
    yield first
    yield from it


class CkptAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose ``save_state``/``load_state`` use the ckpt format and
    whose run directory keeps the step ledger.

    Options (keyword-only, besides Accelerator's own): ``ledger`` (default True): the step
    ledger lives in ``<run directory>/ledger``, the run directory being the parent of the
    first checkpoint saved or loaded; ``ledger_params_every`` (a parameter digest every N
    recorded steps); ``verify_resume`` (``"warn"``, ``"strict"``, ``"off"``: what an inexact
    resume does). Each ``save_state(step=...)`` records its step (RNG streams, and the
    parameters when due); ``ledger_step(step, batch=, loss=)`` after every optimizer step
    records the batches and the loss too. After ``load_state`` (with ``defer_rng``: once
    ``restore_rng``/``resumed_iter`` restored the streams) the re-executed steps are compared
    with the ledger's earlier records: ``ResumeVerificationWarning`` names the first step
    that differs, what differs and the likely cause.
    """

    def __init__(self, *args: Any, ledger: bool = True, ledger_params_every: int = 10, verify_resume: str = "warn",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ckpt_ledger_on = ledger
        self._ckpt_params_every = ledger_params_every
        self._ckpt_verify = verify_resume
        self._ckpt_recorded: int | None = None
        self._ckpt_pending: tuple[int, str] | None = None  # (step, source) of a deferred resume
        #: the step ledger (``ckpt.ledger.Ledger``) once a checkpoint was saved or loaded
        self.ledger: Any = None

    def prepare_data_loader(self, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = super().prepare_data_loader(data_loader, *args, **kwargs)
        # before its first iterator: the state its order is drawn from is kept from the start
        _sampler_order.record_iterators(prepared)
        return prepared

    def _ledger_at(self, checkpoint: str | os.PathLike[str]) -> Any:
        if self.ledger is None and self._ckpt_ledger_on:
            from ..ledger import Ledger

            run_dir = os.path.dirname(os.path.abspath(os.fspath(checkpoint)))
            models = {f"model_{i}": self.unwrap_model(m) for i, m in enumerate(self._models)}
            directory = os.path.join(run_dir, "ledger")
            if self.num_processes > 1:  # one tape directory per rank, as CheckpointManager keeps them
                directory = os.path.join(directory, f"rank-{self.process_index:05d}")
            self.ledger = Ledger(directory, params=models or None,
                                 params_every=self._ckpt_params_every, verify=self._ckpt_verify)  # type: ignore[arg-type]
        return self.ledger

    def ledger_step(self, step: int, *, batch: Any = None, loss: Any = None) -> None:
        """Record optimizer step ``step`` (after it) in the step ledger: ``batch`` (every
        tensor the step consumed, e.g. the list of its micro-batches) and ``loss``. Before
        the first save or load the run directory is unknown and nothing is recorded."""
        if self.ledger is not None:
            self.ledger.step(step, batch=batch, loss=loss, done=False)
            self._ckpt_recorded = step

    def save_state(self, output_dir: str | None = None, *, step: int | None = None, config: Any = None,  # type: ignore[override]
                   overwrite: bool = False, **kwargs: Any) -> str:
        if output_dir is None:
            raise ValueError("CkptAccelerator.save_state needs output_dir (automatic checkpoint naming is not supported)")
        if kwargs:
            raise TypeError(f"unsupported save_state options for the ckpt format: {sorted(kwargs)}")
        path = str(save_state(self, output_dir, step=step, config=config, overwrite=overwrite).path)
        ledger = self._ledger_at(output_dir)
        if ledger is not None and step is not None:
            if self._ckpt_recorded != step:  # a run that only saves: one record per save
                ledger.step(step, done=False)
                self._ckpt_recorded = step
            ledger.step_done(step)  # after the step and its save: where a harness kills
        return path

    def load_state(self, input_dir: str | None = None, *, defer_rng: bool = False, exactness: str = "warn",  # type: ignore[override]
                   config: Any = None, **kwargs: Any) -> Any:
        if input_dir is None:
            raise ValueError("CkptAccelerator.load_state needs input_dir")
        if kwargs:
            raise TypeError(f"unsupported load_state options for the ckpt format: {sorted(kwargs)}")
        result = load_state(self, input_dir, defer_rng=defer_rng, exactness=exactness, config=config)
        ledger = self._ledger_at(input_dir)
        step = result.step if isinstance(result.step, int) else None
        self._ckpt_recorded = step
        if ledger is not None and step is not None:
            if defer_rng:
                self._ckpt_pending = (step, os.path.basename(os.fspath(result.path)))
            else:
                ledger.resumed(step, source=os.path.basename(os.fspath(result.path)))
        return result

    def restore_rng(self, result: Any) -> list[str]:
        restored = restore_rng(result)
        pending, self._ckpt_pending = self._ckpt_pending, None
        if pending is not None and self.ledger is not None:
            self.ledger.resumed(pending[0], source=pending[1])
        return restored

    def resumed_iter(self, loader: Any, result: Any) -> Iterator[Any]:
        """:func:`resumed_iter`, and the ledger's resume starts where the streams are restored."""
        return _resumed_iter(loader, lambda: self.restore_rng(result))

    def end_training(self) -> None:
        ledger, self.ledger = self.ledger, None
        if ledger is not None:
            ledger.close()  # a resume whose re-executed range was cut short reports what it saw
        super().end_training()
