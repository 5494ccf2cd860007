"""Restoring a committed DiLoCo snapshot: under the original tape (``restore_run``,
force mode, bit-identical) or live on a new tape after a syncer fault (``continue_run``).

The snapshot protocol itself (taking and committing the cut) is ``snapshots.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay import Recorder, TapeReader, replay
from replay.channel import TapeHub
from replay.snapshot import CHANNELS_KEY
from replay.errors import SnapshotError
from runs.diloco.config import DiLoCoConfig
from runs.diloco.run import open_recorder, run_actors
from runs.diloco.snapshots import Restored, Snapshots, join_part

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
    """(meta, {part: tree}) of a committed snapshot: each part's entries joined back into
    the tree its actor restores from (``join_part``); the syncer's with its recorded
    channel states. Refuses a file that is not a DiLoCo snapshot."""
    r = Restored.open(path)
    parts = {}
    for p in r.store.part_names(r.name):
        entries = {k: r.store.read_entry(r.name, p, k) for k in ("model", "optim", "messages", "diloco")}
        data = r.store.read_entry(r.name, p, "@data") if p != "syncer" else None
        tree = {"diloco": join_part(p, entries, data)}
        if p == "syncer":
            tree[CHANNELS_KEY] = r.store.read_entry(r.name, p, CHANNELS_KEY)
        parts[p] = tree
    return r.meta, parts


def unreceived(tape: Any, snapshot: str, actors: Any, *, coordinator: str = "syncer"
               ) -> tuple[dict[str, list[list[Any]]], dict[str, list[list[Any]]]]:
    """Taped messages sent inside the cut of ``snapshot`` and never received inside it,
    to and from each of ``actors``: ``(to, from)``, actor -> ``[[channel, chan_seq], ...]``.
    Inside the cut is ``Recorder.append_cut``'s rule: each actor's events up to its own
    ``snapshot`` event of that id, or up to the coordinator's for an actor without one."""
    reader = tape if isinstance(tape, TapeReader) else TapeReader(tape)
    events = [e for e in reader.events() if e.kind.name != "actor"]
    cut: dict[str, int] = {}
    for i, e in enumerate(events):
        if e.kind.name == "snapshot" and e.payload["snapshot_id"] == snapshot:
            cut.setdefault(e.actor, i)
    if coordinator not in cut:
        raise SnapshotError(f"the tape holds no cut of {coordinator} for this snapshot", snapshot=snapshot)
    sends: dict[tuple[str, int], str] = {}
    recvs: set[tuple[str, int]] = set()
    for i, e in enumerate(events):
        if i > cut.get(e.actor, cut[coordinator]) or e.kind.name not in ("send", "recv"):
            continue
        key = (str(e.payload["channel"]), int(e.payload["chan_seq"]))
        if e.kind.name == "send":
            sends[key] = e.actor
        else:
            recvs.add(key)
    want = set(actors)
    to: dict[str, list[list[Any]]] = {a: [] for a in want}
    frm: dict[str, list[list[Any]]] = {a: [] for a in want}
    for (channel, q), sender in sorted(sends.items()):
        if (channel, q) in recvs:
            continue
        dst = channel.partition("->")[2]
        if dst in want:
            to[dst].append([channel, q])
        if sender in want:
            frm[sender].append([channel, q])
    return to, frm


def _opened(tape: Any, snapshot: str | os.PathLike[str]) -> Restored:
    """The snapshot, with what its left-out learners leave in flight on ``tape``."""
    r = Restored.open(snapshot)
    if r.excluded:
        r.lost_to, r.lost_from = unreceived(tape, r.name, r.excluded)
    return r


def restore_run(tape: str | os.PathLike[str], snapshot: str | os.PathLike[str], *,
                step_delay_s: float = 0.0) -> RestoreResult:
    """Restore every actor from ``snapshot`` and continue the run under ``tape`` (force mode).

    Bit-identical means: every event each actor produces after its cut equals the tape's
    (the final parameter digests included), and the caller can compare the returned
    run's final states and losses with the original's. A snapshot that left learners out
    continues too: dead ones are replaced when the tape's plan says; ones left out alive
    (spec §9a) rejoin afresh, which only the tape of a run continued from this snapshot
    (``continue_run``) holds: under any other tape it is refused."""
    r = _opened(tape, snapshot)
    lineage = TapeReader(tape).meta.get("lineage") or {}
    if r.rejoin and lineage.get("from_snapshot") != r.path:
        # Under the tape of the run that took the snapshot, a learner left out alive went
        # on with its own recovery, which a restore cannot re-run. Under the tape of a run
        # continued from this snapshot (continue_run) it rejoined afresh, as here.
        raise SnapshotError(f"snapshot left out {r.rejoin} alive, without their state: under the original tape "
                            "their own recovery cannot be re-run; continue it live (continue_run) instead",
                            snapshot=r.name, path=r.path)
    cfg = DiLoCoConfig.from_dict(dict(TapeReader(tape).meta["config"]["diloco"]))

    def entry(rec: Recorder) -> Any:
        return run_actors(TapeHub(rec, wait_s=cfg.io_timeout_s), cfg, step_delay_s=step_delay_s, restore=r)

    rr = replay(tape, mode="force", align_snapshot=r.name, align_coordinator="syncer", entry=entry)
    return RestoreResult(r.name, r.step, rr.identical, rr.events_compared, rr.value, rr.divergence)


def continue_run(parent_tape: str | os.PathLike[str], snapshot: str | os.PathLike[str],
                 tape: str | os.PathLike[str], *, snapshot_dir: str | os.PathLike[str] | None = None,
                 transport: str | None = None, **kw: Any) -> Any:
    """After a fault in the syncer: continue the run live from a committed snapshot.

    Every actor starts from its part, the recorded in-flight messages are re-delivered
    first, and the run goes on taking fresh decisions. ``transport`` (default: the run's
    own) ``"gloo"`` relaunches every learner as a real process on a new process group (a
    syncer fault takes the group down with it), ``"threads"`` runs them in this process. A
    learner the snapshot left out alive starts afresh and recovers from a healthy peer. The new ``tape`` starts with the parent's history inside
    the cut (``Recorder.append_cut``), so it reads as one run that never crashed: ``ckpt tape
    check`` holds on it and ``ckpt replay TAPE --mode force`` re-executes it from step 0
    bit-identically. Its header's lineage names the parent tape and the snapshot. New
    snapshots go to ``snapshot_dir`` (default: ``checkpoints/`` next to the new tape),
    which must not be the directory the restored snapshot lives in (names would clash).
    ``kw`` goes to :func:`~runs.diloco.run.run_actors`. Returns its RunResult."""
    parent = TapeReader(parent_tape)
    r = _opened(parent, snapshot)
    name = r.name
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
        hub = TapeHub(rec, wait_s=cfg.io_timeout_s)
        if (transport or cfg.transport) == "gloo":
            from runs.diloco.procs import run_processes

            res = run_processes(hub, cfg, restore=r, **kw)
        else:
            res = run_actors(hub, cfg, restore=r, **kw)
    res.tape = str(tape)
    return res
