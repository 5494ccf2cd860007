"""Restoring a committed DiLoCo snapshot: under the original tape (``restore_run``,
force mode, bit-identical) or live on a new tape after a syncer fault (``continue_run``).

The snapshot protocol itself (taking and committing the cut) is ``snapshots.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay import CHANNELS_KEY, CkptSnapshotStore, Recorder, TapeReader, replay
from replay.errors import SnapshotError
from runs.diloco.config import DiLoCoConfig
from runs.diloco.run import open_recorder, run_actors
from runs.diloco.snapshots import FORMAT_VERSION, SNAPSHOT_FORMAT, Snapshots, join_part
from replay import TapeHub

__all__ = ["RestoreResult", "read_snapshot", "restore_run", "continue_run"]


@dataclass(frozen=True, slots=True)
class RestoreResult:
    snapshot: str
    syncer_step: int  # the syncer step the run continued from
    identical: bool  # every event after each actor's cut matched the tape (force mode)
    events_compared: int
    run: Any  # the continued run's RunResult (post-cut losses, final states)
    divergence: Any = None


def read_snapshot(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, {part: tree}) of a committed snapshot; refuses one that cannot be continued."""
    path = str(Path(path).absolute())
    store = CkptSnapshotStore(os.path.dirname(path))
    name = os.path.basename(path)
    meta = store.read_meta(name)
    if meta.get("format") != SNAPSHOT_FORMAT or int(meta.get("version", 0)) != FORMAT_VERSION:
        raise SnapshotError(f"not a DiLoCo snapshot (format {meta.get('format')!r} version {meta.get('version')!r})",
                            snapshot=name, path=path)
    if meta.get("excluded"):
        raise SnapshotError(f"snapshot excluded {list(meta['excluded'])}: their state is not in it, so the run "
                            "cannot be continued from it exactly", snapshot=name, path=path)
    parts = {}
    for p in store.part_names(name):
        entries = {k: store.read_entry(name, p, k) for k in ("model", "optim", "messages", "diloco")}
        data = store.read_entry(name, p, "@data") if p != "syncer" else None
        tree = {"diloco": join_part(p, entries, data)}
        if p == "syncer":
            tree[CHANNELS_KEY] = store.read_entry(name, p, CHANNELS_KEY)
        parts[p] = tree
    return meta, parts


def restore_run(tape: str | os.PathLike[str], snapshot: str | os.PathLike[str], *,
                step_delay_s: float = 0.0) -> RestoreResult:
    """Restore every actor from ``snapshot`` and continue the run under ``tape`` (force mode).

    Bit-identical means: every event each actor produces after its cut equals the tape's
    (the final parameter digests included), and the caller can compare the returned
    run's final states and losses with the original's."""
    meta, parts = read_snapshot(snapshot)
    name = str(meta["snapshot"])
    cfg = DiLoCoConfig.from_dict(dict(TapeReader(tape).meta["config"]["diloco"]))

    def entry(rec: Recorder) -> Any:
        return run_actors(TapeHub(rec, wait_s=cfg.io_timeout_s), cfg, step_delay_s=step_delay_s, restore=parts)

    rr = replay(tape, mode="force", align_snapshot=name, entry=entry)
    return RestoreResult(name, int(meta["syncer_step"]), rr.identical, rr.events_compared, rr.value, rr.divergence)


def continue_run(parent_tape: str | os.PathLike[str], snapshot: str | os.PathLike[str],
                 tape: str | os.PathLike[str], *, snapshot_dir: str | os.PathLike[str] | None = None,
                 **kw: Any) -> Any:
    """After a fault in the syncer: continue the run live from a committed snapshot.

    Every actor starts from its part (as threads of this process, over the in-process
    transport), the recorded in-flight messages are re-delivered first, and the run goes
    on taking fresh decisions. The new ``tape`` starts with the parent's history inside
    the cut (``Recorder.append_cut``), so it reads as one run that never crashed: ``ckpt tape
    check`` holds on it and ``ckpt replay TAPE --mode force`` re-executes it from step 0
    bit-identically. Its header's lineage names the parent tape and the snapshot. New
    snapshots go to ``snapshot_dir`` (default: ``checkpoints/`` next to the new tape),
    which must not be the directory the restored snapshot lives in (names would clash).
    ``kw`` goes to :func:`~runs.diloco.run.run_actors`. Returns its RunResult."""
    meta, parts = read_snapshot(snapshot)
    name = str(meta["snapshot"])
    parent = TapeReader(parent_tape)
    cfg = DiLoCoConfig.from_dict(dict(parent.meta["config"]["diloco"]))
    Path(tape).parent.mkdir(parents=True, exist_ok=True)
    root = Path(snapshot_dir) if snapshot_dir is not None else Path(tape).parent / "checkpoints"
    if root.absolute() == Path(snapshot).absolute().parent:
        raise SnapshotError("continue into another snapshot directory: new snapshots would clash with the "
                            "parent run's", snapshot=name, path=str(root))
    if cfg.snapshot_every:
        snaps = Snapshots(root, keep_last=cfg.snapshot_keep, config={"diloco": cfg.to_dict()})
        kw["snapshots"] = snaps
    else:
        snaps = None
    # the keys of a fork's lineage (replay.replayer), plus the snapshot it continued from
    lineage = {"parent_run_id": parent.run_id.hex(), "parent_tape": str(Path(parent_tape).absolute()),
               "parent_config_hash": parent.meta.get("config_hash"), "from_checkpoint": None,
               "from_snapshot": str(Path(snapshot).absolute()), "changes": {}}
    with open_recorder(tape, cfg, lineage=lineage) as rec:
        rec.append_cut(parent, name, coordinator="syncer")
        if snaps is not None:
            snaps.adopt(snapshot, meta)
        hub = TapeHub(rec, wait_s=cfg.io_timeout_s)
        res = run_actors(hub, cfg, restore=parts, **kw)
    res.tape = str(tape)
    return res
