"""``ckpt ledger diff``, ``ckpt bisect run`` and ``ckpt check-determinism`` as a user runs
them: real subprocesses, in the directory of a training script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import hangs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIN = os.path.dirname(sys.executable)

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _ckpt(*args: str, **env: str) -> subprocess.CompletedProcess:
    return hangs.run([os.path.join(BIN, "ckpt"), *args], cwd=HERE, env=_env(**env), bound_s=hangs.hang_s(20))


def _train(out: str, plant: str = "", step: int = 4, steps: int = 7) -> None:
    hangs.run([sys.executable, "plant_script.py", "--out", out, "--steps", str(steps)], cwd=HERE, check=True,
              env=_env(PLANT=plant, PLANT_STEP=str(step)), bound_s=hangs.hang_s(12))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("bisect-cli")
    a, b = str(base / "a"), str(base / "b")
    _train(a)
    _train(b, "layer")
    return a, b


def test_ledger_diff_names_the_first_step(runs) -> None:
    a, b = runs
    r = _ckpt("ledger", "diff", a, b)
    assert r.returncode == 6, r.stdout + r.stderr
    assert "DIFFERENT from step 4" in r.stdout and "equal through step 3" in r.stdout
    doc = json.loads(_ckpt("ledger", "diff", a, b, "--json").stdout)
    assert doc["first_difference"]["step"] == 4 and doc["equal_through"] == 3 and not doc["identical"]
    same = _ckpt("ledger", "diff", a, a)
    assert same.returncode == 0 and "IDENTICAL" in same.stdout


def test_bisect_run_names_the_module_and_phase(runs, tmp_path) -> None:
    a, b = runs
    r = _ckpt("bisect", "run", a, b, "--entry", "plant_script:target", "--env-b", "PLANT=layer",
              "--work", str(tmp_path / "w"), "--json")
    assert r.returncode == 6, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["step"] == 4 and doc["first"]["module"] == "blocks.0.act" and doc["first"]["phase"] == "forward"
    assert doc["first"]["count"] > 0
    # the traces travel: compare them again from the files
    c = _ckpt("bisect", "compare", str(tmp_path / "w" / "a.trace"), str(tmp_path / "w" / "b.trace"))
    assert c.returncode == 6 and "forward of blocks.0.act" in c.stdout


def test_check_determinism_finds_the_step_the_operation_and_the_fix(tmp_path) -> None:
    r = _ckpt("check-determinism", "--threads", "2", "--entry", "plant_script:target", "--work", str(tmp_path / "w"),
              "--", sys.executable, "plant_script.py", "--out", "{run}", "--steps", "5", PLANT="threads", PLANT_STEP="3")
    assert r.returncode == 6, r.stdout + r.stderr
    assert "DIFFERENT from step 3" in r.stdout
    assert "forward of blocks.1.mix" in r.stdout
    assert "FIX: one intra-op thread" in r.stdout


def test_check_determinism_passes_a_deterministic_script(tmp_path) -> None:
    r = _ckpt("check-determinism", "--work", str(tmp_path / "w"), "--", sys.executable, "plant_script.py",
              "--out", "{run}", "--steps", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DETERMINISTIC" in r.stdout


def test_check_determinism_needs_the_run_placeholder() -> None:
    r = _ckpt("check-determinism", "--", sys.executable, "plant_script.py", "--out", "x")
    assert r.returncode == 2 and "{run}" in r.stderr
