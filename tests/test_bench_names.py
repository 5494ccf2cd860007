"""A benchmark script's folder comes first on its import path: a script named like a
standard-library module (bench/bisect.py) shadows it for every script in that folder."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_no_bench_script_shadows_the_standard_library() -> None:
    clash = sorted(p.name for p in BENCH.glob("*.py") if p.stem in sys.stdlib_module_names)
    assert not clash, f"rename these bench scripts, they shadow standard-library modules: {clash}"
