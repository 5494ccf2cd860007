"""The README's Python examples run as tests, in a scratch directory."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _blocks() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_opens_with_two_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first is not None and text.index("```bash") < 200
    cmds = [line.split("#")[0].strip() for line in first.group(1).splitlines() if line.strip()]
    assert cmds == ["make demo", "make test"]


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _blocks()[index]
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})
