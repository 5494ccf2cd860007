"""The public surface stays small and exact (as httpx's test_exported_members does)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("package", ["ckpt", "replay", "cli", "ckpt.data", "ckpt.errors", "replay.errors"])
def test_every_exported_name_resolves(package):
    import importlib

    mod = importlib.import_module(package)
    assert len(mod.__all__) == len(set(mod.__all__)), "duplicate names in __all__"
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


def test_error_hierarchies_have_one_base():
    import ckpt.errors as ce
    import replay.errors as re_

    for name in ce.__all__:
        assert issubclass(getattr(ce, name), ce.CkptError)
    for name in re_.__all__:
        assert issubclass(getattr(re_, name), re_.ReplayError)


def test_importing_the_packages_does_not_import_torch():
    code = "import sys, ckpt, replay, cli.main, ckpt.reader; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_no_pickle_in_library_code():
    hits = []
    for pkg in ("ckpt", "replay", "cli"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    text = open(os.path.join(dirpath, f), encoding="utf-8").read()
                    for bad in ("import pickle", "from pickle", "cPickle", "dill", "torch.load("):
                        if bad in text:
                            hits.append(f"{dirpath}/{f}: {bad}")
    assert hits == []
