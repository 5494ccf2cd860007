"""What a person at a terminal gets: progress bars on a TTY only, a completion script that
loads in bash, and no extra import for either (``ckpt --help`` stays torch-free and light)."""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
import hangs

ROOT = Path(__file__).resolve().parents[2]
CKPT = [sys.executable, "-m", "ckpt_cli"]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tty") / "step-00000001"
    ckpt.save(path, {"w": torch.zeros(4 << 20)}, step=1)  # 16 MiB: several chunks to re-hash
    return path


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CKPT_PROGRESS"}
    env.update(kw)
    return env


def _with_tty_stderr(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (as in a shell) and stdout on a pipe."""
    master, slave = pty.openpty()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    chunks: list[bytes] = []
    while True:
        r, _, _ = select.select([master], [], [], hangs.hang_s(12))
        if not r:
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    out = p.stdout.read().decode() if p.stdout else ""
    hangs.communicate(p, bound_s=hangs.hang_s(12))
    rc = p.returncode
    os.close(master)
    return rc, out, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_verify_draws_a_bar_on_a_terminal_only(big: Path) -> None:
    rc, out, err = _with_tty_stderr([*CKPT, "verify", str(big)], _env())
    assert rc == 0 and out.startswith(f"ok: {big}")
    assert "verifying" in err and "100%" in err  # click's bar, on stderr
    piped = hangs.run([*CKPT, "verify", str(big)], capture_output=True, text=True, env=_env(), bound_s=hangs.hang_s(12))
    assert piped.returncode == 0 and piped.stderr == "" and piped.stdout.startswith("ok: ")
    rc, out, err = _with_tty_stderr([*CKPT, "verify", str(big)], _env(CKPT_PROGRESS="0"))
    assert rc == 0 and "verifying" not in err


def test_export_hf_draws_a_bar_on_a_terminal(big: Path, tmp_path: Path) -> None:
    ckpt.save(tmp_path / "c", {"model": {"w": torch.zeros(1 << 20)}})
    rc, out, err = _with_tty_stderr([*CKPT, "export", "hf", str(tmp_path / "c"), str(tmp_path / "out")], _env())
    assert rc == 0 and "exporting" in err and out.startswith("exported 'model'")


@pytest.mark.slow
def test_completion_scripts_generate_and_bash_loads_one() -> None:
    for shell, marker in (("bash", "complete -o nosort -F _ckpt_completion ckpt"), ("zsh", "#compdef ckpt"),
                          ("fish", "complete --no-files --command ckpt")):
        p = hangs.run([*CKPT, "completion", shell], capture_output=True, text=True, bound_s=hangs.hang_s(6))
        assert p.returncode == 0 and marker in p.stdout, (shell, p.stdout[:300])
        same = hangs.run([*CKPT], capture_output=True, text=True, bound_s=hangs.hang_s(6),
                         env={**os.environ, "_CKPT_COMPLETE": f"{shell}_source"})
        assert same.stdout.strip() == p.stdout.strip()  # what click generates from the environment variable
    # the completions themselves: subcommands, then a subgroup's commands
    p = hangs.run([*CKPT], capture_output=True, text=True, bound_s=hangs.hang_s(6),
                  env={**os.environ, "_CKPT_COMPLETE": "bash_complete", "COMP_WORDS": "ckpt ex", "COMP_CWORD": "1"})
    assert p.stdout.split() == ["plain,export"]
    p = hangs.run([*CKPT], capture_output=True, text=True, bound_s=hangs.hang_s(6),
                  env={**os.environ, "_CKPT_COMPLETE": "bash_complete", "COMP_WORDS": "ckpt export ", "COMP_CWORD": "2"})
    assert sorted(p.stdout.split()) == ["plain,dcp", "plain,hf"]
    bash = shutil.which("bash")
    if bash is None:  # pragma: no cover - every CI image has bash
        return
    ckpt_bin = Path(sys.executable).with_name("ckpt")
    p = hangs.run([bash, "-c", f'eval "$({ckpt_bin} completion bash)" && complete -p ckpt'], capture_output=True,
                  text=True, bound_s=hangs.hang_s(6))
    assert p.returncode == 0 and "_ckpt_completion" in p.stdout, p.stderr


def test_help_and_progress_import_nothing_heavy() -> None:
    probe = ("import sys\nfrom ckpt_cli.main import cli\nimport ckpt_cli._common\n"
             "try:\n    cli.main(['--help'], prog_name='ckpt')\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('torch', 'tqdm', 'rich', 'numpy', 'transformers') if m in sys.modules))")
    out = hangs.run([sys.executable, "-c", probe], capture_output=True, text=True, bound_s=hangs.hang_s(6))
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
    assert "Exit codes: 0 ok" in out.stdout and "ckpt completion bash" in out.stdout
