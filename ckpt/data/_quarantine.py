"""Quarantine: what counts as a bad sample, and the record kept of each one.

A candidate sample is *bad* when reading it raises one of ``policy.catch`` or when a
declared field holds NaN or Inf. Under ``on_bad="quarantine"`` a bad candidate is
replaced (see ``_fetch``); under ``on_bad="raise"`` the loader fails on it.

A record's ``epoch`` is the epoch in which it was discovered. Records take effect (are
skipped without being read) from the *next* epoch on: the set used during epoch ``e`` is
frozen at the start of ``e``, so a run resumed in the middle of ``e`` skips exactly what
the uninterrupted run skipped, however many records the first half of ``e`` added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

__all__ = ["QuarantinePolicy", "QuarantineRecord", "check_fields", "effective_sets"]

Scope = Literal["sample", "shard"]


@dataclass(frozen=True, slots=True)
class QuarantinePolicy:
    """Which samples are bad and what to do about them.

    - ``fields``: keys (str, for a mapping or an attribute) or positions (int, for a
      tuple/list sample) whose values must be finite. Tensors, numpy arrays and floats
      are checked; ints and bools are finite by construction.
    - ``on_bad``: ``"quarantine"`` replaces the sample by a deterministic resample;
      ``"raise"`` fails (the read's own exception, or ``IntegrityError`` for NaN/Inf).
    - ``scope``: ``"sample"`` skips only the bad sample in later epochs, ``"shard"`` its
      whole shard (shard sources only).
    - ``catch``: exception types from a read that make a sample bad. Others propagate.
      The check must be a pure function of the stored data: a transient I/O error should
      be retried inside the source, not quarantined, or runs stop being reproducible.
    - ``max_attempts``: candidates tried for one position before giving up.
    """

    fields: tuple[str | int, ...] = ()
    on_bad: Literal["quarantine", "raise"] = "quarantine"
    scope: Scope = "sample"
    catch: tuple[type[BaseException], ...] = (Exception,)
    max_attempts: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.fields, tuple) or not all(
            isinstance(f, (str, int)) and not isinstance(f, bool) for f in self.fields
        ):
            raise TypeError(f"QuarantinePolicy.fields must be a tuple of str/int, got {self.fields!r}")
        if self.on_bad not in ("quarantine", "raise"):
            raise ValueError(f"QuarantinePolicy.on_bad must be 'quarantine' or 'raise', got {self.on_bad!r}")
        if self.scope not in ("sample", "shard"):
            raise ValueError(f"QuarantinePolicy.scope must be 'sample' or 'shard', got {self.scope!r}")
        if not isinstance(self.catch, tuple) or not all(
            isinstance(c, type) and issubclass(c, BaseException) for c in self.catch
        ):
            raise TypeError(f"QuarantinePolicy.catch must be a tuple of exception types, got {self.catch!r}")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"QuarantinePolicy.max_attempts must be an int >= 1, got {self.max_attempts!r}")


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    """One quarantined sample (``scope="sample"``) or shard (``scope="shard"``).

    ``index`` is the flat dataset index of the sample that was found bad (for a shard
    record, the first bad sample seen in it); ``shard`` is None for a map-style dataset.
    """

    epoch: int
    index: int
    shard: int | None
    scope: Scope
    reason: str

    @property
    def key(self) -> tuple[str, int]:
        """Identity for de-duplication: a shard is quarantined once, a sample once."""
        if self.scope == "shard":
            assert self.shard is not None
            return ("shard", self.shard)
        return ("sample", self.index)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "shard": self.shard, "scope": self.scope, "reason": self.reason}


def effective_sets(records: tuple[QuarantineRecord, ...], epoch: int) -> tuple[frozenset[int], frozenset[int]]:
    """(samples, shards) skipped without reading during ``epoch``: records from earlier epochs."""
    samples = frozenset(r.index for r in records if r.epoch < epoch and r.scope == "sample")
    shards = frozenset(r.shard for r in records if r.epoch < epoch and r.scope == "shard" and r.shard is not None)
    return samples, shards


def _field(sample: Any, name: str | int) -> Any:
    if isinstance(sample, Mapping):
        return sample[name]
    if isinstance(name, int):
        return sample[name]
    return getattr(sample, name)


def _nonfinite(value: Any) -> bool | None:
    """True if ``value`` holds NaN/Inf, False if not, None if the type is not checkable."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            return not bool(torch.isfinite(value).all())
        return False
    if isinstance(value, bool | int):
        return False
    if isinstance(value, float):
        return not math.isfinite(value)
    if type(value).__module__ == "numpy":  # avoid importing numpy just to check
        import numpy as np

        arr = np.asarray(value)
        if arr.dtype.kind in "fc":
            return not bool(np.isfinite(arr).all())
        return False if arr.dtype.kind in "iub" else None
    return None


def check_fields(sample: Any, fields: tuple[str | int, ...]) -> str | None:
    """The reason ``sample`` is bad, or None. Deterministic: same sample, same answer."""
    for name in fields:
        try:
            value = _field(sample, name)
        except (KeyError, IndexError, AttributeError, TypeError):
            return f"field {name!r} missing"
        bad = _nonfinite(value)
        if bad is None:
            raise TypeError(f"quarantine field {name!r} has uncheckable type {type(value).__name__}")
        if bad:
            return f"field {name!r} has NaN/Inf"
    return None
