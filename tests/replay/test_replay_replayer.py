"""Replay: verify (tape as oracle), force (taped decisions), fork, --from, --until, divergence reports."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
import torch

from replay import ReplayStop, TapeReader, record, replay
from replay.errors import DivergenceError, ReplayError
from replay.replayer import fork, load_entry_point

HERE = Path(__file__).resolve().parent
TRAIN = f"{HERE / 'replay_entry.py'}:train"
SYNCER = f"{HERE / 'replay_entry.py'}:syncer"


@pytest.fixture
def entry():
    """The entry-point module as the replayer loads it, with its tamper hooks reset."""
    fn = load_entry_point(TRAIN)
    mod = sys.modules[fn.__module__]
    mod.TAMPER.clear()
    mod.CALLS["quorum_compute"] = 0
    yield mod
    mod.TAMPER.clear()


@pytest.fixture
def tape(tmp_path: Path, entry) -> Path:
    path = tmp_path / "run.tape"
    record(TRAIN, path, config={"steps": 8, "dump_at": 4, "dump_path": str(tmp_path / "ref.safetensors")},
           param_digest_every=1)
    return path


def test_verify_identical(tape: Path) -> None:
    res = replay(tape)
    n = sum(1 for e in TapeReader(tape).events() if e.kind.name != "actor")
    assert res.identical and res.exit_code == 0 and res.events_compared == n and res.last_step == 7
    assert res.divergence is None and res.env_diff == {}
    assert "IDENTICAL" in res.format() and "same fingerprint" in res.format()


def test_flipped_bit_names_exact_step_and_tensor(tape: Path, tmp_path: Path, entry) -> None:
    entry.TAMPER.update(flip_at=4, tensor="3.weight", index=5, bit=0)
    res = replay(tape)
    assert not res.identical and res.exit_code == 6
    d = res.divergence
    assert d is not None
    assert (d.step, d.actor, d.kind) == (4, "main", "params")
    assert [t.name for t in d.tensors] == ["3.weight"]
    assert d.clock_expected == d.clock_actual
    assert d.expected_digest != d.actual_digest
    assert d.tensors[0].max_abs_diff is None and "no reference" in d.reference_note
    text = res.format()
    assert "DIVERGED at step 4, actor main, event params" in text and "3.weight" in text


def test_flipped_bit_max_abs_diff_against_reference(tape: Path, tmp_path: Path, entry) -> None:
    from safetensors.torch import load_file

    ref = load_file(tmp_path / "ref.safetensors")
    entry.TAMPER.update(flip_at=4, tensor="3.weight", index=5, bit=3)
    res = replay(tape, reference=lambda step: ref if step == 4 else None)
    d = res.divergence
    assert d is not None and [t.name for t in d.tensors] == ["3.weight"]
    flipped = ref["3.weight"].clone()
    entry.flip_bit(flipped, 5, 3)
    expected = (flipped.double() - ref["3.weight"].double()).abs().max().item()
    assert d.tensors[0].max_abs_diff == expected and d.tensors[0].elements_differing == 1
    assert "max abs diff" in res.format()


def test_until_stops_and_reports(tape: Path) -> None:
    res = replay(tape, until=3)
    n = sum(1 for e in TapeReader(tape).events() if e.kind.name != "actor" and e.step <= 3)
    assert res.identical and res.stopped_at == 3 and res.events_compared == n
    assert "up to step 3" in res.format()


def test_run_ending_early_diverges(tape: Path, entry) -> None:
    entry.TAMPER["steps"] = 5
    res = replay(tape)
    assert not res.identical
    assert res.divergence is not None and res.divergence.step == 5 and res.divergence.kind == "step_begin"
    assert "the run ended" in res.divergence.reason


def test_extra_event_diverges_with_kind_named(tape: Path, entry) -> None:
    entry.TAMPER["extra_note_at"] = 2
    res = replay(tape)
    d = res.divergence
    assert d is not None and d.step == 2 and d.kind == "note"
    assert "the tape has params here, the run produced note" in d.reason


def test_env_diff_is_reported(tape: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import replay.replayer as rp

    real = rp.capture_env
    monkeypatch.setattr(rp, "capture_env", lambda: {**real(), "torch": "9.9.9"})
    res = replay(tape)
    assert res.identical and res.env_diff["torch"] == (torch.__version__, "9.9.9")
    assert "environment differs" in res.format() and "9.9.9" in res.format()


def test_force_mode_takes_timing_decisions_from_the_tape(tmp_path: Path, entry) -> None:
    path = tmp_path / "sync.tape"
    record(SYNCER, path, config={"steps": 6, "grace": 0.55}, rng_every=0)
    calls_recorded = entry.CALLS["quorum_compute"]
    assert calls_recorded == 6
    entry.TAMPER["slow"] = 0.5  # learner-2's pushes now arrive late on this "slower machine"
    verify = replay(path)
    assert not verify.identical and verify.divergence is not None
    assert verify.divergence.kind == "quorum" and "members" in [f for f, _, _ in verify.divergence.fields]
    entry.CALLS["quorum_compute"] = 0
    forced = replay(path, mode="force")
    assert forced.identical, forced.format()
    assert entry.CALLS["quorum_compute"] == 0  # never recomputed
    members = [e.payload["members"] for e in TapeReader(path).events() if e.kind.name == "quorum"]
    assert any("learner-2" in m for m in members)


def test_force_mode_with_unchanged_machine_is_identical_too(tmp_path: Path, entry) -> None:
    path = tmp_path / "sync.tape"
    record(SYNCER, path, config={"steps": 3, "grace": 0.55}, rng_every=0)
    assert replay(path).identical and replay(path, mode="force").identical


def test_from_checkpoint_resumes_and_verifies_the_rest(tmp_path: Path, entry) -> None:
    path = tmp_path / "run.tape"
    cdir = tmp_path / "ckpts"
    cdir.mkdir()
    record(TRAIN, path, config={"steps": 8, "ckpt_every": 3, "ckpt_dir": str(cdir)}, param_digest_every=2)
    marks = [e.payload for e in TapeReader(path).events() if e.kind.name == "checkpoint"]
    assert [m["ckpt_id"] for m in marks] == ["step-00000", "step-00003", "step-00006"]
    res = replay(path, from_checkpoint=str(cdir / "step-00003"))
    assert res.identical, res.format()
    n_after = sum(1 for e in TapeReader(path).events() if e.kind.name != "actor" and e.step >= 4)
    assert res.events_compared == n_after and res.last_step == 7
    entry.TAMPER.update(flip_at=6, tensor="0.weight", index=0, bit=1)
    bad = replay(path, from_checkpoint=str(cdir / "step-00003"))
    assert bad.divergence is not None and (bad.divergence.step, bad.divergence.kind) == (6, "params")
    assert [t.name for t in bad.divergence.tensors] == ["0.weight"]


def test_fork_writes_a_new_tape_with_lineage(tmp_path: Path, tape: Path) -> None:
    out = tmp_path / "fork.tape"
    res = fork(tape, out, config_overrides={"seed": 7})
    assert res.mode == "fork" and res.identical and res.out_tape == str(out)
    parent, child = TapeReader(tape), TapeReader(out)
    lin = child.meta["lineage"]
    assert lin["parent_run_id"] == parent.run_id.hex() and lin["changes"] == {"seed": 7}
    assert lin["parent_tape"] == str(tape)
    assert child.meta["config"]["seed"] == 7 and child.meta["config_hash"] != parent.meta["config_hash"]
    pa = [e for e in parent.events() if e.kind.name == "loss"]
    ch = [e for e in child.events() if e.kind.name == "loss"]
    assert len(pa) == len(ch) and pa[0].raw != ch[0].raw
    assert replay(out).identical  # the fork is itself replayable


def test_errors(tmp_path: Path, tape: Path) -> None:
    with pytest.raises(ValueError, match="use mode='fork'"):
        replay(tape, config_overrides={"seed": 1})
    with pytest.raises(ValueError, match="mode must be verify, force or fork"):
        replay(tape, mode="nope")
    with pytest.raises(ReplayError, match="must be 'module:function'"):
        load_entry_point("nocolon")
    with pytest.raises(ReplayError, match="no attribute 'nope'"):
        load_entry_point(f"{HERE / 'replay_entry.py'}:nope")
    with pytest.raises(FileNotFoundError):
        replay(tmp_path / "missing.tape")


def test_user_code_cannot_swallow_the_stop(tape: Path, entry) -> None:
    # ReplayStop is a BaseException: `except Exception` in a training loop does not eat it.
    assert not issubclass(ReplayStop, Exception)
    assert issubclass(DivergenceError, AssertionError)


def test_corrupt_tape_fails_closed_during_replay(tape: Path, tmp_path: Path) -> None:
    from replay.errors import TapeCorruptError

    data = bytearray(tape.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad = tmp_path / "bad.tape"
    bad.write_bytes(bytes(data))
    with pytest.raises(TapeCorruptError, match="followed by a valid record"):
        replay(bad)


def test_loss_sequence_is_bit_identical_across_record_and_fork_of_same_config(tmp_path: Path, tape: Path) -> None:
    out = tmp_path / "same.tape"
    fork(tape, out, config_overrides={})
    a = [struct.pack("<d", e.payload["value"]) for e in TapeReader(tape).events() if e.kind.name == "loss"]
    b = [struct.pack("<d", e.payload["value"]) for e in TapeReader(out).events() if e.kind.name == "loss"]
    assert a == b and len(a) == 8


def test_one_environment_comparison_for_tapes_ledgers_and_checkpoints() -> None:
    """replay, the ledger and the checkpoint gate compare environments with ckpt's one
    ``env_diff`` (nested ``env`` entries per variable), so they never disagree."""
    from ckpt.context.env import env_diff, env_differences

    a = {"torch": "2.13", "env": {"OMP_NUM_THREADS": "1"}, "only_a": 1}
    b = {"torch": "2.14", "env": {"OMP_NUM_THREADS": "2"}}
    assert env_diff(a, b) == {"env.OMP_NUM_THREADS": ("1", "2"), "only_a": (1, None), "torch": ("2.13", "2.14")}
    assert env_differences(a, b, keys=("torch", "env")) == ["torch: '2.13' -> '2.14'",
                                                            "env.OMP_NUM_THREADS: '1' -> '2'"]
    import replay.digest

    assert not hasattr(replay.digest, "env_diff")
