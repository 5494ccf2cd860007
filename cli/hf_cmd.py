"""``ckpt export hf CKPT OUT_DIR``: one entry in the Hugging Face layout (``ckpt.convert.hf``)."""

from __future__ import annotations

import os

import click

from ckpt_cli._common import ANY_PATH, Progress, dump_json, handle_errors, human_bytes, json_option, refuse_nonempty


@click.command("hf")
@click.argument("src", metavar="CKPT", type=ANY_PATH)
@click.argument("out_dir", metavar="OUT_DIR", type=ANY_PATH)
@click.option("--entry", default="model", show_default=True, help="The state entry to export (a module's state_dict).")
@click.option("--part", default=None, help="The part to read (default: the only one, or the first that holds ENTRY).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Shard above this size (transformers' units: 5GB, 500MB, 2GiB), with model.safetensors.index.json.")
@click.option("--config-key", default=None, metavar="KEY",
              help="Write config.json from this value of the saved config (default: the config itself when it has "
                   "model_type, or its only value that has one).")
@click.option("--overwrite", is_flag=True, help="Replace an earlier export in OUT_DIR (other files are left alone).")
@json_option("§4.14")
@handle_errors
def export_hf_cmd(src: str, out_dir: str, entry: str, part: str | None, max_shard_size: str, config_key: str | None,
                  overwrite: bool, as_json: bool) -> None:
    """Write ENTRY of checkpoint CKPT as model.safetensors (or shards and an index) with
    plain parameter names, tied weights as transformers expects, and config.json when
    the checkpoint holds an HF config; from_pretrained(OUT_DIR) then loads it.

    Exit 0; 2 OUT_DIR not empty (without --overwrite) or no such ENTRY; 3 corrupt;
    4 incomplete; 5 CKPT missing; 7 CKPT is not a checkpoint."""
    from ckpt import CheckpointReader
    from ckpt.convert.hf import export_hf, parse_size

    try:
        parse_size(max_shard_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-shard-size") from None
    r = CheckpointReader(src)
    names = r.entries(part) if part is not None or len(r.parts) == 1 else r.entries(r.parts[0].name)
    if entry not in names:
        raise click.BadParameter(f"no entry {entry!r} in {src} (it has {', '.join(names)})", param_hint="--entry")
    if not overwrite:
        refuse_nonempty(out_dir, "OUT_DIR", "--overwrite replaces an earlier export")
    total = r.manifest.total_bytes
    from ckpt.errors import UnsupportedValueError

    with Progress("exporting", total) as bar:
        try:
            res = export_hf(src, out_dir, entry=entry, part=part, max_shard_size=max_shard_size, config_key=config_key,
                            overwrite=overwrite, progress=lambda done, n: bar.to(done, n))
        except UnsupportedValueError as e:
            raise click.BadParameter(str(e), param_hint="--entry") from None
    if as_json:
        dump_json(res.to_json())
        return
    weights = [f for f in res.files if f.endswith(".safetensors")]
    shown = weights[0] if len(weights) == 1 else f"{len(weights)} shards + model.safetensors.index.json"
    click.echo(f"exported {entry!r} of {src} -> {out_dir}: {shown} ({res.tensors} tensors, {human_bytes(res.total_size)})")
    for kept, dropped in res.tied:
        click.echo(f"  tied: {dropped} is {kept} (written once; from_pretrained ties it)")
    if res.config:
        click.echo(f"  config: {os.path.join(out_dir, res.config)}")
    else:
        click.echo(f"  config: not written ({res.config_note})")
    for k in res.skipped:
        click.echo(f"  skipped {k}: not a tensor (the HF layout holds tensors only)")
