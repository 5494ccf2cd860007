"""The part of the loader that runs where samples are read (a worker, or the main process).

``SeededFetcher`` is the map-style dataset handed to ``torch.utils.data.DataLoader``.
It only accepts whole-batch requests (``__getitems__``) built by the loader's batch
sampler. A request carries everything the answer depends on (epoch, positions, the
order's indices, the quarantine set frozen at epoch start), because a persistent worker
holds a copy of this object made when it started and never sees later changes.

For each position it reseeds Python's ``random``, numpy's legacy global RNG (when numpy
is installed) and torch's CPU default generator from ``sample_seed(seed, epoch,
position, attempt)`` before reading, and reseeds once more before collating. So the
sample and its augmentation depend only on those counters, never on which worker ran
it or what that worker ran before; that is what makes the stream independent of
``num_workers`` and of resumes. In the main process (``num_workers=0``) the global RNG
states are saved before and restored after, so the training loop's RNG is untouched.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.utils.data import get_worker_info

from ..errors import IntegrityError
from ._mix import TAG_COLLATE, TAG_SAMPLE, mix64, mix64_continue, resample_index
from ._quarantine import QuarantinePolicy, check_fields
from ._source import FlatSource

try:  # numpy is optional; when present its global RNG is seeded too
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed in the test env
    _np = None

__all__ = ["BatchRequest", "Fetched", "SeededFetcher", "unwrap_fetched", "default_collate"]

_M32 = 0xFFFF_FFFF


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One local batch: this rank's slice of global step ``step`` of ``epoch``."""

    epoch: int
    step: int
    positions: tuple[int, ...]
    indices: tuple[int, ...]
    skip_samples: frozenset[int]
    skip_shards: frozenset[int]


class Fetched(NamedTuple):
    # A NamedTuple rather than a dataclass: DataLoader's pin_memory recurses into
    # namedtuples, so ``batch`` gets pinned and the metadata passes through.
    epoch: int
    step: int
    batch: Any
    served: tuple[int, ...]  # dataset index actually served at each position
    events: tuple[tuple[int, int | None, str], ...]  # (index, shard, reason) per bad candidate


def unwrap_fetched(items: list[Fetched]) -> Fetched:
    """The DataLoader's collate_fn: ``SeededFetcher`` already collated (see its docstring)."""
    return items[0]


def _seed_globals(seed: int) -> None:
    random.seed(seed)
    # The CPU default generator only: ``torch.manual_seed`` would also reseed every CUDA
    # device, clobbering the training loop's CUDA RNG when num_workers=0.
    torch.random.default_generator.manual_seed(seed)
    if _np is not None:
        # The legacy seeder takes 32 bits; seeding from a list (all 64) costs 8x more
        # (init_by_array), and a 32-bit slice of a hash is as good a seed.
        _np.random.seed(seed & _M32)


def _save_globals() -> tuple[Any, torch.Tensor, Any]:
    return random.getstate(), torch.random.default_generator.get_state(), (
        _np.random.get_state() if _np is not None else None
    )


def _restore_globals(saved: tuple[Any, torch.Tensor, Any]) -> None:
    random.setstate(saved[0])
    torch.random.default_generator.set_state(saved[1])
    if _np is not None:
        _np.random.set_state(saved[2])


class SeededFetcher(torch.utils.data.Dataset):
    """Reads, checks, replaces and collates one requested batch, deterministically.

    The collate runs here, inside ``__getitems__``, rather than in DataLoader's collate
    step, so that the whole batch is produced under one save/restore of the global RNG
    and the collate sees a seeded RNG too (``unwrap_fetched`` then only unpacks).
    """

    def __init__(
        self,
        source: FlatSource,
        *,
        seed: int,
        policy: QuarantinePolicy | None,
        collate_fn: Callable[[list[Any]], Any],
        seed_rngs: bool,
    ) -> None:
        self.source = source
        self.seed = seed
        self.policy = policy
        self.collate_fn = collate_fn
        self.seed_rngs = seed_rngs

    def __len__(self) -> int:
        return self.source.num_samples

    def __getitem__(self, index: Any) -> Any:
        raise TypeError("SeededFetcher only serves whole batches through __getitems__")

    def __getitems__(self, request: BatchRequest) -> list[Fetched]:
        in_main = get_worker_info() is None
        saved = _save_globals() if (self.seed_rngs and in_main) else None
        try:
            events: list[tuple[int, int | None, str]] = []
            samples: list[Any] = []
            served: list[int] = []
            # sample_seed(seed, epoch, p, a) == mix64_continue(prefix, p, a): hash the
            # shared prefix once per batch (the per-sample cost matters for cheap samples).
            prefix = mix64(TAG_SAMPLE, self.seed, request.epoch)
            for position, index in zip(request.positions, request.indices):
                sample, chosen = self._serve(request, prefix, position, index, events)
                samples.append(sample)
                served.append(chosen)
            if self.seed_rngs:
                _seed_globals(mix64(TAG_COLLATE, self.seed, request.epoch, request.positions[0]))
            batch = self.collate_fn(samples)
        finally:
            if saved is not None:
                _restore_globals(saved)
        return [Fetched(request.epoch, request.step, batch, tuple(served), tuple(events))]

    def _serve(
        self,
        request: BatchRequest,
        prefix: int,
        position: int,
        index: int,
        events: list[tuple[int, int | None, str]],
    ) -> tuple[Any, int]:
        """The sample served at ``position``: the first good candidate of a fixed chain.

        The chain is ``index, resample(1), resample(2), ...``; candidates in the frozen
        quarantine sets are skipped unread, the rest are read and checked. With a check
        that is a pure function of the data, the chosen sample is therefore a pure
        function of (seed, epoch, position), whichever process runs it.
        """
        policy = self.policy
        source = self.source
        candidate = index
        for attempt in range(policy.max_attempts if policy is not None else 1):
            if attempt:
                candidate = resample_index(self.seed, request.epoch, position, attempt, source.num_samples)
            shard, offset = source.locate(candidate)
            if candidate in request.skip_samples or (shard is not None and shard in request.skip_shards):
                continue
            if self.seed_rngs:
                _seed_globals(mix64_continue(prefix, position, attempt))
            if policy is None:
                return source.read(shard, offset), candidate
            try:
                sample = source.read(shard, offset)
            except policy.catch as exc:
                if policy.on_bad == "raise":
                    raise
                reason = f"read raised {type(exc).__qualname__}: {exc}"
            else:
                reason = check_fields(sample, policy.fields)
                if reason is None:
                    return sample, candidate
                if policy.on_bad == "raise":
                    raise IntegrityError(
                        f"sample {candidate} (shard {shard}, offset {offset}) at epoch {request.epoch} "
                        f"position {position}: {reason}",
                        key=f"sample[{candidate}]",
                    )
            events.append((candidate, shard, reason))
        raise IntegrityError(
            f"epoch {request.epoch} position {position}: all {policy.max_attempts if policy else 1} "
            f"candidates were bad or quarantined (first: sample {index}); raise max_attempts or fix the data",
            key=f"position[{position}]",
        )


def default_collate(samples: Sequence[Any]) -> Any:
    return torch.utils.data.default_collate(list(samples))
