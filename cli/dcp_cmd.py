"""``ckpt import dcp`` / ``ckpt export dcp``: torch.distributed.checkpoint interop.

Import reads DCP's pickled ``.metadata`` with a restricted unpickler (only DCP's metadata
classes, torch.Size, dtypes and a few builtins; spec/sharded-format.md §S.6) and its
items with torch's weights-only loader; the result is a sharded checkpoint of ours.
"""

from __future__ import annotations

import click

from ckpt_cli._common import handle_errors


@click.group("import")
def import_group() -> None:
    """Convert another format into a checkpoint."""


@import_group.command("dcp")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--overwrite", is_flag=True, help="Replace DST if it is a checkpoint.")
@handle_errors
def import_dcp_cmd(src: str, dst: str, overwrite: bool) -> None:
    """Import the DCP checkpoint SRC (.metadata + .distcp) as the checkpoint DST."""
    from ckpt.dcp.interop import import_dcp

    info = import_dcp(src, dst, overwrite=overwrite)
    click.echo(f"imported {src} -> {info.path} (id {info.id}, {info.bytes} bytes)")


@click.group("export")
def export_group() -> None:
    """Convert a checkpoint into another format."""


@export_group.command("dcp")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@handle_errors
def export_dcp_cmd(src: str, dst: str) -> None:
    """Write the checkpoint SRC (its global state) as a DCP checkpoint at DST."""
    from ckpt.dcp.interop import export_dcp

    export_dcp(src, dst)
    click.echo(f"exported {src} -> {dst} (DCP FileSystemWriter layout)")
