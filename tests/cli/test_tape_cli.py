"""`ckpt tape ...` and `ckpt replay` through click's CliRunner, and once as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_cli.main import cli
from replay import Recorder, record
import hangs

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "tests" / "replay" / "replay_entry.py"


def run(*args: str) -> "object":
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def tape(tmp_path: Path) -> Path:
    path = tmp_path / "run.tape"
    record(f"{ENTRY}:train", path, config={"steps": 4}, param_digest_every=1)
    return path


@pytest.fixture
def multi(tmp_path: Path) -> Path:
    path = tmp_path / "multi.tape"
    with Recorder.open(str(path), rng_every=0) as rec:
        a = rec.actor("learner-1")
        for step in range(3):
            a.current_step = step
            with rec.step(step):
                s = a.send("push", b"x", peer="main")
                rec.recv(s)
                rec.loss(step / 3)
    return path


@pytest.mark.parametrize("args", [["tape", "--help"], ["tape", "show", "--help"], ["tape", "verify", "--help"],
                                  ["tape", "check", "--help"], ["tape", "diff", "--help"],
                                  ["tape", "repair", "--help"], ["replay", "--help"]])
def test_help(args: list[str]) -> None:
    r = run(*args)
    assert r.exit_code == 0 and "Usage:" in r.output


def test_show_table_and_filters(multi: Path) -> None:
    r = run("tape", "show", str(multi))
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert lines[0].startswith(f"tape {multi}  run ")
    assert any(" loss " in ln and "0.3333333333333333 (0x3fd5555555555555)" in ln for ln in lines)
    r = run("tape", "show", str(multi), "--actor", "learner-1", "--kind", "send", "--from-step", "1",
            "--to-step", "1")
    rows = [ln for ln in r.output.splitlines()[2:]]
    assert len(rows) == 1 and "learner-1" in rows[0] and " send " in rows[0] and "channel=\"push\"" in rows[0]
    r = run("tape", "show", str(multi), "--json", "--kind", "loss")
    objs = [json.loads(ln) for ln in r.output.splitlines()]
    assert [o["payload"]["value"] for o in objs] == [0.0, 1 / 3, 2 / 3]
    assert [o["step"] for o in objs] == [0, 1, 2] and all(o["actor"] == "main" for o in objs)
    r = run("tape", "show", str(multi), "--kind", "nope")
    assert r.exit_code == 2 and "unknown kind 'nope'" in r.output


def test_verify_ok_torn_corrupt(tape: Path, tmp_path: Path) -> None:
    r = run("tape", "verify", str(tape))
    assert r.exit_code == 0 and r.output.startswith(f"ok: {tape}: ")
    r = run("tape", "verify", str(tape), "--json")
    rep = json.loads(r.output)
    assert rep["dropped_bytes"] == 0 and rep["segments"] == 1 and rep["events"] == rep["records"]
    torn = tmp_path / "torn.tape"
    torn.write_bytes(tape.read_bytes()[:-7])
    r = CliRunner().invoke(cli, ["tape", "verify", str(torn)])
    assert r.exit_code == 4 and "torn tail" in r.output and "ckpt tape repair" in r.output
    bad = tmp_path / "bad.tape"
    data = bytearray(tape.read_bytes())
    data[len(data) // 3] ^= 0x20
    bad.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["tape", "verify", str(bad)])
    # Where the flipped bit lands depends on the header's size (it holds the environment
    # fingerprint, paths included): in a record body it is a corrupt record, in a length
    # field a length above the limit. Both are refused with exit 3, naming offset and seq.
    assert r.exit_code == 3 and ("error: corrupt record" in r.output or "above limit" in r.output)
    assert "offset" in r.output and "seq" in r.output


def test_repair(tape: Path, tmp_path: Path) -> None:
    torn = tmp_path / "torn.tape"
    full = tape.read_bytes()[:-40]  # without its close record: what a killed writer leaves
    torn.write_bytes(full + b"\x01\x02\x03")
    r = run("tape", "repair", str(torn), "--dry-run")
    assert r.exit_code == 0 and "would drop 3 bytes" in r.output and torn.stat().st_size == len(full) + 3
    r = run("tape", "repair", str(torn))
    assert r.exit_code == 0 and "dropped 3 bytes" in r.output
    assert torn.read_bytes() == full
    r = CliRunner().invoke(cli, ["tape", "verify", str(torn)])
    assert r.exit_code == 4 and "not closed (ends at seq" in r.output and "torn tail" not in r.output
    assert "nothing to repair" in run("tape", "repair", str(torn)).output
    bad = tmp_path / "bad.tape"
    data = bytearray(full)
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["tape", "repair", str(bad)])
    assert r.exit_code == 3 and "followed by a valid record" in r.output
    r = run("tape", "repair", str(bad), "--salvage")
    assert r.exit_code == 0 and "dropped" in r.output
    r = CliRunner().invoke(cli, ["tape", "verify", str(bad)])
    assert r.exit_code == 4 and "not closed" in r.output and "torn tail" not in r.output


def test_check(multi: Path, tmp_path: Path) -> None:
    r = run("tape", "check", str(multi))
    assert r.exit_code == 0 and "no invariant violated" in r.output
    bad = tmp_path / "q.tape"
    with Recorder.open(str(bad), rng_every=0) as rec:
        rec.quorum("k", 3, lambda: ["a"])
    r = run("tape", "check", str(bad))
    assert r.exit_code == 6 and "[quorum-below-minimum]" in r.output and "seq 1 main step 0 quorum" in r.output
    r = run("tape", "check", str(bad), "--json")
    assert json.loads(r.output)[0]["rule"] == "quorum-below-minimum"


def test_diff(tape: Path, tmp_path: Path) -> None:
    same = tmp_path / "same.tape"
    record(f"{ENTRY}:train", same, config={"steps": 4}, param_digest_every=1)
    r = run("tape", "diff", str(tape), str(same))
    assert r.exit_code == 0 and "same events" in r.output
    other = tmp_path / "other.tape"
    record(f"{ENTRY}:train", other, config={"steps": 4, "seed": 3}, param_digest_every=1)
    r = run("tape", "diff", str(tape), str(other))
    assert r.exit_code == 6 and "header config_hash" in r.output and "first difference: actor main, step 0" in r.output
    r = run("tape", "diff", str(tape), str(other), "--json")
    d = json.loads(r.output)
    assert d["identical"] is False and d["first_difference"]["a"]["kind"] == d["first_difference"]["b"]["kind"]


def test_replay_cli_identical_and_fork(tape: Path, tmp_path: Path) -> None:
    r = run("replay", str(tape), "--trust")
    assert r.exit_code == 0 and "IDENTICAL" in r.output
    r = run("replay", str(tape), "--until", "1", "--json", "--trust")
    assert json.loads(r.stdout)["stopped_at"] == 1
    out = tmp_path / "fork.tape"
    r = run("replay", str(tape), "--mode", "fork", "--out", str(out), "--set", "seed=5", "--trust")
    assert r.exit_code == 0 and "forked" in r.output
    from replay import TapeReader

    assert TapeReader(out).meta["lineage"]["changes"] == {"seed": 5}
    r = CliRunner().invoke(cli, ["replay", str(tape), "--set", "seed=5", "--trust"])
    assert r.exit_code == 2 and "--mode fork" in r.output


def test_replay_cli_diverged_exit_6(tmp_path: Path) -> None:
    path = tmp_path / "r.tape"
    record(f"{ENTRY}:train", path, config={"steps": 3}, param_digest_every=1)
    shim = tmp_path / "shim.py"
    shim.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('shim_entry', {str(ENTRY)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.TAMPER.update(flip_at=1, tensor='0.bias', index=2, bit=7)\n"
        "train = m.train\n")
    r = CliRunner().invoke(cli, ["replay", str(path), "--entry-point", f"{shim}:train"])
    assert r.exit_code == 6, r.output
    assert "DIVERGED at step 1, actor main, event params" in r.output and "0.bias" in r.output


def test_cli_module_does_not_import_torch() -> None:
    code = ("import sys; import ckpt_cli.tape_cmd, replay, replay.tape, replay.check; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    hangs.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
              bound_s=hangs.hang_s(6))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_subprocess(tape: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def sh(*args: str) -> subprocess.CompletedProcess[str]:
        return hangs.run([sys.executable, "-m", "ckpt_cli", *args], capture_output=True, text=True, env=env,
                         cwd=tmp_path, bound_s=hangs.hang_s(10))

    p = sh("tape", "verify", str(tape))
    assert p.returncode == 0 and p.stdout.startswith("ok: ")
    p = sh("tape", "show", str(tape), "--kind", "loss", "--json")
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 4
    p = sh("replay", str(tape))
    assert p.returncode == 2 and f"resolves to: {ENTRY}" in p.stderr and "--trust" in p.stderr, p.stderr
    p = sh("replay", str(tape), "--trust")
    assert p.returncode == 0 and "IDENTICAL" in p.stdout, p.stderr
    torn = tmp_path / "t.tape"
    torn.write_bytes(tape.read_bytes()[:-41])
    p = sh("tape", "verify", str(torn))
    assert p.returncode == 4 and "torn tail: " in p.stderr


# -- ckpt replay runs no code it was not told to trust (issue 9 item 16) ------------------------------
def _marker_tape(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A tape whose entry point file leaves a marker when it is imported."""
    code = tmp_path / "theirs" / "evil_entry.py"
    code.parent.mkdir()
    marker = tmp_path / "ran.txt"
    code.write_text(f"open({str(marker)!r}, 'w').write('imported')\n"
                    f"import importlib.util\n"
                    f"s = importlib.util.spec_from_file_location('e', {str(ENTRY)!r})\n"
                    "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\ntrain = m.train\n")
    tape = tmp_path / "their.tape"
    record(f"{code}:train", tape, config={"steps": 2}, param_digest_every=1)
    marker.unlink()
    import xxhash

    sys.modules.pop("_ckpt_entry_" + xxhash.xxh3_64_hexdigest(str(code.resolve()).encode()), None)  # import anew
    return tape, code, marker


def test_replay_refuses_the_taped_entry_point_without_trust(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tape, code, marker = _marker_tape(tmp_path)
    monkeypatch.delenv("CKPT_REPLAY_TRUST", raising=False)
    r = CliRunner().invoke(cli, ["replay", str(tape)])
    assert r.exit_code == 2 and f"entry point: {code}:train" in r.output and f"resolves to: {code}" in r.output
    assert "--trust" in r.output and "CKPT_REPLAY_TRUST" in r.output and not marker.exists()
    # The allow-list: a directory that holds the file (another one does not count).
    monkeypatch.setenv("CKPT_REPLAY_TRUST", str(tmp_path / "elsewhere"))
    assert CliRunner().invoke(cli, ["replay", str(tape)]).exit_code == 2 and not marker.exists()
    monkeypatch.setenv("CKPT_REPLAY_TRUST", os.pathsep.join([str(tmp_path / "elsewhere"), str(code.parent)]))
    r = CliRunner().invoke(cli, ["replay", str(tape)])
    assert r.exit_code == 0 and "IDENTICAL" in r.output and marker.exists()


def test_replay_help_says_what_it_runs() -> None:
    out = run("replay", "--help").output
    assert "--trust" in out and "CKPT_REPLAY_TRUST" in out and "never put on sys.path" in out


def test_module_entry_points_are_not_imported_from_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from replay.errors import ReplayError
    from replay.replayer import load_entry_point, resolve_entry_point

    (tmp_path / "cwd_entry_mod.py").write_text("def train(rec):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve_entry_point("cwd_entry_mod:train").file is None
    with pytest.raises(ReplayError, match="current directory is not searched"):
        load_entry_point("cwd_entry_mod:train")
    assert str(tmp_path) not in sys.path and "" not in sys.path
    ep = resolve_entry_point("cwd_entry_mod:train", search_path=(str(tmp_path),))
    assert ep.file == tmp_path / "cwd_entry_mod.py" and "cwd_entry_mod" not in sys.modules  # found, not run
    assert callable(load_entry_point("cwd_entry_mod:train", search_path=(str(tmp_path),)))
    assert str(tmp_path) not in sys.path
