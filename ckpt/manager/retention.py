"""Which checkpoints of a run survive: :class:`RetentionPolicy`, :func:`plan_retention` (the
plan, with its reasons), :func:`apply_retention` and :func:`delete_checkpoints` (the one
deletion routine), and :class:`RunRetention`, a manager's retention: the policy plus what it
must never delete (the newest valid checkpoint on a full disk, a loss guard's rollback
target) and the checkpoints it does not count (those holding a damaged shared file)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Sequence

from .. import _linkcheck
from ..errors import CkptError
from ..reader import CheckpointReader
from ..storage import Storage, resolve
from .listing import CheckpointRecord, checkpoint_name, list_checkpoints

__all__ = ["RetentionPolicy", "RunRetention", "apply_retention", "delete_checkpoints", "plan_retention"]


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



class RunRetention:
    """A manager's retention over ``run_dir``. ``dedup``: the manager's saves share files,
    so a file found damaged (spec/format-2.md §V.4.6) takes its checkpoints out of the
    count. The storage is passed at each call: the manager's changes when it becomes
    the writer (on an object store, every deletion then proves the lease)."""

    def __init__(self, run_dir: str, policy: RetentionPolicy, *, dedup: bool) -> None:
        self.run_dir = run_dir
        self.policy = policy
        self.dedup = dedup
        # checkpoints verified for a guard's floor, by (name, content id): committed files never change
        self._verified: set[tuple[str, str]] = set()
        # checkpoint name -> holds a file found damaged, as of that many findings (_damaged)
        self._damage_scan: tuple[int, dict[str, bool]] = (0, {})

    def apply(self, storage: Storage, *, floor: Callable[[], int | None],
              upcoming: int | None = None) -> tuple[str, ...]:
        """Delete what the policy does not keep. With ``upcoming`` (a save about to be
        written on a full disk), plan as if it had committed, but never delete the
        newest checkpoint that verifies: if the save fails, that is the resume point.
        ``floor()``: a loss guard's floor (spec/loss-guard.md §8) or ``None``, asked once
        per pass; with one, never delete its rollback target either (:meth:`_floor_keep`)."""
        protect: set[str] = set()
        if upcoming is not None:
            protect = self._newest_valid(storage, list_checkpoints(self.run_dir, storage=storage))
        at = floor()
        if at is not None:
            protect |= self._floor_keep(storage, list_checkpoints(self.run_dir, storage=storage), at)
        damaged = self._damaged(storage) if self.dedup else set()
        return apply_retention(self.run_dir, self.policy, storage=storage,
                               protect=protect, upcoming=upcoming, damaged=damaged)

    def _damaged(self, storage: Storage) -> set[str]:
        """The committed checkpoints holding a file that a dedup save of this process found
        damaged (spec/format-2.md §V.4.6): retention does not count them as kept."""
        seen = _linkcheck.damaged_count()
        if not seen:
            return set()
        if self._damage_scan[0] != seen:  # a new finding: what was scanned before is stale
            self._damage_scan = (seen, {})
        scanned = self._damage_scan[1]
        out = set()
        committed = [r for r in list_checkpoints(self.run_dir, storage=storage) if r.committed]
        for r in committed:
            # the newest is scanned every time: a save may have replaced it under its name
            if r.name not in scanned or r is committed[-1]:
                backend, root = resolve(r.path, storage)
                try:
                    names = backend.listdir(root)
                except OSError:
                    continue
                scanned[r.name] = any(_linkcheck.is_damaged(backend, os.path.join(root, n)) for n in names)
            if scanned[r.name]:
                out.add(r.name)
        # The floor's cache of verified checkpoints assumed committed files never change.
        self._verified = {key for key in self._verified if key[0] not in out}
        return out

    def _floor_keep(self, storage: Storage, records: Sequence[CheckpointRecord], floor: int) -> set[str]:
        """The loss-spike guard's retention rule (spec/loss-guard.md §8): every committed
        checkpoint above ``floor`` (each becomes the target as the floor advances), the
        newest at or below it and, while that one does not verify, each older one down
        to the newest that does. Each checkpoint is verified at most once (by name and
        content id: committed files never change)."""
        out = {r.name for r in records if r.committed and r.step > floor}
        for r in reversed([r for r in records if r.committed and r.step <= floor]):
            out.add(r.name)
            try:
                reader = CheckpointReader(r.path, storage=storage)
                key = (r.name, reader.manifest.id)
                if key not in self._verified:
                    reader.verify()
                    self._verified.add(key)
            except (CkptError, OSError):
                continue
            break
        return out

    @staticmethod
    def _newest_valid(storage: Storage, records: Sequence[CheckpointRecord]) -> set[str]:
        """Names of the committed checkpoints from the newest down to the newest one that
        verifies in full (all of them if none does): none of these may be deleted."""
        out: set[str] = set()
        for r in reversed([r for r in records if r.committed]):
            out.add(r.name)
            try:
                CheckpointReader(r.path, storage=storage).verify()
            except (CkptError, OSError):
                continue
            break
        return out
