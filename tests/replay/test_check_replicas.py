"""The replica-run invariants of ``ckpt tape check`` (spec/tape-format.md §8): a step is
committed only under a quorum that lists the replica, and a recovered replica holds the
state its source sent. Clean histories pass; each tampered one is caught and named."""

from __future__ import annotations

from dataclasses import replace

from replay import Recorder, TapeReader, check_events, check_tape

S1, S2 = b"\x01" * 16, b"\x02" * 16
Z = bytes(16)


def _tape(path, *, commit_quorum="q1", members=("g0", "g1"), loaded_state=S1, b_params=None):
    with Recorder.open(str(path), actor="run", rng_every=0, param_digest_every=0, rng_sources=()) as rec:
        a, b = rec.actor("g0.0"), rec.actor("g1.0")
        for x in (a, b):
            x.quorum("q1", 1, lambda: list(members))
        a.event("step_commit", commit_quorum, 1, 2, S1, S1)
        if b_params is not None:
            b.event("step_commit", "q1", 1, 2, b_params, S1)
        a.current_step = b.current_step = 3
        st = a.send("recovery:g0.0->g1.0", peer="g1.0", digest=S2)
        a.event("recovery_sent", "g1.0", S2, S1, 100)
        b.recv(st)
        b.event("recovery_loaded", "g0.0", S2, loaded_state)
    return path


def test_a_clean_history_passes(tmp_path):
    assert check_tape(_tape(tmp_path / "ok.tape")) == []


def test_commit_without_its_quorum_is_caught(tmp_path):
    v = check_tape(_tape(tmp_path / "a.tape", commit_quorum="q9"))
    assert [x.rule for x in v] == ["commit-without-quorum"] and "q9" in v[0].message
    v = check_tape(_tape(tmp_path / "b.tape", members=("g1",)))
    assert [x.rule for x in v] == ["commit-without-quorum"] and "g0" in v[0].message


def test_a_recovered_state_other_than_the_sent_one_is_caught(tmp_path):
    v = check_tape(_tape(tmp_path / "c.tape", loaded_state=S2))
    assert [x.rule for x in v] == ["recovery-state-mismatch"] and {e.actor for e in v[0].events} == {"g0.0", "g1.0"}


def test_tampered_events_of_a_real_history_are_caught(tmp_path):
    evs = list(TapeReader(_tape(tmp_path / "d.tape")).events())
    # drop the source's recovery_sent: the joiner loaded a state nobody sent it
    v = check_events([e for e in evs if e.kind.name != "recovery_sent"])
    assert [x.rule for x in v] == ["recovery-without-source"]
    # rewrite the committed step's quorum key in place
    k = next(i for i, e in enumerate(evs) if e.kind.name == "step_commit")
    raw = evs[k].kind.pack("q7", 1, 2, S1, S1)
    assert [x.rule for x in check_events(evs[:k] + [replace(evs[k], raw=raw)] + evs[k + 1:])] == [
        "commit-without-quorum"]


def test_replicas_that_commit_one_step_with_different_states_are_caught(tmp_path):
    assert check_tape(_tape(tmp_path / "e.tape", b_params=S1)) == []  # the same state: fine
    v = check_tape(_tape(tmp_path / "f.tape", b_params=S2))
    assert [x.rule for x in v] == ["replica-state-diverged"] and {e.actor for e in v[0].events} == {"g0.0", "g1.0"}
