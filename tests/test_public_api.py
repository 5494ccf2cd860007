"""The public surface stays small and exact (as httpx's test_exported_members does)."""

from __future__ import annotations

import os
import sys

import pytest
import hangs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# every package a user imports from: the two libraries and each public subpackage their __all__ names
PUBLIC = ["ckpt", "replay", "ckpt_cli", "ckpt.data", "ckpt.errors", "ckpt.rng", "ckpt.ledger", "ckpt.diff",
          "ckpt.guard", "ckpt.stream", "replay.errors", "replay.channel", "replay.snapshot", "replay.sdc",
          "replay.watchdog"]


@pytest.mark.parametrize("package", PUBLIC)
def test_every_exported_name_resolves(package):
    import importlib

    mod = importlib.import_module(package)
    assert len(mod.__all__) == len(set(mod.__all__)), "duplicate names in __all__"
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


def test_the_top_levels_are_short_and_every_name_has_one_home():
    """The core names at the top level; channel, snapshot, ... names only in their
    subpackage, which the top level's ``__all__`` names (as ``ckpt`` does with ``ckpt.data``)."""
    import importlib
    import types

    for top in ("ckpt", "replay"):
        mod = importlib.import_module(top)
        assert len(mod.__all__) <= 36, f"{top}.__all__ has {len(mod.__all__)} names: move some to a subpackage"
        subs = [n for n in mod.__all__ if isinstance(getattr(mod, n), types.ModuleType)]
        assert sorted(f"{top}.{n}" for n in subs) == sorted(p for p in PUBLIC if p.startswith(top + ".")), top
        flat = set(mod.__all__)
        for n in subs:
            if n == "errors":  # the error classes: the base ones also at the top level, by design
                continue
            twice = flat & set(getattr(mod, n).__all__)
            assert not twice, f"{sorted(twice)} are in {top}.__all__ and {top}.{n}.__all__"


def test_names_that_left_replays_top_level_still_resolve_with_a_warning():
    import replay
    import replay.channel
    import replay.snapshot

    for name, sub in replay._MOVED.items():
        assert name not in replay.__all__ and name in getattr(replay, sub).__all__
        with pytest.warns(DeprecationWarning, match=rf"replay\.{name} moved to replay\.{sub}\.{name}"):
            assert getattr(replay, name) is getattr(getattr(replay, sub), name)


def test_error_hierarchies_have_one_base():
    import ckpt.errors as ce
    import replay.errors as re_

    for name in ce.__all__:
        assert issubclass(getattr(ce, name), ce.CkptError)
    # the tape errors are one set of classes, ckpt's (the framing lives in ckpt.tape)
    tape = {"TapeError": ce.TapeDataError, "TapeCorruptError": ce.TapeCorruptError,
            "TapeTruncatedError": ce.TapeTruncatedError, "TapeFormatError": ce.TapeFormatError,
            "TapeLimitError": ce.TapeLimitError}
    for name in re_.__all__:
        if name in tape:
            assert getattr(re_, name) is tape[name], name
        else:
            assert issubclass(getattr(re_, name), re_.ReplayError), name


def test_importing_the_packages_does_not_import_torch():
    code = "import sys, ckpt, replay, ckpt_cli.main, ckpt.reader; print('torch' in sys.modules)"
    out = hangs.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": ROOT}, bound_s=hangs.hang_s(6))
    assert out.stdout.strip() == "False", out.stdout + out.stderr


# The one documented exception (spec/sharded-format.md §S.6): `ckpt import dcp` reads DCP's
# pickled .metadata with an allowlist unpickler; tested in tests/ckpt/test_dcp_interop.py.
PICKLE_ALLOWED = {os.path.join("ckpt", "convert", "dcp.py")}


def test_no_pickle_in_library_code():
    hits = []
    for pkg in ("ckpt", "replay", "cli", "runs"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if os.path.relpath(os.path.join(dirpath, f), ROOT) in PICKLE_ALLOWED:
                    continue
                if f.endswith(".py"):
                    text = open(os.path.join(dirpath, f), encoding="utf-8").read()
                    for bad in ("import pickle", "from pickle", "cPickle", "dill", "torch.load("):
                        if bad in text:
                            hits.append(f"{dirpath}/{f}: {bad}")
    assert hits == []


# -- the import graph: layers, public names, no cycles ------------------------------------------

# Dependencies point down only: a package may import its own modules and the layers below it.
LAYERS = ("ckpt", "replay", "runs", "ckpt_cli")
# package -> repository folder (the folder cli/ installs as ckpt_cli: setup.py)
FOLDER = {"ckpt": "ckpt", "replay": "replay", "runs": "runs", "ckpt_cli": "cli"}
# No cycle is tolerated (ckpt.reader <-> ckpt._load, the last one, went with ckpt._materialize).
KNOWN_CYCLES: list[set[str]] = []


def _project_modules() -> dict[str, str]:
    """module name -> file, for every module of the four packages."""
    mods = {}
    for pkg in LAYERS:
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, FOLDER[pkg])):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    rel[0] = pkg
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    mods[".".join(rel)] = os.path.join(dirpath, f)
    return mods


def _imports(name: str, path: str, mods: dict[str, str]) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every import in the file, at any depth
    (a function-level import ties modules together as much as a top-level one)."""
    import ast

    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    out: list[tuple[str, str | None, int]] = []
    # `if TYPE_CHECKING:` blocks never run: annotations tie nothing together at import time
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                # `from pkg import module` imports that module; `from mod import name` the module
                out.append((sub, None, node.lineno) if sub in mods else (base, a.name, node.lineno))
    return [(m, n, ln) for m, n, ln in out if m.split(".")[0] in LAYERS]


def _graph() -> dict[str, set[str]]:
    mods = _project_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for target, _, _ in _imports(m, path, mods):
            while target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]
            # A module's own enclosing package is initialised before the module in any case,
            # so an import of it (`from . import __version__`) adds no order: not an edge.
            if target in mods and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def test_dependencies_point_down_only():
    mods = _project_modules()
    bad = []
    for m, path in mods.items():
        mine = LAYERS.index(m.split(".")[0])
        for target, _, line in _imports(m, path, mods):
            if LAYERS.index(target.split(".")[0]) > mine:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target}")
    assert bad == []


def test_runs_use_only_the_libraries_public_names():
    """runs/ is an application of ckpt and replay: it imports a library, a public
    subpackage the library's ``__all__`` names (``ckpt.data``, ``replay.errors``), or a
    name in that module's ``__all__``, never an internal module."""
    import importlib

    mods = _project_modules()
    bad = []
    for m, path in mods.items():
        if not m.startswith("runs"):
            continue
        for target, name, line in _imports(m, path, mods):
            top, _, rest = target.partition(".")
            if top not in ("ckpt", "replay"):
                continue
            where = f"{os.path.relpath(path, ROOT)}:{line}"
            if rest and (rest not in importlib.import_module(top).__all__ or "." in rest):
                bad.append(f"{where} imports the internal module {target}")
            elif name is not None and name not in importlib.import_module(target).__all__:
                bad.append(f"{where} imports {name}, not in {target}.__all__")
    assert bad == []


def test_no_import_cycles():
    from test_layering import cycles  # Tarjan's strongly connected components, one copy

    found = cycles(_graph())
    assert [sorted(c) for c in found if c not in KNOWN_CYCLES] == []


# -- the storage seam: the commit protocol is the backend's, never probed ---------------------------


def _library_sources():
    for pkg in ("ckpt", "cli", "runs", "replay"):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def test_committing_is_decided_behind_the_storage_seam():
    """No code outside ckpt/storage/ chooses a commit protocol, calls a backend's own commit
    requests past the type checker, or probes a storage, a sink or a read handle for a
    capability with a default (``FileSink.write_copy``/``seal``, ``ReadHandle.map_private``
    are declared members)."""
    import re

    storage_dir = os.path.join("ckpt", "storage") + os.sep
    # getattr(obj, "name", default): a capability looked up with a fallback
    probe = re.compile(r"getattr\((?:self\.|r\.)?_?(?:storage|store|backend|resolved|t?sink|handle)\b[^,]*,\s*[\"'][^\"']+[\"']\s*,")
    bad = []
    for rel, text in _library_sources():
        for i, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{i}"
            if "commits_by_manifest" in line and not rel.startswith(storage_dir):
                bad.append(f"{where} branches on commits_by_manifest")
            if "type: ignore[attr-defined]" in line and re.search(r"storage|_storage\b", line):
                bad.append(f"{where} calls a storage member no Protocol declares")
            if probe.search(line):
                bad.append(f"{where} probes a storage, sink or handle with getattr")
            if re.search(r"""["']scheme["'],\s*["']file["']""", line):
                bad.append(f"{where} decides 'local' by a scheme default")
    assert bad == []


def test_every_backend_names_its_commit_protocol_and_the_old_names_still_resolve():
    import warnings

    import ckpt.storage as cs
    from ckpt.storage.memory import MemoryCommit, MemoryStorage

    assert isinstance(cs.local.commit, cs.RenameCommit)
    mem = MemoryStorage()
    assert isinstance(mem.commit, MemoryCommit) and mem.commit.over(cs.local).storage is cs.local
    assert cs.ManifestCommit is cs.ObjectStore  # the earlier name of the object-store protocol
    # one-release shim: still importable, and says what to use instead
    assert "commits_by_manifest" in cs.__all__
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert cs.commits_by_manifest(cs.local) is False and cs.commits_by_manifest(mem) is False
    assert got and all(issubclass(w.category, DeprecationWarning) for w in got)
    assert "storage.commit" in str(got[0].message)


def test_save_options_are_one_public_record():
    import dataclasses

    import ckpt

    assert "SaveOptions" in ckpt.__all__ and "SaveOptionError" in ckpt.errors.__all__
    assert dataclasses.is_dataclass(ckpt.SaveOptions) and ckpt.SaveOptions.__dataclass_params__.frozen
    assert [f.name for f in dataclasses.fields(ckpt.SaveOptions)] == [
        "overwrite", "compress", "dedup", "dedup_from", "reuse", "part_manifests", "this_rank_only"]


def test_renamed_modules_still_import_for_one_release():
    """``ckpt.interop`` became ``ckpt.convert`` and ``ckpt.dcp.interop`` ``ckpt.convert.dcp``:
    the old paths hand on the same objects and say where they went."""
    code = ("import warnings; warnings.simplefilter('always'); import ckpt.convert.hf as h, ckpt.convert.dcp as d\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import ckpt.interop.hf as oh, ckpt.dcp.interop as od\n"
            "assert oh.export_hf is h.export_hf and od.import_dcp is d.import_dcp and od.export_dcp is d.export_dcp\n"
            "msgs = sorted(str(x.message) for x in w if issubclass(x.category, DeprecationWarning))\n"
            "assert any('ckpt.convert.dcp' in m for m in msgs) and any('ckpt.convert' in m for m in msgs), msgs\n")
    out = hangs.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                    bound_s=hangs.hang_s(12))
    assert out.returncode == 0, out.stdout + out.stderr
