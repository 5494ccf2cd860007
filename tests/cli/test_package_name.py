"""The CLI installs as ``ckpt_cli``, so a user project with its own ``cli/`` folder keeps it."""

from __future__ import annotations

import subprocess
import sys
import hangs


def test_a_user_cli_folder_is_not_shadowed(tmp_path):
    user_cli = tmp_path / "cli"
    user_cli.mkdir()
    (user_cli / "__init__.py").write_text("WHOSE = 'user'\n")
    (user_cli / "__main__.py").write_text("print('the user cli')\n")
    run = lambda *args: hangs.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, bound_s=hangs.hang_s(12))

    mine = run("-c", "import cli; print(cli.WHOSE)")
    assert mine.stdout.strip() == "user", mine.stderr
    assert run("-m", "cli").stdout.strip() == "the user cli"

    ours = run("-m", "ckpt_cli", "--version")
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.strip() == "ckpt, version 0.1.0"
    helped = run("-m", "ckpt_cli", "--help")
    assert helped.returncode == 0 and "inspect" in helped.stdout
