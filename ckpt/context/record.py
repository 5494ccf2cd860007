"""``SaveContext``: what a save records beside the state, declared once.

A part stores its state and a context (spec/checkpoint-format.md §8): the step, the
config, the loader's position, the RNG streams, the caller's extra values, the lineage,
and the commit of ``code_dir``. The public save calls (``ckpt.save``, ``ckpt.write_part``,
``DistributedCheckpointer.save``, ``ckpt.dcp.StorageWriter``, the sharded save and
``CheckpointManager``) take these as keywords and build this record once; every layer
below them (the part writer, the collective save, the DCP writer, the manager's save
thread) takes the record and passes it on unchanged, so that a field is added or
documented in one place. How the save is written is the other record,
:class:`ckpt.save_options.SaveOptions`; ``meta`` (the MANIFEST's, not a part's) is
neither.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["SaveContext", "lineage_of"]


# eq=False: the fields hold the caller's live objects (a loader, generators), which are
# compared and hashed by identity, not by value.
@dataclass(frozen=True, slots=True, eq=False)
class SaveContext:
    """The context of one save (every rank builds its own: ``data``, ``generators``,
    ``rng`` and ``extra`` are this process's).

    ``step``: the training step (also the MANIFEST's). ``config``: the run's configuration,
    stored canonically with its hash. ``data``: a loader with ``state_dict()``, whose
    position is saved. ``generators``: named ``torch.Generator`` streams saved with the
    global ones. ``rng``: ``True`` captures every stream when the part is written,
    ``False`` saves none, a mapping is a state captured earlier (``capture_rng``: an
    asynchronous save snapshots the streams at the step and writes them later).
    ``extra``: any tree of the caller's. ``lineage``: the run it belongs to
    (``run_id``, ``resumed_from``). ``code_dir``: whose git commit is recorded (default
    the working directory's).
    """

    step: int | None = None
    config: Any = None
    data: Any = None
    generators: Mapping[str, Any] | None = None
    rng: bool | Mapping[str, Any] = True
    extra: Any = None
    lineage: Mapping[str, Any] | None = None
    code_dir: str | None = None

    def with_rng_now(self) -> SaveContext:
        """This record with the RNG streams captured now if ``rng`` asks for them
        (``True``); otherwise itself. A save written later, on another thread, then stores
        the streams as they were when it was requested."""
        if self.rng is not True:
            return self
        from .rng import capture_rng

        return dataclasses.replace(self, rng=capture_rng(self.generators))


def lineage_of(run_id: str | None, resumed_from: str | None) -> dict[str, Any]:
    """The lineage of ``ckpt.save``'s ``run_id=``/``resumed_from=`` keywords."""
    return {"run_id": run_id, "resumed_from": resumed_from}
