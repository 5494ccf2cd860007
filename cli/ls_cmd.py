"""``ckpt ls``: the checkpoints of a run directory with step, time, size and status."""

from __future__ import annotations

import os
from typing import Any

import click

from ckpt_cli._common import dump_json, handle_errors, human_bytes, when


def _dir_size(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        try:
            st = os.lstat(os.path.join(path, name))
            total += st.st_size
        except OSError:
            pass
    return total


def _holds_checkpoints(path: str) -> bool:
    try:
        return any(os.path.isfile(os.path.join(path, n, "MANIFEST")) for n in os.listdir(path))
    except OSError:
        return False


def list_run(run_dir: str, *, deep: bool = False) -> list[dict[str, Any]]:
    from ckpt.errors import CkptError, IncompleteCheckpointError
    from ckpt import TMP_PREFIX, CheckpointReader
    from ckpt.ledger import ledger_tapes

    rows = []
    for name in sorted(os.listdir(run_dir)):
        p = os.path.join(run_dir, name)
        if not os.path.isdir(p) or os.path.islink(p):
            continue
        row: dict[str, Any] = {"name": name, "step": None, "time": None, "bytes": _dir_size(p), "status": None, "problem": None}
        if name.startswith(TMP_PREFIX):
            row["status"] = "temporary"
            rows.append(row)
            continue
        if not os.path.exists(os.path.join(p, "MANIFEST")) and ledger_tapes(p):
            # The run's step ledger (ckpt.ledger), not a torn save.
            row["status"] = f"step ledger ({len(ledger_tapes(p))} tapes)"
            rows.append(row)
            continue
        if not os.path.exists(os.path.join(p, "MANIFEST")) and _holds_checkpoints(p):
            # A nested run directory (e.g. a baseline's checkpoints), not a torn save.
            row["status"] = "run directory"
            rows.append(row)
            continue
        try:
            r = CheckpointReader(p)
            row.update(step=r.step, time=r.manifest.created_at, kind=r.manifest.kind)
            r.verify(quick=not deep)
            row["status"] = "valid"
        except IncompleteCheckpointError as e:
            row.update(status="incomplete", problem=str(e))
        except CkptError as e:
            row.update(status="corrupt", problem=str(e))
        rows.append(row)
    # Sorted by step where known so the newest checkpoint is last, as a user expects.
    rows.sort(key=lambda r: (r["step"] is None, r["step"] if r["step"] is not None else 0, r["name"]))
    return rows


@click.command("ls")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--deep", is_flag=True, help="Re-hash every chunk instead of checking structure and sizes.")
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def ls_cmd(run_dir: str, deep: bool, as_json: bool) -> None:
    """List checkpoints: valid, incomplete, corrupt; temporary dirs are shown as such."""
    rows = list_run(run_dir, deep=deep)
    if as_json:
        dump_json(rows)
        return
    if not rows:
        click.echo(f"no checkpoints in {run_dir}")
        return
    w = max(len(r["name"]) for r in rows)
    click.echo(f"{'name':<{w}}  {'step':>8}  {'time':<23}  {'size':>10}  status")
    for r in rows:
        step = "-" if r["step"] is None else str(r["step"])
        line = f"{r['name']:<{w}}  {step:>8}  {when(r['time']):<23}  {human_bytes(r['bytes']):>10}  {r['status']}"
        if r["problem"]:
            line += f"  ({r['problem']})"
        click.echo(line)
