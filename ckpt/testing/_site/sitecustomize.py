"""Installs the kill switch of ``ckpt check-resume -- COMMAND`` (ckpt/testing/kill_switch.py).

First on the attempt's ``PYTHONPATH``, so that every Python process of the command runs it
at start. It waits for ckpt's ledger module to be imported (a process that never imports
ckpt pays one finder lookup per import), installs the switch right after that module runs,
and then runs the ``sitecustomize`` this file shadows, if there is one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, Sequence

_TARGET = "ckpt.ledger.ledger"
_HERE = os.path.dirname(os.path.abspath(__file__))


class _InstallAfter(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...: tracebacks still find the lines
        return getattr(self.inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        from ckpt.testing.kill_switch import install_from_env

        install_from_env()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # once, and the lookup below finds the real module
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallAfter(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())

# the sitecustomize of the interpreter or the environment, which this one hides
_me = sys.modules.pop(__name__)
_path, sys.path[:] = list(sys.path), [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
try:
    importlib.import_module("sitecustomize")
except ModuleNotFoundError as e:
    if e.name != "sitecustomize":
        raise
finally:
    sys.path[:] = _path
    sys.modules[__name__] = _me  # the import that is running this file expects its own module back
