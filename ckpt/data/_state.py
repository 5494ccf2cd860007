"""The loader's persisted state: a flat dict of plain values, validated on the way in.

State dict, version 1 (every value is an int, bool, str, None, list or dict, so it
round-trips through msgpack and JSON unchanged):

=====================  =====  ======================================================
key                    type   meaning
=====================  =====  ======================================================
``version``            int    1
``seed``               int    the order's seed, in [0, 2^64)
``epoch``              int    current epoch, >= 0
``position``           int    global samples consumed by the training loop in this
                              epoch; a multiple of ``global_batch_size``, below the
                              epoch length (an epoch that was fully consumed is
                              stored as ``(epoch + 1, 0)``)
``global_batch_size``  int    samples per optimizer step summed over ranks, >= 1
``world_size``         int    ranks that saved it, >= 1 (informs elastic resume)
``rank``               int    rank that saved it, in [0, world_size) (informational:
                              the rest of the state is the same on every rank)
``num_samples``        int    dataset size, guards against a changed dataset
``drop_last``          bool   whether a final partial global batch is dropped
``quarantine``         list   records ``{epoch, index, shard, scope, reason}`` in
                              discovery order (see ``_quarantine``)
``edits``              list   version 2 only: ``{epoch, steps, action, delay}`` in the
                              order they were made (see ``_edits``); epochs >= ``epoch``
=====================  =====  ======================================================

Version 2 adds ``edits`` (the loss-spike guard's data policy) and changes one rule:
``position`` counts slots of the epoch's *schedule* (``_edits``), which is the identity
when no edit applies to the epoch, so it reads exactly as in version 1. A state with no
edit is written as version 1, byte for byte what a version-1 writer wrote, so older
readers keep reading every state that does not need version 2.

A dict that does not follow this table raises ``FormatError`` (``UnsupportedVersionError``
for another version) naming the key; whether a well-formed state *fits* a given loader is
checked by the loader (``StateMismatchError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import FormatError, UnsupportedVersionError
from ._edits import MAX_EDITS, DataEdit, apply_edit, epoch_schedule
from ._mix import M64
from ._quarantine import QuarantineRecord

__all__ = ["STATE_VERSION", "DataState", "epoch_steps"]

STATE_VERSION = 2
"""The newest data state version written; a state that holds no edit is written as version 1."""
_KEYS_V1 = (
    "version",
    "seed",
    "epoch",
    "position",
    "global_batch_size",
    "world_size",
    "rank",
    "num_samples",
    "drop_last",
    "quarantine",
)
_KEYS_V2 = (*_KEYS_V1, "edits")
_RECORD_KEYS = ("epoch", "index", "shard", "scope", "reason")
_EDIT_KEYS = ("epoch", "steps", "action", "delay")


def epoch_steps(num_samples: int, global_batch_size: int, drop_last: bool) -> int:
    """Global steps (optimizer steps) per epoch."""
    if drop_last:
        return num_samples // global_batch_size
    return -(-num_samples // global_batch_size)


def _int(d: Mapping[str, Any], key: str, where: str, lo: int, hi: int = M64) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise FormatError(f"data state: expected an int, got {type(value).__name__}", key=f"{where}{key}")
    if not lo <= value <= hi:
        raise FormatError(f"data state: {value} outside [{lo}, {hi}]", key=f"{where}{key}")
    return value


def _exact_keys(d: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(d, Mapping):
        raise FormatError(f"data state: expected a dict, got {type(d).__name__}", key=where.rstrip(".") or "<root>")
    missing = [k for k in keys if k not in d]
    if missing:
        raise FormatError(f"data state: missing key {missing[0]!r}", key=f"{where}{missing[0]}")
    unknown = sorted(str(k) for k in d if k not in keys)
    if unknown:
        raise FormatError(f"data state: unknown key {unknown[0]!r}", key=f"{where}{unknown[0]}")


@dataclass(frozen=True, slots=True)
class DataState:
    seed: int
    epoch: int
    position: int
    global_batch_size: int
    world_size: int
    rank: int
    num_samples: int
    drop_last: bool
    quarantine: tuple[QuarantineRecord, ...]
    edits: tuple[DataEdit, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {
            "version": 2 if self.edits else 1,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            "rank": self.rank,
            "num_samples": self.num_samples,
            "drop_last": self.drop_last,
            "quarantine": [r.to_dict() for r in self.quarantine],
        }
        if self.edits:
            out["edits"] = [e.to_dict() for e in self.edits]
        return out

    @classmethod
    def from_dict(cls, d: Any) -> DataState:
        version = 1
        if isinstance(d, Mapping) and "version" in d:
            version = d["version"]
            if not isinstance(version, int) or isinstance(version, bool):
                raise FormatError(f"data state: expected an int, got {type(version).__name__}", key="version")
            if version not in (1, 2):
                raise UnsupportedVersionError(
                    f"data state version {version} is not supported (this reader knows 1 and 2)",
                    key="version",
                )
        _exact_keys(d, _KEYS_V2 if version == 2 else _KEYS_V1, "")
        seed = _int(d, "seed", "", 0)
        epoch = _int(d, "epoch", "", 0)
        batch = _int(d, "global_batch_size", "", 1)
        world = _int(d, "world_size", "", 1)
        rank = _int(d, "rank", "", 0, world - 1)
        num_samples = _int(d, "num_samples", "", 1)
        drop_last = d["drop_last"]
        if not isinstance(drop_last, bool):
            raise FormatError(f"data state: expected a bool, got {type(drop_last).__name__}", key="drop_last")
        steps = epoch_steps(num_samples, batch, drop_last)
        edits = _edits(d["edits"], epoch, steps) if version == 2 else ()
        order = epoch_schedule(steps, edits, epoch)
        serves = steps if order is None else len(order)
        position = _int(d, "position", "", 0)
        if position % batch or position // batch >= serves:
            raise FormatError(
                f"data state: position {position} is not the start of one of the {serves} global "
                f"batches of {batch} samples in an epoch",
                key="position",
            )
        raw = d["quarantine"]
        if not isinstance(raw, list):
            raise FormatError(f"data state: expected a list, got {type(raw).__name__}", key="quarantine")
        records = []
        seen: set[tuple[str, int]] = set()
        for i, r in enumerate(raw):
            where = f"quarantine[{i}]."
            _exact_keys(r, _RECORD_KEYS, where)
            r_epoch = _int(r, "epoch", where, 0, epoch)
            index = _int(r, "index", where, 0, num_samples - 1)
            shard = None if r["shard"] is None else _int(r, "shard", where, 0)
            scope = r["scope"]
            if scope not in ("sample", "shard"):
                raise FormatError(f"data state: scope must be 'sample' or 'shard', got {scope!r}", key=f"{where}scope")
            if scope == "shard" and shard is None:
                raise FormatError("data state: a shard record needs a shard", key=f"{where}shard")
            if not isinstance(r["reason"], str):
                raise FormatError(
                    f"data state: expected a str, got {type(r['reason']).__name__}", key=f"{where}reason"
                )
            record = QuarantineRecord(r_epoch, index, shard, scope, r["reason"])
            if record.key in seen:
                raise FormatError(f"data state: duplicate quarantine record {record.key}", key=f"quarantine[{i}]")
            seen.add(record.key)
            records.append(record)
        return cls(seed, epoch, position, batch, world, rank, num_samples, drop_last, tuple(records), edits)


def _edits(raw: Any, epoch: int, steps: int) -> tuple[DataEdit, ...]:
    """Version 2's ``edits``: each well-formed, for this epoch or a later one, and each
    applicable to its epoch's schedule as the edits before it left it."""
    if not isinstance(raw, list):
        raise FormatError(f"data state: expected a list, got {type(raw).__name__}", key="edits")
    if not raw or len(raw) > MAX_EDITS:
        raise FormatError(f"data state: a version-2 state holds 1 to {MAX_EDITS} edits, got {len(raw)}", key="edits")
    out: list[DataEdit] = []
    orders: dict[int, list[int] | range] = {}
    for i, r in enumerate(raw):
        where = f"edits[{i}]."
        _exact_keys(r, _EDIT_KEYS, where)
        e_epoch = _int(r, "epoch", where, epoch)
        if not isinstance(r["steps"], list):
            raise FormatError(f"data state: expected a list, got {type(r['steps']).__name__}", key=f"{where}steps")
        for j, s in enumerate(r["steps"]):
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < steps:
                raise FormatError(f"data state: {s!r} is not one of the {steps} steps of an epoch",
                                  key=f"{where}steps[{j}]")
        try:
            edit = DataEdit(e_epoch, tuple(r["steps"]), r["action"], r["delay"])
            orders[e_epoch] = apply_edit(orders.get(e_epoch, range(steps)), edit)
        except ValueError as exc:
            raise FormatError(f"data state: {exc}", key=f"edits[{i}]") from None
        out.append(edit)
    return tuple(out)
