"""``ckpt.integrations._ranks``: per-rank records sent between ranks without pickle, and the
world-size refusal every multi-process integration shares."""

from __future__ import annotations

import pytest
import torch

from ckpt.errors import ResumeMismatchError
from ckpt.integrations._ranks import _pack, _unpack, refuse_world_change


def test_a_record_with_tensors_and_tuples_round_trips_exactly() -> None:
    record = {"rng": {"python": {"state": [1, 2, 3], "gauss_next": None}, "torch_cpu": b"\x00\x01"},
              "loaders": [{"words": torch.arange(5, dtype=torch.int64), "half": torch.randn(2, 3).to(torch.bfloat16),
                           "flag": torch.tensor(True), "empty": torch.empty(0, 4), "pair": (1, "a")}]}
    back = _unpack(_pack(record))
    assert back["rng"] == record["rng"]
    got, want = back["loaders"][0], record["loaders"][0]
    for k in ("words", "half", "flag", "empty"):
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert got["pair"] == (1, "a") and isinstance(got["pair"], tuple)


def test_an_object_without_a_pickle_free_form_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="cannot send a object between ranks"):
        _pack({"x": object()})


def test_a_world_size_change_is_refused_naming_both_sizes() -> None:
    refuse_world_change("runs/a/step-4", 2, 2, how="")
    with pytest.raises(ResumeMismatchError, match="saved by 2 process\\(es\\), this run has 1") as e:
        refuse_world_change("runs/a/step-4", 2, 1, how="Launch 2.")
    assert e.value.key == "world_size" and e.value.context == {"saved_world_size": 2, "world_size": 1}
