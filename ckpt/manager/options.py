"""``ManagerOptions``: every option of a ``CheckpointManager``, in one frozen record,
validated once when it is made (docs/manager.md says what each one does)."""

from __future__ import annotations

import dataclasses
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from ..errors import UnsupportedValueError
from ..storage import Storage
from .retention import RetentionPolicy

__all__ = ["ManagerOptions"]


@dataclass(frozen=True, slots=True)
class ManagerOptions:
    """How a ``CheckpointManager`` runs: ``CheckpointManager(run_dir, state, **keywords)``
    builds one from its keywords, ``CheckpointManager(run_dir, state, options=opts)`` takes
    one (keywords given too replace its fields).

    ``data``: the loader whose position is saved (``state_dict``/``load_state_dict``);
    ``generators``: ``torch.Generator`` objects saved and restored with the RNG streams;
    ``config``: the run config (hashed and stored; a resume names what changed).
    Cadence: ``every_steps``, ``every_seconds``, and ``signals`` (a save, then
    ``should_stop``). ``retention`` (``None``: ``RetentionPolicy()``). ``async_save`` and
    ``pin_memory`` (staging). ``run_id`` (kept across resumes), ``replicated`` (entries
    rank 0 writes alone), ``exactness`` (the load's environment gate), ``code_dir`` (whose
    commit is recorded), ``clock`` (for ``every_seconds``), ``storage`` (the backend;
    default: resolved from ``run_dir``). The step ledger: ``ledger``,
    ``ledger_params_every``, ``verify_resume``. Format 2.0: ``compress`` (as for
    ``ckpt.save``), ``dedup`` and ``dedup_full_every``. ``writer=False``: a follower.
    """

    data: Any = None
    generators: Mapping[str, Any] | None = None
    config: Any = None
    every_steps: int | None = None
    every_seconds: float | None = None
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    async_save: bool = False
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1)
    run_id: str | None = None
    replicated: Sequence[str] = ()
    exactness: Literal["strict", "warn", "off"] = "warn"
    pin_memory: bool | None = None
    code_dir: str | None = None
    clock: Callable[[], float] = time.monotonic
    storage: Storage | None = None
    ledger: bool = True
    ledger_params_every: int = 10
    verify_resume: Literal["strict", "warn", "off"] = "warn"
    compress: Any = None
    dedup: bool = False
    dedup_full_every: int = 0
    writer: bool = True

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 or None, got {self.every_steps}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ValueError(f"every_seconds must be > 0 or None, got {self.every_seconds}")
        if self.exactness not in ("strict", "warn", "off"):
            raise ValueError(f"exactness must be 'strict', 'warn' or 'off', not {self.exactness!r}")
        if self.dedup_full_every < 0:
            raise ValueError(f"dedup_full_every must be >= 0 (0: never), got {self.dedup_full_every}")
        _check_data_source(self.data)
        if self.retention is None:  # the keyword's documented default
            object.__setattr__(self, "retention", RetentionPolicy())

    @classmethod
    def of(cls, options: ManagerOptions | None, keywords: Mapping[str, Any]) -> ManagerOptions:
        """``options`` with ``keywords`` in place of its fields (a new record, validated);
        an unknown keyword is a ``TypeError``, as for any function."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in keywords:
            if key not in names:
                raise TypeError(f"CheckpointManager.__init__() got an unexpected keyword argument {key!r}")
        if options is None:
            return cls(**keywords)
        return dataclasses.replace(options, **keywords) if keywords else options


def _check_data_source(data: Any) -> None:
    """Refuse, at construction, a ``data=`` that cannot be saved: the first save would
    otherwise fail many steps into the run (a plain DataLoader has no position)."""
    if data is None:
        return
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(data, m, None))]
    if missing:
        t = type(data)
        raise UnsupportedValueError(
            f"data= must have state_dict() and load_state_dict(); {t.__module__}.{t.__qualname__} has no "
            f"{' or '.join(m + '()' for m in missing)}. A plain torch DataLoader keeps no position: use "
            "ckpt.data.ResumableLoader or torchdata.stateful_dataloader.StatefulDataLoader",
            key="@data",
        )
