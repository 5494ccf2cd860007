"""The documentation site builds in strict mode, and every public object has a docstring.

``mkdocs build --strict`` fails on any warning: a link to a page or an anchor that does not
exist, a page left out of the nav, an object the API reference names that mkdocstrings
cannot find. mkdocstrings renders an object without a docstring silently, so the second
check reads the same sources the reference is generated from (griffe, statically, as
mkdocstrings does) and names every public object (a name in the ``__all__`` of a package
the reference documents) that has none.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"

griffe = pytest.importorskip("griffe", reason="the docs extra (mkdocstrings[python]) is not installed")


def _directives() -> list[str]:
    """The objects the API reference pages render (their ``::: dotted.path`` lines)."""
    return [m for page in sorted(REFERENCE.glob("*.md"))
            for m in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(encoding="utf-8"), flags=re.M)]


def _public_objects() -> list[tuple[str, object]]:
    """``(name as exported, griffe object)`` for every non-module name in the ``__all__`` of each
    module the reference renders; a name a package only resolves at run time (its lazy
    ``__getattr__``, which griffe cannot see) must be rendered from its home module in the package."""
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)])
    for package in ("ckpt", "replay"):
        loader.load(package)
    loader.resolve_aliases(external=False, implicit=False)
    collection = loader.modules_collection
    rendered = set(_directives())
    found: list[tuple[str, object]] = []
    for dotted in sorted(rendered):
        obj = collection.get_member(dotted)
        if not obj.is_module:
            continue
        for name in [str(e) if isinstance(e, str) else e.name for e in obj.exports or ()]:
            if name.startswith("_"):
                continue  # __version__: shown by the package's own docstring, not an API object
            exported = f"{dotted}.{name}"
            member = obj.members.get(name)
            if member is None:  # lazy (the package's __getattr__ imports it on first use): rendered from its home
                homes = [r for r in rendered if r.startswith(f"{dotted}.") and r.endswith(f".{name}")]
                assert homes, f"{exported} is public but no reference page renders it (add `::: {dotted}.MODULE.{name}`)"
                member = collection.get_member(homes[0])
            target = member.final_target if member.is_alias else member
            if not target.is_module:
                found.append((exported, target))
    return found


def test_every_public_package_has_a_reference_page() -> None:
    from test_public_api import PUBLIC  # tests/ is on sys.path (its conftest's folder)

    rendered = set(_directives())
    missing = [p for p in PUBLIC if p != "ckpt_cli" and p not in rendered]
    assert not missing, f"public packages without an API reference page under docs/reference/: {missing}"


def test_every_public_object_has_a_docstring() -> None:
    objects = _public_objects()
    assert len(objects) > 150  # the reference covers the whole public surface, not a corner of it
    bare = sorted({name for name, obj in objects if not (obj.docstring and obj.docstring.value.strip())})
    assert not bare, f"{len(bare)} public objects have no docstring: {bare}"


@pytest.mark.slow
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    from hangs import hang_s, run

    p = run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
            cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
            text=True, bound_s=hang_s(30))
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout}\n{p.stderr}"
    for page in ("index.html", "reference/ckpt/index.html", "spec/checkpoint-format/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
