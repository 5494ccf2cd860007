"""The environment is read in ``ckpt/knobs.py`` only, and every variable is documented.

A direct read elsewhere hides a setting from spec/knobs.md and from ``knobs.override``;
the few places below *pass* the environment to a child process or *record* it as data,
and say so where they do it. The counts are ceilings: a new read in one of those files
fails too."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ckpt", "replay", "cli")
READ = re.compile(r"\bos\.environb?\b|\bgetenv\(|\bputenv\(|from os import [^\n]*\benviron\b")

#: file -> (most lines that may touch os.environ, why)
ALLOWED: dict[str, tuple[int, str]] = {
    "ckpt/context/env.py": (1, "records a fixed list of variables as data (a checkpoint's context.env)"),
    "ckpt/context/provenance.py": (1, "passes this environment on to git"),
    "cli/bisect_cmd.py": (6, "passes the environment on to its children, and the sitecustomize source it writes "
                             "for them reads the CKPT_DET_* variables it set"),
    "ckpt/testing/resume_entry.py": (2, "the kill-and-resume harness: sets its attempt's environment, builds its "
                                        "children's"),
    "ckpt/testing/resume_command.py": (1, "the kill-and-resume harness: builds its children's environment"),
    "ckpt/testing/kill_switch.py": (2, "kill_env extends a given environment (default: this one) for a child"),
}


def _sources() -> list[tuple[str, str]]:
    out = []
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    with open(path, encoding="utf-8") as fh:
                        out.append((os.path.relpath(path, ROOT).replace(os.sep, "/"), fh.read()))
    return out


def test_the_environment_is_read_in_knobs_only():
    bad = []
    for rel, text in _sources():
        if rel == "ckpt/knobs.py":
            continue
        lines = [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if READ.search(line)]
        ceiling, _why = ALLOWED.get(rel, (0, ""))
        if len(lines) > ceiling:
            bad.append(f"{rel}: {len(lines)} environment reads, {ceiling} allowed; add an accessor to ckpt/knobs.py "
                       "(documented in spec/knobs.md) instead:\n  " + "\n  ".join(lines))
    assert not bad, "\n".join(bad)


def test_every_variable_is_documented_and_every_documented_one_exists():
    with open(os.path.join(ROOT, "spec", "knobs.md"), encoding="utf-8") as f:
        doc = f.read()
    sources = _sources()
    code = "\n".join(text for _, text in sources)
    named = set(re.findall(r"\bCKPT_[A-Z0-9_]*[A-Z0-9]\b", code))
    with open(os.path.join(ROOT, "ckpt", "knobs.py"), encoding="utf-8") as f:
        knobs_src = f.read()
    named |= set(re.findall(r"\"((?:AWS|LOCAL)_[A-Z0-9_]+)\"", knobs_src))
    documented = set(re.findall(r"`((?:CKPT|AWS|LOCAL)_[A-Z0-9_]*[A-Z0-9])`", doc))
    assert sorted(named - documented) == [], "variables the code names that spec/knobs.md does not document"
    assert sorted(n for n in documented if n not in code) == [], "documented variables no code names"
