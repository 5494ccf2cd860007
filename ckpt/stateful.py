"""The ``Stateful`` protocol, as in torch.distributed.checkpoint."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Stateful"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers,
    ``GradScaler``, data loaders."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...
