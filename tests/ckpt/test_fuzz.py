"""Hypothesis-driven fuzzing of the checkpoint readers (bounded run; ``make fuzz`` is the long one).

Mutations come from ``bench/fuzz.py``: bit flips, truncations, extensions, swapped
files and manifests, hostile safetensors headers (cases from the stock library's own
tests), hostile msgpack trees and huge declared sizes. Most are **re-signed** (chunk
digests, sizes, content id and MANIFEST digest recomputed) so the parsers are what
stands between the bytes and the caller. Every case must load data equal to an
independent decoder's reading (or to the original, when nothing was re-signed) or
raise a documented ``CkptError``; nothing else may escape and nothing may hang.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import hangs

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ckpt_fuzz", REPO / "bench" / "fuzz.py")
assert _spec is not None and _spec.loader is not None
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["ckpt_fuzz"] = fuzz
_spec.loader.exec_module(fuzz)

pytestmark = pytest.mark.filterwarnings("ignore")


class HypothesisDraw:
    """The mutators' Draw interface backed by hypothesis, so failures shrink."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self._values = fuzz.RandomDraw(random.Random(data.draw(st.integers(0, 2**32), label="value seed")))

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, seq: list[Any]) -> Any:
        return seq[self.data.draw(st.integers(0, len(seq) - 1))]

    def raw(self, lo: int, hi: int) -> bytes:
        return self.data.draw(st.binary(min_size=lo, max_size=hi))

    def value(self) -> Any:
        return self.data.draw(_values)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from(fuzz.hostile_values()),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-3, 3), st.booleans(), st.floats()), inner, max_size=4),
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return fuzz.Fuzzer(tmp_path_factory.mktemp("fuzz"))


def _check(out: Any) -> None:
    assert out.kind in ("exact", "refused"), f"{out.kind} in {out.mutator}:\n{out.detail}"


@pytest.mark.timeout(240)
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data(), name=st.sampled_from(sorted(fuzz.MUTATORS)))
def test_mutated_checkpoints_load_exactly_or_are_refused(fuzzer: Any, data: Any, name: str) -> None:
    _check(fuzzer.case(name, HypothesisDraw(data), timeout=hangs.hang_s(3)))


_N_HEADERS = len(fuzz.hostile_headers({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8))


@pytest.mark.parametrize("index", range(_N_HEADERS))
def test_every_hostile_safetensors_header_is_refused(fuzzer: Any, index: int) -> None:
    """Each listed header (from the stock library's tests and our §6.1) on its own."""

    class Fixed(fuzz.RandomDraw):
        def choice(self, seq: list[Any]) -> Any:
            assert len(seq) == _N_HEADERS
            return seq[index]

    out = fuzzer.case("hostile-header", Fixed(random.Random(index)))
    assert out.kind == "refused", f"{out.kind}: {out.detail}"


def test_the_judge_is_not_vacuous(fuzzer: Any) -> None:
    """Data a reader should have refused counts as wrong: colliding map keys, a
    non-canonical BIGINT, a header with float shapes."""
    import msgpack

    with pytest.raises(fuzz._Mismatch):
        fuzz.oracle_tree(b"\x82\xc3\xa1T\x01\xa1I")  # {true: 'T', 1: 'I'}
    assert fuzz.oracle_tree(msgpack.packb({1: "a", "1": "b"})) == {1: "a", "1": "b"}
    with pytest.raises(fuzz._Mismatch):
        fuzz.compare(5, ("ext", 4, b"5"), lambda k: b"")
    with pytest.raises(fuzz._Mismatch):
        fuzz.compare(33, ("ext", 4, "٣٣".encode()), lambda k: b"")
    with pytest.raises(fuzz._Mismatch):
        fuzz.compare(b"", ("ext", 5, b"rank-00000"), lambda k: b"")


@pytest.mark.timeout(240)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data(), name=st.sampled_from(sorted(fuzz.tapes_module().MUTATORS)))
def test_mutated_tapes_read_exactly_or_are_refused(tmp_path_factory: pytest.TempPathFactory, data: Any, name: str) -> None:
    """Tapes: byte mutations unsigned, record mutations re-signed through the real writer;
    verify, every event and the invariant check either agree with the original or raise
    a TapeError."""
    tapes = fuzz.tapes_module()
    root = tmp_path_factory.mktemp("tapefuzz")
    _check(tapes.tape_case(fuzz, root, 0, name, HypothesisDraw(data), timeout=hangs.hang_s(3)))
