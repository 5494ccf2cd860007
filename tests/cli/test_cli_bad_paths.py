"""Every command on every path it cannot use, as a real subprocess (issue 22 item 9).

A symlink loop, a name longer than NAME_MAX, a URL no backend serves and a bucket that
does not exist: each gets one ``error:`` line on stderr and the exit code spec/cli.md §3
gives, never a traceback. The tape commands resolve their path in a click parameter
type, before the command's error handler runs; that is where the tracebacks were."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import hangs

REPO = Path(__file__).resolve().parents[2]

#: command -> how a bad path P goes into its arguments (OUT: a fresh destination)
COMMANDS: dict[str, list[str]] = {
    "inspect": ["inspect", "P"], "verify": ["verify", "P"], "ls": ["ls", "P"], "diff": ["diff", "P", "P"],
    "export dcp": ["export", "dcp", "P", "OUT"], "export hf": ["export", "hf", "P", "OUT"],
    "import dcp": ["import", "dcp", "P", "OUT"], "tape show": ["tape", "show", "P"],
    "tape verify": ["tape", "verify", "P"], "tape check": ["tape", "check", "P"],
    "tape repair": ["tape", "repair", "P"], "tape diff": ["tape", "diff", "P", "P"],
    "tape merge": ["tape", "merge", "P", "-o", "OUT"], "replay": ["replay", "P"],
}
#: bad path -> exit code (spec/cli.md §3: an OS error on the path 1, an unserved scheme 2)
BAD = {"symlink loop": 1, "name too long": 1, "gs:// URL": 2, "missing bucket": None}


@pytest.fixture(scope="module")
def bad_paths(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("badpaths")
    (base / "loop").symlink_to(base / "loop")
    paths = {"symlink loop": str(base / "loop"), "name too long": str(base / ("n" * 300)), "gs:// URL": "gs://bucket/t"}
    env = dict(os.environ, CKPT_PROGRESS="0")
    try:
        server = request.getfixturevalue("s3_server")
    except pytest.skip.Exception:
        server = None
    if server is not None:
        paths["missing bucket"] = "s3://no-such-bucket-for-ckpt/run/t"
        env.update(server.env())
    return {"base": base, "paths": paths, "env": env}


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return hangs.run([sys.executable, "-m", "ckpt_cli", *argv], capture_output=True, text=True, bound_s=hangs.hang_s(30),
                     env=env, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_on_every_bad_path_is_one_line_and_its_code(bad_paths: dict[str, Any], command: str) -> None:
    base: Path = bad_paths["base"]
    runs = {}
    for kind, p in bad_paths["paths"].items():
        out = base / f"out-{command.replace(' ', '-')}-{kind.replace(' ', '-').replace('/', '')}"
        runs[kind] = [str(out) if a == "OUT" else p if a == "P" else a for a in COMMANDS[command]]
    with ThreadPoolExecutor(4) as pool:
        done = dict(zip(runs, pool.map(lambda argv: _run(argv, bad_paths["env"], base), runs.values())))
    for kind, r in done.items():
        err = r.stderr.strip().splitlines()
        assert "Traceback" not in r.stderr, (command, kind, r.stderr[-2000:])
        assert len(err) == 1 and err[0].startswith("error: "), (command, kind, r.stderr[-2000:])
        want = BAD[kind]
        if want is None:  # a bucket the store does not have: named as such, not the store's XML
            assert r.returncode == 1 and "the bucket 'no-such-bucket-for-ckpt' does not exist" in err[0], (command, err)
            assert len(err[0]) < 300, err[0]
        else:
            assert r.returncode == want, (command, kind, r.returncode, err)
        assert r.stdout == "", (command, kind, r.stdout)
