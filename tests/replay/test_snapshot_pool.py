"""The snapshot staging pool gives every buffer back once a part is durable, whatever the
entry's kind (a plain tensor tree or a registered Stateful), and never hands one buffer to
two stagings: a regression made every later snapshot allocate and first-touch its buffers
again (blocking 3-5x a memcpy in bench/snapshot.py, where it had been about one)."""

from __future__ import annotations

import torch

from replay.snapshot.agent import StagingPool, _stage, _typed


def _ptrs(tree: object) -> list[int]:
    sd = tree.state_dict() if callable(getattr(tree, "state_dict", None)) else tree
    return sorted(t.data_ptr() for t in sd.values())  # type: ignore[union-attr]


def test_a_staged_stateful_returns_its_buffers_to_the_pool() -> None:
    pool = StagingPool()
    model = torch.nn.Linear(64, 32)
    first = _typed(model, _stage(model.state_dict(), pool, "model"))
    before = _ptrs(first)
    pool.release(first)
    again = _typed(model, _stage(model.state_dict(), pool, "model"))
    assert _ptrs(again) == before  # the same buffers, reused: no allocation
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)


def test_a_buffer_released_twice_is_handed_out_once() -> None:
    pool = StagingPool()
    t = torch.arange(16.0)
    staged = _stage({"w": t}, pool, "x")
    pool.release(staged)
    pool.release(staged)  # the commit path and the close path both release what they hold
    a = pool.copy(t)
    b = pool.copy(t * 2)
    assert a.data_ptr() != b.data_ptr()
    assert torch.equal(a, t) and torch.equal(b, t * 2)
