"""``ckpt ls``: the checkpoints of a run directory with step, time, size and status.

Without ``--deep`` a checkpoint is opened and its structure and sizes are checked, and
it is shown "committed (not verified)": only ``--deep`` re-hashes every chunk and can
say "valid". What is not a checkpoint is named (``ckpt.probe``): temporary directories,
nested run directories, step ledgers, tapes, DCP and Hugging Face directories.
"""

from __future__ import annotations

import os
from typing import Any

import click

from ckpt_cli._common import dump_json, handle_errors, human_bytes, json_option, not_found, when, wrong_kind

#: ``state`` (JSON) -> ``status`` (the text column) for what is not a checkpoint of ours
_OTHER = {
    "temporary": "temporary",
    "run": "run directory",
    "tape": "event tape",
    "dcp": "DCP checkpoint (not ours: `ckpt import dcp` converts it)",
    "hf": "Hugging Face model directory (not ours)",
    "hf-trainer": "Hugging Face Trainer checkpoint (not ours)",
    "dir": "not a checkpoint",
}


def _dir_size(path: str) -> int:
    """Bytes of the files directly in ``path`` (local or object store)."""
    from ckpt.probe import backend

    storage, p = backend(path)
    if storage is None:
        total = 0
        for name in os.listdir(p):
            try:
                total += os.lstat(os.path.join(p, name)).st_size
            except OSError:
                pass
        return total
    total = 0
    for name in storage.listdir(p):
        try:
            st = storage.lstat(os.path.join(p, name))
            total += st.st_size
        except OSError:
            pass
    return total


def _row(name: str, p: str, deep: bool) -> dict[str, Any]:
    from ckpt import CheckpointReader
    from ckpt.errors import CkptError, IncompleteCheckpointError
    from ckpt.ledger import ledger_tapes
    from ckpt.probe import backend, probe_path

    found = probe_path(p)
    row: dict[str, Any] = {"name": name, "path": p, "step": None, "time": None, "bytes": _dir_size(p), "kind": None,
                           "state": found.kind, "status": _OTHER.get(found.kind), "verified": False, "problem": None}
    if found.kind == "ledger":
        row["status"] = f"step ledger ({len(ledger_tapes(p))} tapes)"
    elif found.kind == "incomplete":
        row.update(status="incomplete", problem=found.what)
    elif found.kind == "checkpoint":
        try:
            storage, at = backend(p)
            r = CheckpointReader(at) if storage is None else CheckpointReader(at, storage=storage)
            row.update(step=r.step, time=r.manifest.created_at, kind=r.manifest.kind)
            r.verify(quick=not deep)
            row.update(state="valid" if deep else "committed", verified=deep,
                       status="valid" if deep else "committed (not verified)")
        except IncompleteCheckpointError as e:
            row.update(state="incomplete", status="incomplete", problem=str(e))
        except CkptError as e:
            row.update(state="corrupt", status="corrupt", problem=str(e))
    return row


def list_run(run_dir: str, *, deep: bool = False) -> list[dict[str, Any]]:
    """One row per directory in ``run_dir`` (or the one row of ``run_dir`` when it is a
    checkpoint itself), sorted by step so that the newest checkpoint is last."""
    from ckpt.probe import probe_path

    if probe_path(run_dir).kind == "checkpoint":
        return [_row(os.path.basename(os.path.abspath(run_dir)), run_dir, deep)]
    from ckpt.probe import list_dir

    rows = []
    for name, is_dir in list_dir(run_dir):
        p = os.path.join(run_dir, name)
        if not is_dir or os.path.islink(p):
            continue
        rows.append(_row(name, p, deep))
    rows.sort(key=lambda r: (r["step"] is None, r["step"] if r["step"] is not None else 0, r["name"]))
    return rows


@click.command("ls")
@click.argument("run_dir", metavar="RUN_DIR")
@click.option("--deep", is_flag=True, help="Re-hash every chunk (status 'valid') instead of checking structure and sizes "
                                           "(status 'committed (not verified)').")
@json_option("§4.3")
@handle_errors
def ls_cmd(run_dir: str, deep: bool, as_json: bool) -> None:
    """List the checkpoints of a run directory: committed (not verified) or, with --deep,
    valid; incomplete; corrupt; temporary; and what else is there, named."""
    from ckpt.probe import probe_path

    found = probe_path(run_dir)
    if found.kind == "missing":
        raise not_found(run_dir)
    if found.kind in ("file", "tape", "ledger", "dcp", "hf", "hf-trainer"):
        raise wrong_kind(f"not a run directory: {run_dir} is {found.describe()}")
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
