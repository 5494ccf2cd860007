"""Laws of VectorClock (property tests) and its canonical encoding."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.clock import Order, VectorClock

ACTORS = st.sampled_from(["a", "b", "c", "syncer", "learner-1", "é"])
clocks = st.dictionaries(ACTORS, st.integers(min_value=0, max_value=2**64 - 1), max_size=6).map(VectorClock.of)
small = st.dictionaries(ACTORS, st.integers(min_value=0, max_value=4), max_size=4).map(VectorClock.of)


@given(clocks, clocks)
def test_merge_commutative(a: VectorClock, b: VectorClock) -> None:
    assert a.merge(b) == b.merge(a)


@given(clocks, clocks, clocks)
def test_merge_associative(a: VectorClock, b: VectorClock, c: VectorClock) -> None:
    assert a.merge(b).merge(c) == a.merge(b.merge(c))


@given(clocks)
def test_merge_idempotent(a: VectorClock) -> None:
    assert a.merge(a) == a


@given(clocks, clocks)
def test_merge_is_least_upper_bound(a: VectorClock, b: VectorClock) -> None:
    m = a.merge(b)
    assert a <= m and b <= m
    for actor in set(a.actors()) | set(b.actors()):
        assert m[actor] == max(a[actor], b[actor])


@given(small)
def test_happens_before_irreflexive(a: VectorClock) -> None:
    assert not a.happened_before(a)
    assert a.compare(a) is Order.EQUAL


@given(small, small)
def test_happens_before_asymmetric_and_compare_dual(a: VectorClock, b: VectorClock) -> None:
    dual = {Order.BEFORE: Order.AFTER, Order.AFTER: Order.BEFORE, Order.EQUAL: Order.EQUAL,
            Order.CONCURRENT: Order.CONCURRENT}
    assert b.compare(a) is dual[a.compare(b)]
    assert not (a.happened_before(b) and b.happened_before(a))
    assert (a.compare(b) is Order.EQUAL) == (a == b)


@given(small, small, small)
def test_happens_before_transitive(a: VectorClock, b: VectorClock, c: VectorClock) -> None:
    if a.happened_before(b) and b.happened_before(c):
        assert a.happened_before(c)


@given(small, small)
def test_compare_matches_pointwise_definition(a: VectorClock, b: VectorClock) -> None:
    actors = set(a.actors()) | set(b.actors())
    le = all(a[x] <= b[x] for x in actors)
    ge = all(a[x] >= b[x] for x in actors)
    expected = Order.EQUAL if le and ge else Order.BEFORE if le else Order.AFTER if ge else Order.CONCURRENT
    assert a.compare(b) is expected


@given(clocks, clocks, ACTORS, ACTORS)
def test_receive_is_after_send(sender: VectorClock, receiver: VectorClock, s: str, r: str) -> None:
    if any(c >= 2**64 - 2 for _, c in sender.entries + receiver.entries):
        return  # a tick would overflow the u64 counter (tested separately)
    stamped = sender.send(s)
    assert sender.happened_before(stamped)
    after = receiver.receive(r, stamped)
    assert stamped.happened_before(after)
    assert receiver.happened_before(after)


@given(small, ACTORS)
def test_tick_advances_only_own_entry(a: VectorClock, me: str) -> None:
    t = a.tick(me)
    assert t[me] == a[me] + 1
    assert all(t[x] == a[x] for x in a.actors() if x != me)
    assert a.happened_before(t)


@given(clocks)
def test_encode_decode_roundtrip(a: VectorClock) -> None:
    assert VectorClock.decode(a.encode()) == a


@given(st.dictionaries(ACTORS, st.integers(min_value=0, max_value=9), max_size=5),
       st.randoms(use_true_random=False))
def test_encoding_is_canonical(d: dict[str, int], rnd) -> None:  # type: ignore[no-untyped-def]
    items = list(d.items())
    rnd.shuffle(items)
    with_zero = items + [("zz-unused", 0)]
    assert VectorClock(tuple(with_zero)).encode() == VectorClock.of(d).encode()
    assert VectorClock(tuple(items)) == VectorClock.of(d)


@settings(max_examples=50)
@given(clocks)
def test_decode_rejects_every_truncation(a: VectorClock) -> None:
    raw = a.encode()
    for cut in range(len(raw)):
        with pytest.raises(ValueError, match="truncated|trailing"):
            VectorClock.decode(raw[:cut])


def _entry(actor: str, counter: int) -> bytes:
    b = actor.encode()
    return struct.pack("<B", len(b)) + b + struct.pack("<Q", counter)


def test_decode_rejects_non_canonical() -> None:
    unsorted = struct.pack("<H", 2) + _entry("b", 1) + _entry("a", 1)
    with pytest.raises(ValueError, match="not strictly sorted"):
        VectorClock.decode(unsorted)
    dup = struct.pack("<H", 2) + _entry("a", 1) + _entry("a", 2)
    with pytest.raises(ValueError, match="not strictly sorted"):
        VectorClock.decode(dup)
    zero = struct.pack("<H", 1) + _entry("a", 0)
    with pytest.raises(ValueError, match="zero counter"):
        VectorClock.decode(zero)
    empty_actor = struct.pack("<H", 1) + struct.pack("<B", 0) + struct.pack("<Q", 1)
    with pytest.raises(ValueError, match="empty"):
        VectorClock.decode(empty_actor)
    with pytest.raises(ValueError, match="trailing 1 bytes"):
        VectorClock.decode(VectorClock.of(a=1).encode() + b"\0")


def test_golden_encoding() -> None:
    assert VectorClock.of(b=2, a=1).encode().hex() == "0200" + "0161" + "0100000000000000" + "0162" + "0200000000000000"
    assert VectorClock().encode() == b"\x00\x00"


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        VectorClock.of({"": 1})
    with pytest.raises(ValueError, match=r"\[0, 2\^64\)"):
        VectorClock.of(a=-1)
    with pytest.raises(ValueError, match=r"\[0, 2\^64\)"):
        VectorClock.of(a=2**64)
    with pytest.raises(ValueError, match="at least 1"):
        VectorClock().tick("a", 0)
    with pytest.raises(ValueError, match="too long"):
        VectorClock.of({"x" * 256: 1}).encode()
    with pytest.raises(ValueError, match=r"\[0, 2\^64\)"):
        VectorClock.of(a=2**64 - 1).tick("a")
