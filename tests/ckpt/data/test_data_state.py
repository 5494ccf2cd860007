"""The data state: msgpack round trips, malformed dicts, dicts that do not fit."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from ckpt.data import QuarantinePolicy, ResumableLoader, merge_rank_states
from ckpt.errors import FormatError, StateMismatchError, UnsupportedVersionError
from ckpt_data_testkit import AugDataset, ListShards, take, via_msgpack


def _loader(**kw: Any) -> ResumableLoader:
    opts: dict[str, Any] = dict(seed=11, global_batch_size=4, world_size=1, rank=0)
    opts.update(kw)
    return ResumableLoader(AugDataset(30, nan_at=frozenset({1, 2, 3, 4, 5})), **opts)


def _state_with_records() -> dict[str, Any]:
    loader = _loader(quarantine=QuarantinePolicy(fields=("x",)))
    take(loader, 9)  # through epoch 0 (7 steps) into epoch 1: every NaN sample was met
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 8 and len(state["quarantine"]) == 4  # sample 1 sits in the dropped tail of epoch 0
    return state


def test_state_round_trips_through_msgpack_and_restores_the_cursor() -> None:
    state = _state_with_records()
    packed = via_msgpack(state)
    assert packed == state
    fresh = _loader(quarantine=QuarantinePolicy(fields=("x",)))
    fresh.load_state_dict(packed)
    assert fresh.state_dict() == state
    assert (fresh.epoch, fresh.position, fresh.step) == (1, 8, 2)
    assert [r.to_dict() for r in fresh.quarantined] == state["quarantine"]


def test_shard_records_round_trip() -> None:
    src = ListShards([3, 4, 5], bad_shards=frozenset({1}))
    loader = ResumableLoader(
        src, seed=2, global_batch_size=4, world_size=1, rank=0, quarantine=QuarantinePolicy(scope="shard")
    )
    take(loader, 3)
    state = loader.state_dict()
    assert [(r["scope"], r["shard"]) for r in state["quarantine"]] == [("shard", 1)]
    fresh = ResumableLoader(
        ListShards([3, 4, 5]), seed=2, global_batch_size=4, world_size=1, rank=0,
        quarantine=QuarantinePolicy(scope="shard"),
    )
    fresh.load_state_dict(via_msgpack(state))
    assert fresh.state_dict() == state


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        d[key] = value

    return mutate


def _rec(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        d["quarantine"][0][key] = value

    return mutate


MALFORMED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing key", lambda d: d.pop("seed"), "missing key 'seed' (key 'seed')"),
    ("unknown key", _set("extra", 1), "unknown key 'extra' (key 'extra')"),
    ("str seed", _set("seed", "11"), "expected an int, got str (key 'seed')"),
    ("bool epoch", _set("epoch", True), "expected an int, got bool (key 'epoch')"),
    ("negative epoch", _set("epoch", -1), "-1 outside [0, 18446744073709551615] (key 'epoch')"),
    ("zero batch", _set("global_batch_size", 0), "0 outside [1, 18446744073709551615] (key 'global_batch_size')"),
    ("rank >= world", _set("rank", 1), "1 outside [0, 0] (key 'rank')"),
    ("int drop_last", _set("drop_last", 1), "expected a bool, got int (key 'drop_last')"),
    ("unaligned position", _set("position", 6), "position 6 is not the start of one of the 7 global batches"),
    ("position past end", _set("position", 28), "position 28 is not the start of one of the 7 global batches"),
    ("quarantine not list", _set("quarantine", {}), "expected a list, got dict (key 'quarantine')"),
    ("record missing key", lambda d: d["quarantine"][0].pop("reason"), "missing key 'reason' (key 'quarantine[0].reason')"),
    ("record bad scope", _rec("scope", "file"), "scope must be 'sample' or 'shard', got 'file' (key 'quarantine[0].scope')"),
    ("record index out of range", _rec("index", 30), "30 outside [0, 29] (key 'quarantine[0].index')"),
    ("record from the future", _rec("epoch", 2), "2 outside [0, 1] (key 'quarantine[0].epoch')"),
    ("record reason not str", _rec("reason", 3), "expected a str, got int (key 'quarantine[0].reason')"),
    ("shard record without shard", _rec("scope", "shard"), "a shard record needs a shard (key 'quarantine[0].shard')"),
    ("duplicate record", lambda d: d["quarantine"].append(dict(d["quarantine"][0])), "duplicate quarantine record"),
    ("record not a dict", lambda d: d["quarantine"].append([1]), "expected a dict, got list (key 'quarantine[4]')"),
]


@pytest.mark.parametrize("name,mutate,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_state_raises_format_error(name: str, mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    state = copy.deepcopy(_state_with_records())
    mutate(state)
    loader = _loader()
    before = loader.state_dict()
    with pytest.raises(FormatError) as info:
        loader.load_state_dict(state)
    assert message in str(info.value)
    assert loader.state_dict() == before  # nothing was half-loaded


def test_not_a_dict_and_unknown_version() -> None:
    loader = _loader()
    with pytest.raises(FormatError, match=r"expected a dict, got list \(key '<root>'\)"):
        loader.load_state_dict([])  # type: ignore[arg-type]
    state = loader.state_dict()
    state["version"] = 3
    with pytest.raises(UnsupportedVersionError, match=r"data state version 3 is not supported \(this reader knows 1 and 2\)"):
        loader.load_state_dict(state)
    state["version"] = "1"
    with pytest.raises(FormatError, match=r"expected an int, got str \(key 'version'\)"):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(seed=12), "data state has seed=11, this loader has 12 (key 'seed')"),
        (dict(global_batch_size=5), "data state has global_batch_size=4, this loader has 5 (key 'global_batch_size')"),
        (dict(drop_last=False), "data state has drop_last=True, this loader has False (key 'drop_last')"),
    ],
)
def test_state_of_another_configuration_raises_state_mismatch(kw: dict[str, Any], message: str) -> None:
    state = _loader().state_dict()
    with pytest.raises(StateMismatchError) as info:
        _loader(**kw).load_state_dict(state)
    assert str(info.value) == message


def test_state_of_another_dataset_or_shard_layout_raises_state_mismatch() -> None:
    state = _loader().state_dict()
    other = ResumableLoader(AugDataset(31), seed=11, global_batch_size=4, world_size=1, rank=0)
    with pytest.raises(StateMismatchError, match=r"num_samples=30, this loader has 31 \(key 'num_samples'\)"):
        other.load_state_dict(state)
    shard_state = ResumableLoader(ListShards([10, 10, 10]), seed=11, global_batch_size=4, world_size=1).state_dict()
    shard_state["quarantine"] = [{"epoch": 0, "index": 25, "shard": 2, "scope": "shard", "reason": "r"}]
    fewer = ResumableLoader(ListShards([15, 15]), seed=11, global_batch_size=4, world_size=1)
    with pytest.raises(StateMismatchError, match=r"names shard 2, this source has 2 shards \(key 'quarantine\[0\].shard'\)"):
        fewer.load_state_dict(shard_state)


def test_merge_rank_states_unions_records_and_checks_cursors() -> None:
    a = _loader().state_dict()
    a["world_size"] = 2
    b = dict(a, rank=1)
    a["quarantine"] = [{"epoch": 0, "index": 7, "shard": None, "scope": "sample", "reason": "r7"}]
    b["quarantine"] = [
        {"epoch": 0, "index": 3, "shard": None, "scope": "sample", "reason": "r3"},
        {"epoch": 0, "index": 7, "shard": None, "scope": "sample", "reason": "r7"},
    ]
    merged = merge_rank_states([a, b])
    assert [r["index"] for r in merged["quarantine"]] == [3, 7]
    assert merged["rank"] == 0 and merged["world_size"] == 2
    with pytest.raises(StateMismatchError, match=r"state 0 has position=0, state 1 has 4 \(key 'position'\)"):
        merge_rank_states([a, dict(b, position=4)])
    with pytest.raises(ValueError, match="needs at least one state"):
        merge_rank_states([])
