"""``ckpt verify``: re-hash every chunk, or check structure and sizes with --quick."""

from __future__ import annotations

import sys

import click

from ckpt_cli._common import handle_errors, human_bytes


@click.command("verify")
@click.argument("path", type=click.Path(file_okay=False, path_type=str))
@click.option("--quick", is_flag=True, help="Structure and sizes only; no re-hash of tensor data.")
@handle_errors
def verify_cmd(path: str, quick: bool) -> None:
    """Exit 0 when valid; 3 when corrupt (naming file, chunk and byte range); 4 when incomplete."""
    from ckpt import CheckpointReader

    r = CheckpointReader(path)
    total = r.manifest.total_bytes
    if not quick and sys.stderr.isatty():
        with click.progressbar(length=total, label="verifying", file=sys.stderr) as bar:
            rep = r.verify(progress=bar.update)
    else:
        rep = r.verify(quick=quick)
    what = "structure and sizes" if quick else f"{rep.chunks} chunks, {human_bytes(rep.bytes)}"
    click.echo(f"ok: {path} ({rep.files} files, {what})")
