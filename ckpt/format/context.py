"""Reader rules for a state document's ``context`` map (spec/checkpoint-format.md §8).

Pure: takes the decoded document, raises :class:`FormatError` naming the key path of
the first value that breaks a rule. Every key of §8 is required with its type; keys a
later minor version adds are ignored. Sub-maps (``topology``, ``commit``, ``env``,
``lineage``, ``config``) are checked key by key where §8 names the key: a named key
that is present has its type; unnamed keys are ignored (forward compatibility).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from ..errors import FormatError

__all__ = ["check_context", "check_entry_names"]

Check = Callable[[Any], bool]


def _str(v: Any) -> bool:
    return type(v) is str


def _int(v: Any) -> bool:
    return type(v) is int


def _bool(v: Any) -> bool:
    return type(v) is bool


def _map(v: Any) -> bool:
    return type(v) is dict


def _bin(v: Any) -> bool:
    return type(v) is bytes


def _or_nil(f: Check) -> Check:
    return lambda v: v is None or f(v)


def _any(v: Any) -> bool:
    return True


def _str_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is str for x in v)


_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")

# key -> (required, check). Spec §8 table.
_TOP: dict[str, tuple[bool, Check]] = {
    "step": (True, _or_nil(_int)),
    "rng": (True, _or_nil(_map)),
    "data": (True, _any),  # a state tree (§7.3), already decoded by its own rules
    "data_type": (True, _or_nil(_str)),
    "config": (True, _or_nil(_map)),
    "topology": (True, _map),
    "commit": (True, _map),
    "env": (True, _map),
    "lineage": (True, _map),
    "extra": (True, _any),
    "entry_types": (True, lambda v: _map(v) and all(_str(k) and _str(x) for k, x in v.items())),
}
# Sub-maps: named keys MUST have these types when present. §8.3-8.6 list what writers
# write; a reader needs only the types to take its decisions safely.
_SUB: dict[str, dict[str, Check]] = {
    "config": {"canonical": _bin, "hash": lambda v: _str(v) and re.fullmatch(r"sha256:[0-9a-f]{64}", v) is not None},
    "topology": {
        "distributed": _bool,
        "world_size": _int,
        "rank": _int,
        "local_rank": _or_nil(_int),
        "local_world_size": _or_nil(_int),
        "backend": _or_nil(_str),
        "hostname": _str,
        "device_kind": _str,
        "device_count": _int,
        "device_names": _str_list,
    },
    "commit": {
        "available": _bool,
        "sha": _or_nil(lambda v: _str(v) and _HEX40.fullmatch(v) is not None),
        "dirty": _or_nil(_bool),
        "diff_sha256": _or_nil(lambda v: _str(v) and _HEX64.fullmatch(v) is not None),
        "repo": _or_nil(_str),
        "reason": _or_nil(_str),
    },
    "env": {
        **{k: _str for k in ("python", "implementation", "platform", "machine", "torch", "ckpt_replay",
                             "float32_matmul_precision")},
        **{k: _or_nil(_str) for k in ("cuda", "nccl", "numpy")},
        "cudnn": _or_nil(_int),
        **{k: _bool for k in ("deterministic_algorithms", "deterministic_warn_only", "cudnn_deterministic",
                              "cudnn_benchmark", "allow_tf32_matmul", "allow_tf32_cudnn")},
        "num_threads": _int,
        "num_interop_threads": _int,
        "env": lambda v: _map(v) and all(_str(k) and (x is None or _str(x)) for k, x in v.items()),
    },
    # resumed_from: what the manager writes is a map {id, name, step}; a str is allowed
    "lineage": {"run_id": _or_nil(_str), "resumed_from": _or_nil(lambda v: _str(v) or _map(v))},
}
# Keys whose sub-map must hold them (the rest of a sub-map's named keys may be absent:
# absent reads as nil/unknown). config needs both halves to mean anything.
_SUB_REQUIRED: dict[str, tuple[str, ...]] = {"config": ("canonical", "hash")}


def check_context(ctx: Any, *, path: str | None = None) -> None:
    if type(ctx) is not dict:
        raise FormatError("context is not a map", path=path, offset=0, key="context")
    for key, (required, ok) in _TOP.items():
        if key not in ctx:
            if required:
                raise FormatError(f"context lacks the key {key!r} (§8)", path=path, offset=0, key=f"context/{key}")
            continue
        v = ctx[key]
        if not ok(v):
            raise FormatError(f"context/{key} has the wrong type {type(v).__name__} (§8)", path=path, offset=0,
                              key=f"context/{key}")
        sub = _SUB.get(key)
        if sub is None or v is None:
            continue
        for need in _SUB_REQUIRED.get(key, ()):
            if need not in v:
                raise FormatError(f"context/{key} lacks {need!r} (§8)", path=path, offset=0, key=f"context/{key}/{need}")
        for name, check in sub.items():
            if name in v and not check(v[name]):
                raise FormatError(f"context/{key}/{name} has a wrong type or form (§8)", path=path, offset=0,
                                  key=f"context/{key}/{name}")


def check_entry_names(state: dict[Any, Any], *, path: str | None = None) -> None:
    """§7.2: top-level entry names are non-empty str not starting with '@'."""
    for name in state:
        if type(name) is not str or not name or name.startswith("@"):
            raise FormatError(f"invalid top-level entry name {name!r} (§7.2)", path=path, offset=0, key=str(name)[:80])
