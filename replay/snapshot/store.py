"""Where snapshot parts go: a small store seam over the multi-part checkpoint API.

``CkptSnapshotStore`` maps a snapshot onto one ``ckpt`` checkpoint (a part per process,
MANIFEST written last, atomic rename); ``MemorySnapshotStore`` is its in-memory twin for
tests. The agent hands a store only plain trees that were already copied at the cut
(dicts/lists of tensors and msgpack-able values), never live objects.

And the control plane: the side channel on which participants report their parts (or
their failure) to the coordinator, and the coordinator publishes the outcome. Over
torch.distributed it is the c10d store the process group was built on (no sockets of
our own); in one process it is a locked dict.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any, Mapping, Protocol, Sequence

import torch

from ckpt import PendingCheckpoint
from replay.errors import SnapshotError

__all__ = [
    "Pending",
    "SnapshotStore",
    "MemorySnapshotStore",
    "CkptSnapshotStore",
    "ControlPlane",
    "MemoryControl",
    "TorchStoreControl",
    "load_tree_into",
]


Pending = PendingCheckpoint
"""A snapshot being written is a checkpoint being written: ckpt's record of it (two strings,
``final`` and ``tmp_dir``, so that markers can carry it to every process)."""


class SnapshotStore(Protocol):
    """Where snapshot parts are written and read back (``CkptSnapshotStore``, ``MemorySnapshotStore``)."""

    def begin(self, name: str) -> Pending: ...

    def write_part(self, pending: Pending, part: str, state: Mapping[str, Any], *, step: int,
                   extra: Mapping[str, Any], rng: Mapping[str, Any] | None, data: Any = None,
                   config: Any = None) -> dict[str, Any]:
        """Write one part durably; return its msgpack-able record for the coordinator.

        ``data``: an object with ``state_dict()``, the part's data-loader state (read
        back as the entry ``"@data"``); ``config``: the run's config (stored canonically
        with its hash by the ckpt store)."""

    def commit(self, pending: Pending, records: Sequence[Mapping[str, Any]], *, step: int,
               meta: Mapping[str, Any]) -> None: ...

    def abort(self, pending: Pending) -> None: ...

    def read_meta(self, name: str) -> dict[str, Any]: ...

    def part_names(self, name: str) -> list[str]: ...

    def read_extra(self, name: str, part: str) -> dict[str, Any]: ...

    def read_entry(self, name: str, part: str, key: str) -> Any:
        """One top-level entry of a part as a plain tree of fresh tensors (``"@data"``:
        the data-loader state)."""

    def load_into(self, name: str, part: str, state: Mapping[str, Any], *, restore_rng: bool) -> None:
        """Load the part's entries named in ``state`` in place."""

    def pending_leftovers(self) -> list[str]:
        """Temporary areas that still exist (for tests of clean aborts)."""


def _copy_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_copy_tree(v) for v in x)
    return copy.deepcopy(x)


def load_tree_into(obj: Any, saved: Any, *, key: str) -> Any:
    """Load ``saved`` into ``obj`` in place where possible; returns the object to keep."""
    if callable(getattr(obj, "load_state_dict", None)):
        obj.load_state_dict(saved)
        return obj
    if isinstance(obj, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != obj.shape or saved.dtype != obj.dtype:
            raise SnapshotError("saved entry does not match the registered tensor", key=key)
        with torch.no_grad():
            obj.copy_(saved)
        return obj
    if isinstance(obj, dict):
        if not isinstance(saved, dict) or set(saved) != set(obj):
            raise SnapshotError("saved entry does not match the registered dict's keys", key=key)
        for k in list(obj):
            obj[k] = load_tree_into(obj[k], saved[k], key=f"{key}/{k}")
        return obj
    if isinstance(obj, list):
        if not isinstance(saved, list) or len(saved) != len(obj):
            raise SnapshotError("saved entry does not match the registered list", key=key)
        for i in range(len(obj)):
            obj[i] = load_tree_into(obj[i], saved[i], key=f"{key}/{i}")
        return obj
    return saved


class MemorySnapshotStore:
    """Keeps committed snapshots in memory (deep copies), with begin/commit/abort semantics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {}
        self._committed: dict[str, dict[str, Any]] = {}
        self._n = 0

    def begin(self, name: str) -> Pending:
        with self._lock:
            if name in self._committed:
                raise SnapshotError("a snapshot with this name is already committed", snapshot=name)
            self._n += 1
            tmp = f"mem-tmp-{self._n}-{name}"
            self._pending[tmp] = {}
            return Pending(name, tmp)

    def write_part(self, pending: Pending, part: str, state: Mapping[str, Any], *, step: int,
                   extra: Mapping[str, Any], rng: Mapping[str, Any] | None, data: Any = None,
                   config: Any = None) -> dict[str, Any]:
        plain = {k: v.state_dict() if callable(getattr(v, "state_dict", None)) else v for k, v in state.items()}
        if data is not None:
            plain["@data"] = data.state_dict()
        data = (_copy_tree(plain), _copy_tree(dict(extra)))
        with self._lock:
            if pending.tmp_dir not in self._pending:
                raise SnapshotError("the snapshot's temporary area is gone (aborted)", snapshot=pending.final)
            self._pending[pending.tmp_dir][part] = data
        return {"name": part, "step": step}

    def commit(self, pending: Pending, records: Sequence[Mapping[str, Any]], *, step: int,
               meta: Mapping[str, Any]) -> None:
        with self._lock:
            parts = self._pending.pop(pending.tmp_dir)
            names = [r["name"] for r in records]
            missing = [n for n in names if n not in parts]
            if missing:
                raise SnapshotError(f"records name parts that were never written: {missing}", snapshot=pending.final)
            self._committed[pending.final] = {"meta": copy.deepcopy(dict(meta)), "step": step,
                                              "parts": {n: parts[n] for n in names}}

    def abort(self, pending: Pending) -> None:
        with self._lock:
            self._pending.pop(pending.tmp_dir, None)

    def _snap(self, name: str) -> dict[str, Any]:
        try:
            return self._committed[name]
        except KeyError:
            raise SnapshotError("no committed snapshot with this name", snapshot=name) from None

    def exists(self, name: str) -> bool:
        return name in self._committed

    def read_meta(self, name: str) -> dict[str, Any]:
        return copy.deepcopy(self._snap(name)["meta"])

    def part_names(self, name: str) -> list[str]:
        return sorted(self._snap(name)["parts"])

    def _part(self, name: str, part: str) -> tuple[dict[str, Any], dict[str, Any]]:
        try:
            return self._snap(name)["parts"][part]
        except KeyError:
            raise SnapshotError("the snapshot has no part for this process", snapshot=name, part=part) from None

    def read_extra(self, name: str, part: str) -> dict[str, Any]:
        return _copy_tree(self._part(name, part)[1])

    def read_entry(self, name: str, part: str, key: str) -> Any:
        saved = self._part(name, part)[0]
        if key not in saved:
            what = "the part holds no data-loader state" if key == "@data" else "the part has no such entry"
            raise SnapshotError(what, snapshot=name, part=part, key=key)
        return _copy_tree(saved[key])

    def load_into(self, name: str, part: str, state: Mapping[str, Any], *, restore_rng: bool) -> None:
        saved = self._part(name, part)[0]
        for key, obj in state.items():
            if key not in saved:
                raise SnapshotError("registered entry is not in the snapshot part", snapshot=name, part=part, key=key)
            load_tree_into(obj, _copy_tree(saved[key]), key=key)

    def pending_leftovers(self) -> list[str]:
        with self._lock:
            return sorted(self._pending)


class CkptSnapshotStore:
    """A snapshot is one ``ckpt`` checkpoint directory ``root/name`` (kind "snapshot")."""

    def __init__(self, root: str | os.PathLike[str], *, exactness: str = "warn") -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.exactness = exactness

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def begin(self, name: str) -> Pending:
        import ckpt

        return ckpt.begin(self.path(name))

    def write_part(self, pending: Pending, part: str, state: Mapping[str, Any], *, step: int,
                   extra: Mapping[str, Any], rng: Mapping[str, Any] | None, data: Any = None,
                   config: Any = None) -> dict[str, Any]:
        import ckpt

        rec = ckpt.write_part(pending, part, state, step=step, extra=dict(extra),
                              rng=rng if rng is not None else False, data=data, config=config)
        return rec.to_dict()

    def commit(self, pending: Pending, records: Sequence[Mapping[str, Any]], *, step: int,
               meta: Mapping[str, Any]) -> None:
        import ckpt

        ckpt.commit(pending, [dict(r) for r in records], kind="snapshot", step=step,
                    meta=dict(meta))

    def abort(self, pending: Pending) -> None:
        import ckpt

        ckpt.abort(pending)

    def _reader(self, name: str) -> Any:
        import ckpt

        return ckpt.open(self.path(name))

    def read_meta(self, name: str) -> dict[str, Any]:
        return dict(self._reader(name).meta)

    def part_names(self, name: str) -> list[str]:
        return sorted(p.name for p in self._reader(name).parts)

    def read_extra(self, name: str, part: str) -> dict[str, Any]:
        r = self._reader(name)
        self._check_part(r, name, part)
        return dict(r.context(part)["extra"])

    @staticmethod
    def _check_part(r: Any, name: str, part: str) -> None:
        if part not in {p.name for p in r.parts}:
            raise SnapshotError("the snapshot has no part for this process", snapshot=name, part=part)

    def read_entry(self, name: str, part: str, key: str) -> Any:
        from ckpt.format.tree import TensorRef

        r = self._reader(name)
        self._check_part(r, name, part)
        tree = r.tree(part)
        if key == "@data":
            saved = tree["context"].get("data")
            if saved is None:
                raise SnapshotError("the part holds no data-loader state", snapshot=name, part=part, key=key)
        elif key in tree["state"]:
            saved = tree["state"][key]
        else:
            raise SnapshotError("the part has no such entry", snapshot=name, part=part, key=key)

        # Resolve only this entry's tensors: the user state next to it may be large.
        def resolve(x: Any) -> Any:
            if isinstance(x, TensorRef):
                return r.tensor(x.key, part=part)
            if isinstance(x, dict):
                return {k: resolve(v) for k, v in x.items()}
            if isinstance(x, list):
                return [resolve(v) for v in x]
            if isinstance(x, tuple):
                return tuple(resolve(v) for v in x)
            return x

        return resolve(saved)

    def load_into(self, name: str, part: str, state: Mapping[str, Any], *, restore_rng: bool) -> None:
        import ckpt

        ckpt.load(self.path(name), dict(state), part=part, restore_rng=restore_rng, exactness=self.exactness,
                  ledger=False)

    def pending_leftovers(self) -> list[str]:
        from ckpt import TMP_PREFIX

        if not os.path.isdir(self.root):
            return []
        return sorted(n for n in os.listdir(self.root) if n.startswith(TMP_PREFIX))


# -- control plane ---------------------------------------------------------------------


class ControlPlane(Protocol):
    """A small key-value side channel shared by all participants (write-once keys)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None:
        """The value, or None if the key is not set yet (never blocks)."""


class MemoryControl:
    """An in-process control plane (a key-value store), for snapshots of threads."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._d[key] = bytes(value)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._d.get(key)


class TorchStoreControl:
    """Over a ``torch.distributed.Store`` (TCPStore, FileStore, the one torchrun made)."""

    def __init__(self, store: Any, prefix: str = "replay/") -> None:
        self._store = store
        self._prefix = prefix
        self._lock = threading.Lock()  # c10d stores are not documented as thread-safe

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._store.set(self._prefix + key, bytes(value))

    def get(self, key: str) -> bytes | None:
        k = self._prefix + key
        with self._lock:
            if not self._store.check([k]):
                return None
            return bytes(self._store.get(k))
