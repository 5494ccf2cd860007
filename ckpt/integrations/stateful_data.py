"""``WorkerRNG``: random augmentation in ``StatefulDataLoader`` workers, resumed exactly.

Usage::

    from ckpt.integrations.stateful_data import WorkerRNG

    loader = StatefulDataLoader(WorkerRNG(dataset), batch_size=8, shuffle=True, num_workers=2)

Why: a ``torchdata`` ``StatefulDataLoader`` saves its sampler position and the workers'
base seed, but not the RNG streams inside its worker processes. A restored worker starts
again from ``torch.manual_seed(base_seed + worker_id)`` (and Python's ``random``, numpy's
global RNG likewise), so every random augmentation drawn in a worker after a mid-epoch
resume differs from the saved run's (measured: the first resumed batch already differs,
with the data order exact). ``StatefulDataLoader`` does save the state of a dataset that
has ``state_dict``/``load_state_dict``, in each worker, with the batch it yields, and
restores it in the worker before its next fetch. ``WorkerRNG`` is that dataset: its state,
inside a worker process, is the worker's RNG streams (torch CPU, Python, numpy when
installed) after the worker's last yielded batch, so the resumed worker continues them.

In the main process (``num_workers=0``) the wrapped dataset draws from RNG streams of its
own, swapped in around each fetch and seeded at first use from ``seed`` (default: the
process's ``torch.initial_seed()``); its state is those streams. Why: a trainer that
fetches one batch ahead (Accelerate's prepared loader; Lightning's prefetcher) interleaves
the next batch's augmentation with the current step's dropout in one global stream, and
snapshots the loader before that fetch, so no single RNG state taken at the save can
replay both; with the augmentation in its own stream, the loader's snapshot holds exactly
the augmentation state before the next batch, and the global stream holds only the
model's draws. (Augmentation in the main process *without* the wrapper draws from the
global stream: exact under Lightning, not mid-epoch under Accelerate.)
Every attribute of the wrapped dataset is reachable through the wrapper.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["WorkerRNG"]

try:  # numpy is optional; when present its global RNG is part of the state
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with torch wheels
    _np = None  # type: ignore[assignment]


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


# The raw streams (torch CPU generator, Python, numpy), swapped around every main-process
# fetch: kept in each library's own form so a swap costs three get/set calls, converted to
# tensors only when the loader asks for the state.
_Raw = tuple[torch.Tensor, Any, Any]


def _raw_state() -> _Raw:
    return torch.random.get_rng_state(), random.getstate(), (_np.random.get_state() if _np is not None else None)


def _set_raw_state(raw: _Raw) -> None:
    torch.random.set_rng_state(raw[0])
    random.setstate(raw[1])
    if _np is not None and raw[2] is not None:
        _np.random.set_state(raw[2])


def _seeded_raw(seed: int) -> _Raw:
    """The three streams as a fresh process seeded with ``seed`` has them, without
    touching the caller's."""
    outer = _raw_state()
    try:
        torch.manual_seed(seed)
        random.seed(seed)
        if _np is not None:
            _np.random.seed(seed % 2**32)
        return _raw_state()
    finally:
        _set_raw_state(outer)


def _rng_state() -> dict[str, Any]:
    return _as_tree(_raw_state())


def _as_tree(raw: _Raw) -> dict[str, Any]:
    version, words, gauss = raw[1]
    state: dict[str, Any] = {
        "torch": raw[0].clone(),
        "python": {"version": int(version), "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
    }
    if raw[2] is not None:
        kind, keys, pos, has_gauss, cached = raw[2]
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(_np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    _set_raw_state(_from_tree(state))


def _from_tree(state: dict[str, Any]) -> _Raw:
    py = state["python"]
    pystate = (int(py["version"]), tuple(int(w) for w in py["words"].tolist()), py["gauss"])
    npstate = None
    if _np is not None and "numpy" in state:
        n = state["numpy"]
        npstate = (n["kind"], n["keys"].numpy().astype(_np.uint32), int(n["pos"]), int(n["has_gauss"]),
                   float(n["cached"]))
    return state["torch"].clone(), pystate, npstate


class WorkerRNG(torch.utils.data.Dataset):
    """A map-style dataset whose ``StatefulDataLoader`` state is the RNG its augmentation
    draws from: the worker process's streams, or in the main process streams of its own
    (see the module docstring). ``dataset``: the dataset to wrap; ``seed``: the seed of the
    main-process streams (default ``torch.initial_seed()`` at the first fetch)."""

    def __init__(self, dataset: Any, seed: int | None = None) -> None:
        self.dataset = dataset
        self.seed = seed
        self._own: _Raw | None = None  # the main-process streams; None until the first fetch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        if _in_worker():
            return self.dataset[index]
        return self._in_own_streams(lambda: self.dataset[index])

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        # Declared here so the fetcher's ``hasattr(dataset, "__getitems__")`` never reaches
        # the wrapped dataset's through ``__getattr__`` and skips the swap; one swap a batch.
        inner = getattr(self.dataset, "__getitems__", None)

        def fetch() -> list[Any]:
            return list(inner(indices)) if inner is not None else [self.dataset[i] for i in indices]

        return fetch() if _in_worker() else self._in_own_streams(fetch)

    def _in_own_streams(self, fetch: Any) -> Any:
        outer = _raw_state()
        if self._own is None:
            self._own = _seeded_raw(torch.initial_seed() if self.seed is None else self.seed)
        _set_raw_state(self._own)
        try:
            return fetch()
        finally:
            self._own = _raw_state()
            _set_raw_state(outer)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed", "_own"):  # not yet set (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        # In a worker: called after each batch it sends (StatefulDataLoader's snapshot). In
        # the main process: called when the loader's state is taken, which a trainer that
        # fetches ahead does before the next fetch.
        if _in_worker():
            return {"worker_rng": _rng_state()}
        return {} if self._own is None else {"main_rng": _as_tree(self._own)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # In a worker: called by the restored worker before its first fetch.
        if _in_worker():
            if state.get("worker_rng") is not None:
                _set_rng_state(state["worker_rng"])
        elif state.get("main_rng") is not None:
            self._own = _from_tree(state["main_rng"])
