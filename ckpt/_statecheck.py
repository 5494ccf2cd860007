"""What ``load`` needs of a decoded part, checked without torch (shared by verify and load).

``decode_tree`` and ``check_context`` make sure the bytes follow the format; this module
checks that the decoded document can be *loaded*: every TENSOR value names a tensor of
the part that holds it, every REPLICA reaches an entry of another part, and the RNG
state has the form ``restore_rng`` consumes. ``CheckpointReader.verify`` runs it on every
part, so a checkpoint that verifies does not fail later in ``load`` on its own content;
``load`` runs it before it touches any target, so a bad document changes nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

from .errors import FormatError
from .format.manifest import PartEntry
from .format.tree import ReplicaRef, TensorRef

__all__ = ["check_part", "replica_target", "PartSource"]

#: the longest REPLICA chain a reader follows (the writer never writes more than one hop)
MAX_REPLICA_HOPS = 4
#: Python's Mersenne Twister state: 624 words plus the position (``random.getstate``)
_PY_STATE_WORDS = 625
_NP_KEY_BYTES = 624 * 4


class PartSource(Protocol):
    """The slice of ``CheckpointReader`` these checks read (kept a seam: no import cycle)."""

    path: str

    def part(self, name: str | None = None) -> PartEntry: ...

    def tree(self, part: str | None = None, *, verify: bool = True) -> dict[str, Any]: ...


def replica_target(reader: PartSource, pe: PartEntry, name: str, saved: Any, *, verify: bool = True) -> tuple[PartEntry, Any]:
    """Follow REPLICA values of top-level entry ``name`` to the part that holds its data."""
    hops = 0
    while isinstance(saved, ReplicaRef):
        hops += 1
        if hops > MAX_REPLICA_HOPS:
            raise FormatError("replica references form a chain", path=reader.path, key=name)
        pe = reader.part(saved.part)
        state = reader.tree(pe.name, verify=verify)["state"]
        if name not in state:
            raise FormatError(f"replica part {pe.name!r} lacks entry {name!r}", path=reader.path, key=name)
        saved = state[name]
    return pe, saved


def _check_refs(obj: Any, keys: frozenset[str], where: str, path: str) -> None:
    stack: list[tuple[Any, str]] = [(obj, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, TensorRef):
            if v.key not in keys:
                raise FormatError(f"structure refers to tensor {v.key[:200]!r}, which its part does not hold", path=path, key=at)
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, f"{at}/<key>"))
                stack.append((x, f"{at}/{k}"))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{at}/{i}") for i, x in enumerate(v))


def _need(ok: bool, what: str, path: str, key: str) -> None:
    if not ok:
        raise FormatError(f"RNG state: {what}", path=path, key=key)


def check_rng(state: Any, path: str) -> None:
    """The form ``ckpt.context.rng.restore_rng`` consumes (spec §8, ``rng``)."""
    if state is None:
        return
    _need(type(state) is dict, "not a map", path, "context/rng")
    py = state.get("python")
    _need(type(py) is dict, "'python' is not a map", path, "context/rng/python")
    words = py.get("state")
    _need(type(py.get("version")) is int, "'python/version' is not an int", path, "context/rng/python/version")
    _need(
        type(words) is list and len(words) == _PY_STATE_WORDS and all(type(w) is int and 0 <= w < 1 << 32 for w in words[:-1])
        and type(words[-1]) is int and 0 <= words[-1] <= 624,
        f"'python/state' is not {_PY_STATE_WORDS} 32-bit words",
        path,
        "context/rng/python/state",
    )
    _need(py.get("gauss_next") is None or type(py["gauss_next"]) is float, "'python/gauss_next' is not a float or nil",
          path, "context/rng/python/gauss_next")
    np = state.get("numpy")
    if np is not None:
        _need(type(np) is dict, "'numpy' is not a map", path, "context/rng/numpy")
        _need(type(np.get("bit_generator")) is str, "'numpy/bit_generator' is not a str", path, "context/rng/numpy")
        _need(type(np.get("keys")) is bytes and len(np["keys"]) == _NP_KEY_BYTES, f"'numpy/keys' is not {_NP_KEY_BYTES} bytes",
              path, "context/rng/numpy/keys")
        for k, t in (("pos", int), ("has_gauss", int), ("cached_gaussian", float)):
            _need(type(np.get(k)) is t, f"'numpy/{k}' is not a {t.__name__}", path, f"context/rng/numpy/{k}")
    _need(type(state.get("torch_cpu")) is bytes, "'torch_cpu' is not bin", path, "context/rng/torch_cpu")
    cuda = state.get("cuda")
    _need(cuda is None or (type(cuda) is list and all(type(b) is bytes for b in cuda)), "'cuda' is not a list of bin",
          path, "context/rng/cuda")
    gens = state.get("generators", {})
    _need(type(gens) is dict, "'generators' is not a map", path, "context/rng/generators")
    for name, g in gens.items():
        _need(type(name) is str and type(g) is dict and type(g.get("device")) is str and type(g.get("state")) is bytes,
              f"generator {str(name)[:80]!r} is not {{device: str, state: bin}}", path, f"context/rng/generators/{name}")


def check_part(reader: PartSource, pe: PartEntry, *, verify: bool = True) -> None:
    """Raise :class:`FormatError` unless every reference in part ``pe`` resolves."""
    tree = reader.tree(pe.name, verify=verify)
    own = frozenset(t.key for t in pe.tensors)
    for name, saved in tree["state"].items():
        src, saved = replica_target(reader, pe, name, saved, verify=verify)
        keys = own if src is pe else frozenset(t.key for t in src.tensors)
        _check_refs(saved, keys, f"state/{name}", reader.path)
    ctx = tree["context"]
    for k in ("data", "extra"):
        _check_refs(ctx.get(k), own, f"context/{k}", reader.path)
    check_rng(ctx.get("rng"), reader.path)
