"""Vector clocks (Mattern/Fidge): an immutable, sparse map actor -> counter.

A missing entry counts as 0, so ``VectorClock()`` is the bottom of the lattice and
clocks of different actor sets compare without padding. Actor ids are strings
(``"syncer"``, ``"learner-3"``, ``"rank-0"``), which keeps tapes readable and lets
actors join without renumbering.

Rules, as used everywhere in ``replay``:
- a local event: ``c = c.tick(me)``
- a send: ``c = c.tick(me)``; the message carries ``c``
- a receive of ``m``: ``c = c.merge(m.clock).tick(me)`` (see :meth:`receive`)
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Iterator, Mapping

__all__ = ["VectorClock", "Order"]

_MAX_ACTOR_LEN = 255
_MAX_ENTRIES = 65535


class Order(enum.Enum):
    """How two vector clocks compare: equal, before, after or concurrent."""

    EQUAL = "equal"
    BEFORE = "before"
    AFTER = "after"
    CONCURRENT = "concurrent"


@dataclass(frozen=True, slots=True)
class VectorClock:
    """Immutable sparse vector clock; entries are kept sorted by actor, zeros dropped."""

    entries: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        # Canonical form: sorted by actor, no zero counters, no duplicates. Two equal
        # clocks therefore have equal ``entries`` and equal encodings.
        norm = tuple(sorted((a, c) for a, c in self.entries if c != 0))
        for i, (actor, counter) in enumerate(norm):
            if not isinstance(actor, str) or not actor:
                raise ValueError(f"vector clock actor must be a non-empty str, got {actor!r}")
            if not isinstance(counter, int) or isinstance(counter, bool) or counter < 0 or counter >= 2**64:
                raise ValueError(f"vector clock counter for {actor!r} must be an int in [0, 2^64), got {counter!r}")
            if i and norm[i - 1][0] == actor:
                raise ValueError(f"duplicate actor {actor!r} in vector clock")
        if norm != self.entries:
            object.__setattr__(self, "entries", norm)

    # -- construction -------------------------------------------------------------
    @classmethod
    def of(cls, mapping: Mapping[str, int] | None = None, /, **counters: int) -> "VectorClock":
        merged = dict(mapping or {})
        merged.update(counters)
        return cls(tuple(merged.items()))

    # -- access -------------------------------------------------------------------
    def __getitem__(self, actor: str) -> int:
        for a, c in self.entries:
            if a == actor:
                return c
        return 0

    def get(self, actor: str) -> int:
        return self[actor]

    def as_dict(self) -> dict[str, int]:
        return dict(self.entries)

    def actors(self) -> Iterator[str]:
        return (a for a, _ in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}:{c}" for a, c in self.entries)
        return f"VC({inner})"

    # -- algebra --------------------------------------------------------------------
    def tick(self, actor: str, by: int = 1) -> "VectorClock":
        if by < 1:
            raise ValueError("tick must advance by at least 1")
        d = dict(self.entries)
        d[actor] = d.get(actor, 0) + by
        return VectorClock(tuple(d.items()))

    def merge(self, other: "VectorClock") -> "VectorClock":
        """Pointwise maximum: the least upper bound of the two clocks."""
        d = dict(self.entries)
        for a, c in other.entries:
            if c > d.get(a, 0):
                d[a] = c
        return VectorClock(tuple(d.items()))

    def send(self, actor: str) -> "VectorClock":
        """The clock after a send event by ``actor``; the message carries it."""
        return self.tick(actor)

    def receive(self, actor: str, message_clock: "VectorClock") -> "VectorClock":
        """The clock of ``actor`` after receiving a message stamped ``message_clock``."""
        return self.merge(message_clock).tick(actor)

    def compare(self, other: "VectorClock") -> Order:
        less = greater = False
        i = j = 0
        a, b = self.entries, other.entries
        # Merge-walk of two sorted sparse vectors, with early exit once both a "less"
        # and a "greater" coordinate have been seen.
        while i < len(a) or j < len(b):
            if j >= len(b) or (i < len(a) and a[i][0] < b[j][0]):
                greater = True  # we have a positive entry the other lacks
                i += 1
            elif i >= len(a) or b[j][0] < a[i][0]:
                less = True
                j += 1
            else:
                if a[i][1] < b[j][1]:
                    less = True
                elif a[i][1] > b[j][1]:
                    greater = True
                i += 1
                j += 1
            if less and greater:
                return Order.CONCURRENT
        if less:
            return Order.BEFORE
        if greater:
            return Order.AFTER
        return Order.EQUAL

    def happened_before(self, other: "VectorClock") -> bool:
        return self.compare(other) is Order.BEFORE

    def __le__(self, other: "VectorClock") -> bool:
        return self.compare(other) in (Order.BEFORE, Order.EQUAL)

    def __lt__(self, other: "VectorClock") -> bool:
        return self.compare(other) is Order.BEFORE

    def __ge__(self, other: "VectorClock") -> bool:
        return self.compare(other) in (Order.AFTER, Order.EQUAL)

    def __gt__(self, other: "VectorClock") -> bool:
        return self.compare(other) is Order.AFTER

    def concurrent(self, other: "VectorClock") -> bool:
        return self.compare(other) is Order.CONCURRENT

    # -- canonical binary encoding -------------------------------------------------
    # u16 count | count x (u8 len | utf-8 actor | u64 counter), little-endian, sorted.
    def encode(self) -> bytes:
        if len(self.entries) > _MAX_ENTRIES:
            raise ValueError("vector clock has too many entries to encode")
        parts = [struct.pack("<H", len(self.entries))]
        for actor, counter in self.entries:
            raw = actor.encode("utf-8")
            if len(raw) > _MAX_ACTOR_LEN:
                raise ValueError(f"actor id too long to encode: {actor[:40]!r}...")
            parts.append(struct.pack("<B", len(raw)))
            parts.append(raw)
            parts.append(struct.pack("<Q", counter))
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> "VectorClock":
        clock, end = cls.decode_from(data, 0)
        if end != len(data):
            raise ValueError(f"trailing {len(data) - end} bytes after vector clock")
        return clock

    @classmethod
    def decode_from(cls, data: bytes | memoryview, pos: int) -> tuple["VectorClock", int]:
        """Decode a clock starting at ``pos``; returns it and the end offset.

        Strict: the encoding must be canonical (sorted, no zeros, no duplicates), so a
        clock has exactly one encoding and digests over encodings are stable.
        """
        mv = memoryview(data)
        if pos + 2 > len(mv):
            raise ValueError("truncated vector clock header")
        (count,) = struct.unpack_from("<H", mv, pos)
        pos += 2
        entries: list[tuple[str, int]] = []
        for _ in range(count):
            if pos + 1 > len(mv):
                raise ValueError("truncated vector clock entry")
            n = mv[pos]
            pos += 1
            if n == 0 or pos + n + 8 > len(mv):
                raise ValueError("truncated or empty vector clock actor")
            actor = bytes(mv[pos : pos + n]).decode("utf-8")
            pos += n
            (counter,) = struct.unpack_from("<Q", mv, pos)
            pos += 8
            if counter == 0:
                raise ValueError(f"non-canonical vector clock: zero counter for {actor!r}")
            if entries and entries[-1][0] >= actor:
                raise ValueError("non-canonical vector clock: actors not strictly sorted")
            entries.append((actor, counter))
        return cls(tuple(entries)), pos
