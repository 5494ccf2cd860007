"""bench/gpu.py is kept ready for a GPU machine (issue 27 item 4): on this CPU-only
machine it must compile, answer --help, refuse bad options, and exit 0 with a clear
"no CUDA device" line instead of measuring anything."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import hangs

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return hangs.run([sys.executable, str(GPU), *args], capture_output=True, text=True, bound_s=hangs.hang_s(60),
                     env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_it_compiles(tmp_path: Path) -> None:
    py_compile.compile(str(GPU), cfile=str(tmp_path / "gpu.pyc"), doraise=True)


def test_help_names_every_row_and_option() -> None:
    p = _run("--help")
    assert p.returncode == 0, p.stderr
    for word in ("--rounds", "--sizes-gib", "--rows", "stall", "save", "load", "rng", "pinned", "DCP"):
        assert word in p.stdout, word


@pytest.mark.parametrize("args", [["--rounds", "3"], ["--rows", "stall,warp"]])
def test_bad_options_are_usage_errors(args: list[str]) -> None:
    p = _run(*args)
    assert p.returncode == 2 and "error:" in p.stderr, (p.returncode, p.stderr)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the run would measure")
def test_without_cuda_it_says_so_and_exits_0() -> None:
    p = _run("--rounds", "7")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("bench/gpu.py: no CUDA device")
