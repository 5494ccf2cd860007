"""torchtitan's checkpoint component writing the ckpt format, through ``ckpt.dcp``.

Usage (a torchtitan ``Trainer.Config``, or any code that builds torchtitan's manager)::

    from ckpt.integrations.torchtitan import CkptCheckpointManager

    config.checkpoint = CkptCheckpointManager.Config(enable=True, interval=100, last_save_model_only=False)

``CkptCheckpointManager`` is torchtitan's ``CheckpointManager`` (0.3.0) with its storage
swapped: every ``dcp.save``/``dcp.async_save``/``dcp.load`` it makes goes through
``ckpt.dcp.StorageWriter``/``StorageReader`` and the pickle-free planners, so each
``<folder>/step-N`` is one committed ckpt checkpoint (spec/sharded-format.md: one part per
rank, chunk digests, atomic commit, each rank's RNG streams in its part) that
``ckpt verify``/``inspect``/``diff`` read. torchtitan's policies stay as they are: the
save interval, ``keep_latest_k``, ``load_step``, ``exclude_from_loading``, the model-only
last save, async (``async_mode="async"``). On top of them:

* resume picks the newest *committed* checkpoint (a ``step-N`` holding our MANIFEST; a
  torchtitan DCP folder, ``.metadata``, still loads through torchtitan's own reader), and a
  checkpoint that fails verification raises instead of being skipped;
* retention never counts or deletes a save still in flight (its temporary directory), and
  the temporary directory of a save the job died in is removed when the job starts again;
* each rank's RNG streams are restored with the state (torchtitan's own checkpoint holds none);
* rank 0 keeps the step ledger in ``<folder>/ledger``: one record per training step
  (RNG digests; a parameter digest every ``ledger_params_every`` steps), and after a
  resume the re-executed steps are compared with the earlier run's records
  (``ResumeVerified`` or ``ResumeVerificationWarning``, as ``ckpt.ledger``).

Not supported: ``async_mode="async_with_pinned_mem"`` (DCP pickles the storage writer into a
staging process; refused with ``SaveOptionError`` when the manager is built). The HF
export (``last_save_in_hf``) and HF loads stay torchtitan's (safetensors through its own
writer). torchtitan 0.3.0 cannot train its models on a CPU-only torch (README, torchtitan);
the manager itself runs anywhere torch.distributed does (gloo included).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer import MODEL, CheckpointManager
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from .._load import load_into
from ..dcp.integration import dcp_load, raise_failed_save, restore_rank_rng
from ..dcp.planner import SavePlanner
from ..dcp.storage import StorageWriter
from ..errors import SaveOptionError
from ..format.manifest import MANIFEST_NAME
from ..reader import CheckpointReader
from ..writer import part_name_for_rank, recover

__all__ = ["CkptCheckpointManager", "committed_steps"]

_STEP_DIR = re.compile(r"step-(\d+)")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_ckpt(path: str) -> bool:
    return filesystem.isfile(filesystem.join(path, MANIFEST_NAME))


def committed_steps(folder: str) -> dict[int, str]:
    """``{step: path}`` of the committed ckpt checkpoints ``step-N`` in ``folder`` (a save in
    flight, ``.tmp-step-N-...``, is not one)."""
    if not filesystem.isdir(folder):
        return {}
    out: dict[int, str] = {}
    for name in filesystem.listdir(folder):
        m = _STEP_DIR.fullmatch(name)
        if m is not None and _is_ckpt(filesystem.join(folder, name)):
            out[int(m.group(1))] = filesystem.join(folder, name)
    return out


class CkptCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` writing and reading ckpt checkpoints (module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        verify: bool = True
        """Check every chunk's digest on load (a mismatch raises ``IntegrityError``)."""

        ledger: bool = True
        """Keep the step ledger in ``<folder>/ledger`` (rank 0) and verify resumes against it."""

        ledger_params_every: int = 10
        """A digest of the parameters every N steps in the ledger (0: none)."""

        verify_resume: Literal["warn", "strict", "off"] = "warn"
        """What an inexact resume does: warn, raise ``ResumeDivergedError``, or nothing."""

        exactness: Literal["warn", "strict", "off"] = "warn"
        """A load in another environment or world size (``ckpt.load``'s gate): warn
        (``ExactnessWarning`` naming the differences), refuse before any tensor is touched
        (``EnvironmentMismatchError``), or say nothing."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        if config.enable and config.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
            raise SaveOptionError("async_mode='async_with_pinned_mem' is not supported by the ckpt backend: DCP "
                                  "pickles the storage writer into a staging process; use 'async' or 'disabled'",
                                  key="checkpoint.async_mode")
        self._ckpt_verify = config.verify
        self._ckpt_exactness = config.exactness
        self._saving_step: int | None = None
        self._loaded: tuple[int, str] | None = None  # (step, checkpoint) of the last ckpt load
        #: the step ledger (``ckpt.ledger.Ledger``) on rank 0, once the manager is enabled
        self.ledger: Any = None
        super().__init__(config, **kwargs)
        if self.enable and config.ledger and _rank() == 0:
            from ..ledger import Ledger

            self.ledger = Ledger(filesystem.join(self.folder, "ledger"), params=self._local_params,
                                 params_every=config.ledger_params_every, verify=config.verify_resume)

    def _local_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's own shard of every parameter and buffer (the ledger digests plain tensors)."""
        from torch.distributed.tensor import DTensor

        for i, m in enumerate(self.states[MODEL].model):
            for k, t in m.state_dict().items():
                if isinstance(t, torch.Tensor):
                    yield f"model_{i}/{k}", t.to_local() if isinstance(t, DTensor) else t

    # -- saving -------------------------------------------------------------------------
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # torchtitan calls save after every optimizer step: the ledger's per-step record.
        if self.ledger is not None:
            self.ledger.step(curr_step, kill=False)
        self._saving_step = curr_step
        try:
            saved = super()._save(curr_step, last_step)
        finally:
            self._saving_step = None
        if self.ledger is not None:
            self.ledger.step_done(curr_step)  # after the step and its save: where a harness kills
        return saved

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:  # the HF export is torchtitan's safetensors, by design
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = StorageWriter(checkpoint_id, step=self._saving_step)
        ret: Any = None
        try:
            if async_mode == AsyncMode.ASYNC:
                ret = _committing(dcp.async_save(state_dict, storage_writer=writer, planner=SavePlanner(),
                                                 process_group=self.pg), writer)
            else:
                dcp.save(state_dict, storage_writer=writer, planner=SavePlanner())
        except BaseException as e:
            raise_failed_save(writer, e)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    # -- loading ------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        mine = committed_steps(folder or self.folder)
        theirs = CheckpointManager._find_load_step(self, folder)  # torchtitan's own DCP/HF folders
        return max([*mine, theirs])

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or not _is_ckpt(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader = CheckpointReader(checkpoint_id)
        own = part_name_for_rank(_rank())
        part = own if own in {p.name for p in reader.manifest.parts} else part_name_for_rank(0)
        # ckpt.load's gate first (environment, world size): under strict nothing is touched
        context = load_into(reader, {}, part=part, restore_rng_state=False, verify=self._ckpt_verify,
                            exactness=self._ckpt_exactness).context
        dcp_load(reader, state_dict, verify=self._ckpt_verify)
        # torchtitan flattens the model's entries into the top level: hand them back
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
        restore_rank_rng(reader, context.get("rng"))
        step = reader.manifest.step
        self._loaded = (step if isinstance(step, int) else -1, os.path.basename(reader.path))

    def _load(self, step: int = -1) -> bool:
        self._loaded = None
        if not self.load_only and filesystem.isdir(self.folder):
            # A save in flight when the job died left its temporary directory; the job owns
            # the folder (torchtitan's premise), so rank 0 clears it before anyone reads.
            if _rank() == 0:
                recover(self.folder, names=lambda n: _STEP_DIR.fullmatch(n) is not None)
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
        loaded = super()._load(step)
        if loaded and self.ledger is not None and self._loaded is not None and self._loaded[0] >= 0:
            self.ledger.resumed(self._loaded[0], source=self._loaded[1])
        return loaded

    # -- retention and shutdown ---------------------------------------------------------
    def _purge_stale_checkpoints(self) -> None:
        if not self._should_purge():
            return
        # committed ckpt checkpoints and torchtitan's own folders; never a save in flight
        found = committed_steps(self.folder)
        for name in filesystem.listdir(self.folder):
            m = _STEP_DIR.fullmatch(name)
            if m is not None and int(m.group(1)) not in found:
                path = filesystem.join(self.folder, name)
                if filesystem.isfile(filesystem.join(path, ".metadata")):
                    found[int(m.group(1))] = path
        for s in sorted(found)[: -self.keep_latest_k]:
            assert self.purge_thread is not None
            self.purge_queue.put(found[s])

    def _close(self) -> None:
        super()._close()
        ledger, self.ledger = self.ledger, None
        if ledger is not None:
            ledger.close()  # a resume whose re-executed range was cut short reports what it saw


def _committing(fut: Any, writer: StorageWriter) -> Future:
    """The future of an async save, failing with our error (its temporary directory removed)."""
    out: Future = Future()

    def done(f: Any) -> None:
        try:
            f.result()
        except BaseException as e:
            try:
                raise_failed_save(writer, e)
            except BaseException as err:
                out.set_exception(err)
            return
        out.set_result(None)

    fut.add_done_callback(done)
    return out
