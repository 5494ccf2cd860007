"""The checkpoint commands, through click's CliRunner and as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import ckpt
from ckpt_cli.main import cli
import hangs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def run_dir(tmp_path, small_state):
    model, opt = small_state
    d = tmp_path / "run"
    ckpt.save(d / "step-00000001", {"model": model, "optim": opt}, config={"lr": 0.01}, step=1)
    with torch.no_grad():
        model[0].weight.add_(0.5)
    ckpt.save(d / "step-00000002", {"model": model, "optim": opt}, config={"lr": 0.02}, step=2)
    return d


def _run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_help_lists_every_command():
    res = _run("--help")
    assert res.exit_code == 0
    for name in ("inspect", "verify", "diff", "ls", "demo", "tape", "replay", "check-resume"):
        assert name in res.output


@pytest.mark.parametrize("cmd", ["inspect", "verify", "diff", "ls", "demo"])
def test_each_command_has_help(cmd):
    res = _run(cmd, "--help")
    assert res.exit_code == 0 and "Usage:" in res.output


def test_inspect_shows_seven_fields_and_tensors(run_dir):
    res = _run("inspect", str(run_dir / "step-00000002"))
    assert res.exit_code == 0, res.output
    for field in ("weights", "optimizer", "rng", "data", "config", "topology", "commit"):
        assert f"    {field}" in res.output
    assert "model/0.weight" in res.output and "float32" in res.output and "[8, 6]" in res.output


def test_inspect_json_is_machine_readable(run_dir):
    res = _run("inspect", "--json", str(run_dir / "step-00000001"))
    data = json.loads(res.output)
    assert data["step"] == 1
    names = {t["name"] for t in data["parts"][0]["tensors"]}
    assert "model/2.bias" in names and "optim/state/0/exp_avg" in names
    assert data["parts"][0]["entries"]["optim"]["field"] == "optimizer"


def test_verify_ok_and_corrupt_exit_codes(run_dir):
    p = run_dir / "step-00000001"
    assert _run("verify", str(p)).exit_code == 0
    tensors = p / "rank-00000.safetensors"
    raw = bytearray(tensors.read_bytes())
    raw[-3] ^= 0x10
    tensors.write_bytes(bytes(raw))
    res = CliRunner().invoke(cli, ["verify", str(p)])
    assert res.exit_code == 3
    assert "rank-00000.safetensors" in res.output and "chunk 0" in res.output
    # --quick checks structure and sizes only, so a flipped data bit passes it
    assert CliRunner().invoke(cli, ["verify", "--quick", str(p)]).exit_code == 0


def test_verify_incomplete_and_missing(tmp_path):
    (tmp_path / "half").mkdir()
    assert CliRunner().invoke(cli, ["verify", str(tmp_path / "half")]).exit_code == 4
    assert CliRunner().invoke(cli, ["verify", str(tmp_path / "nope")]).exit_code == 5


def test_ls_reports_status(run_dir):
    (run_dir / ".tmp-step-00000003-abcdef").mkdir()
    (run_dir / "step-00000004").mkdir()
    res = _run("ls", str(run_dir))
    assert res.exit_code == 0
    lines = {line.split()[0]: line for line in res.output.splitlines()[1:]}
    assert lines["step-00000001"].endswith("committed (not verified)")  # only --deep re-hashes, and says "valid"
    deep = {line.split()[0]: line for line in _run("ls", "--deep", str(run_dir)).output.splitlines()[1:]}
    assert deep["step-00000001"].endswith("  valid")
    assert "temporary" in lines[".tmp-step-00000003-abcdef"]
    assert "incomplete" in lines["step-00000004"]
    nested = run_dir / "baseline"
    nested.mkdir()
    import shutil

    shutil.copytree(run_dir / "step-00000001", nested / "step-00000001")
    lines = {line.split()[0]: line for line in _run("ls", str(run_dir)).output.splitlines()[1:]}
    assert lines["baseline"].endswith("run directory")
    rows = json.loads(_run("ls", "--json", str(run_dir)).output)
    assert [(r["state"], r["status"], r["verified"]) for r in rows if r["name"].startswith("step-00000001")] == \
        [("committed", "committed (not verified)", False)]


def test_diff_identical_and_changed(run_dir):
    a, b = str(run_dir / "step-00000001"), str(run_dir / "step-00000002")
    assert _run("diff", a, a).exit_code == 0
    res = CliRunner().invoke(cli, ["diff", a, b])
    assert res.exit_code == 6
    assert "changed   model/0.weight  max abs diff 0.5" in res.output
    assert "config:" in res.output and "keys lr" in res.output


def _subprocess(*args: str, **kw):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return hangs.run([sys.executable, "-m", "ckpt_cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, bound_s=hangs.hang_s(12), **kw)


def test_real_subprocess_inspect_verify_without_torch(run_dir):
    p = str(run_dir / "step-00000002")
    probe = (
        "import sys, runpy; sys.argv=['ckpt','inspect','%s'];\n"
        "try:\n    runpy.run_module('cli', run_name='__main__')\nexcept SystemExit as e:\n    code=e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NOTORCH')" % p
    )
    out = hangs.run([sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, bound_s=hangs.hang_s(12))
    assert "seven fields" in out.stdout and out.stdout.strip().endswith("NOTORCH"), out.stdout + out.stderr
    res = _subprocess("verify", p)
    assert res.returncode == 0 and res.stdout.startswith("ok:")


@pytest.mark.parametrize("args,code", [
    (("verify", "{d}/step-00000002"), 0),
    (("verify", "--quick", "{d}/step-00000002"), 0),
    (("diff", "{d}/step-00000001", "{d}/step-00000002"), 6),
    (("ls", "{d}"), 0),
    (("inspect", "--json", "{d}/step-00000002"), 0),
])
def test_checkpoint_commands_do_not_import_torch(run_dir, args, code):
    """inspect, verify, diff and ls answer from the files alone (issue: the CLI stays fast)."""
    argv = [a.format(d=run_dir) for a in args]
    probe = (
        "import sys, runpy; sys.argv=['ckpt', *%r]\n"
        "try:\n    runpy.run_module('cli', run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
        "print('EXIT', code, 'TORCH' if 'torch' in sys.modules else 'NOTORCH')" % (argv,)
    )
    out = hangs.run([sys.executable, "-c", probe], capture_output=True, text=True,
                    env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, bound_s=hangs.hang_s(12))
    assert out.stdout.strip().splitlines()[-1] == f"EXIT {code} NOTORCH", out.stdout + out.stderr


def test_help_does_not_import_torch():
    probe = (
        "import sys\nfrom ckpt_cli.main import cli\n"
        "try:\n    cli.main(['--help'], prog_name='ckpt')\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NOTORCH')"
    )
    out = hangs.run([sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, bound_s=hangs.hang_s(6))
    assert out.stdout.strip().endswith("NOTORCH"), out.stdout + out.stderr


def test_inspect_and_verify_understand_snapshots(tmp_path):
    """A snapshot checkpoint laid out as spec/snapshot-protocol.md §4 says, shown by inspect."""
    import ckpt

    p = ckpt.begin(tmp_path / "snap-1")
    parts = [
        ckpt.write_part(p, "p0", {"box": {"w": torch.zeros(4)}, "replay.channels": {"p1": [{"seq": 0, "clock": b"", "meta": {"x": 1}, "tensors": [torch.ones(2)]}]}}),
        ckpt.write_part(p, "p1", {"box": {"w": torch.ones(4)}, "replay.channels": {}}),
    ]
    from replay.clock import VectorClock

    meta = {
        "format": "replay-snapshot", "version": 1, "snapshot": "snap-1", "coordinator": "p0",
        "participants": ["p0", "p1"], "parts": ["p0", "p1"], "excluded": [],
        "cut": {"p0": VectorClock.of(p0=3, p1=1).encode(), "p1": VectorClock.of(p1=2).encode()},
        "channels": {"p0": {"p1": {"first_seq": 0, "count": 1}}, "p1": {"p0": {"first_seq": 0, "count": 0}}},
    }
    ckpt.commit(p, parts, kind="snapshot", meta=meta)
    res = _run("inspect", str(tmp_path / "snap-1"))
    assert res.exit_code == 0, res.output
    assert "snapshot snap-1 (coordinator p0)" in res.output
    assert "processes  p0, p1" in res.output
    assert "VC(p0:3, p1:1)" in res.output
    assert "p1 -> p0: 1 message(s) from seq 0" in res.output
    assert "part p0" in res.output and "part p1" in res.output
    assert _run("verify", str(tmp_path / "snap-1")).exit_code == 0
