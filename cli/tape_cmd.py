"""``ckpt tape show|verify|check|merge|diff|repair`` and ``ckpt replay``.

Exit codes (cli/main.py): 0 valid / identical / no violation; 3 corrupt tape;
4 ``tape verify`` found a torn tail (the tape reads, but its end was never completely
written: run ``ckpt tape repair``); 6 ``replay`` diverged, ``tape diff`` found a
difference, ``tape check`` found violations. No torch at import time.
"""

from __future__ import annotations

import json
from typing import Any

import click

from ckpt_cli._common import ANY_PATH, Progress, TapePath, handle_errors, json_option

__all__ = ["tape", "replay_cmd"]

_TAPE = TapePath()


def _summary(ev: Any) -> str:
    from replay.events import jsonable

    p = ev.payload
    k = ev.kind.name
    if k == "params":
        return f"digest={p['digest'].hex()[:16]} tensors={len(p['tensors'])}"
    if k == "batch":
        ids = p["sample_ids"]
        more = f" ...(+{len(ids) - 8})" if len(ids) > 8 else ""
        return "ids=" + ",".join(map(str, ids[:8])) + more
    if k in ("loss", "metric"):
        import struct

        bits = struct.pack(">d", p["value"]).hex()
        return (f"{p['name']}=" if k == "metric" else "") + f"{p['value']!r} (0x{bits})"
    parts = []
    for name, v in p.items():
        if isinstance(v, bytes):
            parts.append(f"{name}={v.hex()[:16]}")
        else:
            s = json.dumps(jsonable(v), separators=(",", ":"))
            parts.append(f"{name}={s if len(s) < 60 else s[:57] + '...'}")
    return " ".join(parts)


def _clock(c: Any) -> str:
    return "{" + ",".join(f"{a}:{n}" for a, n in c.entries) + "}"


@click.group("tape", context_settings={"help_option_names": ["-h", "--help"]})
def tape() -> None:
    """Show, verify, check, diff and repair event tapes (a .tape file or a segment directory)."""


@tape.command("show")
@click.argument("path", type=_TAPE)
@click.option("--actor", "actors", multiple=True, help="Only these actors (repeatable).")
@click.option("--kind", "kinds", multiple=True, help="Only these event kinds (repeatable), e.g. loss, params.")
@click.option("--from-step", type=int, default=None, help="First step to show (uses the step index).")
@click.option("--to-step", type=int, default=None, help="Last step to show.")
@click.option("--limit", type=int, default=None, help="Show at most this many events.")
@json_option("§4.7", lines=True)
@handle_errors
def show_cmd(path: str, actors: tuple[str, ...], kinds: tuple[str, ...], from_step: int | None,
             to_step: int | None, limit: int | None, as_json: bool) -> None:
    """List the events of a tape as a table, or as JSON Lines with --json."""
    from replay.events import KIND_BY_NAME
    from replay.tape import TapeReader

    for k in kinds:
        if k not in KIND_BY_NAME:
            raise click.BadParameter(f"unknown kind {k!r}; known: {', '.join(KIND_BY_NAME)}", param_hint="--kind")
    r = TapeReader(path)
    if not as_json:
        m = r.meta
        click.echo(f"tape {path}  run {r.run_id.hex()}  entry {m.get('entry_point')}  config {m.get('config_hash')}")
        lin = m.get("lineage")
        if lin:
            how = f"continued from snapshot {lin['from_snapshot']} of" if lin.get("from_snapshot") else "forked from"
            click.echo(f"{how} {lin.get('parent_tape')} (run {lin.get('parent_run_id')})")
        click.echo(f"{'seq':>7} {'step':>6}  {'actor':<12} {'kind':<15} {'clock':<24} payload")
    shown = 0
    for ev in r.events(from_step=from_step):
        if to_step is not None and ev.step > to_step:
            continue  # not a break: another actor may still be at an earlier step
        if (actors and ev.actor not in actors) or (kinds and ev.kind.name not in kinds):
            continue
        if as_json:
            click.echo(json.dumps(ev.to_json(), separators=(",", ":")))
        else:
            click.echo(f"{ev.seq:>7} {ev.step:>6}  {ev.actor:<12} {ev.kind.name:<15} {_clock(ev.clock):<24} "
                       f"{_summary(ev)}")
        shown += 1
        if limit is not None and shown >= limit:
            break
    if r.dropped_bytes and not as_json:
        click.echo(f"torn tail: {r.dropped_bytes} bytes after the last valid record were ignored ({r.torn_reason})",
                   err=True)


@tape.command("verify")
@click.argument("path", type=_TAPE)
@json_option("§4.8")
@handle_errors
def verify_cmd(path: str, as_json: bool) -> None:
    """Check framing, checksums, sequence numbers, hash chain, every event and payload,
    the step index against the records, and that the tape was closed.

    Exit 0 valid and closed; 3 corrupt (offset and seq named; a step index that disagrees
    with the records too); 4 incomplete: a torn tail (repairable) or a tape that was never
    closed (its writer died, or its end was cut off at a record boundary)."""
    from replay.tape import TapeReader

    r = TapeReader(path)
    rep = r.verify()
    if as_json:
        click.echo(json.dumps({**rep.to_json(), "run_id": r.run_id.hex(), "chain": r.header.chain,
                               "zstd": r.header.zstd}, sort_keys=True))
    else:
        feats = ", ".join(f for f, on in (("hash chain", r.header.chain), ("zstd blocks", r.header.zstd)) if on)
        click.echo(f"ok: {path}: {rep.events} events (seq 0..{rep.last_seq}) in {rep.segments} segment(s), "
                   f"{rep.valid_bytes} bytes{' (' + feats + ')' if feats else ''}, step index {rep.index}")
    if rep.dropped_bytes:
        click.echo(f"torn tail: {rep.dropped_bytes} bytes after the last valid record ({rep.torn_reason}); "
                   f"`ckpt tape repair {path}` truncates them", err=True)
    if not rep.closed:
        click.echo(f"not closed (ends at seq {rep.last_seq}): the tape has no close record, so its writer never "
                   "finished or its end (records or segments) is missing", err=True)
    if rep.dropped_bytes or not rep.closed:
        raise click.exceptions.Exit(4)


@tape.command("check")
@click.argument("paths", metavar="TAPE...", nargs=-1, required=True, type=_TAPE)
@json_option("§4.9")
@handle_errors
def check_cmd(paths: tuple[str, ...], as_json: bool) -> None:
    """Check the recorded history's invariants (clocks, sends/receives, merges, quorums,
    recoveries, snapshot cuts). Several tapes (one per process of a job) are checked as
    one history. Exit 0 when none is violated, 6 otherwise."""
    from replay.check import check_tapes

    readers: list[Any] = []
    violations = check_tapes(list(paths), readers=readers)
    for r in readers:
        # The history is judged as far as it goes; say where a tape was cut short (§5.5).
        if not r.closed:
            click.echo(f"note: {r.path} is not closed (ends at seq {r.last_seq}): the history checked may be "
                       "incomplete", err=True)
    path = " ".join(paths)
    if as_json:
        click.echo(json.dumps([v.to_json() for v in violations], indent=2))
    elif not violations:
        click.echo(f"ok: {path}: no invariant violated")
    else:
        click.echo(f"{len(violations)} violation(s) in {path}:")
        for v in violations:
            click.echo(v.format())
    if violations:
        raise click.exceptions.Exit(6)


@tape.command("merge")
@click.argument("paths", metavar="TAPE...", nargs=-1, required=True, type=_TAPE)
@click.option("-o", "--out", "out", required=True, type=click.Path(exists=False, path_type=str),
              help="The job tape to write (must not exist).")
@handle_errors
def merge_cmd(paths: tuple[str, ...], out: str) -> None:
    """Write one job tape from a job's per-process tapes (spec/tape-format.md §2.1), for
    ``ckpt replay``: every event, in happens-before order, actors renumbered, the first
    tape's metadata (entry point, config). Each actor must be on one tape only."""
    from replay.tape.merge import merge_tapes

    n = merge_tapes(list(paths), out)
    click.echo(f"merged {len(paths)} tapes ({n} events) into {out}")


@tape.command("diff")
@click.argument("a", type=_TAPE)
@click.argument("b", type=_TAPE)
@json_option("§4.10")
@handle_errors
def diff_cmd(a: str, b: str, as_json: bool) -> None:
    """Name the first event where two tapes differ (per actor). Exit 0 same events, 6 different."""
    from ckpt.context.env import env_diff
    from replay.tape import TapeReader

    ra, rb = TapeReader(a), TapeReader(b)
    per_a: dict[str, list[Any]] = {}
    per_b: dict[str, list[Any]] = {}
    for ev in ra.events():
        if ev.kind.name != "actor":
            per_a.setdefault(ev.actor, []).append(ev)
    for ev in rb.events():
        if ev.kind.name != "actor":
            per_b.setdefault(ev.actor, []).append(ev)
    first: tuple[Any, Any] | None = None
    for actor in sorted(set(per_a) | set(per_b)):
        xs, ys = per_a.get(actor, []), per_b.get(actor, [])
        for i in range(max(len(xs), len(ys))):
            x = xs[i] if i < len(xs) else None
            y = ys[i] if i < len(ys) else None
            if x is None or y is None or not x.same(y):
                cand = (x, y)
                if first is None or _order(cand) < _order(first):
                    first = cand
                break
    ma, mb = ra.meta, rb.meta
    meta_diff = {k: [ma.get(k), mb.get(k)] for k in ("entry_point", "config_hash", "commit", "initial_checkpoint")
                 if ma.get(k) != mb.get(k)}
    envd = env_diff(ma.get("env") or {}, mb.get("env") or {})
    if as_json:
        click.echo(json.dumps({"identical": first is None,
                               "first_difference": None if first is None else
                               {"a": first[0].to_json() if first[0] else None,
                                "b": first[1].to_json() if first[1] else None},
                               "meta": meta_diff, "env": {k: list(v) for k, v in envd.items()}}, indent=2))
    else:
        for k, (x, y) in meta_diff.items():
            click.echo(f"header {k}: {x!r} vs {y!r}")
        for k, (x, y) in envd.items():
            click.echo(f"env {k}: {x!r} vs {y!r}")
        if first is None:
            click.echo(f"same events: {a} and {b}")
        else:
            x, y = first
            ref = x or y
            click.echo(f"first difference: actor {ref.actor}, step {ref.step}")
            for label, ev in (("a", x), ("b", y)):
                if ev is None:
                    click.echo(f"  {label}: (no more events for this actor)")
                else:
                    click.echo(f"  {label}: seq {ev.seq} step {ev.step} {ev.kind.name} {_clock(ev.clock)} "
                               f"{_summary(ev)}")
    if first is not None:
        raise click.exceptions.Exit(6)


def _order(pair: tuple[Any, Any]) -> tuple[int, int]:
    x, y = pair
    return (x.seq if x is not None else 1 << 62, y.seq if y is not None else 1 << 62)


@tape.command("repair")
@click.argument("path", type=_TAPE)
@click.option("--dry-run", is_flag=True, help="Report what would be truncated; change nothing.")
@click.option("--salvage", is_flag=True,
              help="Also cut at a corrupt middle record, dropping the valid records after it (point-in-time).")
@json_option("§4.11")
@handle_errors
def repair_cmd(path: str, dry_run: bool, salvage: bool, as_json: bool) -> None:
    """Truncate a torn tail (explicitly, reporting the bytes), then rebuild the step index.

    A corrupt middle record is refused (exit 3) unless --salvage is given. Never follows a
    symlink: a segment that is one is refused, the index is replaced, not written through.
    A repaired tape is still not closed (`tape verify` says so): what was lost stays lost."""
    from replay import repair_tape

    rep = repair_tape(path, dry_run=dry_run, salvage=salvage)
    if as_json:
        click.echo(json.dumps({"path": rep.path, "applied": rep.applied, "records": rep.records, "reason": rep.reason,
                               "dropped_bytes": rep.dropped_bytes,
                               "cuts": [{"file": c.file, "old_size": c.old_size, "new_size": c.new_size,
                                         "remove": c.remove} for c in rep.cuts]}, indent=2, sort_keys=True))
        return
    if not rep.cuts:
        click.echo(f"ok: {path}: nothing to repair ({rep.records} records)")
        return
    for c in rep.cuts:
        verb = "would truncate" if dry_run else "truncated"
        click.echo(f"{verb} {c.file}: {'remove' if c.remove else f'{c.old_size} -> {c.new_size} bytes'}")
    click.echo(f"{'would drop' if dry_run else 'dropped'} {rep.dropped_bytes} bytes ({rep.reason}); "
               f"{rep.records} records kept")


def _parse_set(items: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items:
        if "=" not in it:
            raise click.BadParameter(f"expected KEY=VALUE, got {it!r}", param_hint="--set")
        k, v = it.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


@click.command("replay")
@click.argument("path", type=_TAPE)
@click.option("--from", "from_checkpoint", type=ANY_PATH, default=None,
              help="Resume from this checkpoint (the entry point loads it via rec.resume_from).")
@click.option("--until", type=int, default=None, help="Stop after this step.")
@click.option("--mode", type=click.Choice(["verify", "force", "fork"]), default="verify", show_default=True,
              help="verify: tape is the oracle; force: also take taped decisions; fork: record a new tape.")
@click.option("--out", type=click.Path(path_type=str), default=None, help="fork: the new tape.")
@click.option("--set", "sets", multiple=True, help="fork: change a config value, KEY=JSON (repeatable).")
@click.option("--entry-point", default=None,
              help="Run this module:function (or file.py:function) instead of the taped one; naming it yourself "
                   "counts as trusting it.")
@click.option("--trust", is_flag=True,
              help="Run the entry point the tape names. Without it (or the CKPT_REPLAY_TRUST allow-list) ckpt replay "
                   "prints the entry point and the file it resolves to, and stops (exit 2).")
@click.option("--import-path", "import_path", multiple=True, type=click.Path(file_okay=False, path_type=str),
              help="Directory to import the entry point from (repeatable). The current directory is never added "
                   "implicitly.")
@click.option("--reference", type=ANY_PATH, default=None,
              help="A .safetensors file of the original run's tensors at the divergence step (max abs diffs).")
@json_option("§4.6")
@handle_errors
def replay_cmd(path: str, from_checkpoint: str | None, until: int | None, mode: str, out: str | None,
               sets: tuple[str, ...], entry_point: str | None, trust: bool, import_path: tuple[str, ...],
               reference: str | None, as_json: bool) -> None:
    """Re-execute the run recorded on a tape. Exit 0 identical, 6 diverged, 3 corrupt tape.

    Replaying imports and runs the tape's entry point: code, exactly like running the
    training script. A tape from someone else can name any module or file, so by default
    ckpt replay only prints the entry point and the file it resolves to, and exits 2.
    Run it with --trust, or list its directory in CKPT_REPLAY_TRUST (directories
    separated by the OS path separator). --entry-point names the code yourself. The
    current directory is never put on sys.path; use --import-path DIR."""
    from replay.replayer import TRUST_ENV, replay, resolve_entry_point, trusted_by_env
    from replay.tape import TapeReader

    if mode == "fork" and not out:
        raise click.BadParameter("fork writes a new tape: give --out", param_hint="--out")
    if sets and mode != "fork":
        raise click.BadParameter("--set changes the run: use --mode fork", param_hint="--set")
    spec = entry_point or TapeReader(path).meta.get("entry_point")
    if spec:
        ep = resolve_entry_point(str(spec), search_path=import_path)
        click.echo(f"entry point: {ep.spec}\n  resolves to: {ep.file if ep.file is not None else '(not found)'}",
                   err=True)
        if not (trust or entry_point or trusted_by_env(ep)):
            click.echo(f"refusing to run code named by the tape {path}: replaying runs it. Pass --trust if you "
                       f"trust this tape, or list the file's directory in {TRUST_ENV}.", err=True)
            raise click.exceptions.Exit(2)
    ref = None
    if reference is not None:
        from safetensors.torch import load_file

        tensors = load_file(reference)
        ref = lambda step: tensors  # noqa: E731 - one file, whatever the step
    with Progress("replaying", 1) as bar:
        result = replay(path, mode=mode, from_checkpoint=from_checkpoint, until=until, reference=ref,
                        entry_point=entry_point, out=out, config_overrides=_parse_set(sets) or None,
                        search_path=import_path, progress=bar.to)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2, default=str))
    else:
        click.echo(result.format())
    if result.exit_code:
        raise click.exceptions.Exit(result.exit_code)
