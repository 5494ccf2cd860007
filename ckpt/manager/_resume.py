"""Resume: the fallback rule (past damaged checkpoints only), the refusal of a checkpoint
that does not fit the live state or world (``ResumeMismatchError``), and the config
comparison a resume reports (``ConfigChangedWarning``)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..dcp.layout import is_sharded
from ..errors import (
    CkptError,
    EnvironmentMismatchError,
    ResumeMismatchError,
    StateMismatchError,
    UnsupportedVersionError,
)
from ..reader import CheckpointReader
from ..storage import Storage

__all__ = ["ConfigChangedWarning", "ResumeFallbackWarning", "config_changes", "warn_config_changed"]


class ResumeFallbackWarning(RuntimeWarning):
    """The newest checkpoint is damaged (it did not verify); an older one was used (the
    message says why). Never issued for a checkpoint that does not fit the live state:
    that stops the resume (``ResumeMismatchError``)."""


class ConfigChangedWarning(UserWarning):
    """A run resumed with a config other than the one its checkpoint recorded; the
    message names the keys that changed (and their old and new values)."""


def config_changes(saved: Any, live: Any, *, limit: int = 10) -> list[str]:
    """The keys (dotted paths) whose values differ between two configs' canonical
    forms, each as ``key: old -> new`` (at most ``limit``, then a count)."""
    from ..context.config import canonicalize

    def flat(obj: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
        if isinstance(obj, dict) and obj:
            for k, v in obj.items():
                flat(v, f"{prefix}.{k}" if prefix else str(k), out)
        else:
            out[prefix or "(config)"] = obj
        return out

    a, b = flat(canonicalize(saved), "", {}), flat(canonicalize(live), "", {})
    missing = object()
    keys = sorted(k for k in set(a) | set(b) if a.get(k, missing) != b.get(k, missing))

    def show(v: Any) -> str:
        text = "(absent)" if v is missing else repr(v)
        return text if len(text) <= 40 else text[:37] + "..."

    out = [f"{k}: {show(a.get(k, missing))} -> {show(b.get(k, missing))}" for k in keys[:limit]]
    if len(keys) > limit:
        out.append(f"and {len(keys) - limit} more")
    return out


def warn_config_changed(path: str, context: Mapping[str, Any], live: Any, *, stacklevel: int = 2) -> list[str]:
    """One ``ConfigChangedWarning`` when ``live`` (the resuming run's config) differs from
    the config a checkpoint's ``context`` recorded; returns the changes (empty: none, or
    nothing to compare because either side has no config)."""
    saved = context.get("config")
    if live is None or not saved:
        return []
    from ..context.config import config_hash
    from ..format.codec import unpackb

    if config_hash(live) == saved.get("hash"):
        return []
    changes = config_changes(unpackb(saved["canonical"], path=path, what="config"), live)
    if changes:
        warnings.warn(f"resuming from {path} with a changed config: " + "; ".join(changes),
                      ConfigChangedWarning, stacklevel=stacklevel + 1)
    return changes



# resume() falls back only past a checkpoint that is damaged (corrupt, truncated,
# re-signed with content load cannot take, vanished). What every older checkpoint of the
# run would fail too stops it, because falling back past all of them starts the run
# afresh and its saves then replace the run's checkpoints: the strict exactness gate, a
# checkpoint written by a newer format version, and a state or world that does not fit
# (ResumeMismatchError, told apart in _mismatch).
_REFUSALS: tuple[type[BaseException], ...] = (EnvironmentMismatchError, UnsupportedVersionError)


@dataclass(frozen=True, slots=True)
class Target:
    """What a resume loads into and in which world, as the manager holds them at the call.
    ``ctl``: the process group the ranks agree on (``None`` in one process)."""

    run_dir: str
    storage: Storage
    state: Mapping[str, Any]
    data: Any
    generators: Mapping[str, Any]
    config: Any
    exactness: str
    rank: int
    world_size: int
    distributed: bool
    ctl: Any


@dataclass(slots=True)
class Outcome:
    """What :func:`load_first` ended with: the ``LoadResult`` and its checkpoint's name
    (``result`` is ``None`` when none loaded), the damaged ones skipped before it, and
    ``error``: an apply that failed part-way when no older checkpoint loaded after it
    (the targets are unusable; the caller raises it)."""

    result: Any = None
    name: str = ""
    skipped: list[str] = field(default_factory=list)
    error: Exception | None = None


def load_first(t: Target, names: Sequence[str], *, defer_rng: bool) -> Outcome:
    """Load the first of ``names`` that loads (``resume()``'s fallback rule). Raises
    ``ResumeMismatchError`` for an intact checkpoint that does not fit (every rank
    together), and what every older checkpoint would fail too (``_REFUSALS``)."""
    from .._torchio import prepare_load

    out = Outcome()
    for choice in names:
        path = os.path.join(t.run_dir, choice)
        prepared = None
        error: BaseException | None = None
        sharded = False
        try:
            reader = CheckpointReader(path, storage=t.storage)
            sharded = is_sharded(reader.manifest)  # --- sharded hook (ckpt.dcp) ---
            part = None
            if len(reader.parts) > 1 or t.distributed:
                from ..writer import part_name_for_rank

                part = part_name_for_rank(t.rank)
                if not sharded and part not in reader.parts.names:
                    raise world_mismatch(t, reader, part)
            if sharded:
                # every chunk of every rank's part, before any target is written
                if t.rank == 0:
                    reader.verify()
            else:
                # Every check and the hash of every chunk, before any target is written.
                prepared = prepare_load(
                    reader,
                    t.state,
                    part=part,
                    data=t.data,
                    # deferred: restore_rng() restores the generators with the other streams
                    generators=None if defer_rng else (t.generators or None),
                    restore_rng_state=not defer_rng,
                    verify=True,
                    exactness=t.exactness,
                )
        except Exception as e:  # damage is skipped below; a mismatch or a refusal stops
            error = e
        misfit_error = mismatch(t, error, path) if isinstance(error, StateMismatchError) else None
        failed, refused, misfit = error is not None, isinstance(error, _REFUSALS), misfit_error is not None
        if t.ctl is not None:  # all ranks load the same checkpoint or none does
            failed, refused, misfit = (
                bool(v) for v in t.ctl.all_reduce_max([int(failed), int(refused), int(misfit)])
            )
        if misfit or refused:  # every rank raises together (none waits in a collective)
            if prepared is not None:
                prepared.close()
            if misfit:
                raise misfit_error or ResumeMismatchError(
                    f"cannot resume {t.run_dir} from {path}: another rank's state or world does not fit this "
                    "checkpoint (that rank's error names the key). Nothing in the run directory was changed; "
                    "this manager will not save", path=path)
            if isinstance(error, _REFUSALS):
                raise error
            raise CkptError("another rank refused this checkpoint (strict exactness gate, format version)", path=path)
        if failed:
            if prepared is not None:
                prepared.close()
            why = f"{type(error).__name__}: {error}" if error is not None else "another rank could not load it"
            warnings.warn(f"skipping {path}: {why}", ResumeFallbackWarning, stacklevel=4)
            out.skipped.append(choice)
            continue
        if sharded:  # collective: DCP reshards onto this job's shards
            from ..dcp.integration import load_sharded

            try:
                out.result = load_sharded(
                    reader, t.state, data=t.data, generators=t.generators or None,
                    restore_rng=not defer_rng, verify=t.rank != 0, exactness=t.exactness,
                )
            except StateMismatchError as e:
                raise mismatch(t, e, path) from e
            out.name = choice
            break
        assert prepared is not None
        try:
            out.result = prepared.apply()
        except Exception as e:  # a file changed between the passes, a Stateful refused
            if isinstance(e, StateMismatchError):  # load_state_dict refused it: not damage
                raise mismatch(t, e, path, applied=True) from e
            if t.ctl is not None:
                raise  # ranks cannot agree on a fallback after some applied theirs
            # The targets may be mixed now: only a complete load of an older
            # checkpoint (which rewrites every target) makes them usable again.
            out.error = e
            warnings.warn(f"skipping {path}: {type(e).__name__}: {e}", ResumeFallbackWarning, stacklevel=4)
            out.skipped.append(choice)
            continue
        out.name = choice
        break
    if out.result is not None:
        out.error = None
    return out


def mismatch(t: Target, error: StateMismatchError, path: str, *, applied: bool = False) -> ResumeMismatchError:
    """The resume refusal for a checkpoint that is intact but does not fit the state."""
    if isinstance(error, ResumeMismatchError):
        return error
    ctx = dict(error.context)  # saved_shape/target_shape and dtypes, where a tensor differs
    where = (
        "Some targets were already written (a Stateful's load_state_dict refused the rest): "
        "do not train with them. " if applied else ""
    )
    return ResumeMismatchError(
        f"cannot resume {t.run_dir} from {path}: the state does not fit this checkpoint: {error.message}"
        f"{_config_note(t, path)}. "
        "The checkpoint is intact, so resume() does not fall back past it (no older checkpoint of the run "
        f"fits either, and starting afresh would overwrite the run). {where}Nothing in the run directory was "
        "changed and this manager will not save. Build the state the run was saved with (ckpt.latest(run_dir) "
        "returns its config without loading it), or start the changed one in a new run directory",
        path=path, key=error.key, **ctx,
    )


def _config_note(t: Target, path: str) -> str:
    """How this run's config differs from the checkpoint's, for a mismatch message
    (a changed model usually comes with a changed config: name it)."""
    if t.config is None:
        return ""
    try:
        reader = CheckpointReader(path, storage=t.storage)
        saved = reader.tree(reader.parts[0].name)["context"].get("config")  # the structure file only
        if not saved:
            return ""
        from ..context.config import config_hash
        from ..format.codec import unpackb

        if config_hash(t.config) == saved.get("hash"):
            return ""
        changes = config_changes(unpackb(saved["canonical"], path=path, what="config"), t.config)
    except (CkptError, OSError):
        return ""
    return f" (the config differs too: {'; '.join(changes)})" if changes else ""


def world_mismatch(t: Target, reader: CheckpointReader, part: str) -> ResumeMismatchError:
    names = list(reader.parts.names)
    return ResumeMismatchError(
        f"cannot resume {t.run_dir} from {reader.path}: this job has world size {t.world_size} but the "
        f"checkpoint was saved by {len(names)} rank(s) (parts {names[:8]}): there is no part {part!r} for rank "
        f"{t.rank}. The checkpoint is intact, so resume() does not fall back past it. Nothing in the run "
        f"directory was changed and this manager will not save. Resume with the saving world size, or save "
        "sharded state (ckpt.dcp), which reshards on resume",
        path=reader.path, key=part, saved_world_size=len(names), world_size=t.world_size,
    )


def refused_save(refusal: ResumeMismatchError) -> ResumeMismatchError:
    """What a save raises after a refused resume (its saves would replace the run's checkpoints)."""
    return ResumeMismatchError(
        f"this CheckpointManager does not save: its resume was refused because the state does not fit "
        f"the run's checkpoint ({refusal.message}); the run's checkpoints stay as they are. Build the state the "
        "run was saved with, or start the changed one in a new run directory",
        path=refusal.path, key=refusal.key, **refusal.context,
    )
