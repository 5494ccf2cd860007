"""Chandy-Lamport snapshots of the reference run: committed as ckpt checkpoints under a
retention policy, consistent on the tape, and a mid-run snapshot restored and continued
under the tape matches the original run bit for bit."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpt
import runs.diloco.run as diloco_run
from ckpt_cli.main import cli
from replay.channel import Message, MessageKind, actor_of
from replay.check import check_tape
from runs.diloco import record
from runs.diloco.restore import read_snapshot, restore_run
from runs.diloco.snapshots import list_snapshots
from replay.errors import SnapshotError
from replay.replayer import replay
from replay.tape import TapeReader

from tests.runs.diloco._kit import Gate, gated_network, tiny


def _cfg(**kw: object):
    # 40 steps: the loss fault's learners are back well before the end, so late
    # snapshots have every learner in them (restorable) whatever the timing
    return tiny(steps=40, snapshot_every=1, **kw)


@pytest.fixture(scope="module")
def snap_run(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("snap")
    return record(d / "tape", _cfg()), d


def _same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (n, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), n


def _assert_continues_identically(orig, rr) -> None:
    assert rr.identical, rr.divergence
    run = rr.run
    _same(run.syncer.state, orig.syncer.state)  # every fragment and its outer momentum
    mine, theirs = orig.final_learner_states(), run.final_learner_states()
    assert sorted(theirs) == sorted(mine)
    for a in mine:
        _same(theirs[a], mine[a])
    # the loss sequences after the cut: every learner's and the syncer's validation losses
    by = {(o.actor, o.incarnation): o.losses for o in orig.learners}
    for o in run.learners:  # (a learner restored after its last step has none)
        full = by[(o.actor, o.incarnation)]
        assert o.losses == full[len(full) - len(o.losses):]
    assert run.syncer.val == [v for v in orig.syncer.val if v[0] >= rr.syncer_step]
    assert run.syncer.plans == orig.syncer.plans[rr.syncer_step:]


@pytest.mark.slow
def test_snapshots_committed_kept_by_retention_and_on_the_tape(snap_run) -> None:
    res, d = snap_run
    outcomes = res.extra["snapshots"]
    assert len(outcomes) >= 3 and all(o["committed"] for o in outcomes)
    kept = list_snapshots(d / "checkpoints")
    # ckpt's RetentionPolicy: the last 2, plus the newest snapshot that also continues
    # exactly under this tape; every committed snapshot is restorable (spec §9a)
    assert all(k["meta"]["restorable"] for k in kept)
    exact = [Path(o["path"]).name for o in outcomes if o["exact"]]
    want = {Path(o["path"]).name for o in outcomes[-2:]} | set(exact[-1:])
    assert exact and {k["name"] for k in kept} == want
    assert not [p for p in (d / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    for k in kept:
        ckpt.open(k["path"]).verify()
        assert k["meta"]["format"] == "replay-snapshot" and k["meta"]["parts"][0] == "syncer"
        assert k["meta"]["exact"] == next(o["exact"] for o in outcomes if Path(o["path"]).name == k["name"])
        assert ckpt.open(k["path"]).step == k["meta"]["syncer_step"] == k["step"]  # the checkpoint's step: the cut's
        r = CliRunner().invoke(cli, ["inspect", k["path"]])
        assert r.exit_code == 0 and f"snapshot {k['name']} (coordinator syncer)" in r.output
        assert CliRunner().invoke(cli, ["verify", k["path"]]).exit_code == 0
    events = list(TapeReader(res.tape).events())
    taped = {e.payload["snapshot_id"]: e.payload for e in events if e.kind.name == "snapshot_outcome"}
    assert sorted(taped) == sorted(Path(o["path"]).name for o in outcomes)
    for o in outcomes:
        t = taped[Path(o["path"]).name]
        assert t["committed"] and sorted(t["parts"]) == sorted(o["parts"]) and t["excluded"] == o["excluded"]
    cuts = [e for e in events if e.kind.name == "snapshot"]
    assert {e.actor for e in cuts} == {"syncer", *(f"learner-{i}" for i in range(4))}
    assert check_tape(res.tape) == []  # every cut consistent, every crossing message recorded


@pytest.mark.slow
def test_failed_learners_are_excluded_by_policy_and_taped(snap_run) -> None:
    res, _ = snap_run
    outcomes = res.extra["snapshots"]
    with_dead = [o for o in outcomes if o["excluded"]]
    assert with_dead, "chaos kills learners: some snapshot must have left one out"
    events = list(TapeReader(res.tape).events())
    excl = {(e.payload["detail"]["snapshot"], e.payload["target"]) for e in events
            if e.kind.name == "fault_detected" and e.payload["fault"] == "snapshot-excluded"}
    for o in with_dead:
        for a in o["excluded"]:
            assert (Path(o["path"]).name, a) in excl
            assert a not in o["parts"]


@pytest.mark.slow
def test_force_replay_with_snapshots_is_identical(snap_run) -> None:
    res, _ = snap_run
    r = replay(res.tape, mode="force")
    assert r.identical, r.format()
    assert r.events_compared == sum(1 for e in TapeReader(res.tape).events() if e.kind.name != "actor")


@pytest.mark.slow
def test_restore_mid_run_snapshot_continues_bit_identically(snap_run) -> None:
    res, d = snap_run
    kept = [k for k in list_snapshots(d / "checkpoints") if k["meta"]["exact"]]  # kept by retention
    assert kept
    snap = kept[-1]
    assert 0 < snap["step"] < res.cfg.syncer_steps
    rr = restore_run(res.tape, snap["path"])
    assert rr.syncer_step == snap["step"] and rr.events_compared > 0
    _assert_continues_identically(res, rr)


@pytest.mark.slow
def test_restore_earliest_snapshot_replays_the_faults_after_it(tmp_path: Path) -> None:
    # Every snapshot kept: the earliest one with all learners in it (usually syncer step
    # 1, before the kill) is continued; deaths, recoveries and rejoins after the cut are
    # re-enacted by the restored actors and still match the tape bit for bit.
    # snapshot_wait: a snapshot begins at every syncer step, so one falls while a learner
    # is dead (between its death and its replacement's activation, two steps)
    res = record(tmp_path / "tape", tiny(snapshot_every=1, snapshot_keep=50, snapshot_wait=True))
    ok = [k for k in list_snapshots(tmp_path / "checkpoints") if not k["meta"]["excluded"]]
    assert ok
    rr = restore_run(res.tape, ok[0]["path"])
    _assert_continues_identically(res, rr)
    after = [a for s, a in res.syncer.deaths if s >= rr.syncer_step]
    assert sorted(a for _, a in rr.run.syncer.deaths) == sorted(after)
    assert sum(len(o.losses) for o in rr.run.learners) > 0
    # A snapshot that left out only dead learners continues exactly under the tape too:
    # their replacements are activated when the tape's plan says, and recover from a peer.
    partial = [k for k in list_snapshots(tmp_path / "checkpoints") if k["meta"]["excluded"]]
    dead_only = [k for k in partial if sorted(k["meta"]["excluded"]) == sorted(_policy(k))
                 and set(_policy(k).values()) == {"dead"}]
    assert dead_only, [_policy(k) for k in partial]
    _assert_continues_identically(res, restore_run(res.tape, dead_only[-1]["path"]))


def _policy(k) -> dict[str, str]:
    """The learners a snapshot left out by policy at its cut: actor -> "dead"/"recovering"."""
    return dict(read_snapshot(k["path"])[1]["syncer"]["diloco"]["snapshot"]["excluded"])


def test_restore_refuses_a_non_snapshot(tmp_path: Path) -> None:
    import ckpt as c

    p = tmp_path / "ck"
    c.save(p, {"x": torch.zeros(2)}, step=1)
    with pytest.raises(SnapshotError, match="not a DiLoCo snapshot"):
        restore_run(tmp_path / "nope.tape", p)


@pytest.mark.slow
def test_snapshot_parts_show_each_field_where_it_belongs(snap_run) -> None:
    """Parameters are the weights, optimizer state the optimizer, the loader state the
    data offsets, the run's config with its hash; and reading a part back gives exactly
    the tree that was written (restore depends on it, bit for bit)."""
    import json

    from runs.diloco.snapshots import join_part, part_entries

    res, d = snap_run
    k = list_snapshots(d / "checkpoints")[-1]
    r = CliRunner().invoke(cli, ["inspect", "--json", k["path"]])
    assert r.exit_code == 0, r.output
    parts = {p["name"]: p for p in json.loads(r.output)["parts"]}
    assert sorted(parts) == sorted(k["meta"]["parts"])
    cfg_hash = {p["config_hash"] for p in parts.values()}
    assert len(cfg_hash) == 1 and None not in cfg_hash  # one config, in every part
    for name, p in parts.items():
        fields = {e: v["field"] for e, v in p["entries"].items()}
        assert fields["model"] == "weights" and fields["optim"] == "optimizer" and fields["messages"] == "messages"
        assert set(fields.values()) <= {"weights", "optimizer", "messages", "other"}
        assert [e for e, f in fields.items() if f == "weights"] == ["model"]  # nothing else passes for weights
        assert p["entries"]["model"]["tensors"] > 0 and p["entries"]["optim"]["tensors"] > 0
        if name == "syncer":
            assert p["data"] is None
        else:
            assert p["data"]["type"].endswith("LoaderState") and "position" in p["data"]["state"]
    text = CliRunner().invoke(cli, ["inspect", k["path"]]).output
    assert "optimizer  optim: " in text and "other state  diloco (plain values)" in text

    # split and join are inverse on the trees read back: tensors bit-identical, all else equal
    _meta, trees = read_snapshot(k["path"])
    for actor, tree in trees.items():
        entries, data = part_entries(actor, tree)
        back = join_part(actor, {n: (v.state_dict() if hasattr(v, "state_dict") else v) for n, v in entries.items()},
                         data.state_dict() if data is not None else None)
        _same_tree(back, tree["diloco"])


def _same_tree(a, b, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b) or sorted(map(str, a)) == sorted(map(str, b)), where
        for key in a:
            _same_tree(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), where  # bit for bit (a NaN loss too)
    else:
        assert a == b, where


class _SyncerCrash(Exception):
    pass


@pytest.mark.slow
def test_syncer_crash_continues_live_from_the_newest_snapshot(tmp_path: Path) -> None:
    """The one fault that costs a pause: the syncer dies mid-run. The run goes on from
    a snapshot (dead learners left out of it are replaced), taking fresh decisions, on a new tape
    that holds the history inside the cut; that tape checks clean and a forced replay of
    it from step 0 reproduces the continued run bit for bit."""
    from runs.diloco.restore import continue_run

    cfg = _cfg()
    crash_at = 14

    def die(s: int, *_: object) -> None:
        if s == crash_at:
            raise _SyncerCrash(f"syncer died after step {s}")

    with pytest.raises(_SyncerCrash):
        record(tmp_path / "run1" / "tape", cfg, after_step=die)
    # The newest snapshot that left no learner out alive (retention keeps it): the
    # continuation then replays from step 0 (from one that did, it replays from the
    # snapshot: test_a_partial_snapshot_continues_live_and_the_left_out_learners_rejoin).
    kept = [k for k in list_snapshots(tmp_path / "run1" / "checkpoints") if k["meta"]["exact"]]
    assert kept, "a snapshot was taken before the crash"
    snap = kept[-1]
    assert snap["step"] <= crash_at

    with pytest.raises(SnapshotError, match="another snapshot directory"):
        continue_run(tmp_path / "run1" / "tape", snap["path"], tmp_path / "run1" / "tape2")

    new = tmp_path / "run2" / "tape"
    res = continue_run(tmp_path / "run1" / "tape", snap["path"], new)
    assert len(res.syncer.plans) == cfg.syncer_steps - snap["step"]  # every remaining step, none skipped
    header = TapeReader(new).meta
    assert header["lineage"]["from_snapshot"] == str(Path(snap["path"]).absolute())
    assert header["lineage"]["parent_run_id"] == TapeReader(tmp_path / "run1" / "tape").run_id.hex()
    outcomes = res.extra["snapshots"]
    assert outcomes[0]["path"] == str(Path(snap["path"]).absolute()) and outcomes[0]["committed"]
    assert any(o["committed"] for o in outcomes[1:]), "the continued run goes on taking snapshots"
    for k in list_snapshots(tmp_path / "run2" / "checkpoints"):
        ckpt.open(k["path"]).verify()

    assert check_tape(new) == []
    rr = replay(new, mode="force")
    assert rr.identical, rr.divergence
    again = rr.value
    _same(again.syncer.state, res.syncer.state)
    # the replay ran from step 0; the continued run's validation losses are its tail
    assert [v for v in again.syncer.val if v[0] >= snap["step"]] == res.syncer.val
    mine, theirs = res.final_learner_states(), again.final_learner_states()
    assert sorted(mine) == sorted(theirs)
    for a in mine:
        _same(theirs[a], mine[a])


@pytest.mark.slow
def test_a_partial_snapshot_continues_live_and_the_left_out_learners_rejoin(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """After a syncer fault the run continues from a snapshot that left a learner out while
    it was still recovering: the syncer and the included learners start from their parts,
    the left-out one starts afresh and recovers from a healthy peer as it does live; the
    new tape checks clean and a forced replay of it reproduces the continued run."""
    from runs.diloco.restore import continue_run

    # Forced by events, not by a slow peer (a 0.1 s delay once lost the race at load 14):
    # a replacement's "joined" (and all it sends the syncer after it) is held until the
    # syncer has sent a marker of a cut that has neither the replacement nor the learner it
    # replaces inside, that is a cut taken while it was recovering.
    def left_out(m: Message) -> bool:
        parts = [actor_of(str(e)) for e in m.meta.get("participants", ())]
        return bool(gate.held) and m.kind == MessageKind.MARKER and m.src == "syncer" and \
            all(actor_of(h.src) not in parts for h in gate.held)

    gate = Gate(lambda m: m.dst == "syncer" and m.meta.get("kind") == "joined", until=left_out)
    monkeypatch.setattr(diloco_run, "InProcessNetwork", gated_network([gate]))
    res = record(tmp_path / "run1" / "tape", tiny(snapshot_every=1, snapshot_keep=50, snapshot_wait=True))
    assert gate.open and not gate.held
    monkeypatch.undo()
    partial = [k for k in list_snapshots(tmp_path / "run1" / "checkpoints") if "recovering" in _policy(k).values()]
    assert partial, "a replacement is still recovering at the cut right after its activation"
    snap = partial[0]
    with pytest.raises(SnapshotError, match="continue it live"):  # its recovery cannot be re-run under the tape
        restore_run(res.tape, snap["path"])
    new = tmp_path / "run2" / "tape"
    out = continue_run(res.tape, snap["path"], new)
    assert len(out.syncer.plans) == res.cfg.syncer_steps - snap["step"]
    left = sorted(snap["meta"]["excluded"])
    events = list(TapeReader(new).events())
    back = [e.payload["target"] for e in events if e.kind.name == "fault_recovered"
            and e.payload["fault"] == "snapshot-excluded"]
    rejoined = sorted(a for a, why in _policy(snap).items() if why == "recovering")
    assert sorted(back) == rejoined and set(rejoined) <= set(left)
    assert sorted(out.final_learner_states()) == [f"learner-{i}" for i in range(res.cfg.learners)]
    assert check_tape(new) == []
    # The new tape holds the history inside the cut, then the continuation, in which the
    # left-out learner rejoined afresh: a forced replay from the snapshot (every actor at
    # its cut, the left-out one after its events before the syncer's) reproduces it.
    rr = restore_run(new, snap["path"])
    assert rr.identical, rr.divergence
    _same(rr.run.syncer.state, out.syncer.state)
    assert rr.run.syncer.val == out.syncer.val and rr.run.syncer.plans == out.syncer.plans
    mine, theirs = out.final_learner_states(), rr.run.final_learner_states()
    assert sorted(mine) == sorted(theirs)
    for a in mine:
        _same(theirs[a], mine[a])
