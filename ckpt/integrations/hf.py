"""Exact resume for HF ``transformers.Trainer``: ``CkptTrainer``.

Usage (the lines a user changes)::

    from ckpt.integrations.hf import CkptTrainer

    trainer = CkptTrainer(model=model, args=TrainingArguments(..., save_steps=50), train_dataset=ds,
                          ckpt_dir="runs/gpt2")
    trainer.train()        # resumes from the newest checkpoint in runs/gpt2 that verifies

Why a subclass and not only a ``TrainerCallback``: a callback sees ``TrainerState`` and the
model, but not the loss accumulated since the last log (``Trainer._tr_loss``), the data
loader Trainer builds, nor the moments Trainer restores RNG and skips data on resume. The
subclass overrides Trainer's documented checkpoint hooks (``_save_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_rng_state``, ``_load_scaler``,
``get_train_dataloader``, ``get_batch_samples``) and installs one callback
(``on_train_begin``). Nothing in ``transformers`` or ``accelerate`` is reassigned.

What is saved, through one ``CheckpointManager`` (async by default), at Trainer's own save
points (``save_strategy``/``save_steps``) and on SIGTERM/SIGUSR1:

* model, optimizer, LR scheduler, the Accelerate grad scaler (when there is one);
* ``TrainerState`` (global step, epoch, log history, flos, best metric, the states of
  ``ExportableState`` callbacks and ``TrainerControl``), plus the loss accumulated since
  the last log, so the next logged loss is the same float;
* RNG of every process (Python, numpy, torch CPU, CUDA), one part per rank, restored where
  Trainer restores its own (``_load_rng_state``), after the data iterator exists;
* the data position: the training data is served by ``ckpt.data.ResumableLoader``
  (seed ``args.data_seed`` or ``args.seed``), whose position is O(1) to restore. Trainer's
  ``skip_first_batches`` (which re-reads the skipped batches and, with a shuffled sampler,
  is not exact) is bypassed for this loader.

Resume refusals: a run directory whose checkpoint does not fit (a model of another shape,
another world size) stops ``train()`` with ``ResumeMismatchError`` (key, both shapes,
checkpoint) before a step is taken; nothing in the run directory is saved, replaced or
deleted. Only damaged checkpoints are fallen back past. A config other than the
checkpoint's (the model config, or a training argument such as the learning rate) is named
in one ``ConfigChangedWarning``.

Not supported (refused or documented): DeepSpeed, FSDP, ``IterableDataset`` training data,
``load_best_model_at_end`` (Trainer looks for its own checkpoint folders), resuming with a
``resume_from_checkpoint=`` argument (the run directory decides), hyper-parameter search.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from ..data import ResumableLoader
from ..manager import CheckpointManager, RetentionPolicy
from ..manager.listing import may_resume

__all__ = ["CkptTrainer"]

# TrainerState fields that describe this process, not the run: never restored.
_PER_PROCESS = ("is_local_process_zero", "is_world_process_zero")

# TrainingArguments that name places, this process or reporting, not the training itself:
# left out of the recorded config, so that a resume does not warn about them.
_NOT_CONFIG = ("output_dir", "logging_dir", "run_name", "local_rank", "resume_from_checkpoint", "report_to",
               "disable_tqdm", "log_level", "log_level_replica", "log_on_each_node", "project", "push_to_hub",
               "overwrite_output_dir")
_NOT_CONFIG_PREFIXES = ("hub_", "trackio_")


def _training_config(args: Any) -> dict[str, Any]:
    """The training arguments a resume must not change silently (learning rate, schedule,
    batch sizes, seeds, precision...), as recorded in the checkpoint's config."""
    from ..context.config import canonicalize
    from ..errors import UnsupportedValueError

    out = {}
    for k, v in args.to_dict().items():
        if k in _NOT_CONFIG or k.startswith(_NOT_CONFIG_PREFIXES):
            continue
        try:
            canonicalize(v)
        except UnsupportedValueError:
            continue  # no canonical form (an object passed through): not comparable
        out[k] = v
    return out


class _Live:
    """A Stateful whose target Trainer creates later than the resume point (optimizer,
    scheduler). A load that arrives before the target exists is held until ``apply``."""

    def __init__(self, get: Callable[[], Any]) -> None:
        self._get = get
        self._pending: Any = None

    def state_dict(self) -> Any:
        target = self._get()
        return {} if target is None else target.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self._pending = state  # applied by apply(), once Trainer created the object

    def apply(self) -> None:
        state, self._pending = self._pending, None
        if state is not None:
            self._get().load_state_dict(state)


class _TrainerStateful:
    """``TrainerState`` and Trainer's loop variables as one Stateful (per rank)."""

    def __init__(self, trainer: CkptTrainer) -> None:
        self._t = trainer
        self.loop_vars: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self._t
        st = {k: v for k, v in vars(t.state).items() if k != "stateful_callbacks"}
        callbacks: dict[str, Any] = {}
        for cb in t.callback_handler.callbacks + [t.control]:
            if isinstance(cb, ExportableState):
                callbacks.setdefault(type(cb).__name__, []).append(cb.state())
        st["stateful_callbacks"] = {k: v[0] if len(v) == 1 else v for k, v in callbacks.items()}
        tr_loss = getattr(t, "_tr_loss", None)
        return {
            "state": st,
            "loop": {
                "tr_loss": tr_loss.detach().cpu().clone() if isinstance(tr_loss, torch.Tensor) else torch.zeros(()),
                "globalstep_last_logged": int(getattr(t, "_globalstep_last_logged", 0)),
                "current_flos": float(getattr(t, "current_flos", 0.0)),
            },
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, v in sd["state"].items():
            if k not in _PER_PROCESS:
                setattr(self._t.state, k, v)
        # Trainer resets these right before on_train_begin; the callback puts them back.
        # (_total_loss_scalar is not: as on Trainer's own resume, the train_loss metric of
        # a train() call averages that call's steps.)
        self.loop_vars = dict(sd["loop"])


class _RestoreLoopVars(TrainerCallback):
    def __init__(self, trainer: CkptTrainer) -> None:
        self._t = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._t._ckpt_restore_loop_vars()


class CkptTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are ckpt checkpoints and whose resume is exact.

    Options (keyword-only, besides Trainer's own): ``ckpt_dir`` (the run directory);
    ``ckpt_async`` (default True); ``ckpt_config`` (recorded and hashed; default: the
    model's ``config.to_dict()`` under ``"model"`` and the training arguments, less paths
    and reporting, under ``"training"``); ``ckpt_exactness`` (``"warn"``, ``"strict"``, ``"off"``).
    ``args.save_total_limit`` becomes ``RetentionPolicy(keep_last=...)``.
    """

    def __init__(
        self,
        *args: Any,
        ckpt_dir: str | os.PathLike[str],
        ckpt_async: bool = True,
        ckpt_config: Any = None,
        ckpt_exactness: str = "warn",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
        self._ckpt_async = ckpt_async
        self._ckpt_config = ckpt_config
        self._ckpt_exactness = ckpt_exactness
        self._ckpt_mgr: CheckpointManager | None = None
        self._ckpt_loader: ResumableLoader | None = None
        self._ckpt_live: dict[str, _Live] = {}
        self._ckpt_trainer_state = _TrainerStateful(self)
        self._ckpt_rng_pending = False
        self._ckpt_positioned: Any = None  # our loader's iterator while the resumed epoch runs
        self._ckpt_last_step: int | None = None
        #: step of the checkpoint the last train() resumed from (None: started fresh)
        self.ckpt_resumed_from: int | None = None
        self.add_callback(_RestoreLoopVars(self))

    # -- entry -----------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint not in (None, False):
            raise ValueError(
                "CkptTrainer resumes from ckpt_dir by itself (the newest checkpoint that verifies); "
                f"do not pass resume_from_checkpoint (got {resume_from_checkpoint!r})"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise NotImplementedError("CkptTrainer does not support DeepSpeed or FSDP yet (full per-rank state only)")
        return super().train(None, *args, **kwargs)

    def _inner_training_loop(self, batch_size: Any = None, args: Any = None, resume_from_checkpoint: Any = None,
                             trial: Any = None, ignore_keys_for_eval: Any = None) -> Any:
        # A non-None marker turns on Trainer's resume path (its load hooks, which we own);
        # whether a checkpoint actually verifies is decided in _init_training_state.
        # A crashed save's complete temporary copy counts: the manager publishes it when it
        # takes the run's lock, after this decision (ckpt.manager.listing.may_resume).
        marker = self.ckpt_dir if may_resume(self.ckpt_dir) else None
        try:
            return super()._inner_training_loop(batch_size, args, marker, trial, ignore_keys_for_eval)
        finally:
            if self._ckpt_mgr is not None:
                mgr, self._ckpt_mgr = self._ckpt_mgr, None
                mgr.close()  # waits for the save in flight; raises if it failed

    # -- data --------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        ds = self.train_dataset
        if ds is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__len__"):
            raise NotImplementedError("CkptTrainer needs a map-style train_dataset (IterableDataset has no O(1) position)")
        collator = self.data_collator
        try:
            import datasets

            if isinstance(ds, datasets.Dataset):
                ds = self._remove_unused_columns(ds, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        a = self.args
        self._ckpt_loader = ResumableLoader(
            ds,
            seed=int(a.data_seed if a.data_seed is not None else a.seed),
            # one loader step is one micro-batch on every rank
            global_batch_size=self._train_batch_size * a.world_size,
            world_size=a.world_size,
            rank=a.process_index,
            drop_last=bool(a.dataloader_drop_last) or a.world_size > 1,
            collate_fn=collator,
            num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=bool(a.dataloader_persistent_workers and a.dataloader_num_workers),
            prefetch_factor=a.dataloader_prefetch_factor if a.dataloader_num_workers else None,
        )
        return self._ckpt_loader

    # -- resume ------------------------------------------------------------------------
    def _ckpt_manager(self) -> CheckpointManager:
        self._ckpt_live = {
            "optimizer": _Live(lambda: getattr(self.optimizer, "optimizer", self.optimizer)),
            "scheduler": _Live(lambda: self.lr_scheduler),
        }
        state: dict[str, Any] = {"model": self.model, **self._ckpt_live}
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        state["trainer"] = self._ckpt_trainer_state
        config = self._ckpt_config
        if config is None:
            config = {"training": _training_config(self.args)}
            if hasattr(getattr(self.model, "config", None), "to_dict"):
                config["model"] = self.model.config.to_dict()
        return CheckpointManager(
            self.ckpt_dir,
            state,
            data=self._ckpt_loader,
            config=config,
            async_save=self._ckpt_async,
            retention=RetentionPolicy(keep_last=self.args.save_total_limit or 2),
            # model, optimizer, scheduler and scaler are the same on every DDP rank
            replicated=tuple(k for k in state if k != "trainer") if self.args.world_size > 1 else (),
            exactness=self._ckpt_exactness,  # type: ignore[arg-type]
        )

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: Any, trial: Any) -> tuple[int, int]:
        super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        self._ckpt_mgr = self._ckpt_manager()
        self._ckpt_last_step = None
        self.ckpt_resumed_from = None
        if resume_from_checkpoint is None:
            return 0, 0
        result = self._ckpt_mgr.resume(defer_rng=True)
        if result is None:
            return 0, 0
        self.ckpt_resumed_from = result.step
        self._ckpt_rng_pending = True
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        self._load_callback_state()
        assert self._ckpt_loader is not None
        # Trainer's epoch loop starts at the loader's epoch and counts the micro-batches
        # already consumed in it (the loader is already there: nothing is skipped).
        return self._ckpt_loader.epoch, self._ckpt_loader.step

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        for live in self._ckpt_live.values():
            live.apply()

    def _load_scaler(self, checkpoint: Any) -> None:
        pass  # loaded in place by the manager, with everything else

    def _load_rng_state(self, checkpoint: Any) -> None:
        # Trainer calls this once the epoch's iterator exists (and, mid-epoch, after the
        # first batches were fetched): the moment the saved streams must be back.
        if self._ckpt_rng_pending and self._ckpt_mgr is not None:
            self._ckpt_rng_pending = False
            self._ckpt_mgr.restore_rng()

    def _ckpt_restore_loop_vars(self) -> None:
        lv, self._ckpt_trainer_state.loop_vars = self._ckpt_trainer_state.loop_vars, None
        if lv is None:
            return
        self._tr_loss = lv["tr_loss"].to(self.args.device)
        self._globalstep_last_logged = lv["globalstep_last_logged"]
        self.current_flos = lv["current_flos"]

    def _run_epoch(self, **kwargs: Any) -> Any:
        # In the resumed epoch Trainer counts the micro-batches already trained (its step
        # counters must start there) and rebuilds its data loader to drop them
        # (accelerate's ``skip_first_batches``). Our loader is already at the resumed
        # position (O(1)): dropping batches would move it past the position. So Trainer
        # gets an empty DataLoader to rebuild, and get_batch_samples serves this epoch
        # from our loader's iterator, made here, where Trainer would have made it.
        loader = self._ckpt_loader
        if not (loader is not None and kwargs.get("train_dataloader") is loader
                and kwargs.get("resume_from_checkpoint") is not None and kwargs.get("epoch") == kwargs.get("epochs_trained")
                and kwargs.get("steps_trained_in_current_epoch", 0) > 0 and not self.args.ignore_data_skip):
            return super()._run_epoch(**kwargs)
        self._ckpt_positioned = iter(loader)
        try:
            return super()._run_epoch(**{**kwargs, "train_dataloader": torch.utils.data.DataLoader([])})
        finally:
            self._ckpt_positioned = None

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        if self._ckpt_positioned is not None:  # the resumed epoch: see _run_epoch
            epoch_iterator = self._ckpt_positioned
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    # -- save --------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # as Trainer does before saving (a collective under DDP)
        assert self._ckpt_mgr is not None
        self._ckpt_mgr.save(self.state.global_step)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        mgr, step = self._ckpt_mgr, self.state.global_step
        if mgr is None or step == self._ckpt_last_step:
            return
        # After Trainer's own log/eval/save of this step: a preemption save here holds
        # exactly what the next step needs. Also raises a failed async save.
        self._ckpt_last_step = step
        mgr.after_step(step)
        if mgr.should_stop:
            self.control.should_training_stop = True
