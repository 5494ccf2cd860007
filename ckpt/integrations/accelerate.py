"""``Accelerator.save_state``/``load_state`` in the ckpt format (no pickle).

Usage::

    from ckpt.integrations.accelerate import CkptAccelerator   # instead of accelerate.Accelerator

    acc = CkptAccelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    acc.register_for_checkpointing(counters)
    ...
    acc.save_state("runs/a/step-00000100", step=100)          # at an optimizer-step boundary
    ...
    res = acc.load_state("runs/a/step-00000100", defer_rng=True)
    it = acc.resumed_iter(loader, res)   # the iterator's setup draws a seed; then the RNG is restored

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

A checkpoint that does not fit the prepared objects (a model of another shape, a missing
entry) is refused by ``load_state`` with ``ResumeMismatchError`` (key, both shapes,
checkpoint) before anything is written; ``save_state`` never replaces a checkpoint unless
``overwrite=True``. Pass the run's config to both (``config=``): ``load_state`` names what
changed in one ``ConfigChangedWarning``.

Not supported yet: more than one process (``num_processes > 1``), DeepSpeed/FSDP/Megatron
plugins, XLA/NPU/MPS RNG.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from accelerate import Accelerator

from ..errors import ResumeMismatchError, StateMismatchError, UnsupportedValueError
from ..reader import CheckpointReader

__all__ = ["CkptAccelerator", "save_state", "load_state", "restore_rng", "resumed_iter"]


def _inner(obj: Any, attr: str) -> Any:
    # AcceleratedOptimizer.optimizer / AcceleratedScheduler.scheduler: the torch objects
    return getattr(obj, attr, obj)


def _state(acc: Accelerator) -> dict[str, Any]:
    if acc.num_processes > 1:
        raise NotImplementedError("ckpt.integrations.accelerate supports one process for now (num_processes > 1 given)")
    if acc.state.distributed_type.value in ("DEEPSPEED", "FSDP", "MEGATRON_LM"):
        raise NotImplementedError(f"ckpt.integrations.accelerate does not support {acc.state.distributed_type.value} yet")
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
        state[f"dataloader_{i}"] = d
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

    return save(path, _state(accelerator), step=step, config=config, overwrite=overwrite)


def load_state(accelerator: Accelerator, path: str | os.PathLike[str], *, defer_rng: bool = False,
               exactness: str = "warn", config: Any = None) -> Any:
    """Load a checkpoint written by :func:`save_state` into the prepared objects, in place.

    RNG streams are restored last; with ``defer_rng=True`` they are not, and
    :func:`restore_rng` puts them back (call it right after creating the dataloader
    iterator, which draws from the RNG). Returns the ``LoadResult``. A checkpoint that
    does not fit the prepared objects raises ``ResumeMismatchError`` (nothing written);
    ``config``, the resuming run's, is compared with the saved one (``ConfigChangedWarning``).
    """
    from .._torchio import load_into
    from ..manager import warn_config_changed

    state = _state(accelerator)
    counters = state["accelerator"]
    reader = CheckpointReader(path)
    try:
        result = load_into(reader, state, restore_rng_state=not defer_rng, exactness=exactness)
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


def resumed_iter(loader: Any, result: Any) -> Iterator[Any]:
    """Iterate ``loader`` from its restored position with the RNG of ``load_state(...,
    defer_rng=True)`` restored at the right moment.

    A prepared dataloader sets itself up (and draws its base seed from the global RNG)
    only when its first batch is requested, so restoring the RNG before that would be
    undone by one draw. This fetches the first batch, then restores the streams. Exact
    when fetching a batch draws nothing from the global RNG (``num_workers=0`` and no
    random augmentation in the main process; workers get their seeds from the new base
    seed, so random augmentation inside workers is not exact: use
    ``ckpt.data.ResumableLoader``).

    Not exact yet for a prepared ``StatefulDataLoader`` checkpointed right after the last
    batch of an epoch: its resumed iterator starts the next epoch drawing fewer seeds from
    the global RNG than the saved run's fresh iterator did (measured; mid-epoch is exact).
    """
    it = iter(loader)
    try:
        first = next(it)
    except StopIteration:
        restore_rng(result)
        return
    restore_rng(result)
    yield first
    yield from it


class CkptAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose ``save_state``/``load_state`` use the ckpt format."""

    def save_state(self, output_dir: str | None = None, *, step: int | None = None, config: Any = None,  # type: ignore[override]
                   overwrite: bool = False, **kwargs: Any) -> str:
        if output_dir is None:
            raise ValueError("CkptAccelerator.save_state needs output_dir (automatic checkpoint naming is not supported)")
        if kwargs:
            raise TypeError(f"unsupported save_state options for the ckpt format: {sorted(kwargs)}")
        return str(save_state(self, output_dir, step=step, config=config, overwrite=overwrite).path)

    def load_state(self, input_dir: str | None = None, *, defer_rng: bool = False, exactness: str = "warn",  # type: ignore[override]
                   config: Any = None, **kwargs: Any) -> Any:
        if input_dir is None:
            raise ValueError("CkptAccelerator.load_state needs input_dir")
        if kwargs:
            raise TypeError(f"unsupported load_state options for the ckpt format: {sorted(kwargs)}")
        return load_state(self, input_dir, defer_rng=defer_rng, exactness=exactness, config=config)

    @staticmethod
    def restore_rng(result: Any) -> list[str]:
        return restore_rng(result)

    @staticmethod
    def resumed_iter(loader: Any, result: Any) -> Iterator[Any]:
        return resumed_iter(loader, result)
