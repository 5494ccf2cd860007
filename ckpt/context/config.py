"""Canonical form and hash of a run's config (dict, dataclass, argparse Namespace, mapping).

Canonical form: msgpack with map keys sorted, tuples as arrays, floats as float64
(exact bits). The hash is sha256 of those bytes, so two configs that compare equal
field by field hash equal, whatever type or key order they were given in.

Map keys are stored losslessly (spec/checkpoint-format.md §8.2): a key is a str or a
64-bit int (HF configs carry ``id2label = {0: "LABEL_0"}``). Int keys come first in
ascending numeric order, then str keys by code point, so ``{0: a, "0": b}`` keeps both
and the order never depends on insertion. bool keys are refused: ``True == 1`` as a dict
key, so a config holding both would silently lose one.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from ..errors import UnsupportedValueError

__all__ = ["canonical_config", "config_hash", "canonicalize"]

_I64_MIN, _U64_END = -(1 << 63), 1 << 64


def _key_order(k: int | str) -> tuple[int, int | str]:
    # ints (numeric order) before strs (code point order); the two never compare.
    return (0, k) if isinstance(k, int) else (1, k)


def _canonical_key(k: Any, path: str) -> int | str:
    if isinstance(k, enum.Enum):
        k = k.value
    if isinstance(k, str):
        return str(k)
    if isinstance(k, int) and not isinstance(k, bool):
        if not _I64_MIN <= k < _U64_END:
            raise UnsupportedValueError("config int keys must fit in 64 bits", key=f"{path}/{k}")
        return int(k)
    raise UnsupportedValueError(
        f"config keys must be str or int, got {type(k).__name__} (bool, float, None and tuple keys have no canonical form)",
        key=f"{path}/{k!r}",
    )


def canonicalize(obj: Any, path: str = "config") -> Any:
    if obj is None or isinstance(obj, (bool, str, bytes)):
        return obj
    if isinstance(obj, enum.Enum):
        return canonicalize(obj.value, path)
    if isinstance(obj, int):
        if not _I64_MIN <= obj < _U64_END:
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
    # Any Mapping/Sequence, not only dict/list: OmegaConf's DictConfig/ListConfig and
    # Lightning's AttributeDict are configs people pass as they are.
    if isinstance(obj, Mapping):
        keys: dict[int | str, Any] = {}
        for k in obj:
            ck = _canonical_key(k, path)
            if ck in keys:
                raise UnsupportedValueError(f"config keys {keys[ck]!r} and {k!r} collide", key=f"{path}/{k}")
            keys[ck] = k
        return {ck: canonicalize(obj[keys[ck]], f"{path}/{ck}") for ck in sorted(keys, key=_key_order)}
    if isinstance(obj, Sequence):
        return [canonicalize(v, f"{path}/{i}") for i, v in enumerate(obj)]
    raise UnsupportedValueError(f"config value of type {type(obj).__name__} has no canonical form", key=path)


def canonical_config(cfg: Any) -> bytes:
    return msgpack.packb(canonicalize(cfg), use_bin_type=True)


def config_hash(cfg: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical_config(cfg)).hexdigest()
