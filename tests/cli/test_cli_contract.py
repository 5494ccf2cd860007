"""spec/cli.md is the CLI's contract: every bad path gets its exit code (§2, §3), and every
``--json`` report holds exactly the keys its table documents (§4), checked key by key
against real reports of real checkpoints, tapes and runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckpt
from ckpt_cli.main import cli
import hangs

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec" / "cli.md"
ENTRY = ROOT / "tests" / "replay" / "replay_entry.py"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# --- the spec's tables -----------------------------------------------------------------------
def spec_tables() -> dict[str, dict[str, tuple[bool, bool]]]:
    """``"ckpt verify"`` -> {key path: (optional, open)} from the §4 tables."""
    tables: dict[str, dict[str, tuple[bool, bool]]] = {}
    current = None
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^### 4\.\d+ `(ckpt [a-z -]+?) --json`", line)
        if m:
            current = m.group(1)
            tables[current] = {}
            continue
        if line.startswith("## "):
            current = None
        m = re.match(r"^\| `([^`]+)` \| ([^|]*) \|", line)
        if current and m:
            typ = m.group(2)
            tables[current][m.group(1)] = ("optional" in typ, "open" in typ)
    return tables


TABLES = spec_tables()


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def shape(doc: Any, table: dict[str, tuple[bool, bool]]) -> tuple[set[str], set[str]]:
    """(key paths present, object paths visited), walking as the table's notation says."""
    keys: set[str] = set()
    objects: set[str] = set()

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, list):
            for item in obj:
                walk(item, prefix + "[]")
            return
        if not isinstance(obj, dict):
            return
        if any(k.startswith(prefix + "{}") for k in table):
            for v in obj.values():
                walk(v, prefix + "{}")
            return
        objects.add(prefix)
        for k, v in obj.items():
            p = _join(prefix, str(k))
            keys.add(p)
            if not table.get(p, (False, False))[1]:
                walk(v, p)

    walk(doc, "")
    return keys, objects


def check_shape(command: str, doc: Any, seen: dict[str, set[str]]) -> None:
    table = TABLES[command]
    keys, objects = shape(doc, table)
    parents = {k.rsplit(".", 1)[0] if "." in k else "" for k in table}
    undocumented = {k for k in keys if k not in table and not any(
        d.startswith(k + ".") or d.startswith(k + "[]") or d.startswith(k + "{}") for d in table)}
    assert not undocumented, f"{command}: keys not in spec/cli.md: {sorted(undocumented)}"
    for k, (optional, _) in table.items():
        parent = k.rsplit(".", 1)[0] if "." in k else ""
        if not optional and parent in objects:
            assert k in keys, f"{command}: documented key {k!r} missing from a report"
    assert parents  # the table parsed
    seen.setdefault(command, set()).update(keys)


# --- things to point the commands at ------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("contract")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    run = base / "run"
    ckpt.save(run / "step-00000001", {"model": model, "optim": opt}, config={"lr": 0.1}, step=1)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ckpt.save(run / "step-00000002", {"model": model, "optim": opt}, config={"lr": 0.2}, step=2)
    (run / ".tmp-step-00000003-abcdef").mkdir()
    torn = run / "step-00000004"
    ckpt.save(torn, {"w": torch.ones(2)}, step=4)
    (torn / "MANIFEST").unlink()
    corrupt = base / "corrupt"
    ckpt.save(corrupt, {"w": torch.arange(64.0)}, step=5)
    f = next(corrupt.glob("*.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    # a replicated entry: rank 1 holds a REPLICA of rank 0's model
    pending = ckpt.begin(base / "replicated")
    from ckpt.writer import Replicated

    parts = [ckpt.write_part(pending, "rank-00000", {"model": model}, step=1),
             ckpt.write_part(pending, "rank-00001", {"model": Replicated("rank-00000")}, step=1)]
    ckpt.commit(pending, parts)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(base / "dcp"), no_dist=True)
    hf = base / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (hf / "model.safetensors").write_bytes(b"")
    trainer = base / "hf-run" / "checkpoint-5"
    trainer.mkdir(parents=True)
    (trainer / "trainer_state.json").write_text("{}")
    ledger = base / "ledger"
    ledger.mkdir()
    from replay import record

    tape = base / "run.tape"
    record(f"{ENTRY}:train", tape, config={"steps": 3}, param_digest_every=1)
    (ledger / "00001.tape").write_bytes(tape.read_bytes())
    (base / "empty").mkdir()
    (base / "src").mkdir()
    (base / "src" / "train.py").write_text("")
    (base / "file.py").write_text("print('hi')\n")
    return {"checkpoint": run / "step-00000001", "checkpoint2": run / "step-00000002", "run": run,
            "temporary": run / ".tmp-step-00000003-abcdef", "incomplete": torn, "empty": base / "empty",
            "corrupt": corrupt, "replicated": base / "replicated", "dcp": base / "dcp", "hf": hf,
            "hf-trainer": trainer, "hf-run": base / "hf-run", "ledger": ledger, "tape": tape, "dir": base / "src",
            "file": base / "file.py", "missing": base / "nope", "base": base}


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


# --- §2/§3: the exit-code table -----------------------------------------------------------------
KINDS = ["missing", "checkpoint", "corrupt", "temporary", "incomplete", "empty", "run", "ledger", "tape", "dcp", "hf",
         "hf-trainer", "dir", "file"]
#: spec/cli.md §3, column by column
READS_CHECKPOINT = {"missing": 5, "checkpoint": 0, "corrupt": 3, "temporary": 4, "incomplete": 4, "empty": 4,
                    "run": 7, "ledger": 7, "tape": 7, "dcp": 7, "hf": 7, "hf-trainer": 7, "dir": 7, "file": 7}
VERIFY = {**READS_CHECKPOINT, "run": 4}  # the run holds an incomplete step-00000004: the run's verdict is 4
LS = {"missing": 5, "checkpoint": 0, "corrupt": 0, "temporary": 0, "incomplete": 0, "empty": 0, "run": 0,
      "ledger": 7, "tape": 7, "dcp": 7, "hf": 7, "hf-trainer": 7, "dir": 0, "file": 7}
TAPE = {"missing": 5, "checkpoint": 7, "corrupt": 7, "temporary": 7, "incomplete": 7, "empty": 7, "run": 7,
        "ledger": 7, "tape": 0, "dcp": 7, "hf": 7, "hf-trainer": 7, "dir": 7, "file": 3}


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_path_gets_its_exit_code(world: dict[str, Path], kind: str) -> None:
    p = world[kind]
    r = invoke("inspect", p)
    # inspect reads MANIFEST only: a flipped data bit is verify's (and diff's, which reads the tensors) to find
    assert r.exit_code == (0 if kind == "corrupt" else READS_CHECKPOINT[kind]), (kind, r.output)
    if r.exit_code:
        assert r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1, r.output
    r = invoke("diff", p, p)
    assert r.exit_code == READS_CHECKPOINT[kind], (kind, r.output)
    r = invoke("verify", p)
    assert r.exit_code == VERIFY[kind], (kind, r.output)
    assert invoke("ls", p).exit_code == LS[kind], kind
    assert invoke("tape", "verify", p).exit_code == TAPE[kind], kind
    assert invoke("tape", "show", p, "--limit", "1").exit_code == TAPE[kind], kind


def test_what_each_bad_path_is_named(world: dict[str, Path]) -> None:
    out = lambda *a: invoke(*a).output  # noqa: E731
    assert "a DCP checkpoint" in out("inspect", world["dcp"]) and "ckpt import dcp" in out("inspect", world["dcp"])
    assert "Hugging Face model directory" in out("ls", world["hf"])
    assert "Hugging Face Trainer checkpoint" in out("inspect", world["hf-trainer"])
    run = out("inspect", world["run"])
    assert "a run directory (2 checkpoint(s), newest step-00000002)" in run and "--latest" in run
    assert "a checkpoint is a directory" in out("inspect", world["file"])
    assert "no such file or directory" in out("ls", world["missing"])
    assert "read it with `ckpt inspect" in out("tape", "show", world["checkpoint"])
    assert "step ledger" in out("tape", "show", world["ledger"]) and "00001.tape" in out("tape", "show", world["ledger"])
    assert "no MANIFEST: the save never committed" in out("inspect", world["incomplete"])
    r = invoke("inspect", "--latest", world["run"])
    assert r.exit_code == 0 and "step 2 " in r.output
    rows = {line.split()[0]: line for line in out("ls", world["hf-run"]).splitlines()[1:]}
    assert rows["checkpoint-5"].endswith("Hugging Face Trainer checkpoint (not ours)")


def test_verify_several_paths_one_summary_one_code(world: dict[str, Path]) -> None:
    r = invoke("verify", world["checkpoint"], world["run"], world["corrupt"], world["missing"], world["dcp"])
    assert r.exit_code == 3  # corrupt outranks incomplete (4), missing (5) and not a checkpoint (7)
    lines = r.output.splitlines()
    assert lines[-1] == "summary: 7 checked: 3 valid, 1 corrupt, 1 incomplete, 1 missing, 1 not a checkpoint; 1 skipped; exit 3"
    assert sum(line.startswith("ok: ") for line in lines) == 3
    assert any(line.startswith("skipped: ") and ".tmp-step-00000003" in line for line in lines)
    r = invoke("verify", world["checkpoint"], world["checkpoint2"])
    assert r.exit_code == 0 and r.output.splitlines()[-1] == "summary: 2 checked: 2 valid; exit 0"
    r = invoke("verify", "--quick", world["run"] / "step-00000001", world["run"] / "step-00000002")
    assert r.output.splitlines()[-1] == "summary: 2 checked: 2 structure ok; exit 0"


def test_demo_refuses_a_directory_in_use(tmp_path: Path) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    for args in (["demo", "--basic"], ["demo", "basic"], ["demo"]):
        r = invoke(*args, "--out", used)
        assert r.exit_code == 2 and "is not empty" in r.output, r.output
    assert [p.name for p in used.iterdir()] == ["notes.txt"]  # nothing written next to it


def test_real_subprocess_exit_codes_and_stderr(world: dict[str, Path]) -> None:
    env = dict(os.environ, CKPT_PROGRESS="0")

    def sh(*args: Any) -> subprocess.CompletedProcess[str]:
        return hangs.run([sys.executable, "-m", "ckpt_cli", *map(str, args)], capture_output=True, text=True,
                         bound_s=hangs.hang_s(12), env=env, cwd=world["base"])

    p = sh("inspect", world["dcp"])
    assert p.returncode == 7 and p.stdout == "" and p.stderr.startswith("error: not a checkpoint: a DCP checkpoint")
    p = sh("ls", world["missing"])
    assert p.returncode == 5 and p.stdout == "" and "no such file or directory" in p.stderr
    p = sh("verify", "--json", world["run"])
    assert p.returncode == 4 and json.loads(p.stdout)["summary"]["exit_code"] == 4


# --- §4: every --json report, key by key ------------------------------------------------------------
def test_json_reports_match_the_spec(world: dict[str, Path], tmp_path: Path) -> None:
    seen: dict[str, set[str]] = {}

    def report(command: str, *args: Any, code: int = 0, lines: bool = False) -> Any:
        r = CliRunner().invoke(cli, [*command.split()[1:], "--json", *map(str, args)], catch_exceptions=False)
        assert r.exit_code == code, (command, args, r.output)
        docs = [json.loads(x) for x in r.stdout.splitlines() if x.strip()] if lines else [json.loads(r.stdout)]
        for d in docs:
            check_shape(command, d, seen)
        return docs if lines else docs[0]

    s = report("ckpt inspect", world["checkpoint"])
    assert s["parts"][0]["entries"]["model"]["replica"] is None
    rep = report("ckpt inspect", world["replicated"])
    entry = {p["name"]: p["entries"]["model"] for p in rep["parts"]}["rank-00001"]
    assert entry["replica"] == {"part": "rank-00000", "tensors": 4, "bytes": entry["replica"]["bytes"]}
    assert entry["field"] == "weights" and entry["type"] == "torch.nn.modules.container.Sequential"
    imported = tmp_path / "imported"
    report("ckpt import dcp", world["dcp"], imported)
    sh = report("ckpt inspect", imported)
    assert sh["sharded"]["world_size"] == 1 and sh["sharded"]["tensors"]
    report("ckpt export dcp", world["checkpoint"], tmp_path / "exported-dcp")
    report("ckpt export hf", world["checkpoint"], tmp_path / "exported-hf")
    v = report("ckpt verify", world["checkpoint"], world["run"], world["corrupt"], world["missing"], code=3)
    assert v["summary"]["by_status"] == {"valid": 3, "corrupt": 1, "incomplete": 1, "missing": 1}
    rows = report("ckpt ls", world["run"])
    assert {r["name"]: r["state"] for r in rows} == {"step-00000001": "committed", "step-00000002": "committed",
                                                      ".tmp-step-00000003-abcdef": "temporary",
                                                      "step-00000004": "incomplete"}
    report("ckpt ls", world["run"], "--deep")
    d = report("ckpt diff", world["checkpoint"], world["checkpoint2"], code=6)
    assert "tensors" in d["differs"] and "config" in d["differs"]
    report("ckpt tape show", world["tape"], lines=True)
    report("ckpt tape verify", world["tape"])
    from replay import Recorder

    bad = tmp_path / "q.tape"
    with Recorder.open(str(bad), rng_every=0) as rec:
        rec.quorum("k", 3, lambda: ["a"])
    assert report("ckpt tape check", bad, code=6)[0]["rule"] == "quorum-below-minimum"
    from replay import record

    other = tmp_path / "other.tape"
    record(f"{ENTRY}:train", other, config={"steps": 3, "seed": 3}, param_digest_every=1)
    report("ckpt tape diff", world["tape"], other, code=6)
    torn = tmp_path / "torn.tape"
    torn.write_bytes(world["tape"].read_bytes()[:-5])
    report("ckpt tape repair", torn, "--dry-run")
    report("ckpt replay", world["tape"], "--trust")
    shim = tmp_path / "shim.py"
    shim.write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('shim_entry', {str(ENTRY)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.TAMPER.update(flip_at=1, tensor='0.bias', index=2, bit=7)\n"
        "train = m.train\n")
    div = report("ckpt replay", world["tape"], "--entry-point", f"{shim}:train", code=6)
    assert div["divergence"]["tensors"] and div["divergence"]["step"] == 1
    c = report("ckpt check-resume", "--", sys.executable, "-c", "pass", code=2)
    assert c["mode"] == "command" and c["verdict"] == "NO CLAIM"
    # entry mode renders ckpt.testing's result (the check itself runs processes for tens of seconds and
    # is tested in tests/ckpt; the README runs it for real): its record, as the library returns it
    from ckpt.testing import resume_entry as rc

    fake = rc.ResumeCheckResult("m:f", 8, (4,), 1, False, (), (rc.Divergence("resume", 4, "sched", "sched/last_epoch",
                                "3 != 0"),), (rc.ResumeEvent(0, None, 0, 4), rc.ResumeEvent(1, "step-00000003", 3, None)),
                                8, 40, str(tmp_path))
    mp = pytest.MonkeyPatch()
    mp.setattr(rc, "check_resume", lambda *a, **k: fake)
    try:
        c = report("ckpt check-resume", "--entry", "m:f", code=6)
    finally:
        mp.undo()
    assert c["mode"] == "entry" and c["verdict"] == "DIFFERENT" and c["divergences"][0]["key"] == "sched/last_epoch"
    # two short runs with step ledgers, one with a changed learning rate from its third step
    def tiny_run(where: Path, lr_at_3: float) -> Path:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        mgr = ckpt.CheckpointManager(where, {"model": m, "optim": o}, every_steps=2, ledger_params_every=1)
        for step in range(1, 5):
            if step == 3:
                o.param_groups[0]["lr"] = lr_at_3
            x = torch.ones(3, 4) * step
            loss = m(x).pow(2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
            mgr.after_step(step, batch=x, loss=loss)
        mgr.close()
        return where

    ra, rb = tiny_run(tmp_path / "ra", 0.1), tiny_run(tmp_path / "rb", 0.2)
    ld = report("ckpt ledger diff", ra, rb, code=6)
    assert ld["first_difference"]["step"] == 3 and ld["equal_through"] == 2
    from ckpt.bisect import StepTracer, save_trace

    def trace(path: Path, scale: float) -> Path:
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        with StepTracer(m, o) as t:
            loss = m(torch.ones(2, 4) * scale).sum()
            loss.backward()
            o.step()
            t.loss(loss)
        save_trace(t.trace(meta={"step": 1, "capsule": "x"}), path)
        return path

    bc = report("ckpt bisect compare", trace(tmp_path / "a.trace", 1.0), trace(tmp_path / "b.trace", 1.5), code=6)
    assert bc["first"]["module"] == "0" and bc["first"]["phase"] == "forward"
    demo = report("ckpt demo", "basic", "--out", tmp_path / "demo", "--steps", "12")
    assert demo["passed"] and [c["name"] for c in demo["checks"]][0] == "checkpoints valid"
    report("ckpt demo", "--list")
    # every documented key was seen in some report (the tables list nothing that never happens)
    for command, table in TABLES.items():
        unseen = {k for k, (optional, _) in table.items() if not optional and k not in seen.get(command, set())}
        assert not unseen, f"{command}: documented but never produced here: {sorted(unseen)}"


def test_replay_names_the_file_of_an_installed_entry_point(tmp_path: Path) -> None:
    """`ckpt replay` prints the file a taped entry point resolves to, before it asks for trust:
    a package installed by a meta-path finder (pip install -e) used to read "(not found)"."""
    code = ("import sys; sys.path = [p for p in sys.path if p not in ('', '.', %r)]\n"
            "from replay.replayer import resolve_entry_point\n"
            "print(resolve_entry_point('runs.diloco.run:main').file)\n"
            "print('runs' in sys.modules)") % str(ROOT)
    p = hangs.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, bound_s=hangs.hang_s(6),
                  env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    file, imported = p.stdout.split()
    assert file == str(ROOT / "runs" / "diloco" / "run.py") and imported == "False", p.stdout + p.stderr
