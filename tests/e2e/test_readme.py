"""The README's Python examples run as tests, in a scratch directory."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _blocks() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _needs(index: int) -> set[str]:
    """Fixtures a block asks for in the comment line before it (``needs=s3``)."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    metas = re.findall(r"(?:<!-- example: ([^\n]*?) -->\n)?```python\n", text)
    m = re.search(r"needs=([\w,]+)", metas[index] or "")
    return set(m.group(1).split(",")) if m else set()


def _with_s3(request, monkeypatch) -> None:
    """The README's s3:// examples run against the test server, bucket ``ckpt-readme``."""
    from ckpt.storage import forget_backends

    server = request.getfixturevalue("s3_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    try:
        server.create_bucket("ckpt-readme")
    except Exception:  # noqa: BLE001 - made by an earlier example of this session
        pass
    forget_backends()


def test_readme_opens_with_two_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first is not None and text.index("```bash") < 200
    cmds = [line.split("#")[0].strip() for line in first.group(1).splitlines() if line.strip()]
    assert cmds == ["make demo", "make test"]


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_python_block_runs(index, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    if "s3" in _needs(index):
        _with_s3(request, monkeypatch)
    code = _blocks()[index]
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})
