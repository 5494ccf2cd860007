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

In the main process (``num_workers=0``) it saves and restores nothing: augmentation there
draws from the main process's global RNG, which the trainer integrations restore at the
point the trainer resumes (exact under Lightning; under Accelerate not mid-epoch, whose
prepared loader fetches one batch ahead: see ``ckpt.integrations.accelerate``).
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


def _rng_state() -> dict[str, Any]:
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.random.get_rng_state(),
        "python": {"version": int(version), "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
    }
    if _np is not None:
        kind, keys, pos, has_gauss, cached = _np.random.get_state()
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(_np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.random.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(w) for w in py["words"].tolist()), py["gauss"]))
    if _np is not None and "numpy" in state:
        n = state["numpy"]
        _np.random.set_state((n["kind"], n["keys"].numpy().astype(_np.uint32), int(n["pos"]), int(n["has_gauss"]),
                              float(n["cached"])))


class WorkerRNG(torch.utils.data.Dataset):
    """A map-style dataset whose ``StatefulDataLoader`` state is the RNG of the worker
    process reading it (see the module docstring). ``dataset``: the dataset to wrap."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not yet set (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        # Called by the worker after each batch it sends (StatefulDataLoader's snapshot).
        return {"worker_rng": _rng_state()} if _in_worker() else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Called by the restored worker before its first fetch.
        if _in_worker() and state.get("worker_rng") is not None:
            _set_rng_state(state["worker_rng"])
