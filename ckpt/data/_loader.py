"""``ResumableLoader``: the cursor over the global order, and its DataLoader plumbing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader

from ..errors import StateMismatchError
from ._edits import DataEdit, apply_edit, epoch_schedule
from ._fetch import BatchRequest, Fetched, SeededFetcher, default_collate, unwrap_fetched
from ._mix import M64, TAG_LOADER, mix64
from ._order import EpochOrder
from ._quarantine import QuarantinePolicy, QuarantineRecord, effective_sets
from ._source import FlatSource
from ._state import DataState, epoch_steps

__all__ = ["ResumableLoader", "ResumeInfo", "BatchInfo", "merge_rank_states", "OnQuarantine"]

OnQuarantine = Callable[[int, "int | None", str], None]
"""The quarantine callback: ``on_quarantine(sample_index, shard, reason)``; ``shard`` is None for a map-style dataset."""

# The sampler computes indices in vectorised chunks that start at one step and double
# up to this many positions: the first batch after a resume is cheap (O(1), about a
# millisecond), later ones amortise the tensor ops.
_SAMPLER_CHUNK_POSITIONS = 4096


@dataclass(frozen=True, slots=True)
class ResumeInfo:
    """What the last ``load_state_dict`` restored. ``elastic``: the world size changed,
    so the sample sequence continues exactly but numerics cannot be bit-identical."""

    elastic: bool
    saved_world_size: int
    saved_rank: int
    world_size: int
    rank: int
    epoch: int
    position: int


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """The last batch handed to the training loop: where it sits in the global order."""

    epoch: int
    step: int
    positions: tuple[int, ...]
    indices: tuple[int, ...]  # dataset indices served (replacements included)


def _rank_slice(lo: int, hi: int, rank: int, world_size: int) -> range:
    # Contiguous slices whose sizes differ by at most one. With the global batch fixed,
    # the union over ranks is [lo, hi) for any world size: that is the elastic rule.
    n = hi - lo
    return range(lo + rank * n // world_size, lo + (rank + 1) * n // world_size)


@dataclass(frozen=True, slots=True)
class _Plan:
    """One pass: the global steps ``steps`` of ``order.epoch`` (the rest of its schedule),
    as seen by ``rank``."""

    order: EpochOrder
    steps: Sequence[int]
    global_batch_size: int
    world_size: int
    rank: int
    skip_samples: frozenset[int]
    skip_shards: frozenset[int]

    def slice(self, step: int) -> range:
        lo = step * self.global_batch_size
        hi = min(lo + self.global_batch_size, self.order.num_samples)
        return _rank_slice(lo, hi, self.rank, self.world_size)


class _RankBatchSampler:
    """Yields this rank's ``BatchRequest`` for each global step of the current plan.

    It lives in the main process (DataLoader calls ``iter`` on it at each ``iter`` of the
    loader, persistent workers included), so the loader re-plans it before each pass.
    It holds no reference to the loader on purpose: a cycle loader -> DataLoader ->
    iterator -> sampler -> loader would leave the worker shutdown to the cyclic GC,
    which may finalise the index queues first and then wait 5 s per worker.
    """

    def __init__(self) -> None:
        self.plan: _Plan | None = None

    def __len__(self) -> int:
        return 0 if self.plan is None else len(self.plan.steps)

    def __iter__(self) -> Iterator[BatchRequest]:
        plan = self.plan
        assert plan is not None, "ResumableLoader plans the sampler before iter()"
        max_chunk = max(1, _SAMPLER_CHUNK_POSITIONS // plan.global_batch_size)
        chunk, first = 1, 0
        while first < len(plan.steps):
            steps = plan.steps[first : first + chunk]
            first, chunk = first + len(steps), min(2 * chunk, max_chunk)
            slices = [plan.slice(step) for step in steps]
            indices = plan.order.indices([p for s in slices for p in s])
            at = 0
            for step, s in zip(steps, slices):
                yield BatchRequest(
                    plan.order.epoch, step, tuple(s), tuple(indices[at : at + len(s)]),
                    plan.skip_samples, plan.skip_shards,
                )
                at += len(s)


class _LoaderIterator:
    """One pass from the loader's position to the end of the epoch."""

    def __init__(self, loader: ResumableLoader, generation: int, inner: Iterator[Fetched], start: int, stop: int):
        self._loader = loader
        self._generation = generation
        self._inner = inner
        self._step = start
        self._stop = stop
        self._drained = False

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        current = loader._generation == self._generation
        if self._step >= self._stop:
            if current and not self._drained:
                # Drain the DataLoader iterator so non-persistent workers shut down now.
                # Never once superseded: persistent workers share it with the new pass.
                self._drained = True
                next(self._inner, None)
            raise StopIteration
        if not current:
            raise RuntimeError(
                "this ResumableLoader iterator was superseded by a newer iter() or load_state_dict(); "
                "the loader is a single cursor"
            )
        fetched = next(self._inner)
        loader._consume(fetched, self._step)
        self._step += 1
        return fetched.batch


class ResumableLoader:
    """A deterministic, resumable loader over a map-style dataset or a ``ShardSource``.

    Iterating yields this rank's batches from the current position to the end of the
    current epoch; the next ``iter()`` starts the next epoch. Position and epoch advance
    when a batch is handed to the caller, so ``state_dict()`` taken between steps is
    exactly what the training loop consumed, whatever the workers prefetched.

    Options (keyword-only):

    - ``seed``: the order's seed; ``global_batch_size``: samples per optimizer step
      summed over ranks (must stay the same across resumes, elastic ones included).
    - ``world_size``/``rank``: default to ``torch.distributed``'s when it is initialised,
      else 1/0. Rank ``r`` gets a contiguous slice of each global batch.
    - ``drop_last``: drop the final partial global batch (default). Without it the
      final batch is split over the ranks and must hold at least one sample per rank.
    - ``collate_fn``, ``num_workers``, ``persistent_workers``, ``prefetch_factor``,
      ``pin_memory``, ``timeout``, ``worker_init_fn``, ``multiprocessing_context``: as
      for DataLoader. Options not listed are not offered because they would break
      determinism (``sampler``, ``shuffle``, ``in_order=False``) or are the loader's own
      (``generator``).
    - ``quarantine``: a ``QuarantinePolicy``, or None to let every read error propagate.
    - ``on_quarantine(sample_index, shard, reason)``: called in the main process, as the
      batch that found it is yielded, once per new record (per sample, or per shard
      under ``scope="shard"``).
    - ``seed_sample_rngs``: reseed the global RNGs per sample (about 20 us per sample).
      Turn off only for datasets that draw no random numbers. With ``num_workers=0`` the
      reseeding (and the save/restore around it) touches the process-global RNGs, so it
      is not safe for two loaders iterated from different threads of one process.

    ``len(loader)`` is the number of batches per epoch (the same on every rank).
    """

    def __init__(
        self,
        source: Any,
        *,
        seed: int,
        global_batch_size: int,
        world_size: int | None = None,
        rank: int | None = None,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        quarantine: QuarantinePolicy | None = None,
        on_quarantine: OnQuarantine | None = None,
        seed_sample_rngs: bool = True,
    ) -> None:
        if world_size is None or rank is None:
            dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
            world_size = world_size if world_size is not None else (torch.distributed.get_world_size() if dist_on else 1)
            rank = rank if rank is not None else (torch.distributed.get_rank() if dist_on else 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= M64:
            raise ValueError(f"seed must be an int in [0, 2^64), got {seed!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if not isinstance(global_batch_size, int) or global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size must be an int >= world_size ({world_size}), got {global_batch_size!r}"
            )
        self._source = FlatSource(source)
        n = self._source.num_samples
        if epoch_steps(n, global_batch_size, drop_last) < 1:
            raise ValueError(f"{n} samples make no global batch of {global_batch_size} (drop_last={drop_last})")
        tail = n % global_batch_size
        if not drop_last and tail and tail < world_size:
            # Some rank would get an empty last batch and skip a step the others take,
            # which hangs DDP and makes per-rank positions disagree.
            raise ValueError(
                f"the final global batch has {tail} samples, fewer than world_size={world_size}; "
                f"use drop_last=True or another global_batch_size"
            )
        if quarantine is not None and quarantine.scope == "shard" and not self._source.sharded:
            raise ValueError("QuarantinePolicy(scope='shard') needs a ShardSource, got a map-style dataset")
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank = rank
        self.drop_last = bool(drop_last)
        self.policy = quarantine
        self.on_quarantine = on_quarantine
        self._epoch = 0
        self._position = 0
        self._edits: list[DataEdit] = []
        self._schedule_cache: tuple[int, int, Sequence[int]] | None = None  # (epoch, edits, schedule)
        self._records: list[QuarantineRecord] = []
        self._record_keys: set[tuple[str, int]] = set()
        self._generation = 0
        self._resume_info: ResumeInfo | None = None
        self._last_batch: BatchInfo | None = None
        self._order_cache: EpochOrder | None = None
        self._fetcher = SeededFetcher(
            self._source,
            seed=seed,
            policy=quarantine,
            collate_fn=collate_fn if collate_fn is not None else default_collate,
            seed_rngs=seed_sample_rngs,
        )
        self._sampler = _RankBatchSampler()
        # A private generator: without one, every iter() of the DataLoader draws its
        # worker base seed from the *global* torch RNG and shifts the training loop's
        # random stream (checklist 6.F). The base seed itself is irrelevant here, since
        # every sample reseeds its worker's RNGs from its own counters.
        generator = torch.Generator()
        generator.manual_seed(mix64(TAG_LOADER, seed) & 0x7FFF_FFFF_FFFF_FFFF)
        self._dataloader = DataLoader(
            self._fetcher,
            batch_sampler=self._sampler,
            collate_fn=unwrap_fetched,
            num_workers=num_workers,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
        )  # in_order stays at its default, True: batches arrive in sampler order

    # -- geometry -------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self._source.num_samples

    @property
    def steps_per_epoch(self) -> int:
        """Global steps of an unedited epoch; every rank yields this many batches per
        epoch (fewer in an epoch with skips, :meth:`edit`)."""
        return epoch_steps(self._source.num_samples, self.global_batch_size, self.drop_last)

    def __len__(self) -> int:
        """Batches the current epoch serves (its schedule's length; same on every rank)."""
        return len(self._schedule(self._epoch))

    def _schedule(self, epoch: int) -> Sequence[int]:
        """The global steps ``epoch`` serves, in order (``ckpt.data._edits``)."""
        c = self._schedule_cache
        if c is not None and c[0] == epoch and c[1] == len(self._edits):
            return c[2]
        order = epoch_schedule(self.steps_per_epoch, self._edits, epoch)
        sched: Sequence[int] = range(self.steps_per_epoch) if order is None else order
        self._schedule_cache = (epoch, len(self._edits), sched)
        return sched

    def _slice(self, step: int) -> range:
        lo = step * self.global_batch_size
        hi = min(lo + self.global_batch_size, self._source.num_samples)
        return _rank_slice(lo, hi, self.rank, self.world_size)

    def _order(self, epoch: int) -> EpochOrder:
        if self._order_cache is None or self._order_cache.epoch != epoch:
            self._order_cache = EpochOrder(self._source.num_samples, self.seed, epoch)
        return self._order_cache

    # -- cursor ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Global samples of the current epoch consumed by the training loop."""
        return self._position

    @property
    def step(self) -> int:
        """Batches of the current epoch consumed by the training loop: the slot of the
        epoch's schedule the next batch comes from (its global step when unedited)."""
        return self._position // self.global_batch_size

    @property
    def cursor(self) -> tuple[int, int]:
        """``(epoch, slot)`` of the next batch: what :meth:`upcoming` and
        :meth:`slots_between` count from."""
        return self._epoch, self.step

    @property
    def edits(self) -> tuple[DataEdit, ...]:
        """The edits of the order (skips and defers) in the order they were made."""
        return tuple(self._edits)

    @property
    def quarantined(self) -> tuple[QuarantineRecord, ...]:
        return tuple(self._records)

    @property
    def last_batch(self) -> BatchInfo | None:
        return self._last_batch

    @property
    def resume_info(self) -> ResumeInfo | None:
        return self._resume_info

    @property
    def resumed_elastic(self) -> bool:
        """True when the loaded state was saved at another world size: the sample
        sequence continues exactly, but a resume check must not claim bit-exactness."""
        return self._resume_info is not None and self._resume_info.elastic

    def __iter__(self) -> _LoaderIterator:
        self._generation += 1
        epoch, start = self._epoch, self.step
        sched = self._schedule(epoch)
        self._sampler.plan = self._plan(epoch, sched[start:])
        return _LoaderIterator(self, self._generation, iter(self._dataloader), start, len(sched))

    def _plan(self, epoch: int, steps: Sequence[int]) -> _Plan:
        skip_samples, skip_shards = effective_sets(tuple(self._records), epoch)
        return _Plan(self._order(epoch), steps, self.global_batch_size, self.world_size, self.rank,
                     skip_samples, skip_shards)

    def _consume(self, fetched: Fetched, slot: int) -> None:
        sched = self._schedule(self._epoch)
        step = sched[slot]
        if fetched.epoch != self._epoch or fetched.step != step:
            raise RuntimeError(
                f"internal: batch for epoch {fetched.epoch} step {fetched.step} arrived when "
                f"epoch {self._epoch} step {step} was expected"
            )
        for index, shard, reason in fetched.events:
            scope = self.policy.scope if self.policy is not None else "sample"
            record = QuarantineRecord(self._epoch, index, shard, scope, reason)
            if record.key in self._record_keys:
                continue
            self._record_keys.add(record.key)
            self._records.append(record)
            if self.on_quarantine is not None:
                self.on_quarantine(index, shard, reason)
        self._last_batch = BatchInfo(self._epoch, step, tuple(self._slice(step)), fetched.served)
        if slot + 1 >= len(sched):
            # Normalise eagerly: a state saved right after the last batch of an epoch
            # reads as "start of the next epoch", so every rank saves the same state.
            self._epoch += 1
            self._position = 0
            # Edits of finished epochs change nothing any more: the state stays small.
            self._edits = [e for e in self._edits if e.epoch >= self._epoch]
        else:
            self._position = (slot + 1) * self.global_batch_size

    # -- edits of the order, and looking ahead (the loss-spike guard's data policy) ---
    def edit(self, edit: DataEdit) -> None:
        """Skip, or defer by ``edit.delay`` batches, global steps of this epoch or a later
        one that the cursor has not reached (``ckpt.data._edits`` has the rule). The edit
        is part of the state from now on. Like ``load_state_dict``, it makes a live
        iterator stale: call ``iter()`` again. ``ValueError`` for a step that is already
        served, skipped, or not a step of the epoch."""
        if not isinstance(edit, DataEdit):
            raise TypeError(f"edit() takes a ckpt.data.DataEdit, got {type(edit).__name__}")
        if edit.epoch < self._epoch:
            raise ValueError(f"epoch {edit.epoch} is over (the cursor is in epoch {self._epoch})")
        bad = [s for s in edit.steps if s >= self.steps_per_epoch]
        if bad:
            raise ValueError(f"step {bad[0]} is not one of the {self.steps_per_epoch} steps of an epoch")
        consumed = self.step if edit.epoch == self._epoch else 0
        apply_edit(self._schedule(edit.epoch), edit, consumed=consumed)  # raises before anything changes
        self._generation += 1
        self._edits.append(edit)

    def upcoming(self, count: int, *, start: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """``(epoch, global step)`` of the ``count`` batches served from ``start`` (an
        ``(epoch, slot)`` cursor; default: this loader's), crossing epochs, under the
        edits made so far."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        epoch, slot = self.cursor if start is None else start
        out: list[tuple[int, int]] = []
        while len(out) < count:
            sched = self._schedule(epoch)
            take = sched[slot : slot + count - len(out)]
            out.extend((epoch, s) for s in take)
            epoch, slot = epoch + 1, 0
        return out

    def slots_between(self, start: tuple[int, int], stop: tuple[int, int]) -> int:
        """How many batches are served from cursor ``start`` to cursor ``stop``
        (both ``(epoch, slot)``; ``stop`` not before ``start``)."""
        (e0, s0), (e1, s1) = start, stop
        if (e1, s1) < (e0, s0):
            raise ValueError(f"cursor {stop} is before {start}")
        return sum(len(self._schedule(e)) for e in range(e0, e1)) - s0 + s1

    def peek(self, count: int) -> list[tuple[BatchInfo, Any]]:
        """The next ``count`` batches exactly as iteration will serve them, read in this
        process, with the cursor, the state and every global RNG stream left as they
        were. Quarantine findings are not recorded here (they are when the batch is
        served). Past the current epoch the skip sets are those known now: a sample found
        bad later in this epoch would change the next one."""
        from ..context.rng import isolated

        out: list[tuple[BatchInfo, Any]] = []
        sampler = _RankBatchSampler()
        with isolated():
            for epoch, step in self.upcoming(count):
                sampler.plan = self._plan(epoch, (step,))
                req = next(iter(sampler))
                fetched = self._fetcher.__getitems__(req)[0]
                out.append((BatchInfo(epoch, step, tuple(self._slice(step)), fetched.served), fetched.batch))
        return out

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state (see ``ckpt.data._state`` for the table): plain, msgpack-able values."""
        return DataState(
            self.seed,
            self._epoch,
            self._position,
            self.global_batch_size,
            self.world_size,
            self.rank,
            self._source.num_samples,
            self.drop_last,
            tuple(self._records),
            tuple(self._edits),
        ).to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state; O(1) in the position. Raises ``FormatError`` for a malformed
        dict and ``StateMismatchError`` for one saved by a differently configured loader."""
        st = DataState.from_dict(state)
        for key, saved, mine in (
            ("seed", st.seed, self.seed),
            ("global_batch_size", st.global_batch_size, self.global_batch_size),
            ("num_samples", st.num_samples, self._source.num_samples),
            ("drop_last", st.drop_last, self.drop_last),
        ):
            if saved != mine:
                raise StateMismatchError(f"data state has {key}={saved!r}, this loader has {mine!r}", key=key)
        for i, record in enumerate(st.quarantine):
            if record.shard is not None and not (self._source.sharded and record.shard < self._source.num_shards):
                raise StateMismatchError(
                    f"quarantine record names shard {record.shard}, this source has {self._source.num_shards} shards",
                    key=f"quarantine[{i}].shard",
                )
        self._generation += 1  # any live iterator is now stale
        self._epoch = st.epoch
        self._position = st.position
        self._edits = list(st.edits)
        self._records = list(st.quarantine)
        self._record_keys = {r.key for r in self._records}
        self._last_batch = None
        self._resume_info = ResumeInfo(
            elastic=st.world_size != self.world_size,
            saved_world_size=st.world_size,
            saved_rank=st.rank,
            world_size=self.world_size,
            rank=self.rank,
            epoch=st.epoch,
            position=st.position,
        )


def merge_rank_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state from the per-rank states of a single save, for an elastic resume.

    Every rank saves the same cursor; only the quarantine records differ, since each rank
    discovers the bad samples it reads. The merge checks the cursors agree and unions the
    records (earliest discovery wins), ordered by (epoch, scope, shard, index).
    """
    if not states:
        raise ValueError("merge_rank_states needs at least one state")
    parsed = [DataState.from_dict(s) for s in states]
    first = parsed[0]
    for i, st in enumerate(parsed[1:], start=1):
        for key in ("seed", "epoch", "position", "global_batch_size", "world_size", "num_samples", "drop_last",
                    "edits"):
            if getattr(st, key) != getattr(first, key):
                raise StateMismatchError(
                    f"rank states disagree: state 0 has {key}={getattr(first, key)!r}, "
                    f"state {i} has {getattr(st, key)!r}",
                    key=key,
                )
    best: dict[tuple[str, int], QuarantineRecord] = {}
    for st in parsed:
        for r in st.quarantine:
            if r.key not in best or r.epoch < best[r.key].epoch:
                best[r.key] = r
    records = sorted(best.values(), key=lambda r: (r.epoch, r.scope, -1 if r.shard is None else r.shard, r.index))
    merged = DataState(
        first.seed,
        first.epoch,
        first.position,
        first.global_batch_size,
        first.world_size,
        0,
        first.num_samples,
        first.drop_last,
        tuple(records),
        first.edits,
    )
    return merged.to_dict()
