"""A run directory's checkpoints: their names, :func:`list_checkpoints`, and :func:`latest`
(the checkpoint ``resume()`` will choose, found without loading it)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import CkptError, UnsupportedVersionError
from ..format.manifest import MANIFEST_NAME, TMP_PREFIX, decode_manifest
from ..knobs import knobs
from ..reader import CheckpointReader
from ..storage import Storage, resolve

__all__ = ["CheckpointRecord", "LatestCheckpoint", "checkpoint_name", "is_checkpoint_name", "latest",
           "list_checkpoints"]

_NAME_RE = re.compile(r"^step-(\d{8,})$")


def checkpoint_name(step: int) -> str:
    """The directory name of a step's checkpoint in a run directory: ``step-NNNNNNNN``."""
    return f"step-{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a committed checkpoint's directory name (``step-NNNNNNNN``)."""
    return bool(_NAME_RE.match(name))


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    name: str
    path: str
    step: int
    committed: bool
    metrics: dict[str, Any] | None = None


def may_resume(run_dir: str | os.PathLike[str], *, storage: Storage | None = None) -> bool:
    """Whether a manager's ``resume()`` in ``run_dir`` may find a checkpoint: a committed
    one, or the temporary copy of a save that a crash interrupted after it was complete
    (the manager's recovery, when it takes the run's lock, publishes that copy before
    ``resume`` looks). A caller deciding *before* it builds the manager whether to resume
    must count both: counting committed ones only skips the resume of a run killed in its
    save's last moments, and the run then starts again from step 0 (seen under load)."""
    if any(r.committed for r in list_checkpoints(run_dir, storage=storage)):
        return True
    storage, root = resolve(run_dir, storage)
    root = storage.commit.record_path(os.fspath(run_dir), root)
    try:
        names = storage.listdir(root)
    except FileNotFoundError:
        return False
    return any(_temporary_of_a_step(n) for n in names)


def _temporary_of_a_step(name: str) -> bool:
    """``.tmp-step-NNNNNNNN-<hex>`` (a save's copy) or the same with ``.old`` (an overwrite's)."""
    if not name.startswith(TMP_PREFIX):
        return False
    base = name[len(TMP_PREFIX):].removesuffix(".old")
    return _NAME_RE.match(base.rsplit("-", 1)[0]) is not None


def list_checkpoints(
    run_dir: str | os.PathLike[str], *, with_metrics: bool = False, storage: Storage | None = None
) -> list[CheckpointRecord]:
    """``step-*`` directories of a run, oldest first. Temporary dirs are never listed."""
    storage, root = resolve(run_dir, storage)
    root = storage.commit.record_path(os.fspath(run_dir), root)
    try:
        names = storage.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _NAME_RE.match(name)
        if not m:
            continue
        path = os.path.join(root, name)
        committed = storage.isfile(os.path.join(path, MANIFEST_NAME))
        metrics = None
        if with_metrics and committed:
            try:
                mpath = os.path.join(path, MANIFEST_NAME)
                size = storage.lstat(mpath).st_size
                if size > knobs().max_manifest_bytes + 64:  # never read more than a reader would
                    raise CkptError("MANIFEST above the size limit", path=mpath)
                man = decode_manifest(storage.read(mpath, 0, size), path=path)
                got = man.meta.get("metrics")
                metrics = dict(got) if isinstance(got, dict) else None
            except (OSError, CkptError):
                metrics = None  # unreadable: protected by step rules only
        out.append(CheckpointRecord(name, path, int(m.group(1)), committed, metrics))
    out.sort(key=lambda r: r.step)
    return out


@dataclass(frozen=True, slots=True)
class LatestCheckpoint:
    """The checkpoint ``resume()`` will load, found without loading it (:func:`latest`).

    ``config`` is the config saved with it (its canonical form: maps, lists, plain
    values; ``None`` if the run saved none), ``config_hash`` its hash; ``skipped`` names
    the newer checkpoints passed over as damaged, each with the error."""

    path: str
    name: str
    step: int
    id: str
    config: Any
    config_hash: str | None
    skipped: tuple[tuple[str, str], ...] = ()


def latest(run_dir: str | os.PathLike[str], *, verify: bool = True, storage: Storage | None = None
           ) -> LatestCheckpoint | None:
    """The checkpoint ``CheckpointManager.resume()`` will choose in ``run_dir``, and its
    config, without loading any tensor into anything: the newest committed ``step-*``
    that verifies (``verify=False``: the newest whose MANIFEST and structure decode,
    which reads no tensor bytes, as ``ckpt inspect --latest`` does). ``None`` when none
    qualifies. Read the model's shape from ``.config`` before building the model::

        found = ckpt.latest("runs/gpt")
        cfg = found.config["model"] if found else default_model_config
    """
    storage, _ = resolve(run_dir, storage)  # one backend for the listing and the readers
    skipped: list[tuple[str, str]] = []
    for rec in reversed(list_checkpoints(run_dir, storage=storage)):
        if not rec.committed:
            continue
        try:
            reader = CheckpointReader(rec.path, storage=storage)
            pe = reader.parts[0]
            if verify:
                reader.verify()
            else:
                reader.tree(pe.name, verify=False)
            saved = (reader.tree(pe.name, verify=False)["context"].get("config") or {}).get("hash")
            config = reader.config(pe.name)
        except UnsupportedVersionError:
            raise  # resume() stops here too: a newer writer's checkpoint is not damage
        except (CkptError, OSError) as e:  # damaged: resume() falls back past it as well
            skipped.append((rec.name, f"{type(e).__name__}: {e}"))
            continue
        return LatestCheckpoint(reader.path, rec.name, int(reader.step if reader.step is not None else rec.step),
                                str(reader.manifest.id), config, saved, tuple(skipped))
    return None

