"""``CheckpointManager``: a run directory of ``step-NNNNNNNN/`` checkpoints that resume exactly.

Usage (the loop calls ``after_step`` at every optimizer-step boundary)::

    mgr = CheckpointManager("runs/a", {"model": model, "optim": opt, "sched": sched,
                                       "counters": counters}, data=loader,
                            every_steps=100, async_save=True)
    mgr.resume()                                  # newest checkpoint that verifies, or nothing
    for step in range(mgr.start_step + 1, total + 1):
        ...                                       # forward/backward over the micro-batches
        opt.step(); sched.step()
        mgr.after_step(step, metrics={"loss": loss})
        if mgr.should_stop:                       # SIGTERM/SIGUSR1: saved, now leave
            break
    mgr.close()

What it guarantees
==================
**Saves at step boundaries only.** ``after_step(step)`` saves when ``step`` is a multiple
of ``every_steps``, when ``every_seconds`` have passed since the last save, or when
SIGTERM/SIGUSR1 arrived since the last call. A signal only sets a flag (the handler does
no I/O); the save happens at the next boundary, synchronously, then ``should_stop``
turns true so the loop exits cleanly. Call ``after_step`` after ``optimizer.step()`` and
``scheduler.step()`` and never inside gradient accumulation: a boundary is where the
checklist (reference §6) says state is complete.

**Async save.** With ``async_save=True`` the loop blocks only while the state's tensors
are copied into one pre-allocated, reused staging buffer (``ckpt.staging``; pinned host
memory for CUDA sources) and the RNG and data cursors are captured. Writing and hashing
run in one background thread (``os.write`` and xxhash release the GIL). At most one save
is in flight: the next save waits for the previous one. A failure in the background is
raised as ``BackgroundSaveError`` by the next call into the manager (``after_step``,
``save``, ``wait``, ``resume`` or ``close``), never swallowed.

**Latest valid.** ``resume()`` lists committed ``step-*`` directories (``.tmp-*`` are
never candidates), newest first, and loads the first that loads: every chunk verified
and every check passed before any target is written (``ckpt.load`` is all or nothing).
It falls back past a checkpoint that is *damaged* (corrupt, truncated, content load
cannot take, removed meanwhile), each named in a ``ResumeFallbackWarning`` with the error
that disqualified it (file, chunk, offset), and past nothing else. An intact checkpoint
that does not fit the state (other keys, shapes or dtypes: a changed model) or the world
(no part for this rank) raises ``ResumeMismatchError`` naming the checkpoint, the key and
both shapes: no older checkpoint of the run would fit either, and a fresh start would
overwrite the run. Nothing in the run directory is changed, and the manager refuses to
save until a later resume succeeds. The strict exactness gate and a checkpoint of a newer
format version stop the resume too. :func:`latest` returns the checkpoint ``resume()``
will choose, and its config, without loading it; a config other than the checkpoint's is
named in one ``ConfigChangedWarning``. ``save(step)`` never replaces a committed checkpoint
unless asked (``overwrite=True``), except one the resume skipped as damaged.

**Retention.** ``RetentionPolicy``: keep the last K, keep every step divisible by N, keep
the best M by a metric passed to ``after_step(metrics=...)`` (stored in the manifest's
``meta``). The sets are computed separately and united; anything else is deleted, but
only after a new checkpoint has committed, and never the newest committed checkpoint
(the one a crash would resume from). Deletion renames into a ``.tmp-<step>-<hex>.del`` name first,
so a crash mid-delete leaves a directory no reader accepts rather than a torn checkpoint.
**Full disk:** once a save has failed for space (ENOSPC/EDQUOT), every later save of
this manager first deletes what its own commit would delete (planning as if it had
committed), so the run does not wedge; the checkpoints from the newest down to the
newest one that verifies in full are never deleted for this.

**One writer per run directory.** The manager holds an exclusive ``flock`` on
``<run_dir>/.ckpt-writer.lock`` from construction to ``close()`` (``ckpt.runlock``; rank 0
holds it for a distributed job). A second manager, in this process or another, gets
``RunDirLockedError`` naming the holder's pid and host; the kernel drops the lock when
the holder dies, SIGKILL included. Under the lock, leftovers of crashed saves are
cleaned at start (``ckpt.writer.recover``): a complete copy left under a ``.tmp-`` name
by a crash inside a commit is put back under its step name; other ``.tmp-*`` are removed,
except those a writer holds or changed within ``orphan_grace_s`` (a save that takes no
lock may still commit them). On an object store the lock is a lease renewed by a daemon
thread, taken over only after it expired; every commit and deletion proves it first
(``LeaseLostError``; spec/object-storage.md §O.6).
**Followers.** ``writer=False`` makes a manager that reads a run directory another one
writes (replicas of one data-parallel state: one writes, every one can ``resume()`` or
``rewind()`` from it): it takes no lock, never saves (``save()`` refuses) and never
deletes; ``set_writer(True)`` makes it the writer, waiting for the previous writer's
lock (released by ``close()`` or by its death), and ``set_writer(False)`` hands it back.

**Compression and dedup** (format 2.0, spec/format-2.md; both off by default).
``compress=`` is passed to every save (``True``: float tensors stored as BPZ1 byte planes +
zstd). ``dedup=True`` records a digest of every tensor, and a save shares by hard link the
files of the previous checkpoint (the last one committed or resumed from) whose tensors are
all unchanged, writing only the rest: frozen weights, embeddings and rarely updated EMA
copies cost their bytes once per run. Each checkpoint stays complete on its own (its own
directory entry for every byte), so retention deletes checkpoints as before and the
filesystem frees a file's bytes when no kept checkpoint links it. Shared bytes share their
fate (a damaged file fails every checkpoint that links it): ``dedup_full_every=K`` writes
everything at every K-th save. A save checks what it links (spec/format-2.md §V.4.6): a file
whose bytes changed is written again from memory (``SharedFileDamagedWarning``), and
retention does not count the checkpoints holding it toward ``keep_last``.

**Signals.** The SIGTERM/SIGUSR1 handlers chain: the handler installed before the
manager's is still called (after the flag is set), and ``close()`` puts it back unless
someone installed another handler after the manager's.

**Lineage.** Every checkpoint records ``run_id`` (kept across resumes: a resumed run is
the same run) and ``resumed_from`` (the content id and name of the checkpoint this
process resumed from), in each part's context and in the manifest ``meta``.

**Distributed.** When torch.distributed is initialised with more than one rank, saves go
through ``ckpt.distributed``: per-rank parts for RNG and data state, entries listed in
``replicated`` written once by rank 0, commit by rank 0 after every rank wrote. The
per-step decision (due by time, signal seen on any rank) is agreed with one small
all-reduce on the manager's own process group, so all ranks save the same steps.

Exact-resume checklist (what an exact resume must capture)
==========================================================
Handled, with where:

* A. Model ``state_dict`` with buffers, tied weights kept tied (writer de-duplication),
  master-weight dtype (dtypes are stored exactly). Frozen flags and EMA copies: pass them
  as entries (an EMA module is just another Stateful).
* B. Optimizer ``state_dict`` in full (``exp_avg``, ``exp_avg_sq``, ``step`` tensors,
  ``param_groups`` including ``foreach``/``fused``/``capturable`` flags, which live in
  ``param_groups``).
* C. Scheduler ``state_dict`` (``last_epoch``, ``_step_count``, ``_last_lr``, ``base_lrs``).
  Capture point: after ``optimizer.step`` and ``scheduler.step`` (``after_step``
  contract). Lambdas are not serialised: pass the run config as ``config=`` and its hash
  is recorded.
* D. ``GradScaler.state_dict`` when given as an entry (create it *before* ``resume()``).
  Autocast dtype: put it in ``config``.
* E. Counters: a plain dict entry (``{"tokens": 0, ...}``) is restored in place. Step:
  the checkpoint step. Micro-step: saves happen only at optimizer-step boundaries.
* F. RNG per process: Python, numpy global, torch CPU, every CUDA device, every
  registered ``torch.Generator`` (``generators=``), restored last. Order relative to
  ``iter(dataloader)``: ``ckpt.data.ResumableLoader`` gives its DataLoader a private
  generator, so creating an iterator draws nothing from the global RNG; for a plain
  ``DataLoader`` use ``resume(defer_rng=True)``, create the iterator, then
  ``restore_rng()`` (tested both ways).
* G. Data: ``ckpt.data.ResumableLoader`` state (epoch, samples consumed by the loop,
  seed, shard assignment, quarantine); per-sample RNG seeding makes worker RNG a
  function of (seed, epoch, position), so ``num_workers`` and prefetching do not matter.
* H. World size and topology are recorded; a different world size is named as an
  exactness difference on load.
* I/J. Determinism flags, thread counts, ``CUBLAS_WORKSPACE_CONFIG``, NCCL env,
  versions: recorded in every part and compared on load (``exactness="strict"`` refuses,
  ``"warn"`` names every difference). Commit SHA and config hash are recorded.

**Sharded state.** A state whose modules/optimizers hold DTensors (FSDP2, tensor
parallel) is saved through ``ckpt.dcp`` (one part per rank, DCP's planner, resharding
on resume to any world size and mesh; spec/sharded-format.md). Such saves are blocking
(``async_save`` does not apply): DCP's collectives share the default group with the loop.

Out of scope (documented, not handled): Megatron/DTensor RNG trackers; mps/xpu RNG; shuffle buffers and
token-packing remainders in the data layer; DDP bucket sizes, NCCL algorithm pinning and
collective order (recorded only where they are env variables); ``torch.compile`` caches
and the SDPA backend choice; section K (DiLoCo learner/syncer state) belongs to
``replay``. A plain ``DataLoader`` with a ``shuffle=True`` sampler or worker RNG is not
resumable mid-epoch; use ``ckpt.data``.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

from . import _linkcheck
from ._linkcheck import SharedFileDamagedWarning
from .context import prime as prime_context
from .dcp.layout import is_sharded
from .errors import (
    BackgroundSaveError,
    CheckpointExistsError,
    CkptError,
    EnvironmentMismatchError,
    ResumeMismatchError,
    RunDirLockedError,
    StateMismatchError,
    UnsupportedValueError,
    UnsupportedVersionError,
    WaitTimeoutError,
)
from .format.manifest import MANIFEST_NAME, decode_manifest
from .knobs import knobs
from .reader import CheckpointReader
from .save_options import SaveOptions
from .storage import Storage, is_space_error, resolve
from .writer import recover

__all__ = [
    "CheckpointManager",
    "RetentionPolicy",
    "CheckpointRecord",
    "SaveReport",
    "Rewind",
    "ResumeFallbackWarning",
    "ConfigChangedWarning",
    "LatestCheckpoint",
    "latest",
    "SharedFileDamagedWarning",
    "list_checkpoints",
    "plan_retention",
    "apply_retention",
    "delete_checkpoints",
    "checkpoint_name",
]

_NAME_RE = re.compile(r"^step-(\d{8,})$")


def checkpoint_name(step: int) -> str:
    """The directory name of a step's checkpoint in a run directory: ``step-NNNNNNNN``."""
    return f"step-{step:08d}"


class ResumeFallbackWarning(RuntimeWarning):
    """The newest checkpoint is damaged (it did not verify); an older one was used (the
    message says why). Never issued for a checkpoint that does not fit the live state:
    that stops the resume (``ResumeMismatchError``)."""


class ConfigChangedWarning(UserWarning):
    """A run resumed with a config other than the one its checkpoint recorded; the
    message names the keys that changed (and their old and new values)."""


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Which committed checkpoints survive. The three sets are separate and united."""

    keep_last: int = 2
    keep_every: int | None = None
    keep_best: int = 0
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the resume point is always kept), got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {self.keep_every}")
        if self.keep_best < 0:
            raise ValueError(f"keep_best must be >= 0, got {self.keep_best}")
        if self.keep_best and not self.best_metric:
            raise ValueError("keep_best needs best_metric")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    name: str
    path: str
    step: int
    committed: bool
    metrics: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class SaveReport:
    """Timings of one save. ``stall_s``: time the loop was blocked; ``background_s``:
    time spent writing, hashing and committing (in the background when async)."""

    step: int
    path: str
    asynchronous: bool
    stall_s: float
    background_s: float
    nbytes: int
    deleted: tuple[str, ...] = ()


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


def list_checkpoints(
    run_dir: str | os.PathLike[str], *, with_metrics: bool = False, storage: Storage | None = None
) -> list[CheckpointRecord]:
    """``step-*`` directories of a run, oldest first. Temporary dirs are never listed."""
    storage, root = resolve(run_dir, storage)
    root = storage.commit.record_path(os.fspath(run_dir), root)
    try:
        names = storage.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _NAME_RE.match(name)
        if not m:
            continue
        path = os.path.join(root, name)
        committed = storage.isfile(os.path.join(path, MANIFEST_NAME))
        metrics = None
        if with_metrics and committed:
            try:
                mpath = os.path.join(path, MANIFEST_NAME)
                size = storage.lstat(mpath).st_size
                if size > knobs().max_manifest_bytes + 64:  # never read more than a reader would
                    raise CkptError("MANIFEST above the size limit", path=mpath)
                man = decode_manifest(storage.read(mpath, 0, size), path=path)
                got = man.meta.get("metrics")
                metrics = dict(got) if isinstance(got, dict) else None
            except (OSError, CkptError):
                metrics = None  # unreadable: protected by step rules only
        out.append(CheckpointRecord(name, path, int(m.group(1)), committed, metrics))
    out.sort(key=lambda r: r.step)
    return out


@dataclass(frozen=True, slots=True)
class LatestCheckpoint:
    """The checkpoint ``resume()`` will load, found without loading it (:func:`latest`).

    ``config`` is the config saved with it (its canonical form: maps, lists, plain
    values; ``None`` if the run saved none), ``config_hash`` its hash; ``skipped`` names
    the newer checkpoints passed over as damaged, each with the error."""

    path: str
    name: str
    step: int
    id: str
    config: Any
    config_hash: str | None
    skipped: tuple[tuple[str, str], ...] = ()


def latest(run_dir: str | os.PathLike[str], *, verify: bool = True, storage: Storage | None = None
           ) -> LatestCheckpoint | None:
    """The checkpoint ``CheckpointManager.resume()`` will choose in ``run_dir``, and its
    config, without loading any tensor into anything: the newest committed ``step-*``
    that verifies (``verify=False``: the newest whose MANIFEST and structure decode,
    which reads no tensor bytes, as ``ckpt inspect --latest`` does). ``None`` when none
    qualifies. Read the model's shape from ``.config`` before building the model::

        found = ckpt.latest("runs/gpt")
        cfg = found.config["model"] if found else default_model_config
    """
    storage, _ = resolve(run_dir, storage)  # one backend for the listing and the readers
    skipped: list[tuple[str, str]] = []
    for rec in reversed(list_checkpoints(run_dir, storage=storage)):
        if not rec.committed:
            continue
        try:
            reader = CheckpointReader(rec.path, storage=storage)
            pe = reader.parts[0]
            if verify:
                reader.verify()
            else:
                reader.tree(pe.name, verify=False)
            saved = (reader.tree(pe.name, verify=False)["context"].get("config") or {}).get("hash")
            config = reader.config(pe.name)
        except UnsupportedVersionError:
            raise  # resume() stops here too: a newer writer's checkpoint is not damage
        except (CkptError, OSError) as e:  # damaged: resume() falls back past it as well
            skipped.append((rec.name, f"{type(e).__name__}: {e}"))
            continue
        return LatestCheckpoint(reader.path, rec.name, int(reader.step if reader.step is not None else rec.step),
                                str(reader.manifest.id), config, saved, tuple(skipped))
    return None


def config_changes(saved: Any, live: Any, *, limit: int = 10) -> list[str]:
    """The keys (dotted paths) whose values differ between two configs' canonical
    forms, each as ``key: old -> new`` (at most ``limit``, then a count)."""
    from .context.config import canonicalize

    def flat(obj: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
        if isinstance(obj, dict) and obj:
            for k, v in obj.items():
                flat(v, f"{prefix}.{k}" if prefix else str(k), out)
        else:
            out[prefix or "(config)"] = obj
        return out

    a, b = flat(canonicalize(saved), "", {}), flat(canonicalize(live), "", {})
    missing = object()
    keys = sorted(k for k in set(a) | set(b) if a.get(k, missing) != b.get(k, missing))

    def show(v: Any) -> str:
        text = "(absent)" if v is missing else repr(v)
        return text if len(text) <= 40 else text[:37] + "..."

    out = [f"{k}: {show(a.get(k, missing))} -> {show(b.get(k, missing))}" for k in keys[:limit]]
    if len(keys) > limit:
        out.append(f"and {len(keys) - limit} more")
    return out


def warn_config_changed(path: str, context: Mapping[str, Any], live: Any, *, stacklevel: int = 2) -> list[str]:
    """One ``ConfigChangedWarning`` when ``live`` (the resuming run's config) differs from
    the config a checkpoint's ``context`` recorded; returns the changes (empty: none, or
    nothing to compare because either side has no config)."""
    saved = context.get("config")
    if live is None or not saved:
        return []
    from .context.config import config_hash
    from .format.codec import unpackb

    if config_hash(live) == saved.get("hash"):
        return []
    changes = config_changes(unpackb(saved["canonical"], path=path, what="config"), live)
    if changes:
        warnings.warn(f"resuming from {path} with a changed config: " + "; ".join(changes),
                      ConfigChangedWarning, stacklevel=stacklevel + 1)
    return changes


def plan_retention(records: Sequence[CheckpointRecord], policy: RetentionPolicy, *,
                   damaged: Iterable[str] = ()) -> dict[str, tuple[str, ...]]:
    """Which committed checkpoints to keep, and why (``name -> reasons``).

    Committed checkpoints not in the result are to be deleted. The newest committed one
    is always kept (``"resume-point"``). ``damaged``: checkpoints known to hold bytes that
    do not verify (a shared file found damaged, spec/format-2.md §V.4.6). They do not count
    toward ``keep_last``, so a damaged file never costs the last checkpoints that load;
    those newer than the oldest one kept are kept too (``"damaged"``), since what
    retention deletes is always older than what it keeps (§10.7).
    """
    committed = [r for r in records if r.committed]
    keep: dict[str, list[str]] = {}
    if not committed:
        return {}
    keep.setdefault(committed[-1].name, []).append("resume-point")
    bad = frozenset(damaged)
    lasts = [r for r in committed if r.name not in bad][-policy.keep_last :] or committed[-policy.keep_last :]
    for r in lasts:
        keep.setdefault(r.name, []).append("last")
    for r in committed:
        if r.name in bad and r.step > lasts[0].step and r.name not in keep:
            keep.setdefault(r.name, []).append("damaged")
    if policy.keep_every:
        for r in committed:
            if r.step % policy.keep_every == 0:
                keep.setdefault(r.name, []).append("every")
    if policy.keep_best and policy.best_metric:
        scored = []
        for r in committed:
            v = (r.metrics or {}).get(policy.best_metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:  # NaN never "best"
                scored.append((float(v), r.step, r.name))
        sign = 1.0 if policy.best_mode == "min" else -1.0
        # Ties go to the older step: a later equal score does not evict a kept best.
        scored.sort(key=lambda s: (sign * s[0], s[1]))
        for _, _, name in scored[: policy.keep_best]:
            keep.setdefault(name, []).append("best")
    return {k: tuple(v) for k, v in keep.items()}


# resume() falls back only past a checkpoint that is damaged (corrupt, truncated,
# re-signed with content load cannot take, vanished). What every older checkpoint of the
# run would fail too stops it, because falling back past all of them starts the run
# afresh and its saves then replace the run's checkpoints: the strict exactness gate, a
# checkpoint written by a newer format version, and a state or world that does not fit
# (ResumeMismatchError, told apart in _mismatch).
_REFUSALS: tuple[type[BaseException], ...] = (EnvironmentMismatchError, UnsupportedVersionError)


@dataclass(slots=True)
class _Job:
    step: int
    path: str
    state: dict[str, Any]
    data: Any
    rng: dict[str, Any]
    extra: Any
    meta: dict[str, Any]
    lineage: dict[str, Any]
    stall_s: float
    nbytes: int
    asynchronous: bool
    report: SaveReport | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class CheckpointManager:
    """Checkpoints of one run, saved at step boundaries and resumed exactly.

    ``state`` maps names to Statefuls (modules, optimizers, schedulers, scalers) or plain
    trees (counters), as for ``ckpt.save``. Options are keyword-only.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        state: Mapping[str, Any],
        *,
        data: Any = None,
        generators: Mapping[str, Any] | None = None,
        config: Any = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        retention: RetentionPolicy | None = None,
        async_save: bool = False,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
        run_id: str | None = None,
        replicated: Sequence[str] = (),
        exactness: Literal["strict", "warn", "off"] = "warn",
        pin_memory: bool | None = None,
        code_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        storage: Storage | None = None,
        ledger: bool = True,
        ledger_params_every: int = 10,
        verify_resume: Literal["strict", "warn", "off"] = "warn",
        compress: Any = None,
        dedup: bool = False,
        dedup_full_every: int = 0,
        writer: bool = True,
    ) -> None:
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 or None, got {every_steps}")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError(f"every_seconds must be > 0 or None, got {every_seconds}")
        if exactness not in ("strict", "warn", "off"):
            raise ValueError(f"exactness must be 'strict', 'warn' or 'off', not {exactness!r}")
        if dedup_full_every < 0:
            raise ValueError(f"dedup_full_every must be >= 0 (0: never), got {dedup_full_every}")
        _check_data_source(data)
        # The one resolver: a local directory, or an object-store prefix (s3://...).
        self._storage, self.run_dir = resolve(run_dir, storage)
        self.state = dict(state)
        self.data = data
        self.generators = dict(generators or {})
        self.config = config
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.retention = retention or RetentionPolicy()
        self.async_save = async_save
        self.replicated = tuple(replicated)
        self.exactness = exactness
        self.code_dir = code_dir
        #: format 2.0 options passed to every save (spec/format-2.md): ``compress`` as for
        #: ``ckpt.save``; ``dedup`` shares the files of the previous checkpoint whose tensors
        #: did not change (hard links); every ``dedup_full_every``-th save writes everything
        self.compress = compress
        self.dedup = dedup
        #: how every save of this manager is written, passed on unchanged (``overwrite``: a
        #: step re-run after falling back past a corrupt checkpoint replaces it)
        self.save_options = SaveOptions(overwrite=True, compress=compress, dedup=dedup)
        self.dedup_full_every = dedup_full_every
        self._dedup_source: str | None = None  # the checkpoint the next save may share files of
        self._dedup_saves = 0
        self._clock = clock
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.resumed_from: dict[str, Any] | None = None
        self._start_step = 0
        self._last_save_step: int | None = None
        self._last_save_time = clock()
        self._signal: int | None = None
        self._stop = False
        self._inflight: _Job | None = None
        self._worker: _SaveWorker | None = None
        self._failed: _Job | None = None
        self._deferred_rng: dict[str, Any] | None = None
        self._closed = False
        self._space_short = False
        #: reports of completed saves, oldest first
        self.reports: list[SaveReport] = []
        self.ledger: Any = None
        #: the ``LoadResult`` of the last ``resume()`` or ``rewind()``
        self.last_load: Any = None
        # The loss-spike guard (ckpt.guard.LossGuard) attached to this manager, if any,
        # and what retention keeps for it: the newest checkpoint at or below the floor.
        self._guard: Any = None
        self._floor: int | None = None
        self._verified: set[tuple[str, str]] = set()
        # Set when resume() or rewind() found that the run's checkpoint does not fit the
        # live state (or world): this manager then never saves, since its saves would
        # replace the run's checkpoints. Cleared by a later load that succeeds.
        self._refusal: ResumeMismatchError | None = None
        # The checkpoints the last resume()/rewind() skipped as damaged: a save of their
        # step replaces them without overwrite=True (the re-run step's checkpoint).
        self._replaceable: set[str] = set()
        # checkpoint name -> holds a file found damaged, as of that many findings (_damaged)
        self._damage_scan: tuple[int, dict[str, bool]] = (0, {})

        from .staging import Staging

        self._staging = Staging(pin_memory=pin_memory) if async_save else None

        from .distributed import DistributedCheckpointer, is_distributed

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
        from .dcp.integration_probe import holds_dtensor

        #: DTensor state (FSDP2/TP): saved and resumed through ckpt.dcp (sharded hook)
        self.sharded = holds_dtensor(self.state)
        if self.sharded:
            from .dcp.integration import refuse_sharded_options

            refuse_sharded_options(self.save_options, self.run_dir, where="CheckpointManager on sharded (DTensor) state")
        if missing := [k for k in self.replicated if k not in self.state]:
            raise ValueError(f"replicated entries {missing} are not in the state")

        # One writer per run directory: rank 0 holds the lock for the whole job, taken
        # before orphan cleanup (which would otherwise delete a live writer's saves).
        self._lock: Any = None  # what storage.commit.run_lock returned (an flock, a lock object)
        self.removed_orphans: tuple[str, ...] = ()
        #: (temporary name, step name) of complete copies put back after a crash
        self.restored_orphans: tuple[tuple[str, str], ...] = ()
        refusal: BaseException | None = None
        # A follower (writer=False) of a run directory another manager writes: it lists
        # and loads (resume, rewind) but never locks, saves or deletes; set_writer(True)
        # makes it the writer (replicated training: one replica writes, all can roll back).
        self._writer = bool(writer)
        if self.rank == 0 and self._writer:
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
            self._release_lock()
            raise refusal

        if self._writer:
            # git and uname run here, on the loop's thread: never on the save thread, where a
            # DataLoader forking workers meanwhile deadlocks them (ckpt.context.provenance).
            prime_context(self.code_dir)

        # The step ledger (ckpt.ledger): created now, after seeding, so its RNG baseline
        # is the streams' start values; "unused, not compared" is judged against it.
        self.ledger = self._make_ledger(ledger_params_every, verify_resume) if ledger else None

        self._old_handlers: dict[int, Any] = {}
        if signals and threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        elif signals:
            warnings.warn("CheckpointManager created off the main thread: no signal handlers installed", RuntimeWarning, stacklevel=2)

    # -- properties --------------------------------------------------------------------
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

    def checkpoints(self) -> list[CheckpointRecord]:
        """The run directory's checkpoints, oldest first, with the metrics retention ranks them by."""
        return list_checkpoints(self.run_dir, with_metrics=True, storage=self._storage)

    def latest(self, *, verify: bool = True) -> LatestCheckpoint | None:
        """The checkpoint :meth:`resume` will load, and its config, without loading it
        (:func:`latest`)."""
        return latest(self.run_dir, verify=verify, storage=self._storage)

    # -- signals -----------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens at the next step boundary, in the loop's thread.
        if not self._closed:
            self._signal = signum
        # Chain: the handler installed before ours still runs (a user's logging, a
        # launcher's cleanup). SIG_DFL/SIG_IGN are not called: the default action of
        # SIGTERM would kill the process before the save this handler exists for.
        prev = self._old_handlers.get(signum)
        if callable(prev):
            prev(signum, frame)

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """What the signal handler does; for tests and for cooperative preemption."""
        self._signal = signum

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
        if self._guard is not None:
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
        from .ledger import ENV_DIR, Ledger

        root = os.environ.get(ENV_DIR)
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
        if not self._writer:  # a follower saves nothing; a signal still stops its loop
            self._stop = self._stop or self._signal is not None
            return False
        due = bool(self.every_steps and step % self.every_steps == 0)
        if self.every_seconds is not None and self._clock() - self._last_save_time >= self.every_seconds:
            due = True
        sig = self._signal is not None
        if self._ctl is not None:
            due_i, sig_i = self._ctl.all_reduce_max([int(due), int(sig)])
            due, sig = bool(due_i), bool(sig_i)
        if step == self._last_save_step:
            due = False  # already saved (or resumed from) this very state
        if sig:
            # Preemption: save synchronously (unless this state is saved already), then stop.
            saved = step != self._last_save_step
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
        if not self._writer:
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
            if self.ledger is not None:
                self.ledger.close()
            for sig in self._old_handlers:
                try:
                    # Only if ours is still installed: a handler installed after ours
                    # (which may chain to ours) is not overwritten. Ours stays in its
                    # chain, closed: it only forwards to the previous handler.
                    if signal.getsignal(sig) == self._on_signal:
                        signal.signal(sig, _first_open_handler(self, sig))
                except (ValueError, TypeError):  # pragma: no cover - not main thread
                    pass
            hung = self._inflight is not None and not self._inflight.done.is_set()
            if self._worker is not None:
                self._worker.stop(join=not hung)
                self._worker = None
            if self._staging is not None:
                self._staging.release()
            if not hung:  # a save still running (reported by wait()) may yet commit: the run stays locked
                self._release_lock()

    def _take_lock(self, *, wait: bool) -> None:
        self._storage.makedirs(self.run_dir)
        owner = {"run_id": self.run_id, "world_size": self.world_size}
        # an flock on a filesystem, a lease object on an object store (§O.6)
        self._lock = self._storage.commit.run_lock(self.run_dir, owner=owner, wait=wait)
        # the run as its writer sees it: on an object store every commit and deletion then
        # proves the lease first (LeaseLostError once another writer took the run over)
        self._unlocked_storage = self._storage
        self._storage = self._storage.commit.holding(self._lock)
        rec = recover(self.run_dir, names=lambda n: bool(_NAME_RE.match(n)), storage=self._storage)
        self.removed_orphans, self.restored_orphans = rec.removed, rec.restored

    @property
    def writer(self) -> bool:
        """Whether this manager writes the run directory (``False``: a follower)."""
        return self._writer

    def set_writer(self, on: bool, *, wait: bool = True) -> None:
        """Become the run directory's writer (take its lock: with ``wait``, block until
        the previous writer closes or dies; clean leftovers of crashed saves) or stop
        being it (finish the save in flight, release the lock). Single-process managers
        only: a distributed job's rank 0 is its writer for good."""
        self._check_open()
        if self._ctl is not None:
            raise CkptError("set_writer is for a single-process manager; a distributed job's rank 0 is its writer",
                            path=self.run_dir)
        if bool(on) == self._writer:
            return
        if on:
            self._take_lock(wait=wait)
            self._writer = True
        else:
            self.wait()
            self._release_lock()
            self._writer = False

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._storage = self._unlocked_storage
            self._lock.release()
            self._lock = None

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
        loaded = self._load_first(self._candidates(lambda r: True), defer_rng=defer_rng, exactness=exactness)
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
        if self._guard is not None:
            self._guard._restore(result, rewound=False)
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
        loaded = self._load_first(self._candidates(keep), defer_rng=False, exactness=exactness)
        if loaded is None:
            return None
        result, choice, fallbacks = loaded
        target = int(result.step or 0)
        discarded: tuple[str, ...] = ()
        if self.rank == 0 and self._writer:  # a follower leaves the deleting to the writer
            newer = [r for r in list_checkpoints(self.run_dir, storage=self._storage) if r.committed and r.step > target]
            discarded = delete_checkpoints(self.run_dir, newer, storage=self._storage)
        self._loaded(result, choice)
        return Rewind(result, choice, target, discarded, tuple(fallbacks))

    def _loaded(self, result: Any, choice: str) -> None:
        self._refusal = None  # the state fits the run again: its saves are the run's
        self.resumed_from = {"id": result.id, "name": choice, "step": result.step}
        self.last_load = result
        self._dedup_source = os.path.join(self.run_dir, choice)
        self._start_step = int(result.step or 0)
        self._last_save_step = self._start_step
        self._last_save_time = self._clock()

    def _candidates(self, keep: Callable[[CheckpointRecord], bool]) -> list[str]:
        """Names of the committed checkpoints ``keep`` accepts, newest first (rank 0 lists,
        every rank gets the same list)."""
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

    def _load_first(self, names: Sequence[str], *, defer_rng: bool, exactness: str | None
                    ) -> tuple[Any, str, list[str]] | None:
        """Load the first of ``names`` that loads (``resume()``'s fallback rule); returns
        (result, its name, the names skipped before it), or None."""
        from ._torchio import prepare_load

        skipped: list[str] = []
        changed: Exception | None = None  # an apply failed: targets stay unusable until a load succeeds
        result = None
        for choice in names:
            path = os.path.join(self.run_dir, choice)
            prepared = None
            error: BaseException | None = None
            sharded = False
            try:
                reader = CheckpointReader(path, storage=self._storage)
                sharded = is_sharded(reader.manifest)  # --- sharded hook (ckpt.dcp) ---
                part = None
                if len(reader.parts) > 1 or self._dist is not None:
                    from .writer import part_name_for_rank

                    part = part_name_for_rank(self.rank)
                    if not sharded and part not in reader.parts.names:
                        raise self._world_mismatch(reader, part)
                if sharded:
                    # every chunk of every rank's part, before any target is written
                    if self.rank == 0:
                        reader.verify()
                else:
                    # Every check and the hash of every chunk, before any target is written.
                    prepared = prepare_load(
                        reader,
                        self.state,
                        part=part,
                        data=self.data,
                        # deferred: restore_rng() restores the generators with the other streams
                        generators=None if defer_rng else (self.generators or None),
                        restore_rng_state=not defer_rng,
                        verify=True,
                        exactness=exactness or self.exactness,
                    )
            except Exception as e:  # damage is skipped below; a mismatch or a refusal stops
                error = e
            mismatch = self._mismatch(error, path) if isinstance(error, StateMismatchError) else None
            failed, refused, misfit = error is not None, isinstance(error, _REFUSALS), mismatch is not None
            if self._ctl is not None:  # all ranks load the same checkpoint or none does
                failed, refused, misfit = (
                    bool(v) for v in self._ctl.all_reduce_max([int(failed), int(refused), int(misfit)])
                )
            if misfit or refused:  # every rank raises together (none waits in a collective)
                if prepared is not None:
                    prepared.close()
                if misfit:
                    raise self._refuse(mismatch or ResumeMismatchError(
                        f"cannot resume {self.run_dir} from {path}: another rank's state or world does not fit this "
                        "checkpoint (that rank's error names the key). Nothing in the run directory was changed; "
                        "this manager will not save", path=path))
                if isinstance(error, _REFUSALS):
                    raise error
                raise CkptError("another rank refused this checkpoint (strict exactness gate, format version)", path=path)
            if failed:
                if prepared is not None:
                    prepared.close()
                why = f"{type(error).__name__}: {error}" if error is not None else "another rank could not load it"
                warnings.warn(f"skipping {path}: {why}", ResumeFallbackWarning, stacklevel=3)
                skipped.append(choice)
                continue
            if sharded:  # collective: DCP reshards onto this job's shards
                from .dcp.integration import load_sharded

                try:
                    result = load_sharded(
                        reader, self.state, data=self.data, generators=self.generators or None,
                        restore_rng=not defer_rng, verify=self.rank != 0, exactness=exactness or self.exactness,
                    )
                except StateMismatchError as e:
                    raise self._refuse(self._mismatch(e, path)) from e
                break
            assert prepared is not None
            try:
                result = prepared.apply()
            except Exception as e:  # a file changed between the passes, a Stateful refused
                if isinstance(e, StateMismatchError):  # load_state_dict refused it: not damage
                    raise self._refuse(self._mismatch(e, path, applied=True)) from e
                if self._ctl is not None:
                    raise  # ranks cannot agree on a fallback after some applied theirs
                # The targets may be mixed now: only a complete load of an older
                # checkpoint (which rewrites every target) makes them usable again.
                changed = e
                warnings.warn(f"skipping {path}: {type(e).__name__}: {e}", ResumeFallbackWarning, stacklevel=3)
                skipped.append(choice)
                continue
            break
        self._replaceable = set(skipped)  # damaged: the re-run steps may replace them
        if result is None:
            if changed is not None:
                raise changed
            return None
        return result, choice, skipped

    def _mismatch(self, error: StateMismatchError, path: str, *, applied: bool = False) -> ResumeMismatchError:
        """The resume refusal for a checkpoint that is intact but does not fit the state."""
        if isinstance(error, ResumeMismatchError):
            return error
        ctx = dict(error.context)  # saved_shape/target_shape and dtypes, where a tensor differs
        where = (
            "Some targets were already written (a Stateful's load_state_dict refused the rest): "
            "do not train with them. " if applied else ""
        )
        return ResumeMismatchError(
            f"cannot resume {self.run_dir} from {path}: the state does not fit this checkpoint: {error.message}"
            f"{self._config_note(path)}. "
            "The checkpoint is intact, so resume() does not fall back past it (no older checkpoint of the run "
            f"fits either, and starting afresh would overwrite the run). {where}Nothing in the run directory was "
            "changed and this manager will not save. Build the state the run was saved with (ckpt.latest(run_dir) "
            "returns its config without loading it), or start the changed one in a new run directory",
            path=path, key=error.key, **ctx,
        )

    def _config_note(self, path: str) -> str:
        """How this run's config differs from the checkpoint's, for a mismatch message
        (a changed model usually comes with a changed config: name it)."""
        if self.config is None:
            return ""
        try:
            reader = CheckpointReader(path, storage=self._storage)
            saved = reader.tree(reader.parts[0].name)["context"].get("config")  # the structure file only
            if not saved:
                return ""
            from .context.config import config_hash
            from .format.codec import unpackb

            if config_hash(self.config) == saved.get("hash"):
                return ""
            changes = config_changes(unpackb(saved["canonical"], path=path, what="config"), self.config)
        except (CkptError, OSError):
            return ""
        return f" (the config differs too: {'; '.join(changes)})" if changes else ""

    def _world_mismatch(self, reader: CheckpointReader, part: str) -> ResumeMismatchError:
        names = list(reader.parts.names)
        return ResumeMismatchError(
            f"cannot resume {self.run_dir} from {reader.path}: this job has world size {self.world_size} but the "
            f"checkpoint was saved by {len(names)} rank(s) (parts {names[:8]}): there is no part {part!r} for rank "
            f"{self.rank}. The checkpoint is intact, so resume() does not fall back past it. Nothing in the run "
            f"directory was changed and this manager will not save. Resume with the saving world size, or save "
            "sharded state (ckpt.dcp), which reshards on resume",
            path=reader.path, key=part, saved_world_size=len(names), world_size=self.world_size,
        )

    def _refuse(self, error: ResumeMismatchError) -> ResumeMismatchError:
        self._refusal = error
        return error

    def restore_rng(self) -> list[str]:
        """Restore the RNG streams held back by ``resume(defer_rng=True)``."""
        from .context.rng import restore_rng

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
            r = self._refusal
            raise ResumeMismatchError(
                f"this CheckpointManager does not save: its resume was refused because the state does not fit "
                f"the run's checkpoint ({r.message}); the run's checkpoints stay as they are. Build the state the "
                "run was saved with, or start the changed one in a new run directory",
                path=r.path, key=r.key, **r.context,
            )
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
        from .context.rng import capture_rng
        from .staging import frozen_stateful

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
            from .writer import Replicated

            for k in self.replicated:
                state[k] = Replicated("rank-00000")
        data_obj = frozen_stateful(self.data, data_sd) if self.data is not None else None
        meta = self._meta(metrics)
        lineage = {
            "run_id": self.run_id,
            "resumed_from": self.resumed_from["id"] if self.resumed_from else None,
            "resumed_from_name": self.resumed_from["name"] if self.resumed_from else None,
        }
        job = _Job(
            step=step,
            path=os.path.join(self.run_dir, checkpoint_name(step)),
            state=state,
            data=data_obj,
            rng=rng,
            extra=extra,
            meta=meta,
            lineage=lineage,
            stall_s=0.0,
            nbytes=nbytes,
            asynchronous=not block,
        )
        self._last_save_step = step
        self._last_save_time = self._clock()
        if block:
            self._run(job)
            job.stall_s = time.perf_counter() - t0
            if job.report is not None:
                self.reports[-1] = _with_stall(job.report, job.stall_s)
            if job.error is not None:
                self._failed = job
                self._raise_failure()
            return
        job.stall_s = time.perf_counter() - t0
        prime_context(self.code_dir)  # cached after the first call (a follower made writer)
        self._inflight = job
        if self._worker is None:
            self._worker = _SaveWorker(self._run)
        self._worker.submit(job)

    def _run(self, job: _Job) -> None:
        from .writer import abort, begin, commit, write_part

        t0 = time.perf_counter()
        freed: tuple[str, ...] = ()
        try:
            options = dataclasses.replace(self.save_options, reuse=self._reuse())
            if self._space_short and self.rank == 0:
                # The disk filled up before: retention after a commit can never run
                # again if no commit fits, so delete now what the commit would delete.
                freed = self._apply_retention(upcoming=job.step)
            if self._dist is not None:
                self._dist.save(
                    job.path,
                    job.state,
                    step=job.step,
                    config=self.config,
                    data=job.data,
                    rng=job.rng,
                    extra=job.extra,
                    lineage=job.lineage,
                    meta=job.meta,
                    code_dir=self.code_dir,
                    storage=self._storage,
                    options=options,
                )
            else:
                pending = begin(job.path, overwrite=options.overwrite, storage=self._storage)
                try:
                    part = write_part(
                        pending,
                        "rank-00000",
                        job.state,
                        step=job.step,
                        config=self.config,
                        data=job.data,
                        rng=job.rng,
                        extra=job.extra,
                        lineage=job.lineage,
                        code_dir=self.code_dir,
                        storage=self._storage,
                        options=options,
                    )
                    commit(pending, [part], step=job.step, meta=job.meta, storage=self._storage)
                except BaseException:
                    abort(pending, storage=self._storage)
                    raise
            if self.dedup:
                self._dedup_source = job.path  # the newest commit: retention never deletes it
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
            job.data = None
            job.done.set()

    def _reuse(self) -> Any:
        """This rank's part of the previous checkpoint, for a dedup save to share files of
        (format-2.md §V.4); None for a full save. Every rank decides alike: the source and
        the save count are the same on all of them."""
        if not self.dedup or self._dedup_source is None:
            return None
        self._dedup_saves += 1
        if self.dedup_full_every and self._dedup_saves % self.dedup_full_every == 0:
            return None  # a full save bounds how many checkpoints share one file's fate
        from .writer import part_name_for_rank, reuse_from

        return reuse_from(self._dedup_source, part_name_for_rank(self.rank), storage=self._storage)

    def _save_sharded(self, step: int, metrics: Mapping[str, Any] | None, extra: Any, t0: float) -> None:
        """Sharded hook (ckpt.dcp): a collective DCP save on this thread, every rank
        together. It blocks (DCP's collectives run on the default group, which the
        training loop also uses; a background thread would interleave with it)."""
        from .dcp.integration import save_sharded

        path = os.path.join(self.run_dir, checkpoint_name(step))
        meta = self._meta(metrics)
        lineage = {
            "run_id": self.run_id,
            "resumed_from": self.resumed_from["id"] if self.resumed_from else None,
            "resumed_from_name": self.resumed_from["name"] if self.resumed_from else None,
        }
        self._last_save_step = step
        self._last_save_time = self._clock()
        info = save_sharded(
            path, self.state, config=self.config, data=self.data, step=step, generators=self.generators or None,
            extra=extra, lineage=lineage, code_dir=self.code_dir, meta=meta, storage=self._storage,
            options=self.save_options,
        )
        deleted = self._apply_retention() if self.rank == 0 else ()
        stall = time.perf_counter() - t0
        self.reports.append(SaveReport(step, path, False, stall, stall, info.bytes, deleted))

    def _meta(self, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
        meta = {"run_id": self.run_id, "metrics": dict(metrics or {}), "resumed_from": self.resumed_from}
        if self._guard is not None:
            meta["guard"] = self._guard._state()  # spec/loss-guard.md §5
        return meta

    # -- housekeeping ------------------------------------------------------------------
    def _apply_retention(self, *, upcoming: int | None = None) -> tuple[str, ...]:
        """Delete what the policy does not keep. With ``upcoming`` (a save about to be
        written on a full disk), plan as if it had committed, but never delete the
        newest checkpoint that verifies: if the save fails, that is the resume point.
        With a guard attached, never delete its rollback target either (``_floor_keep``)."""
        protect: set[str] = set()
        if upcoming is not None:
            protect = self._newest_valid(list_checkpoints(self.run_dir, storage=self._storage))
        floor = self._floor
        if floor is not None:
            protect |= self._floor_keep(list_checkpoints(self.run_dir, storage=self._storage), floor)
        damaged = self._damaged() if self.dedup else set()
        return apply_retention(self.run_dir, self.retention, storage=self._storage,
                               protect=protect, upcoming=upcoming, damaged=damaged)

    def _damaged(self) -> set[str]:
        """The committed checkpoints holding a file that a dedup save of this process found
        damaged (spec/format-2.md §V.4.6): retention does not count them as kept."""
        seen = _linkcheck.damaged_count()
        if not seen:
            return set()
        if self._damage_scan[0] != seen:  # a new finding: what was scanned before is stale
            self._damage_scan = (seen, {})
        scanned = self._damage_scan[1]
        out = set()
        committed = [r for r in list_checkpoints(self.run_dir, storage=self._storage) if r.committed]
        for r in committed:
            # the newest is scanned every time: a save may have replaced it under its name
            if r.name not in scanned or r is committed[-1]:
                storage, root = resolve(r.path, self._storage)
                try:
                    names = storage.listdir(root)
                except OSError:
                    continue
                scanned[r.name] = any(_linkcheck.is_damaged(storage, os.path.join(root, n)) for n in names)
            if scanned[r.name]:
                out.add(r.name)
        # The guard's cache of verified checkpoints assumed committed files never change.
        self._verified = {key for key in self._verified if key[0] not in out}
        return out

    def _floor_keep(self, records: Sequence[CheckpointRecord], floor: int) -> set[str]:
        """The loss-spike guard's retention rule (spec/loss-guard.md §8): every committed
        checkpoint above ``floor`` (each becomes the target as the floor advances), the
        newest at or below it and, while that one does not verify, each older one down
        to the newest that does. Each checkpoint is verified at most once (by name and
        content id: committed files never change)."""
        out = {r.name for r in records if r.committed and r.step > floor}
        for r in reversed([r for r in records if r.committed and r.step <= floor]):
            out.add(r.name)
            try:
                reader = CheckpointReader(r.path, storage=self._storage)
                key = (r.name, reader.manifest.id)
                if key not in self._verified:
                    reader.verify()
                    self._verified.add(key)
            except (CkptError, OSError):
                continue
            break
        return out

    def _newest_valid(self, records: Sequence[CheckpointRecord]) -> set[str]:
        """Names of the committed checkpoints from the newest down to the newest one that
        verifies in full (all of them if none does): none of these may be deleted."""
        out: set[str] = set()
        for r in reversed([r for r in records if r.committed]):
            out.add(r.name)
            try:
                CheckpointReader(r.path, storage=self._storage).verify()
            except (CkptError, OSError):
                continue
            break
        return out


def _first_open_handler(closed: CheckpointManager, sig: int) -> Any:
    """The handler to restore when ``closed`` leaves the top of ``sig``'s chain: the one it
    replaced, skipping every manager closed meanwhile. Managers closed in creation order
    leave the older ones in the chain (each was under a newer one then); restoring the
    newest one's predecessor as such would install a closed manager's handler, which
    never calls SIG_DFL, and SIGTERM would be ignored for the rest of the process."""
    handler = closed._old_handlers[sig]
    for _ in range(1024):  # one hop per manager ever created; bounded against a cycle
        owner = getattr(handler, "__self__", None)
        if not (isinstance(owner, CheckpointManager) and getattr(handler, "__func__", None) is CheckpointManager._on_signal
                and owner._closed and sig in owner._old_handlers):
            break
        handler = owner._old_handlers[sig]
    return handler


class _SaveWorker:
    """The one long-lived thread that runs a manager's asynchronous saves, in order.

    A thread started per save made ``save`` wait until the new thread had been
    scheduled and had run (``Thread.start`` blocks for that): on a busy 2-core machine,
    milliseconds of stall beyond the staging copy. This thread is started once, at the
    first async save, at a lower CPU priority, and is handed each job through a queue,
    which does not wait. Interpreter exit still waits for a save in flight, as it did:
    the thread is not a daemon, and once the main thread has ended it finishes what it
    was given and stops (an idle one notices within ``_POLL_S``).
    """

    _POLL_S = 0.5

    def __init__(self, run: Callable[[Any], None]) -> None:
        self._run = run
        self._start()

    def _start(self) -> None:
        self._jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, args=(self._jobs,), name="ckpt-save", daemon=False)
        self._thread.start()

    def _loop(self, jobs: "queue.SimpleQueue[Any]") -> None:
        _lower_thread_priority(knobs().save_thread_nice)
        main = threading.main_thread()
        while True:
            try:
                job = jobs.get(timeout=self._POLL_S)
            except queue.Empty:
                if not main.is_alive():
                    return
                continue
            if job is None:
                return
            self._run(job)

    def submit(self, job: Any) -> None:
        if not self._thread.is_alive():  # a forked child, or a worker that saw the main thread end
            self._start()
        self._jobs.put(job)

    def stop(self, *, join: bool = True) -> None:
        """Stop after the jobs given; with ``join``, wait for that (the job in flight is
        done: the loop only has to see the sentinel; bounded all the same)."""
        self._jobs.put(None)
        if join and self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(knobs().save_timeout_s)

    def where(self) -> str:
        """The save thread's innermost frames, for a hang report."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            return "no frame (the thread has ended)"
        stack = traceback.extract_stack(frame)[-4:]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))


def _lower_thread_priority(nice: int) -> None:
    """Make the calling (background save) thread yield the CPU to the training loop.

    On two cores the loop's intra-op threads use both; a save thread at the same
    priority takes one of them for its write copies and hashing, and every parallel
    operation of the step then waits for its slowest thread. With a higher nice value
    the scheduler runs the save in the gaps of the step (its Python parts, its waits)
    and the step keeps both cores; the save takes longer but finishes long before the
    next one is due (bench/async_save.py). Linux applies nice per thread, and threads
    this one starts (the digest thread) inherit it. Never lowers the loop's own thread:
    only an asynchronous save's thread calls this.
    """
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError):  # not Linux, or not permitted: run at the loop's priority
        pass


def apply_retention(run_dir: str | os.PathLike[str], policy: RetentionPolicy, *, storage: Storage | None = None,
                    protect: Iterable[str] = (), upcoming: int | None = None,
                    damaged: Iterable[str] = ()) -> tuple[str, ...]:
    """Delete the committed checkpoints under ``run_dir`` that ``policy`` does not keep
    (:func:`plan_retention`); returns their names. The manager runs this after each
    commit; anything else that commits checkpoints into a directory (a snapshotter) runs
    it too, so that there is one retention routine. Names in ``protect`` are never
    deleted; ``upcoming`` plans as if that step had already committed (freeing space
    before a save on a full disk) and is itself never deleted; ``damaged`` as for
    :func:`plan_retention`. On an object store a
    checkpoint is deleted MANIFEST first (it is uncommitted from that instant), then
    its objects (spec/object-storage.md)."""
    storage, normal = resolve(run_dir, storage)
    run_dir = storage.commit.record_path(os.fspath(run_dir), normal)
    protected = set(protect)
    records = list_checkpoints(run_dir, with_metrics=bool(policy.keep_best), storage=storage)
    if upcoming is not None and not any(r.step == upcoming for r in records):
        name = checkpoint_name(upcoming)
        records = sorted([*records, CheckpointRecord(name, os.path.join(run_dir, name), upcoming, True)],
                         key=lambda r: r.step)
    keep = plan_retention(records, policy, damaged=damaged)
    doomed = [r for r in records
              if r.committed and r.name not in keep and r.name not in protected and r.step != upcoming]
    # Older than every kept one: an undone deletion is redone next time (no fsync, §10.7).
    return delete_checkpoints(run_dir, doomed, storage=storage, durable=False)


def delete_checkpoints(run_dir: str | os.PathLike[str], records: Iterable[CheckpointRecord], *,
                       storage: Storage | None = None, durable: bool = True) -> tuple[str, ...]:
    """Delete these checkpoints of ``run_dir`` (the one deletion routine: retention's and
    a rewind's) through ``storage.commit.remove_checkpoints``; returns the names deleted.
    On a filesystem each is renamed into a ``.tmp-`` name first, so a crash mid-delete
    leaves a directory no reader accepts, never a torn ``step-*``; on an object store its
    MANIFEST goes first (it is uncommitted from that instant), then its objects
    (spec/object-storage.md).

    ``durable``: fsync the directory once the renames are done, before anything is
    removed, so that no crash can bring a deleted checkpoint back. A rewind needs that
    (it deletes *newer* checkpoints: one brought back would be the next resume's pick);
    retention does not (spec/checkpoint-format.md §10.7: what it deletes is older than
    what it keeps, and the next retention deletes it again), so it passes False."""
    storage, normal = resolve(run_dir, storage)
    run_dir = storage.commit.record_path(os.fspath(run_dir), normal)
    records = list(records)
    gone = set(storage.commit.remove_checkpoints(run_dir, [r.path for r in records], durable=durable))
    return tuple(r.name for r in records if r.path in gone)


def _check_data_source(data: Any) -> None:
    """Refuse, at construction, a ``data=`` that cannot be saved: the first save would
    otherwise fail many steps into the run (a plain DataLoader has no position)."""
    if data is None:
        return
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(data, m, None))]
    if missing:
        t = type(data)
        raise UnsupportedValueError(
            f"data= must have state_dict() and load_state_dict(); {t.__module__}.{t.__qualname__} has no "
            f"{' or '.join(m + '()' for m in missing)}. A plain torch DataLoader keeps no position: use "
            "ckpt.data.ResumableLoader or torchdata.stateful_dataloader.StatefulDataLoader",
            key="@data",
        )


def _with_stall(report: SaveReport, stall: float) -> SaveReport:
    return SaveReport(report.step, report.path, report.asynchronous, stall, report.background_s, report.nbytes, report.deleted)
