"""Canonical form and hash of a run's config (dict, dataclass, argparse Namespace).

Canonical form: msgpack with map keys sorted, tuples as arrays, floats as float64
(exact bits). The hash is sha256 of those bytes, so two configs that compare equal
field by field hash equal, whatever type or key order they were given in.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
from typing import Any

import msgpack

from ..errors import UnsupportedValueError

__all__ = ["canonical_config", "config_hash", "canonicalize"]


def canonicalize(obj: Any, path: str = "config") -> Any:
    if obj is None or isinstance(obj, (bool, str, bytes)):
        return obj
    if isinstance(obj, enum.Enum):
        return canonicalize(obj.value, path)
    if isinstance(obj, int):
        if not -(1 << 63) <= obj < (1 << 64):
            raise UnsupportedValueError("config integers must fit in 64 bits", key=path)
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    elif type(obj).__name__ == "Namespace" and hasattr(obj, "__dict__"):
        obj = vars(obj)
    elif isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, dict):
        out = {}
        for k in obj:
            if not isinstance(k, str):
                raise UnsupportedValueError(f"config keys must be strings, got {type(k).__name__}", key=f"{path}/{k}")
        for k in sorted(obj):
            out[k] = canonicalize(obj[k], f"{path}/{k}")
        return out
    if isinstance(obj, (list, tuple)):
        return [canonicalize(v, f"{path}/{i}") for i, v in enumerate(obj)]
    raise UnsupportedValueError(f"config value of type {type(obj).__name__} has no canonical form", key=path)


def canonical_config(cfg: Any) -> bytes:
    return msgpack.packb(canonicalize(cfg), use_bin_type=True)


def config_hash(cfg: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical_config(cfg)).hexdigest()
