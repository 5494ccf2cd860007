"""``ckpt ls``: the checkpoints of a run directory with step, time, size and status."""

from __future__ import annotations

import os
import stat
from typing import Any

import click

from ckpt_cli._common import PathOrURL, dump_json, handle_errors, human_bytes, when


def _dir_size(storage: Any, path: str) -> int:
    total = 0
    for name in storage.listdir(path):
        try:
            st = storage.lstat(os.path.join(path, name))
            total += st.st_size
        except OSError:
            pass
    return total


def _holds_checkpoints(storage: Any, path: str) -> bool:
    try:
        return any(storage.isfile(os.path.join(path, n, "MANIFEST")) for n in storage.listdir(path))
    except OSError:
        return False


def list_run(run_dir: str, *, deep: bool = False) -> list[dict[str, Any]]:
    from ckpt.errors import CkptError, IncompleteCheckpointError
    from ckpt import TMP_PREFIX, CheckpointReader
    from ckpt.ledger import ledger_tapes
    from ckpt.storage import resolve

    # The one resolver: a local directory or an object-store prefix (s3://...).
    storage, root = resolve(run_dir)
    if storage.scheme == "file":
        root = run_dir  # rows name paths the way the user typed them
    rows = []
    for name in sorted(storage.listdir(root)):
        p = os.path.join(root, name)
        try:
            st = storage.lstat(p)
        except OSError:  # removed since the listing
            continue
        if not stat.S_ISDIR(st.st_mode):  # lstat: a symlink is not followed
            continue
        row: dict[str, Any] = {"name": name, "step": None, "time": None, "bytes": _dir_size(storage, p), "status": None, "problem": None}
        if name.startswith(TMP_PREFIX):
            row["status"] = "temporary"
            rows.append(row)
            continue
        committed = storage.exists(os.path.join(p, "MANIFEST"))
        if not committed and storage.scheme == "file" and ledger_tapes(p):
            # The run's step ledger (ckpt.ledger), not a torn save.
            row["status"] = f"step ledger ({len(ledger_tapes(p))} tapes)"
            rows.append(row)
            continue
        if not committed and _holds_checkpoints(storage, p):
            # A nested run directory (e.g. a baseline's checkpoints), not a torn save.
            row["status"] = "run directory"
            rows.append(row)
            continue
        try:
            r = CheckpointReader(p, storage=storage)
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
@click.argument("run_dir", type=PathOrURL(exists=True, file_okay=False))
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
