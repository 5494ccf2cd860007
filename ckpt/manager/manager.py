"""The ``CheckpointManager`` façade: saves at step boundaries, resume and rewind, close.
Each concern it drives lives in a module of its own (``ckpt/manager/__init__.py`` lists
them); docs/manager.md is the user guide."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..context import prime as prime_context
from ..context.record import SaveContext
from ..errors import (
    BackgroundSaveError,
    CheckpointExistsError,
    CkptError,
    ResumeMismatchError,
    RunDirLockedError,
    WaitTimeoutError,
)
from ..format.manifest import MANIFEST_NAME
from ..knobs import knobs
from ..save_options import SaveOptions
from ..storage import Storage, is_space_error, resolve
from . import _resume
from ._cadence import Cadence
from ._dedup import DedupSource
from ._resume import ResumeFallbackWarning, warn_config_changed
from ._role import WriterRole
from ._saver import SaveJob, SaveReport, SaveWorker, with_stall, write
from ._signals import SignalFlag
from .hooks import StepCall, StepHook
from .listing import CheckpointRecord, LatestCheckpoint, checkpoint_name, latest, list_checkpoints
from .options import ManagerOptions
from .retention import RunRetention, delete_checkpoints

__all__ = ["CheckpointManager", "Rewind"]


@dataclass(frozen=True, slots=True)
class Rewind:
    """What ``CheckpointManager.rewind`` did: the load, the checkpoint it came from (name
    and step), the newer committed checkpoints it deleted, and the newer candidates that
    did not load (each named in a ``ResumeFallbackWarning``)."""

    result: Any
    name: str
    step: int
    discarded: tuple[str, ...]
    fallbacks: tuple[str, ...]


class CheckpointManager:
    """Checkpoints of one run, saved at step boundaries and resumed exactly.

    ``state`` maps names to Statefuls (modules, optimizers, schedulers, scalers) or plain
    trees (counters), as for ``ckpt.save``. Options are keyword-only: the fields of
    :class:`~ckpt.manager.ManagerOptions`, given one by one or as ``options=``.
    """

    def __init__(self, run_dir: str | os.PathLike[str], state: Mapping[str, Any], *,
                 options: ManagerOptions | None = None, **keywords: Any) -> None:
        opts = ManagerOptions.of(options, keywords)
        self.options = opts
        # The one resolver: a local directory, or an object-store prefix (s3://...).
        storage, self.run_dir = resolve(run_dir, opts.storage)
        self.state = dict(state)
        self.data = opts.data
        self.generators = dict(opts.generators or {})
        self.config = opts.config
        self.every_steps = opts.every_steps
        self.every_seconds = opts.every_seconds
        self.retention = opts.retention
        self.async_save = opts.async_save
        self.replicated = tuple(opts.replicated)
        self.exactness = opts.exactness
        self.code_dir = opts.code_dir
        #: format 2.0 options passed to every save (spec/format-2.md): ``compress`` as for
        #: ``ckpt.save``; ``dedup`` shares the files of the previous checkpoint whose tensors
        #: did not change (hard links); every ``dedup_full_every``-th save writes everything
        self.compress = opts.compress
        self.dedup = opts.dedup
        #: how every save of this manager is written, passed on unchanged (``overwrite``: a
        #: step re-run after falling back past a corrupt checkpoint replaces it)
        self.save_options = SaveOptions(overwrite=True, compress=opts.compress, dedup=opts.dedup)
        self.dedup_full_every = opts.dedup_full_every
        self._dedup = DedupSource(opts.dedup, opts.dedup_full_every)
        self._cadence = Cadence(opts.every_steps, opts.every_seconds, opts.clock)
        self._retainer = RunRetention(self.run_dir, self.retention, dedup=opts.dedup)
        self._signals = SignalFlag()
        self.run_id = opts.run_id or uuid.uuid4().hex[:16]
        self.resumed_from: dict[str, Any] | None = None
        self._start_step = 0
        self._stop = False
        self._inflight: SaveJob | None = None
        self._worker: SaveWorker | None = None
        self._failed: SaveJob | None = None
        self._deferred_rng: dict[str, Any] | None = None
        self._closed = False
        self._space_short = False
        #: reports of completed saves, oldest first
        self.reports: list[SaveReport] = []
        self.ledger: Any = None
        #: the ``LoadResult`` of the last ``resume()`` or ``rewind()``
        self.last_load: Any = None
        self._hook: StepHook | None = None  # attach(): a LossGuard, say
        # Set when resume() or rewind() found that the run's checkpoint does not fit the
        # live state (or world): this manager then never saves, since its saves would
        # replace the run's checkpoints. Cleared by a later load that succeeds.
        self._refusal: ResumeMismatchError | None = None
        # The checkpoints the last resume()/rewind() skipped as damaged: a save of their
        # step replaces them without overwrite=True (the re-run step's checkpoint).
        self._replaceable: set[str] = set()

        from ..staging import Staging

        self._staging = Staging(pin_memory=opts.pin_memory) if opts.async_save else None

        from ..distributed import DistributedCheckpointer, is_distributed

        if is_distributed():
            import torch.distributed as dist

            # Two groups: one for the loop's per-step agreement (main thread), one for
            # save traffic (background thread); never two threads on one group.
            self._ctl = DistributedCheckpointer(io_group=dist.new_group(backend="gloo"))
            self._dist: Any = DistributedCheckpointer(io_group=dist.new_group(backend="gloo"))
            self.rank = self._dist.rank
            self.world_size = self._dist.world_size
        else:
            self._ctl = None
            self._dist = None
            self.rank = 0
            self.world_size = 1
        from ..dcp.integration_probe import holds_dtensor

        #: DTensor state (FSDP2/TP): saved and resumed through ckpt.dcp (sharded hook)
        self.sharded = holds_dtensor(self.state)
        if self.sharded:
            from ..dcp.integration import refuse_sharded_options

            refuse_sharded_options(self.save_options, self.run_dir, where="CheckpointManager on sharded (DTensor) state")
        if missing := [k for k in self.replicated if k not in self.state]:
            raise ValueError(f"replicated entries {missing} are not in the state")

        # One writer per run directory: rank 0 holds the lock for the whole job, taken
        # before orphan cleanup (which would otherwise delete a live writer's saves).
        # A follower (writer=False) of a run directory another manager writes lists and
        # loads (resume, rewind) but never locks, saves or deletes; set_writer(True)
        # makes it the writer (replicated training: one replica writes, all can roll back).
        self._role = WriterRole(storage, self.run_dir, writer=bool(opts.writer))
        refusal: BaseException | None = None
        if self.rank == 0 and self._role.writer:
            try:
                self._take_lock(wait=False)
            except BaseException as e:  # noqa: BLE001 - every rank must hear about it
                refusal = e
        if self._ctl is not None:
            # Every rank raises together rather than waiting at a barrier rank 0 never reaches.
            msg = None if self.rank != 0 else (b"" if refusal is None else f"{type(refusal).__name__}: {refusal}".encode())
            why = self._ctl.broadcast_bytes(msg).decode()
            if why and refusal is None:
                cls = RunDirLockedError if why.startswith(RunDirLockedError.__name__ + ":") else CkptError
                refusal = cls(f"rank 0 could not open the run directory: {why}", path=self.run_dir)
        if refusal is not None:
            self._role.release()
            raise refusal

        if self._role.writer:
            # git and uname run here, on the loop's thread: never on the save thread, where a
            # DataLoader forking workers meanwhile deadlocks them (ckpt.context.provenance).
            prime_context(self.code_dir)

        # The step ledger (ckpt.ledger): created now, after seeding, so its RNG baseline
        # is the streams' start values; "unused, not compared" is judged against it.
        self.ledger = self._make_ledger(opts.ledger_params_every, opts.verify_resume) if opts.ledger else None

        self._signals.install(opts.signals, stacklevel=2)

    # -- properties --------------------------------------------------------------------
    @property
    def _storage(self) -> Storage:
        """The run's storage as this manager uses it (holding the run's lock while it writes)."""
        return self._role.storage

    @property
    def start_step(self) -> int:
        """The step the loaded checkpoint was taken at (0 when nothing was resumed)."""
        return self._start_step

    @property
    def should_stop(self) -> bool:
        """True once a preemption signal was handled: the state is saved; leave the loop."""
        return self._stop

    @property
    def staging_allocations(self) -> int:
        return 0 if self._staging is None else self._staging.allocations

    @property
    def staging_nbytes(self) -> int:
        return 0 if self._staging is None else self._staging.nbytes

    @property
    def removed_orphans(self) -> tuple[str, ...]:
        """Leftovers of crashed saves removed when this manager became the writer."""
        return self._role.removed_orphans

    @property
    def restored_orphans(self) -> tuple[tuple[str, str], ...]:
        """(temporary name, step name) of complete copies put back after a crash."""
        return self._role.restored_orphans

    def checkpoints(self) -> list[CheckpointRecord]:
        """The run directory's checkpoints, oldest first, with the metrics retention ranks them by."""
        return list_checkpoints(self.run_dir, with_metrics=True, storage=self._storage)

    def latest(self, *, verify: bool = True) -> LatestCheckpoint | None:
        """The checkpoint :meth:`resume` will load, and its config, without loading it
        (:func:`latest`)."""
        return latest(self.run_dir, verify=verify, storage=self._storage)

    # -- the step hook (a LossGuard) -------------------------------------------------------
    @property
    def hook(self) -> StepHook | None:
        """The :class:`~ckpt.manager.StepHook` attached to this manager, if any."""
        return self._hook

    def attach(self, hook: StepHook) -> StepCall:
        """Attach ``hook``: from now on ``after_step`` refuses (the loop calls the hook), the
        manager asks the hook for its retention floor, its meta entries at each save, and
        tells it what ``resume()`` loaded. Returns the step call the hook ends an accepted
        step with."""
        if self._hook is not None:
            raise CkptError("this CheckpointManager already has a step hook attached", path=self.run_dir)
        self._hook = hook
        return self._after_step

    def detach(self, hook: StepHook) -> None:
        """Detach ``hook`` (if it is the one attached): ``after_step`` works again."""
        if self._hook is hook:
            self._hook = None

    # -- signals -----------------------------------------------------------------------
    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """What the signal handler does; for tests and for cooperative preemption."""
        self._signals.received = signum

    # -- the loop's calls --------------------------------------------------------------
    def after_step(self, step: int, *, batch: Any = None, loss: Any = None, metrics: Mapping[str, Any] | None = None,
                   extra: Any = None, values: Mapping[str, Any] | None = None) -> bool:
        """Call once per optimizer step, after it. Saves if due; returns True if it did.

        ``batch`` (every tensor the step consumed) and ``loss`` go to the step ledger;
        without them it still records the RNG streams and a periodic parameter digest.
        ``values``: plain values carried across steps that the checkpoint may not hold
        (``{"lr": lr, "best_val": best}``): a resume whose value differs names it.
        With a ``LossGuard`` attached, call ``guard.after_step`` instead: it judges the
        loss before anything of the step is saved."""
        if self._hook is not None:
            raise CkptError("a LossGuard is attached to this manager: call guard.after_step(step, loss=...) so the "
                            "loss is judged before the step is saved", path=self.run_dir)
        return self._after_step(step, batch=batch, loss=loss, metrics=metrics, extra=extra, values=values)

    def _after_step(self, step: int, *, batch: Any = None, loss: Any = None, metrics: Mapping[str, Any] | None = None,
                    extra: Any = None, values: Mapping[str, Any] | None = None) -> bool:
        self._check_open()
        self._raise_failure()
        if self.ledger is not None:
            self.ledger.step(step, batch=batch, loss=loss, values=values, done=False)
        saved = self._after_step_save(step, metrics, extra)
        if self.ledger is not None:
            self.ledger.step_done(step)  # after the step and its save: where a harness kills
        return saved

    @property
    def resume_report(self) -> Any:
        """The ledger's verdict on the last ``resume()`` (``ckpt.ledger.ResumeReport``), once known."""
        return self.ledger.report if self.ledger is not None else None

    def _make_ledger(self, params_every: int, verify: str) -> Any:
        from ..knobs import ledger_dir
        from ..ledger import Ledger

        root = ledger_dir()
        if root:
            directory = os.path.join(root, os.path.basename(self.run_dir))
        else:  # an append-only tape: a local file, beside the run where it is local
            directory = self._storage.commit.ledger_dir(self.run_dir)
        if self.world_size > 1:
            directory = os.path.join(directory, f"rank-{self.rank:05d}")
        modules = {k: v for k, v in self.state.items() if hasattr(v, "named_parameters")}
        return Ledger(directory, params=modules or None, params_every=params_every, generators=self.generators,
                      verify=verify, run_id=self.run_id)  # type: ignore[arg-type]

    def _after_step_save(self, step: int, metrics: Mapping[str, Any] | None, extra: Any) -> bool:
        if not self._role.writer:  # a follower saves nothing; a signal still stops its loop
            self._stop = self._stop or self._signals.received is not None
            return False
        due = self._cadence.due(step)
        sig = self._signals.received is not None
        if self._ctl is not None:
            due_i, sig_i = self._ctl.all_reduce_max([int(due), int(sig)])
            due, sig = bool(due_i), bool(sig_i)
        if step == self._cadence.last_step:
            due = False  # already saved (or resumed from) this very state
        if sig:
            # Preemption: save synchronously (unless this state is saved already), then stop.
            saved = step != self._cadence.last_step
            if saved:
                self._save(step, metrics, extra, block=True)
            else:
                self.wait()
            self._stop = True
            return saved
        if due:
            self._save(step, metrics, extra, block=not self.async_save)
            return True
        return False

    def save(self, step: int, *, metrics: Mapping[str, Any] | None = None, extra: Any = None, block: bool | None = None,
             overwrite: bool = False) -> None:
        """Save now (at a step boundary). ``block`` defaults to ``not async_save``.

        A committed checkpoint of ``step`` already in the run is never replaced silently:
        ``CheckpointExistsError`` unless ``overwrite=True`` (or unless ``resume()`` skipped
        it as damaged: the re-run step replaces it)."""
        self._check_open()
        self._raise_failure()
        if not self._role.writer:
            raise CkptError("this CheckpointManager is a follower (writer=False): it does not save; "
                            "set_writer(True) first", path=self.run_dir)
        if self._inflight is not None and self._inflight.step == step:
            self._join()  # a save in flight of this very step commits (or fails) before the check
            self._raise_failure()
        self._check_save(step, overwrite=overwrite)
        if self.ledger is not None:
            self.ledger.touch(step)  # a run that only saves still has a ledger: a resume is not "missing" one
        self._save(step, metrics, extra, block=(not self.async_save) if block is None else block, checked=True)

    def wait(self) -> SaveReport | None:
        """Wait for the save in flight; raise ``BackgroundSaveError`` if it failed."""
        self._join()
        self._raise_failure()
        return self.reports[-1] if self.reports else None

    def close(self) -> None:
        """Wait for the save in flight, restore signal handlers, release staging."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._signals.close()
            if self.ledger is not None:
                self.ledger.close()
            self._signals.restore()
            hung = self._inflight is not None and not self._inflight.done.is_set()
            if self._worker is not None:
                self._worker.stop(join=not hung)
                self._worker = None
            if self._staging is not None:
                self._staging.release()
            if not hung:  # a save still running (reported by wait()) may yet commit: the run stays locked
                self._role.release()

    # -- the writer role ---------------------------------------------------------------
    def _take_lock(self, *, wait: bool) -> None:
        # an flock on a filesystem, a lease object on an object store (§O.6)
        self._role.take(wait=wait, owner={"run_id": self.run_id, "world_size": self.world_size})

    @property
    def writer(self) -> bool:
        """Whether this manager writes the run directory (``False``: a follower)."""
        return self._role.writer

    def set_writer(self, on: bool, *, wait: bool = True) -> None:
        """Become the run directory's writer (take its lock: with ``wait``, block until
        the previous writer closes or dies; clean leftovers of crashed saves) or stop
        being it (finish the save in flight, release the lock). Single-process managers
        only: a distributed job's rank 0 is its writer for good."""
        self._check_open()
        if self._ctl is not None:
            raise CkptError("set_writer is for a single-process manager; a distributed job's rank 0 is its writer",
                            path=self.run_dir)
        if bool(on) == self._role.writer:
            return
        if on:
            self._take_lock(wait=wait)
            self._role.writer = True
        else:
            self.wait()
            self._role.release()
            self._role.writer = False

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- resume ------------------------------------------------------------------------
    def resume(self, *, defer_rng: bool = False, restore_rng: bool = True, exactness: str | None = None) -> Any:
        """Load the newest committed checkpoint that verifies; ``None`` if there is none.

        Returns the ``LoadResult``. With ``defer_rng`` (or ``restore_rng=False``, the name
        ``ckpt.load`` uses), RNG streams are not restored now: call :meth:`restore_rng`
        right after creating the DataLoader iterator (a plain DataLoader draws its base
        seed from the global RNG at ``iter()``), or never, to continue with this process's
        streams.

        Falls back past damaged checkpoints only (each named in a
        ``ResumeFallbackWarning``). A checkpoint that is intact but does not fit the live
        state (other keys, shapes or dtypes) or world (no part for this rank) raises
        ``ResumeMismatchError`` naming the checkpoint, the key and both shapes: nothing in
        the run directory is changed, and this manager refuses to save from then on.
        :func:`latest` tells beforehand which checkpoint this picks and its config. A
        config other than the checkpoint's is named in one ``ConfigChangedWarning``.
        """
        self._check_open()
        self._raise_failure()
        held_how = "resume(defer_rng=True)" if defer_rng else "resume(restore_rng=False)"
        defer_rng = defer_rng or not restore_rng
        loaded = self._load_first(self.candidates(lambda r: True), defer_rng=defer_rng, exactness=exactness)
        if loaded is None:
            return None
        result, choice, _ = loaded
        if defer_rng:
            self._deferred_rng = result.context.get("rng")
        lineage = result.context.get("lineage") or {}
        if isinstance(lineage.get("run_id"), str) and lineage["run_id"]:
            self.run_id = lineage["run_id"]
        self._loaded(result, choice)
        if self.rank == 0:
            warn_config_changed(result.path, result.context, self.config, stacklevel=3)
        if self.ledger is not None:  # held-back streams are named at the first step unless restore_rng() ran
            self.ledger.resumed(self._start_step, source=choice, run_id=self.run_id,
                                rng_held=f"{held_how}|call restore_rng() right after creating the DataLoader "
                                         "iterator" if defer_rng else "")
        if self._hook is not None:
            self._hook.on_restore(result)
        return result

    def rewind(self, *, before: int | None = None, step: int | None = None,
               exactness: str | None = None) -> Rewind | None:
        """Roll the run back: load the newest committed checkpoint whose step is below
        ``before`` (or the one of exactly ``step``) that verifies and loads, exactly as
        ``resume()`` would (all or nothing, falling back past any that fails), then
        discard every committed checkpoint newer than it: they belong to the abandoned
        timeline, and a later resume must never pick one. ``None`` when no candidate
        loads (nothing is discarded then). The loss-spike guard's step 5
        (spec/loss-guard.md §3); the ledger is left to the caller (the guard tapes the
        rollback, which voids the abandoned steps' records)."""
        if (before is None) == (step is None):
            raise ValueError("rewind() takes exactly one of before= or step=")
        self._check_open()
        self.wait()  # a save in flight commits (or fails) before the listing
        keep = (lambda r: r.step < before) if before is not None else (lambda r: r.step == step)
        loaded = self._load_first(self.candidates(keep), defer_rng=False, exactness=exactness)
        if loaded is None:
            return None
        result, choice, fallbacks = loaded
        target = int(result.step or 0)
        discarded: tuple[str, ...] = ()
        if self.rank == 0 and self._role.writer:  # a follower leaves the deleting to the writer
            newer = [r for r in list_checkpoints(self.run_dir, storage=self._storage) if r.committed and r.step > target]
            discarded = delete_checkpoints(self.run_dir, newer, storage=self._storage)
        self._loaded(result, choice)
        return Rewind(result, choice, target, discarded, tuple(fallbacks))

    def _loaded(self, result: Any, choice: str) -> None:
        self._refusal = None  # the state fits the run again: its saves are the run's
        self.resumed_from = {"id": result.id, "name": choice, "step": result.step}
        self.last_load = result
        self._dedup.source = os.path.join(self.run_dir, choice)
        self._start_step = int(result.step or 0)
        self._cadence.mark(self._start_step)

    def candidates(self, keep: Callable[[CheckpointRecord], bool]) -> list[str]:
        """Names of the committed checkpoints ``keep`` accepts, newest first (rank 0 lists,
        every rank gets the same list: a collective in a distributed job). An uncommitted
        one that ``keep`` accepts is named in a ``ResumeFallbackWarning``."""
        names: list[str] = []
        if self.rank == 0:
            for rec in reversed(list_checkpoints(self.run_dir, storage=self._storage)):
                if not keep(rec):
                    continue
                if not rec.committed:
                    warnings.warn(f"skipping {rec.path}: no MANIFEST, the save never committed", ResumeFallbackWarning, stacklevel=3)
                    continue
                names.append(rec.name)
        if self._ctl is not None:
            payload = "\n".join(names).encode() if self.rank == 0 else None
            names = [n for n in self._ctl.broadcast_bytes(payload).decode().split("\n") if n]
        return names

    def _load_first(self, names: list[str], *, defer_rng: bool, exactness: str | None
                    ) -> tuple[Any, str, list[str]] | None:
        """Load the first of ``names`` that loads (``resume()``'s fallback rule); returns
        (result, its name, the names skipped before it), or None. A checkpoint that does
        not fit makes this manager refuse to save (``_check_save``)."""
        target = _resume.Target(
            self.run_dir, self._storage, self.state, self.data, self.generators, self.config,
            exactness or self.exactness, self.rank, self.world_size, self._dist is not None, self._ctl,
        )
        try:
            out = _resume.load_first(target, names, defer_rng=defer_rng)
        except ResumeMismatchError as e:
            self._refusal = e
            raise
        self._replaceable = set(out.skipped)  # damaged: the re-run steps may replace them
        if out.result is None:
            if out.error is not None:
                raise out.error
            return None
        return out.result, out.name, out.skipped

    def restore_rng(self) -> list[str]:
        """Restore the RNG streams held back by ``resume(defer_rng=True)``."""
        from ..context.rng import restore_rng

        if self._deferred_rng is None:
            raise CkptError("no deferred RNG state: call resume(defer_rng=True) first", key="rng")
        state, self._deferred_rng = self._deferred_rng, None
        restored = restore_rng(state, self.generators or None, path=self.run_dir)
        if self.ledger is not None and self.resumed_from is not None:
            self.ledger.rng_restored()
        return restored

    # -- saving ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CkptError("the CheckpointManager is closed", path=self.run_dir)

    def _raise_failure(self) -> None:
        job = self._inflight
        if job is not None and job.done.is_set():
            self._join()
        failed, self._failed = self._failed, None
        if failed is not None:
            err = failed.error
            raise BackgroundSaveError(
                f"async save of step {failed.step} failed, nothing was committed: {type(err).__name__}: {err}",
                path=failed.path,
                step=failed.step,
            ) from err

    def _join(self) -> None:
        job = self._inflight
        if job is None:
            return
        limit = knobs().save_timeout_s
        if not job.done.wait(limit):
            # A hang detector, not a verdict on speed: the save's own waits are bounded
            # (locks: lock_timeout_s), so only a stuck system call gets here. Say where.
            where = self._worker.where() if self._worker is not None else "unknown"
            raise WaitTimeoutError(
                f"the asynchronous save of step {job.step} has not finished after {limit:g} s; the save "
                f"thread is at {where} (raise CKPT_SAVE_TIMEOUT_S if the storage is only slow)",
                path=job.path, step=job.step, waited_on=f"the asynchronous save of step {job.step}", timeout_s=limit,
            )
        self._inflight = None
        if job.error is not None:
            self._failed = job

    def _check_save(self, step: int, *, overwrite: bool) -> None:
        """Refuse a save that would replace what the caller did not ask to replace: any
        save after a refused resume, and a committed checkpoint of ``step`` (every rank
        raises together: rank 0 looks, the ranks agree)."""
        if self._refusal is not None:
            raise _resume.refused_save(self._refusal)
        if overwrite:
            return
        name = checkpoint_name(step)
        exists = name not in self._replaceable and self.rank == 0 and \
            self._storage.isfile(os.path.join(self.run_dir, name, MANIFEST_NAME))
        if self._ctl is not None:
            exists = bool(self._ctl.all_reduce_max([int(exists)])[0])
        if exists:
            raise CheckpointExistsError(
                f"step {step} is already saved in this run: a save never replaces a checkpoint unless asked "
                "(save(step, overwrite=True)); did the script skip resume()?",
                path=os.path.join(self.run_dir, name),
            )
        self._replaceable.discard(name)  # replaced once: the new one is no longer damaged

    def _save(self, step: int, metrics: Mapping[str, Any] | None, extra: Any, *, block: bool,
              checked: bool = False) -> None:
        from ..context.rng import capture_rng
        from ..staging import frozen_stateful

        t0 = time.perf_counter()
        # At most one save in flight, and the staging buffer is still being read by it.
        self._join()
        self._raise_failure()
        if not checked:
            self._check_save(step, overwrite=False)
        if self.sharded:
            self._save_sharded(step, metrics, extra, t0)
            return
        stateful = {k: callable(getattr(v, "state_dict", None)) for k, v in self.state.items()}
        if self._dist is not None and self.rank != 0:
            # Replicated entries are written by rank 0 only; no need to snapshot them here.
            entries = {k: v for k, v in self.state.items() if k not in self.replicated}
        else:
            entries = dict(self.state)
        trees = {k: (v.state_dict() if stateful[k] else v) for k, v in entries.items()}
        data_sd = self.data.state_dict() if self.data is not None else None
        rng = capture_rng(self.generators or None)
        nbytes = 0
        if self._staging is not None and not block:
            frozen, stats = self._staging.snapshot({"state": trees, "data": data_sd, "extra": extra})
            trees, data_sd, extra = frozen["state"], frozen["data"], frozen["extra"]
            nbytes = stats.nbytes
        # A blocking save writes from the live tensors: the loop waits for it anyway.
        state = {k: (frozen_stateful(self.state[k], trees[k]) if stateful[k] else trees[k]) for k in trees}
        if self._dist is not None and self.rank != 0:
            from ..writer import Replicated

            for k in self.replicated:
                state[k] = Replicated("rank-00000")
        data_obj = frozen_stateful(self.data, data_sd) if self.data is not None else None
        job = SaveJob(
            step=step,
            path=os.path.join(self.run_dir, checkpoint_name(step)),
            state=state,
            context=SaveContext(step=step, config=self.config, data=data_obj, rng=rng, extra=extra,
                                lineage=self._lineage(), code_dir=self.code_dir),
            meta=self._meta(step, metrics),
            stall_s=0.0,
            nbytes=nbytes,
            asynchronous=not block,
        )
        self._cadence.mark(step)
        if block:
            self._run(job)
            job.stall_s = time.perf_counter() - t0
            if job.report is not None:
                self.reports[-1] = with_stall(job.report, job.stall_s)
            if job.error is not None:
                self._failed = job
                self._raise_failure()
            return
        job.stall_s = time.perf_counter() - t0
        prime_context(self.code_dir)  # cached after the first call (a follower made writer)
        self._inflight = job
        if self._worker is None:
            self._worker = SaveWorker(self._run)
        self._worker.submit(job)

    def _run(self, job: SaveJob) -> None:
        """Write, commit and report one save (the save thread's work when asynchronous)."""
        t0 = time.perf_counter()
        freed: tuple[str, ...] = ()
        try:
            options = dataclasses.replace(self.save_options, reuse=self._dedup.reuse(self.rank, self._storage))
            if self._space_short and self.rank == 0:
                # The disk filled up before: retention after a commit can never run
                # again if no commit fits, so delete now what the commit would delete.
                freed = self._apply_retention(upcoming=job.step)
            write(job, dist=self._dist, storage=self._storage, options=options)
            if self.dedup:
                self._dedup.source = job.path  # the newest commit: retention never deletes it
            deleted = freed + (self._apply_retention() if self.rank == 0 else ())
            job.report = SaveReport(job.step, job.path, job.asynchronous, job.stall_s, time.perf_counter() - t0, job.nbytes, deleted)
            self.reports.append(job.report)
        except BaseException as e:  # noqa: BLE001 - surfaced at the next call
            job.error = e
            if is_space_error(e):
                # Sticky for this manager: on a disk that filled up once, every later
                # save makes room first (never below the newest valid checkpoint).
                self._space_short = True
        finally:
            # Drop references to staged tensors and frozen trees as soon as possible.
            job.state = {}
            job.context = dataclasses.replace(job.context, data=None, extra=None)
            job.done.set()

    def _save_sharded(self, step: int, metrics: Mapping[str, Any] | None, extra: Any, t0: float) -> None:
        """Sharded hook (ckpt.dcp): a collective DCP save on this thread, every rank
        together. It blocks (DCP's collectives run on the default group, which the
        training loop also uses; a background thread would interleave with it)."""
        from ..dcp.integration import save_sharded_with

        path = os.path.join(self.run_dir, checkpoint_name(step))
        meta = self._meta(step, metrics)
        context = SaveContext(step=step, config=self.config, data=self.data, generators=self.generators or None,
                              extra=extra, lineage=self._lineage(), code_dir=self.code_dir)
        self._cadence.mark(step)
        info = save_sharded_with(path, self.state, context, meta=meta, storage=self._storage,
                                 options=self.save_options)
        deleted = self._apply_retention() if self.rank == 0 else ()
        stall = time.perf_counter() - t0
        self.reports.append(SaveReport(step, path, False, stall, stall, info.bytes, deleted))

    def _meta(self, step: int, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
        meta = {"run_id": self.run_id, "metrics": dict(metrics or {}), "resumed_from": self.resumed_from}
        if self._hook is not None:
            meta.update(self._hook.before_save(step))  # a LossGuard's state: spec/loss-guard.md §5
        return meta

    def _lineage(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "resumed_from": self.resumed_from["id"] if self.resumed_from else None,
            "resumed_from_name": self.resumed_from["name"] if self.resumed_from else None,
        }

    def _apply_retention(self, *, upcoming: int | None = None) -> tuple[str, ...]:
        """Retention after a commit, or before a save on a full disk (``upcoming``): the
        policy, the attached hook's floor, the damaged checkpoints (``RunRetention``)."""
        return self._retainer.apply(self._storage, floor=self._retention_floor, upcoming=upcoming)

    def _retention_floor(self) -> int | None:
        hook = self._hook
        return hook.retention_floor() if hook is not None else None
