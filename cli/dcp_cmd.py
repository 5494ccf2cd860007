"""``ckpt import dcp`` / ``ckpt export dcp`` (torch.distributed.checkpoint interop), and
the ``import`` / ``export`` groups (``ckpt export hf`` lives in ``hf_cmd``).

Import reads DCP's pickled ``.metadata`` with a restricted unpickler (only DCP's metadata
classes, torch.Size, dtypes and a few builtins; spec/sharded-format.md §S.6) and its
items with torch's weights-only loader; the result is a sharded checkpoint of ours.
"""

from __future__ import annotations

import click

from ckpt_cli._common import ANY_PATH, Progress, dump_json, handle_errors, json_option, not_found, refuse_nonempty, \
    wrong_kind
from ckpt_cli.hf_cmd import export_hf_cmd


@click.group("import")
def import_group() -> None:
    """Convert another format into a checkpoint."""


@import_group.command("dcp")
@click.argument("src", type=ANY_PATH)
@click.argument("dst", type=ANY_PATH)
@click.option("--overwrite", is_flag=True, help="Replace DST if it is a checkpoint.")
@json_option("§4.12")
@handle_errors
def import_dcp_cmd(src: str, dst: str, overwrite: bool, as_json: bool) -> None:
    """Import the DCP checkpoint SRC (.metadata + .distcp) as the checkpoint DST.

    Exit 0; 2 DST exists (without --overwrite); 3 SRC corrupt or refused by the
    restricted unpickler; 5 SRC missing; 7 SRC is not a DCP checkpoint (what it is named)."""
    from ckpt.convert.dcp import import_dcp
    from ckpt.probe import probe_path

    found = probe_path(src)
    if found.kind == "missing":
        raise not_found(src)
    if found.kind != "dcp":
        raise wrong_kind(f"not a DCP checkpoint: {src} is {found.what}")
    if not overwrite:
        refuse_nonempty(dst, "DST", "--overwrite replaces a checkpoint there")
    with Progress("importing", 1) as bar:
        info = import_dcp(src, dst, overwrite=overwrite, progress=bar.to)
    if as_json:
        dump_json({"src": src, "path": info.path, "id": info.id, "step": info.step, "bytes": info.bytes})
        return
    click.echo(f"imported {src} -> {info.path} (id {info.id}, {info.bytes} bytes)")


@click.group("export")
def export_group() -> None:
    """Convert a checkpoint into another format (dcp, hf)."""


@export_group.command("dcp")
@click.argument("src", type=ANY_PATH)
@click.argument("dst", type=ANY_PATH)
@json_option("§4.13")
@handle_errors
def export_dcp_cmd(src: str, dst: str, as_json: bool) -> None:
    """Write the checkpoint SRC (its global state) as a DCP checkpoint at DST.

    Exit 0; 2 DST not empty; 3 corrupt; 4 incomplete; 5 SRC missing; 7 not a checkpoint."""
    from ckpt import CheckpointReader
    from ckpt.convert.dcp import export_dcp

    CheckpointReader(src)  # what SRC is, before anything is written (exit 3/4/5/7)
    refuse_nonempty(dst, "DST", "export into a new or empty directory")
    with Progress("exporting", 1) as bar:
        export_dcp(src, dst, progress=bar.to)
    if as_json:
        dump_json({"src": src, "dst": dst, "format": "dcp"})
        return
    click.echo(f"exported {src} -> {dst} (DCP FileSystemWriter layout)")


export_group.add_command(export_hf_cmd)
