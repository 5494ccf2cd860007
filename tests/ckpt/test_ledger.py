"""The step ledger inside CheckpointManager, its tape, bad ledgers, isolated(), and ckpt diff."""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckpt
from ckpt.errors import ResumeDivergedError
from ckpt.ledger import ResumeVerificationWarning, read_ledger_dir
from ckpt_cli.main import cli


class Loop:
    """A small training loop run under a manager; ``stop_at`` ends the process's part early
    (as a crash would, without a final save), ``draw_outside`` draws from the torch RNG
    right after resume (an evaluation outside the checkpointed state)."""

    def __init__(self, run_dir, **mgr_kw):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.mgr = ckpt.CheckpointManager(run_dir, {"model": self.model, "optim": self.opt}, every_steps=4,
                                          signals=(), **mgr_kw)

    def run(self, total, *, stop_at=None, draw_outside=False, with_batch=True):
        self.mgr.resume()
        if draw_outside:
            torch.rand(3)
        for step in range(self.mgr.start_step + 1, total + 1):
            x = torch.randn(8, 4)
            loss = self.model(x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.mgr.after_step(step, batch=x if with_batch else None, loss=loss if with_batch else None)
            if stop_at == step:
                self.mgr.wait()
                os.close(self.mgr.ledger._writer._fd)  # the process "dies": no close record, nothing more
                self.mgr.ledger._writer = None
                return
        self.mgr.close()


def _crash_and_resume(tmp_path, *, draw_outside=False, **kw):
    Loop(tmp_path / "run", **kw).run(12, stop_at=7)
    loop = Loop(tmp_path / "run", **kw)
    loop.run(12, draw_outside=draw_outside)
    return loop.mgr.resume_report


def test_resume_verified_exact_and_on_the_tape(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeVerificationWarning)
        rep = _crash_and_resume(tmp_path)
    assert rep.verdict == "exact" and (rep.first, rep.last) == (5, 7)
    assert rep.text.startswith("resume verified exact over steps 5..7")
    tapes, problems = read_ledger_dir(str(tmp_path / "run" / "ledger"))
    assert not problems and len(tapes) == 2
    assert [c.verdict for c in tapes[1].checks] == ["exact"]
    res = CliRunner().invoke(cli, ["tape", "show", tapes[1].path, "--kind", "resume_check"])
    assert res.exit_code == 0 and "resume verified exact over steps 5..7" in res.output
    res = CliRunner().invoke(cli, ["ls", str(tmp_path / "run")])
    assert res.exit_code == 0 and "step ledger (2 tapes)" in res.output and "incomplete" not in res.output


def test_rng_drawn_outside_is_named_and_strict_raises(tmp_path):
    with pytest.warns(ResumeVerificationWarning, match=r"resume diverged at step 5 .*RNG stream torch_cpu differs"):
        rep = _crash_and_resume(tmp_path, draw_outside=True)
    # the batch is drawn from the shifted stream, so it differs too, but it is no batch the first
    # run consumed: the cause is the draw outside the checkpointed state, not the data position
    assert rep.verdict == "diverged" and rep.divergence.rng == ("torch_cpu",) and rep.divergence.batch
    assert "none the first run consumed: a draw outside the checkpointed state" in rep.cause
    Loop(tmp_path / "s" / "run", verify_resume="strict").run(12, stop_at=7)
    with pytest.raises(ResumeDivergedError, match="resume diverged at step 5"):
        Loop(tmp_path / "s" / "run", verify_resume="strict").run(12, draw_outside=True)


def test_without_batch_the_param_digest_still_catches_it_within_n_steps(tmp_path):
    Loop(tmp_path / "run", ledger_params_every=2).run(12, stop_at=7, with_batch=False)
    loop = Loop(tmp_path / "run", ledger_params_every=2)
    with pytest.warns(ResumeVerificationWarning):
        loop.run(12, draw_outside=True, with_batch=False)
    d = loop.mgr.resume_report.divergence
    assert d.step == 5 and d.rng == ("torch_cpu",)


def test_off_policy_compares_nothing(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeVerificationWarning)
        assert _crash_and_resume(tmp_path, draw_outside=True, verify_resume="off") is None


def _stopped_run(tmp_path):
    Loop(tmp_path / "run").run(12, stop_at=7)
    return read_ledger_dir(str(tmp_path / "run" / "ledger"))[0][0].path


def test_missing_ledger_warns_and_resume_still_works(tmp_path):
    path = _stopped_run(tmp_path)
    os.remove(path)
    loop = Loop(tmp_path / "run")
    with pytest.warns(ResumeVerificationWarning, match="resume not verified: no ledger in"):
        loop.run(12)
    assert loop.mgr.start_step == 4 and loop.mgr.resume_report.verdict == "skipped"


def test_torn_ledger_tail_is_the_normal_case(tmp_path):
    path = _stopped_run(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)  # the kill tore the last record (step 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeVerificationWarning)
        loop = Loop(tmp_path / "run")
        loop.run(12)
    assert loop.mgr.resume_report.text.startswith("resume verified exact over steps 5..6")


def test_corrupt_ledger_is_named_and_skipped(tmp_path):
    path = _stopped_run(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[400] ^= 0xFF  # a middle record: valid records follow it
    open(path, "wb").write(bytes(data))
    loop = Loop(tmp_path / "run")
    with pytest.warns(ResumeVerificationWarning, match=r"unreadable tapes: .*00000\.tape.*offset"):
        loop.run(12)
    assert loop.mgr.start_step == 4


def test_ledger_of_another_run_is_refused(tmp_path):
    _stopped_run(tmp_path)
    for p in read_ledger_dir(str(tmp_path / "run" / "ledger"))[0]:
        os.rename(p.path, p.path + ".x")
    other = ckpt.ledger.Ledger(str(tmp_path / "run" / "ledger"), run_id="0123456789abcdef")
    for s in range(1, 8):
        other.step(s, batch=torch.zeros(1))
    other.close()
    loop = Loop(tmp_path / "run")
    with pytest.warns(ResumeVerificationWarning, match="belongs to another run .*0123456789abcdef"):
        loop.run(12)


def test_ledger_events_decode_with_the_replay_reader(tmp_path):
    from replay.tape import TapeReader

    path = _stopped_run(tmp_path)
    evs = list(TapeReader(path).events())
    names = [e.kind.name for e in evs]
    assert names[0] in ("actor", "ledger_open") and names.count("ledger_step") == 7
    mine = read_ledger_dir(str(tmp_path / "run" / "ledger"))[0][0]
    steps = [e for e in evs if e.kind.name == "ledger_step"]
    assert [e.step for e in steps] == [s.step for s in mine.steps] == list(range(1, 8))
    for e, s in zip(steps, mine.steps):
        p = e.payload
        assert p["loss"] == s.loss and p["batch"] == s.batch and p["has"] == 3
        assert [tuple(x) for x in p["rng"]] == list(s.rng)


def test_isolated_restores_every_stream():
    gen = torch.Generator().manual_seed(3)
    before = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=gen))
    random.seed(1), np.random.seed(1), torch.manual_seed(1), gen.manual_seed(3)
    with pytest.raises(RuntimeError):
        with ckpt.rng.isolated({"g": gen}):
            random.random(), np.random.rand(), torch.rand(5), torch.rand(5, generator=gen)
            raise RuntimeError("evaluation failed")
    random.seed(1), np.random.seed(1), torch.manual_seed(1), gen.manual_seed(3)
    with ckpt.rng.isolated({"g": gen}):
        random.random(), np.random.rand(), torch.rand(5), torch.rand(5, generator=gen)
    after = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=gen))
    random.seed(1), np.random.seed(1), torch.manual_seed(1), gen.manual_seed(3)
    ref = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=gen))
    assert after[:2] == ref[:2] and torch.equal(after[2], ref[2]) and torch.equal(after[3], ref[3])
    del before


def test_diff_separates_tensors_from_rng_and_ignore_sets_the_exit_code(tmp_path):
    w = {"w": torch.arange(4.0)}
    torch.manual_seed(0)
    ckpt.save(str(tmp_path / "a"), w, step=1)
    torch.rand(1)
    ckpt.save(str(tmp_path / "b"), w, step=1)
    w2 = {"w": torch.arange(4.0) + 1}
    ckpt.save(str(tmp_path / "c"), w2, step=1)
    r = CliRunner().invoke(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert r.exit_code == 6 and "RNG state differs" in r.output and "tensors differ" not in r.output
    r = CliRunner().invoke(cli, ["diff", "--ignore", "rng.torch_cpu", "--ignore", "env",
                                 str(tmp_path / "a"), str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["diff", "--ignore", "rng", str(tmp_path / "b"), str(tmp_path / "c")])
    assert r.exit_code == 6 and "tensors differ" in r.output and "RNG state differs" not in r.output
    r = CliRunner().invoke(cli, ["diff", "--ignore", "rng", "--ignore", "w", str(tmp_path / "b"), str(tmp_path / "c")])
    assert r.exit_code == 0, r.output


def test_diff_does_not_compare_streams_unused_in_both_runs(tmp_path):
    """Two bit-identical manager runs in two processes' worth of Python seeding: the
    python stream differs but the ledgers show it was never drawn from."""
    for name, seed in (("a", 1), ("b", 2)):
        random.seed(seed)  # CPython seeds differently in every process
        Loop(tmp_path / name / "run").run(8)
    a, b = str(tmp_path / "a" / "run" / "step-00000008"), str(tmp_path / "b" / "run" / "step-00000008")
    r = CliRunner().invoke(cli, ["diff", a, b, "--ignore", "env"])
    assert r.exit_code == 0, r.output
    assert "rng numpy, python: unused in both runs (step ledger), not compared" in r.output


def _st(step, batch, rng=0, loss=1.0, params=None):
    from ckpt.ledger import LedgerStep

    return LedgerStep(step, (("torch_cpu", bytes([rng]) * 16), ("python", bytes(16))), bytes([batch]) * 16, loss,
                      params)


@pytest.mark.parametrize("actual, cause", [
    ({5: _st(5, 6), 6: _st(6, 7)}, "the batch is the one the first run consumed at step 6: the data position is 1 batch ahead"),
    ({5: _st(5, 1), 6: _st(6, 1)}, "the batch is the one the first run consumed at step 1: the data position is 4 batches behind"),
    ({5: _st(5, 99), 6: _st(6, 98)}, "the batch differs: the data position was not captured"),
    ({5: _st(5, 99, rng=3)}, "the batch and RNG stream(s) torch_cpu differ, and the batch is none the first run consumed"),
    ({5: _st(5, 5, rng=3)}, "RNG stream(s) torch_cpu differ while the batch is equal"),
    ({5: _st(5, 5, loss=2.0)}, "the loss differs while batch and RNG streams are equal, in the same environment: "
                               "state that the checkpoint does not hold"),
    ({5: _st(5, 5, loss=-0.0), 6: _st(6, 6)}, "the loss differs while batch"),  # bits, not ==
])
def test_cause_table(actual, cause):
    from ckpt.ledger import compare_runs

    expected = {s: _st(s, s) for s in range(1, 9)}
    expected[5] = _st(5, 5, loss=1.0 if cause != "x" else 0.0)
    if actual.get(5) is not None and actual[5].loss == -0.0:
        expected[5] = _st(5, 5, loss=0.0)
    rep = compare_runs({s: expected[s] for s in actual}, actual, expected_used={"torch_cpu"}, actual_used=set(),
                       env_diffs=["torch: '2.12' -> '2.13'"])
    rep_all = compare_runs(expected, actual, expected_used={"torch_cpu"}, actual_used=set())
    assert rep.verdict == rep_all.verdict == "diverged" and rep.divergence.step == 5
    assert rep_all.cause.startswith(cause), rep_all.cause
    assert "rng python (unused)" in rep.divergence.not_compared


def test_ckpt_encoder_writes_the_bytes_of_the_event_table():
    """ckpt.ledger encodes its three kinds itself (ckpt cannot import replay); the bytes
    must be exactly what replay's table encodes for the same fields."""
    from ckpt.ledger import LedgerOpen, LedgerStep, ResumeCheck
    from ckpt.ledger.record import encode_event
    from replay.events import kind

    D = bytes(range(16))
    cases = [
        (LedgerOpen("0123456789abcdef", 40, "step-00000040", (("python", D), ("torch_cpu", D[::-1]))),
         ("ledger_open", ("0123456789abcdef", 40, "step-00000040", [("python", D), ("torch_cpu", D[::-1])]))),
        (LedgerStep(41, (("torch_cpu", D),), D, -0.0, None), ("ledger_step", (3, D, -0.0, [("torch_cpu", D)], bytes(16)))),
        (ResumeCheck("exact", 41, 47, "resume verified exact over steps 41..47"),
         ("resume_check", ("exact", 41, 47, "resume verified exact over steps 41..47"))),
    ]
    for rec, (name, fields) in cases:
        code, body = encode_event(rec, 1, step=47)
        k = kind(name)
        assert code == k.code
        assert body[22:] == k.pack(*fields)  # after the 12-byte head and one 10-byte clock entry


def test_a_ledger_tape_whose_header_never_finished_is_not_a_problem(tmp_path):
    _stopped_run(tmp_path)
    with open(tmp_path / "run" / "ledger" / "00001.tape", "wb") as f:
        f.write(b"CKPTTAPE\x01\x00")  # a later process died inside its header write
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeVerificationWarning)
        loop = Loop(tmp_path / "run")
        loop.run(12)
    assert loop.mgr.resume_report.text.startswith("resume verified exact over steps 5..7")
