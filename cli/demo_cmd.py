"""``ckpt demo --out DIR``: the project's main job (see README).

By default: the Decoupled-DiLoCo reference run under seeded chaos, a no-fault run, a
synchronous elastic baseline, a forced replay, a tape check, a snapshot restore
continued under the tape, a syncer-fault drill (the run continued live from a
snapshot on a new tape, which is checked and replayed), then the report and a
PNG of the loss curves (``replay/diloco/demo.py``). ``--basic``: the single-process
bit-exact resume check.
"""

from __future__ import annotations

import sys

import click

from cli._common import handle_errors


@click.command("demo")
@click.option("--out", "out_dir", default="demo-out", show_default=True, type=click.Path(file_okay=False, path_type=str))
@click.option("--basic", is_flag=True, help="The single-process checkpoint / bit-exact resume demo instead.")
@click.option("--quick", is_flag=True, help="A small reference run (seconds; for tests).")
@click.option("--transport", type=click.Choice(["gloo", "threads"]), default="gloo", show_default=True,
              help="Learners as processes over torch.distributed gloo, or as threads of one process.")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=10), help="--basic: training steps.")
@handle_errors
def demo_cmd(out_dir: str, basic: bool, quick: bool, transport: str, steps: int) -> None:
    """Run the Decoupled-DiLoCo reference run under chaos and print what it proves."""
    if basic:
        from ckpt.examples.basic_demo import DemoConfig, run

        save_every = max(steps // 3, 1)
        cfg = DemoConfig(steps=steps, save_every=save_every, resume_from_step=2 * save_every)
        res = run(out_dir, cfg, echo=click.echo, progress=sys.stdout.isatty())
        ok = res["valid"] and res["losses_identical"] and res["params_identical"] and res["optim_identical"]
    else:
        from replay.diloco.demo import run_demo

        rep = run_demo(out_dir, quick=quick, transport=transport, echo=click.echo, progress=sys.stdout.isatty())
        ok = rep.ok()
    click.echo("demo: " + ("all checks passed" if ok else "A CHECK FAILED"))
    if not ok:
        raise click.exceptions.Exit(1)
