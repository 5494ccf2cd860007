"""Deterministic, resumable data loading with pinned offsets.

Design
======

**One global order per epoch, addressed by position.** The samples of epoch ``e`` are
consumed in the order ``EpochOrder(n, seed, e)``: a keyed Feistel bijection on
``[0, n)`` whose round keys are ``mix64(tag, seed, e, round)`` (SplitMix64 folded over
the counters). Position ``p`` maps to dataset index ``order.index(p)`` in O(1), with
plain integer arithmetic, so the order is the same on every platform and torch version
and does not depend on world size, rank, batch size or ``num_workers``. Global step
``t`` consumes positions ``[t*B, (t+1)*B)`` for global batch size ``B``; rank ``r`` of
``W`` takes the contiguous slice ``[t*B + r*B//W, t*B + (r+1)*B//W)``.

**Count what the training loop consumed, not what was produced.** DataLoader workers
prefetch ``prefetch_factor * num_workers`` batches ahead, and a sampler's own counter
runs ahead with them. The state records the position *after the last batch handed to
the caller*, updated in the main process as each batch is yielded. A state taken
between two steps therefore names exactly the first sample the next step needs, and
prefetched-but-unused batches are simply produced again after a resume. Resuming is
O(1): ``load_state_dict`` sets ``(epoch, position)`` and the sampler starts at step
``position // B``; nothing is iterated or skipped.

**Seed every sample, not every worker.** Before reading position ``p`` (attempt ``a``,
see quarantine), the fetcher reseeds Python's ``random``, numpy's global RNG and torch's
CPU generator from ``sample_seed(seed, e, p, a)``, and once more before collating. A
sample's augmentation thus depends on its counters only, not on which worker ran it,
what that worker ran before, or whether the worker is persistent (persistent workers
are seeded once by DataLoader and never reseeded, checklist 2.2). Changing
``num_workers`` across a resume changes nothing in the stream. In the main process the
global RNG states are saved and restored around each batch, and the DataLoader gets a
private ``torch.Generator`` so that ``iter()`` does not draw its base seed from the
global RNG: creating an iterator leaves the training loop's RNG untouched.

**Elastic rules.** The state is global (the same on every rank): epoch, global position,
seed, global batch size. Resuming with another world size but the same global batch size
continues the same global sequence: the new ranks slice the same global steps, so no
sample is dropped or repeated. A different global batch size, seed, dataset size or
``drop_last`` is refused (``StateMismatchError``). An elastic resume is flagged by
``ResumableLoader.resumed_elastic`` / ``resume_info.elastic``: sample order is exact,
but numerics cannot be bit-identical across a world-size change (reduction order
changes), so a resume check must not claim exactness. ``merge_rank_states`` unions the
per-rank quarantine records for such a resume.

**Quarantine without losing determinism.** With a ``QuarantinePolicy``, a candidate
that raises or has NaN/Inf in a declared field is bad; the position is then served by
the chain ``order.index(p), resample(1), resample(2), ...`` with
``resample(a) = mix64(tag, seed, e, p, a) % n``: the first good candidate wins. The check
runs per sample where the sample is read, and a bad sample is bad in every run, so the
choice is a pure function of ``(seed, e, p)`` whichever worker makes it. The main
process records each newly bad sample (or shard) in the state as batches arrive and
calls ``on_quarantine(sample_index, shard, reason)``. Records skip their sample (or
shard) without reading it from the *next* epoch on; within an epoch the skip set is the
one frozen at the epoch's start, so a run resumed mid-epoch makes the same choices as
the uninterrupted run.

**Edits of the order.** ``loader.edit(DataEdit(epoch, steps, "skip"|"defer", delay))``
skips global steps of an epoch, or serves them ``delay`` batches later; the cursor then
counts slots of the edited schedule, and the edits are part of the state (version 2).
This is the loss-spike guard's data policy (``ckpt.guard``): the rule is in
``ckpt.data._edits``. ``upcoming(n)`` names the next batches and ``peek(n)`` reads them
without moving the cursor or any RNG stream (the guard's routing warmup).

Not covered: shard-local (block) shuffling for sequential formats, shuffle buffers, and
token packing; sources whose read is not a pure function of the stored data.
"""

from __future__ import annotations

from ._edits import DataEdit
from ._loader import BatchInfo, OnQuarantine, ResumableLoader, ResumeInfo, merge_rank_states
from ._mix import sample_seed
from ._order import EpochOrder
from ._quarantine import QuarantinePolicy, QuarantineRecord
from ._source import ShardSource
from ._state import STATE_VERSION

__all__ = [
    "ResumableLoader",
    "ShardSource",
    "QuarantinePolicy",
    "QuarantineRecord",
    "ResumeInfo",
    "BatchInfo",
    "DataEdit",
    "OnQuarantine",
    "EpochOrder",
    "sample_seed",
    "merge_rank_states",
    "STATE_VERSION",
]
