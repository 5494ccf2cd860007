"""The fault simulator in the suite: a seeded budget of trials over every write path.

Each trial injects one fault (EIO, ENOSPC, a torn write, a crash followed by a power
loss, or one bit flipped at rest between saves) at a point drawn from its seed, and
checks the invariants V1-V6 of tests/sim/harness.py. The suite runs every write path
under two fault kinds, rotated so that each kind meets most paths; the long run is
``make fuzz`` (bench/sim.py: thousands of trials, every kind on every path)."""

from __future__ import annotations

import pytest

from tests.sim.harness import FAULTS, S3_PATHS, WRITE_PATHS, run_trial


def _rotation(paths: list[str], per_path: int) -> list[tuple[str, str, int]]:
    out = []
    for i, path in enumerate(paths):
        for j in range(per_path):
            fault = FAULTS[(i + 2 * j) % len(FAULTS)]
            out.append((path, fault, 1000 * i + j))
    return out


LOCAL = _rotation(sorted(WRITE_PATHS), 2) + [("manager-dedup", "flip", 7), ("manager-dedup", "flip", 8)]
OBJECT = _rotation(sorted(S3_PATHS), 1)


@pytest.mark.slow
@pytest.mark.parametrize("path,fault,seed", LOCAL, ids=[f"{p}-{f}-{s}" for p, f, s in LOCAL])
def test_write_path_survives_faults(path: str, fault: str, seed: int, tmp_path) -> None:
    outcome = run_trial(path, seed, str(tmp_path), fault=fault)
    assert not outcome.violations, outcome.report()


@pytest.mark.slow
@pytest.mark.parametrize("path,fault,seed", OBJECT, ids=[f"{p}-{f}-{s}" for p, f, s in OBJECT])
def test_object_store_write_path_survives_faults(path: str, fault: str, seed: int, tmp_path, s3) -> None:
    """The same invariants against the real S3-compatible server the suite starts."""
    outcome = run_trial(path, seed, str(tmp_path), s3={"env": s3.server.env(), "url": s3.url()}, fault=fault)
    assert not outcome.violations, outcome.report()


def test_every_fault_kind_is_in_the_suite() -> None:
    assert {f for _, f, _ in LOCAL} == set(FAULTS)
    assert {p for p, _, _ in LOCAL} == set(WRITE_PATHS)
