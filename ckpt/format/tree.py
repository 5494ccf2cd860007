"""msgpack encoding of state trees, with explicit extension types (no pickle).

Plain values map to msgpack natively: nil, bool, int (64-bit), float (always
float64, so every bit including NaN payloads survives), str, bin, array, map.
Everything else has an explicit extension code, listed here and in the spec:

====  =========  ==========================================================
code  name       payload
====  =========  ==========================================================
1     TENSOR     utf-8 key into the part's tensor table
2     TUPLE      a msgpack array (elements encoded recursively)
3     DTYPE      utf-8 dtype name from format/dtypes.py
4     BIGINT     ascii decimal of an int outside [-2^63, 2^64)
5     REPLICA    utf-8 name of the part that holds this subtree
6     DEVICE     utf-8 device string ("cpu", "cuda:0")
====  =========  ==========================================================

A value of any other type raises :class:`UnsupportedValueError` at save time naming
its key path. The module is pure: the caller supplies a hook that recognises tensors
and other library types, so this file never imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from ..errors import FormatError, LimitExceededError, UnsupportedValueError
from ..knobs import knobs
from . import dtypes
from .codec import ContainerBudget, DuplicateKeyError, unpackb

__all__ = [
    "EXT_TENSOR",
    "EXT_TUPLE",
    "EXT_DTYPE",
    "EXT_BIGINT",
    "EXT_REPLICA",
    "EXT_DEVICE",
    "TensorRef",
    "DtypeRef",
    "ReplicaRef",
    "DeviceRef",
    "to_wire",
    "decode_tree",
    "render_path",
    "check_device",
    "DEVICE_TYPES",
]

EXT_TENSOR = 1
EXT_TUPLE = 2
EXT_DTYPE = 3
EXT_BIGINT = 4
EXT_REPLICA = 5
EXT_DEVICE = 6

_I64_MIN = -(1 << 63)
_U64_MAX = (1 << 64) - 1

# BIGINT canonical form (spec §7.3): ASCII digits only (str.isdigit() also accepts
# "٣٣"), no leading zeros, no "+", no "-0"; the value itself must be out of msgpack's
# int range, since an in-range int has exactly one encoding: a msgpack int.
_BIGINT_RE = re.compile(r"-?[1-9][0-9]{0,4095}")

#: Device types a DEVICE value may name (spec §7.3 "Device strings"): the types
#: torch.device accepts. An index, when present, is a decimal without leading zeros
#: in 0..127: torch holds a device index in a signed 8 bits, so a larger one cannot be
#: given back as written (``cuda:128`` read as ``cuda:-128``).
DEVICE_TYPES = (
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia",
    "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
)
_DEVICE_RE = re.compile(r"(%s)(:(0|[1-9][0-9]?|1[01][0-9]|12[0-7]))?" % "|".join(DEVICE_TYPES))


def check_device(text: str, *, path: str | None = None) -> str:
    if _DEVICE_RE.fullmatch(text) is None:
        raise FormatError(f"invalid device string {text[:80]!r}", path=path, offset=0)
    return text


@dataclass(frozen=True, slots=True)
class TensorRef:
    key: str


@dataclass(frozen=True, slots=True)
class DtypeRef:
    name: str


@dataclass(frozen=True, slots=True)
class ReplicaRef:
    part: str


@dataclass(frozen=True, slots=True)
class DeviceRef:
    device: str


def render_path(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path) if path else "<root>"


# hook(value, path) -> msgpack.ExtType, or None when the value is not its kind
Hook = Callable[[Any, tuple[Any, ...]], "msgpack.ExtType | None"]


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def to_wire(obj: Any, hook: Hook, path: tuple[Any, ...] = (), depth: int = 0) -> Any:
    """Convert a state tree into msgpack-native values and ExtTypes."""
    if depth > knobs().max_nesting:
        raise UnsupportedValueError("state nests too deeply", key=render_path(path))
    t = type(obj)
    if obj is None or t is bool or t is str or t is bytes:
        return obj
    if t is int:
        return obj if _I64_MIN <= obj <= _U64_MAX else msgpack.ExtType(EXT_BIGINT, str(obj).encode("ascii"))
    if t is float:
        return obj
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if type(k) is float and k != k:
                raise UnsupportedValueError("a NaN map key cannot be looked up; readers refuse it", key=render_path(path))
            wk = to_wire(k, hook, path + (k,), depth + 1)
            if isinstance(wk, (dict, list)):
                raise UnsupportedValueError("unhashable map key", key=render_path(path + (k,)))
            out[wk] = to_wire(v, hook, path + (k,), depth + 1)
        return out
    if t is list:
        return [to_wire(v, hook, path + (i,), depth + 1) for i, v in enumerate(obj)]
    ext = hook(obj, path)
    if ext is not None:
        return ext
    if isinstance(obj, tuple):  # includes torch.Size and namedtuples (restored as tuple)
        items = [to_wire(v, hook, path + (i,), depth + 1) for i, v in enumerate(obj)]
        return msgpack.ExtType(EXT_TUPLE, _packb(items))
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):  # int subclasses, e.g. IntEnum
        return to_wire(int(obj), hook, path, depth)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, list):
        return [to_wire(v, hook, path + (i,), depth + 1) for i, v in enumerate(obj)]
    raise UnsupportedValueError(
        f"cannot store a value of type {t.__module__}.{t.__qualname__} without pickle", key=render_path(path)
    )


@dataclass(frozen=True, slots=True)
class _TuplePayload:
    """A tuple not decoded yet (hashable, so it may stand as a map key meanwhile)."""

    data: bytes


def decode_tree(data: bytes | memoryview, *, path: str | None = None, max_value: int | None = None) -> Any:
    """Decode a structure file body; extension values become *Ref placeholders.

    Tuple payloads are decoded after the enclosing document, never from inside
    msgpack's ext hook: each nested C unpacker call holds tens of KiB of C stack, so
    ~200 nested tuples would overflow it and crash the interpreter. Nesting of every
    container is bounded by ``max_nesting`` (plus the two wrapper maps of the file).
    ``max_value``: the longest str/bin/ext value (``codec.value_limit`` of the file).
    """
    limit = knobs().max_nesting + 2
    budget = ContainerBudget()  # one count for the document and every tuple inside it

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == EXT_TUPLE:
            return _TuplePayload(bytes(payload))
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"extension {code} payload is not utf-8", path=path, offset=0) from None
        if code == EXT_TENSOR:
            return TensorRef(text)
        if code == EXT_DTYPE:
            if text not in dtypes.DTYPES:
                raise FormatError(f"unknown dtype {text[:80]!r}", path=path, offset=0)
            return DtypeRef(text)
        if code == EXT_BIGINT:
            if len(text) > 4096 or _BIGINT_RE.fullmatch(text) is None:
                raise FormatError(f"malformed big integer {text[:40]!r}", path=path, offset=0)
            v = int(text)
            if _I64_MIN <= v <= _U64_MAX:
                raise FormatError(f"big integer {text[:40]} is in msgpack's int range (not canonical)", path=path, offset=0)
            return v
        if code == EXT_REPLICA:
            return ReplicaRef(text)
        if code == EXT_DEVICE:
            return DeviceRef(check_device(text, path=path))
        raise FormatError(f"unknown extension type {code}", path=path, offset=0)

    def expand(obj: Any, depth: int) -> Any:
        # One Python frame per level (no comprehensions) and a hard depth bound.
        if depth > limit:
            raise LimitExceededError("containers nest too deeply", path=path, offset=0)
        t = type(obj)
        if t is _TuplePayload:
            inner = unpackb(obj.data, path=path, what="tuple", ext_hook=ext_hook, budget=budget, max_value=max_value)
            if not isinstance(inner, list):
                raise FormatError("tuple payload is not an array", path=path, offset=0)
            return tuple(expand(inner, depth))
        if t is list:
            for i, v in enumerate(obj):
                tv = type(v)
                if tv is list or tv is dict or tv is _TuplePayload:
                    obj[i] = expand(v, depth + 1)
            return obj
        if t is dict:
            if any(type(k) is _TuplePayload for k in obj):
                rebuilt = {}
                for k, v in obj.items():
                    rebuilt[expand(k, depth + 1) if type(k) is _TuplePayload else k] = v
                if len(rebuilt) != len(obj):
                    # two tuple keys with different bytes but equal values, e.g. (1,) and (1.0,)
                    raise FormatError("map repeats a tuple key (keys equal as values are duplicates)", path=path, offset=0)
                obj = rebuilt
            for k, v in obj.items():
                tv = type(v)
                if tv is list or tv is dict or tv is _TuplePayload:
                    obj[k] = expand(v, depth + 1)
            return obj
        return obj

    tree = unpackb(data, path=path, what="state tree", ext_hook=ext_hook, budget=budget, max_value=max_value)
    try:
        out = expand(tree, 0)
    except (TypeError, DuplicateKeyError) as e:  # an unhashable value inside a tuple key
        raise FormatError(f"malformed state tree: {e}", path=path, offset=0) from None
    _check_replicas(out, path)
    return out


def _check_replicas(doc: Any, path: str | None) -> None:
    """REPLICA may only be the whole value of a top-level entry (spec §9): anywhere else
    (deeper in a tree, as a key, in the context) it would reach callers as an internal
    placeholder instead of state."""
    allowed = doc.get("state") if type(doc) is dict else None
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        v, where = stack.pop()
        t = type(v)
        if t is dict:
            for k, x in v.items():
                if type(k) is ReplicaRef or (type(k) is tuple and _holds_replica(k)):
                    raise FormatError(f"REPLICA used as a map key at {where or '/'}", path=path, offset=0)
                if type(x) is ReplicaRef:
                    if v is not allowed:
                        raise FormatError(f"REPLICA below a top-level entry at {where}/{k}", path=path, offset=0)
                else:
                    stack.append((x, f"{where}/{k}"))
        elif t is list or t is tuple:
            for i, x in enumerate(v):
                if type(x) is ReplicaRef:
                    raise FormatError(f"REPLICA below a top-level entry at {where}/{i}", path=path, offset=0)
                stack.append((x, f"{where}/{i}"))


def _holds_replica(t: tuple[Any, ...]) -> bool:
    stack = list(t)
    while stack:
        x = stack.pop()
        if type(x) is ReplicaRef:
            return True
        if type(x) is tuple:
            stack.extend(x)
    return False
