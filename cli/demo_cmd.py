"""``ckpt demo --out DIR``: the project's main job (see README)."""

from __future__ import annotations

import sys

import click

from cli._common import handle_errors


@click.command("demo")
@click.option("--out", "out_dir", default="demo-out", show_default=True, type=click.Path(file_okay=False, path_type=str))
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=10))
@handle_errors
def demo_cmd(out_dir: str, steps: int) -> None:
    """Train, checkpoint, inspect, verify, and prove a bit-exact resume."""
    from ckpt.examples.basic_demo import DemoConfig, run

    save_every = max(steps // 3, 1)
    cfg = DemoConfig(steps=steps, save_every=save_every, resume_from_step=2 * save_every)
    res = run(out_dir, cfg, echo=click.echo, progress=sys.stdout.isatty())
    ok = res["valid"] and res["losses_identical"] and res["params_identical"] and res["optim_identical"]
    click.echo("demo: " + ("all checks passed" if ok else "A CHECK FAILED"))
    if not ok:
        raise click.exceptions.Exit(1)
