"""Every example in README.md and the documentation site's pages (docs/**/*.md) runs here, and
what it prints is compared with the page.

The convention, for every section of the README and of every page under docs/ (one
convention for all of them; a block that does not follow it fails):

- A ```python block runs in a fresh scratch directory (its working directory), in this
  process, with the repository importable. What it prints on stdout must equal the ```text
  block right after it, which is introduced by the line ``<!-- output -->``. A block that
  prints and has no output block fails: show what it prints.
- A ```console block runs: each ``$ COMMAND`` line runs in bash in the scratch directory,
  with the virtualenv's ``bin`` first on PATH and progress bars off; the lines after it, up to
  the next ``$``, are what it prints (stdout and stderr together, as a terminal shows them).
  It must exit 0, unless the line ends with a comment ``# exit N``.
- Other languages: the README's first ```bash block holds the two setup commands
  (``test_readme_opens_with_two_commands``); any other block says why it does not run.
- ``id=`` names are one namespace over all the pages: a block of docs/diloco.md may say
  ``after=demo`` to read what the README's demo wrote.
- Options go in a comment line right before a block, ``<!-- example: KEY=VALUE ... -->``:

  ==================  ===================================================================
  ``id=NAME``         names the block's scratch directory ...
  ``after=NAME``      ... which this block reuses, running after NAME (a console session
                      over files a python block wrote, or a continuation)
  ``file=NAME.py``    the python block is written to ``NAME.py`` in the scratch directory
                      and run as ``python NAME.py`` (a script a later block imports or
                      replays), instead of in this process
  ``copy=A,B``        copy these repository files into the scratch directory, at the
                      same relative paths (``docs/examples/tiny_gpt.py``)
  ``vary=N1,N2``      outputs that vary from run to run, named from VARY below
  ``needs=NAME``      a setup from NEEDS below, e.g. ``needs=s3``: the S3-compatible server
                      the tests start (``s3_server`` in tests/conftest.py), its
                      ``AWS_*`` variables set for the block, bucket ``ckpt-readme`` made
  ``timeout=S``       seconds per command (default 900)
  ``shared=NAME``     a console block whose first command is the long run ``NAME`` of
                      ``SHARED_RUNS`` (tests/conftest.py), run once per session: the tests
                      that check more of its claims read the same run's output directory
                      (``shared_runs.get(NAME)``) instead of paying for it again
  ``no-run="REASON"`` the block does not run (a reviewer reads REASON: say where what it
                      shows is checked instead)
  ==================  ===================================================================

- Normalised always: trailing spaces; ``/tmp/`` in a console command stands for the scratch
  directory (``/tmp/demo-real`` runs as ``SCRATCH/demo-real``) and the scratch directory prints
  as ``/tmp``; a timestamp ``YYYY-MM-DD HH:MM:SS UTC`` matches any timestamp; ``...`` alone on a
  line of the expected output matches any lines (none included), ``...`` inside a line any text.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# multi-process runs, subprocesses or heavy imports: `make check` leaves them out
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: the pages whose examples run: the README first, then every page of the site (docs/, mkdocs.yml)
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

#: ``vary=`` names: each turns a kind of token of the expected output into a pattern
VARY: dict[str, tuple[str, str]] = {
    # name: (what it matches in the expected text, the pattern it becomes); tried in this order
    "direction": (r"\b(?:better|worse)\b", r"(?:better|worse)"),  # which side of a comparison won
    "hex": (r"\b[0-9a-f]{8,}\b", r"[0-9a-f]+"),  # ids and digests
    "sizes": (r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB)\b", r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB)"),  # any size, any unit
    "times": (r"\d+(?:\.\d+)? s\b", r"\d+(?:\.\d+)? s"),  # durations
    "numbers": (r"-?\d+(?:\.\d+)?", r"-?\d+(?:\.\d+)?"),  # any number (counts, steps, losses); spaces stretch too
}
_STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


def _need_s3(request: pytest.FixtureRequest) -> dict[str, str]:
    server = request.getfixturevalue("s3_server")
    try:
        server.create_bucket("ckpt-readme")
    except Exception:  # noqa: BLE001 - made by an earlier example of this session
        pass
    return dict(server.env())


#: ``needs=`` names: each prepares what a block needs and returns environment variables for it
NEEDS: dict[str, Any] = {"s3": _need_s3}


@dataclass
class Block:
    index: int
    lang: str
    code: str
    line: int
    options: dict[str, str] = field(default_factory=dict)
    output: str | None = None  # the ```text block marked <!-- output --> after it
    page: str = "README.md"  # where it is, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(text: str, page: str = "README.md", first: int = 0) -> list[Block]:
    """The blocks of one page; their indexes start at ``first`` (one numbering over all pages)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    pending_opts: dict[str, str] = {}
    pending_output = False
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^<!-- example: (.*) -->\s*$", line)
        if m:
            for item in shlex.split(m.group(1)):  # no-run="a reason with spaces"
                k, _, v = item.partition("=")
                pending_opts[k] = v
            i += 1
            continue
        if re.match(r"^<!-- output -->\s*$", line):
            pending_output = True
            i += 1
            continue
        m = re.match(r"^```(\w*)\s*$", line)
        if m:
            lang, start = m.group(1), i + 1
            j = start
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            body = "\n".join(lines[start:j]) + "\n"
            if pending_output:
                assert blocks and lang == "text", f"{page}:{i + 1}: <!-- output --> must precede a ```text block"
                assert blocks[-1].output is None, f"{page}:{i + 1}: a second output block for one example"
                blocks[-1].output = body
            else:
                blocks.append(Block(first + len(blocks), lang, body, i + 1, pending_opts, page=page))
            pending_opts, pending_output = {}, False
            i = j + 1
            continue
        if line.strip():
            assert not pending_output, f"{page}:{i + 1}: <!-- output --> must be right before its ```text block"
            pending_opts = {} if not line.startswith("<!--") else pending_opts
        i += 1
    return blocks


def parse_pages(pages: list[Path]) -> list[Block]:
    blocks: list[Block] = []
    for path in pages:
        blocks += parse(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)), len(blocks))
    return blocks


BLOCKS = parse_pages(PAGES)


def expected_pattern(expected: str, vary: set[str]) -> str:
    """The expected text as a regex, with the always-on and the ``vary`` normalisations."""
    unknown = vary - set(VARY)
    assert not unknown, f"unknown vary= names {sorted(unknown)}; known: {sorted(VARY)}"
    order = [v for v in VARY if v in vary]  # VARY's order: a size or a time before a bare number
    tokens = [_STAMP] + [VARY[v][0] for v in order]
    finder = re.compile("|".join(f"({t})" for t in tokens))
    if not expected.strip():
        return ""  # a command that prints nothing
    out: list[str] = []
    for line in expected.rstrip("\n").split("\n"):
        line = line.rstrip()
        if line.strip() == "...":
            out.append(r"(?:[^\n]*\n)*?")
            continue
        pat = []
        for piece in re.split(r"(\.\.\.)", line):
            if piece == "...":
                pat.append(r"[^\n]*?")
                continue
            pos = 0
            for m in finder.finditer(piece):
                pat.append(_lit(piece[pos:m.start()], vary))
                group = next(g for g in range(1, len(tokens) + 1) if m.group(g) is not None)
                pat.append(_STAMP if group == 1 else VARY[order[group - 2]][1])
                pos = m.end()
            pat.append(_lit(piece[pos:], vary))
        out.append("".join(pat) + r"\n")
    return "".join(out)


def _lit(text: str, vary: set[str]) -> str:
    if vary:  # a varying value of another width shifts the columns after it: a gap of 2+ spaces stretches
        return r" +".join(re.escape(p) for p in re.split(r" {2,}", text)) if "  " in text else re.escape(text)
    return re.escape(text)


def normalise(actual: str, scratch: Path) -> str:
    text = actual.replace(str(scratch), "/tmp")
    return "".join(line.rstrip() + "\n" for line in text.rstrip("\n").split("\n")) if text.strip() else ""


def compare(expected: str, actual: str, vary: set[str], where: str) -> None:
    pat = expected_pattern(expected, vary)
    if re.fullmatch(pat, actual):
        return
    diff = "\n".join(difflib.unified_diff(expected.rstrip("\n").split("\n"), actual.rstrip("\n").split("\n"),
                                          "README", "actual", lineterm="", n=2))
    pytest.fail(f"{where}: the printed output differs from the page (vary={sorted(vary) or 'none'}):\n{diff}")


# -- running --------------------------------------------------------------------------------------
_SCRATCH: dict[str, Path] = {}
_DONE: set[int] = set()


def _scratch_for(block: Block, factory: pytest.TempPathFactory) -> Path:
    name = block.options.get("after") or block.options.get("id")
    if name and name in _SCRATCH:
        return _SCRATCH[name]
    path = factory.mktemp(f"readme-{block.index}")
    if name:
        _SCRATCH[name] = path
    return path


def _commands(code: str) -> list[tuple[str, str]]:
    """``(command, expected output)`` pairs of a console block."""
    out: list[tuple[str, list[str]]] = []
    for line in code.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            out.append((line[2:], []))
        else:
            assert out, f"console block output before its first $ command: {line!r}"
            out[-1][1].append(line)
    return [(c, "\n".join(o) + "\n" if o else "") for c, o in out]


def _expected_exit(cmd: str) -> int:
    m = re.search(r"#\s*exit (\d+)\s*$", cmd)
    return int(m.group(1)) if m else 0


def run_block(block: Block, factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> None:
    if block.index in _DONE:
        return
    after = block.options.get("after")
    if after:
        firsts = [b for b in BLOCKS if b.options.get("id") == after]
        assert firsts, f"{block.where}: after={after} names no block"
        run_block(firsts[0], factory, request)
    extra_env: dict[str, str] = {}
    for need in filter(None, block.options.get("needs", "").split(",")):
        assert need in NEEDS, f"{block.where}: needs={need}: known are {sorted(NEEDS)}"
        extra_env.update(NEEDS[need](request))
    runs = request.getfixturevalue("shared_runs")
    env = {**runs.env(), **extra_env}
    shared = None
    if "shared" in block.options:  # the long run other tests read too: once per session
        assert block.lang == "console" and not after, f"{block.where}: shared= is for a console block's first command"
        shared = runs.get(block.options["shared"])
        _SCRATCH[block.options.get("id") or f"shared-{block.index}"] = shared.scratch
    scratch = shared.scratch if shared else _scratch_for(block, factory)
    for rel in filter(None, block.options.get("copy", "").split(",")):
        dst = scratch / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst)
    vary = set(filter(None, block.options.get("vary", "").split(",")))
    where = f"{block.where} ({block.lang} block {block.index})"
    from hangs import run, scale

    timeout = float(block.options.get("timeout", 900)) * scale()  # a hang bound (tests/hangs.py)
    if block.lang == "python":
        if "file" in block.options:
            script = scratch / block.options["file"]
            script.write_text(block.code, encoding="utf-8")
            p = run([sys.executable, script.name], cwd=scratch, env=env, bound_s=timeout)
            assert p.returncode == 0, f"{where}: exited {p.returncode}\n{p.stdout}\n{p.stderr}"
            printed = p.stdout
        else:
            printed = _exec(block.code, scratch, where, extra_env)
        printed = normalise(printed, scratch)
        if block.output is None:
            assert not printed, f"{where} prints output the page does not show; add a ```text block after it " \
                                f"introduced by <!-- output -->:\n{printed}"
        else:
            compare(block.output, printed, vary, where)
    elif block.lang == "console":
        assert block.output is None, f"{where}: a console block holds its own output"
        for n, (cmd, expected) in enumerate(_commands(block.code)):
            if shared and n == 0:
                assert cmd == shared.command, f"{where}: shared={block.options['shared']} runs `{shared.command}` " \
                                              f"(tests/conftest.py SHARED_RUNS), the page shows `{cmd}`"
                code, printed = shared.returncode, shared.output
            else:
                real = re.sub(r"(?<![\w.])/tmp/", f"{scratch}/", cmd)
                p = run(["bash", "-c", real], cwd=scratch, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, bound_s=timeout)
                code, printed = p.returncode, p.stdout
            want = _expected_exit(cmd)
            assert code == want, f"{where}: `{cmd}` exited {code}, the page says {want}:\n{printed}"
            compare(expected, normalise(printed, scratch), vary, f"{where}: `{cmd}`")
    _DONE.add(block.index)


def _exec(code: str, scratch: Path, where: str, env: dict[str, str] | None = None) -> str:
    buf = io.StringIO()
    old = os.getcwd()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    if env:
        _forget_backends()  # storage backends made before read their environment (AWS_*) again
    os.chdir(scratch)
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, where, "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(old)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if env:
            _forget_backends()
    return buf.getvalue()


def _forget_backends() -> None:
    try:
        from ckpt.storage import forget_backends
    except ImportError:  # no object-store backends in this tree
        return
    forget_backends()


# -- the tests ------------------------------------------------------------------------------------
def test_readme_opens_with_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first is not None and text.index("```bash") < 200
    cmds = [line.split("#")[0].strip() for line in first.group(1).splitlines() if line.strip()]
    assert cmds == ["make demo", "make test"]


def test_every_block_follows_the_convention() -> None:
    langs = [b.lang for b in BLOCKS]
    assert langs[0] == "bash" and BLOCKS[0].page == "README.md"
    ids = [b.options["id"] for b in BLOCKS if "id" in b.options]
    assert len(ids) == len(set(ids)), f"an id= is used twice (one namespace over all pages): {sorted(ids)}"
    for b in BLOCKS[1:]:
        if "no-run" in b.options:
            assert b.options["no-run"], f"{b.where}: no-run= needs a reason"
            continue
        assert b.lang in ("python", "console"), (
            f"{b.where}: a ```{b.lang} block that is neither an example nor an example's output: make it "
            f"a ```console session or the output of one (<!-- output -->), or mark it <!-- example: no-run=REASON -->")
        known = {"id", "after", "file", "copy", "vary", "needs", "timeout", "no-run", "shared"}
        assert set(b.options) <= known, f"{b.where}: unknown options {sorted(set(b.options) - known)}"


def test_every_page_is_in_the_site() -> None:
    """A page under docs/ whose examples run is one a reader can find: it is in the site's
    navigation (mkdocs.yml; the strict build, tests/test_docs.py, fails on a page left out),
    and the README links the site's home."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in PAGES[1:]:
        rel = page.relative_to(ROOT / "docs").as_posix()
        assert re.search(rf"^\s*- (?:.+: )?{re.escape(rel)}\s*$", nav, flags=re.M), f"mkdocs.yml's nav has no {rel}"
    assert "](docs/index.md)" in README.read_text(encoding="utf-8"), "README.md links no docs/index.md"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_resolves() -> None:
    """Relative links of the README and the docs pages name files that exist, and their
    ``#anchor`` a heading of that file (moving a section must not strand its readers)."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            rel, _, anchor = target.partition("#")
            dest = (page.parent / rel).resolve() if rel else page
            assert dest.exists(), f"{page.relative_to(ROOT)}: link ({target}) names no file"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", dest.read_text(encoding="utf-8"), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, (
                    f"{page.relative_to(ROOT)}: link ({target}): {dest.name} has no heading with that anchor")


RUNNABLE = [b for b in BLOCKS[1:] if b.lang in ("python", "console") and "no-run" not in b.options]


def _xdist_group(b: Block) -> str | None:
    """The pytest-xdist group of a block: the blocks of one ``after=`` chain share a scratch
    directory that the chain's first block fills, and a ``shared=`` block shares its run with the
    tests that read it (``xdist_group(NAME)`` in their modules): one worker must run them all, or
    another worker would pay for the same run again."""
    root = b
    while root.options.get("after"):
        firsts = [x for x in BLOCKS if x.options.get("id") == root.options["after"]]
        if not firsts:
            return None  # the test itself fails naming the missing id
        root = firsts[0]
    if "shared" in root.options:
        return root.options["shared"]
    chained = root is not b or any(x.options.get("after") == root.options.get("id") for x in BLOCKS if "id" in root.options)
    return f"readme-{root.options['id']}" if chained else None


def _param(b: Block) -> Any:
    # a block's own timeout= bounds the whole test too (pytest-timeout's default is 300 s),
    # with room for the blocks that run before its commands (after=)
    marks = [pytest.mark.timeout(int(float(b.options["timeout"])) + 300)] if "timeout" in b.options else []
    group = _xdist_group(b)
    if group:
        marks.append(pytest.mark.xdist_group(group))
    page = "" if b.page == "README.md" else Path(b.page).relative_to("docs").with_suffix("").as_posix() + "-"
    return pytest.param(b, id=f"{page}line{b.line}-{b.lang}", marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_readme_example(block: Block, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> None:
    run_block(block, tmp_path_factory, request)


def test_the_harness_normalises_as_documented() -> None:
    """The harness's own rules, on fixed text (a README edit cannot weaken them unnoticed)."""
    pat = expected_pattern("a 2026-12-01 04:25:11 UTC b\n...\nend ... done\n", set())
    assert re.fullmatch(pat, "a 1999-01-02 03:04:05 UTC b\nx\ny\nend of it all done\n")
    assert re.fullmatch(pat, "a 1999-01-02 03:04:05 UTC b\nend - done\n")
    assert not re.fullmatch(pat, "a 1999-01-02 03:04:05 UTC c\nend - done\n")
    assert not re.fullmatch(expected_pattern("loss 2.6500\n", set()), "loss 2.6501\n")
    assert re.fullmatch(expected_pattern("loss 2.6500  ok\n", {"numbers"}), "loss 12.01 ok\n")
    assert re.fullmatch(expected_pattern("id e9179ee9f035f8cc\n", {"hex"}), "id 0123456789abcdef\n")
    assert not re.fullmatch(expected_pattern("id e9179ee9f035f8cc\n", set()), "id 0123456789abcdef\n")
    assert re.fullmatch(expected_pattern("chaos better by 7.9%\n", {"direction"}), "chaos worse by 7.9%\n")
    assert re.fullmatch(expected_pattern("size  1.6 MiB ok\n", {"numbers", "sizes"}), "size  941.1 KiB ok\n")
    assert normalise("at /x/y/run  \n\n", Path("/x/y")) == "at /tmp/run\n"
    blocks = parse("```bash\nmake\n```\n<!-- example: id=a vary=hex -->\n```python\nprint(1)\n```\n<!-- output -->\n"
                   "```text\n1\n```\n")
    assert blocks[1].options == {"id": "a", "vary": "hex"} and blocks[1].output == "1\n"
