"""``ckpt verify PATH...``: re-hash every chunk (or check structure and sizes with --quick)
of each checkpoint named, and of every checkpoint in each run directory named.

A thin rendering of ``ckpt.audit.verify_paths``: one line per checkpoint, a summary
line, and one exit code, the smallest non-zero one of the outcomes (spec/cli.md §2).
"""

from __future__ import annotations

import click

from ckpt_cli._common import Progress, dump_json, handle_errors, human_bytes, json_option

_MARK = {"valid": "ok", "structure ok": "ok", "skipped": "skipped"}


def outcome_json(o: object) -> dict[str, object]:
    keys = ("path", "status", "exit_code", "kind", "step", "files", "chunks", "bytes", "message")
    return {k: getattr(o, k) for k in keys}


@click.command("verify")
@click.argument("paths", metavar="PATH...", nargs=-1, required=True)
@click.option("--quick", is_flag=True, help="Structure and sizes only; no re-hash of tensor data.")
@json_option("§4.2")
@handle_errors
def verify_cmd(paths: tuple[str, ...], quick: bool, as_json: bool) -> None:
    """Verify checkpoints, and every checkpoint in the run directories given.

    Exit 0 when all are valid; otherwise the most severe outcome: 3 corrupt (file, chunk
    and byte range named), 4 incomplete, 5 missing, 7 not a checkpoint (what it is named)."""
    from ckpt.audit import STATUSES, overall_exit_code, verify_paths

    with Progress("verifying", 1, enabled=None if not quick else False) as bar:
        outcomes = verify_paths(paths, quick=quick, progress=bar.to)
    code = overall_exit_code(outcomes)
    checked = [o for o in outcomes if o.status != "skipped"]
    ok = [o for o in checked if o.exit_code == 0]
    counts: dict[str, int] = {}
    for o in checked:
        counts[o.status] = counts.get(o.status, 0) + 1
    if as_json:
        dump_json({"quick": quick, "results": [outcome_json(o) for o in outcomes],
                   "summary": {"checked": len(checked), "ok": len(ok), "failed": len(checked) - len(ok),
                               "skipped": len(outcomes) - len(checked), "by_status": counts, "exit_code": code}})
        raise click.exceptions.Exit(code)
    for o in outcomes:
        if o.status in ("valid", "structure ok"):
            what = "structure and sizes" if quick else f"{o.chunks} chunks, {human_bytes(o.bytes)}"
            click.echo(f"ok: {o.path} ({o.files} files, {what})")
        elif o.status == "skipped":
            click.echo(f"skipped: {o.path}: {o.message}")
        else:
            click.echo(f"{o.status.upper()}: {o.path}: {o.message}", err=True)
    if len(outcomes) > 1 or len(paths) > 1:
        order = {s: i for i, s in enumerate(STATUSES)}
        parts = [f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: order.get(kv[0], 99))]
        skipped = len(outcomes) - len(checked)
        click.echo(f"summary: {len(checked)} checked: {', '.join(parts) or 'nothing found'}"
                   + (f"; {skipped} skipped" if skipped else "") + f"; exit {code}")
    raise click.exceptions.Exit(code)
