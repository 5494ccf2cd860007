"""``ckpt demo [NAME] --out DIR``: run one of the reference runs in ``runs/`` (docs/reference-runs.md).

``diloco`` (the default, the project's main job): the Decoupled-DiLoCo reference run
under seeded chaos, a no-fault run, a synchronous elastic baseline, a forced replay, a
tape check, a snapshot restore continued under the tape, a syncer-fault drill, then the
report and a PNG of the loss curves (``runs/diloco/demo.py``). ``basic``: the
single-process bit-exact resume check (``--basic`` is kept as its alias). ``stages``: pipeline
stage skipping (``runs/stages/demo.py``). ``--list``
names them. Every demo ends with its named checks; the exit status is 1 when any failed.
"""

from __future__ import annotations

import importlib
from typing import Sequence

import click

from ckpt_cli._common import dump_json, handle_errors, json_option, progress_enabled, refuse_nonempty
from runs import DEMOS  # strings only: importing `runs` stays torch-free, so `--help` stays fast


class _Shell:
    """``ckpt ls`` and ``ckpt inspect`` as the basic demo shows them (runs never import cli)."""

    def ls(self, run_dir: str) -> list[str]:
        from ckpt_cli.ls_cmd import list_run

        return [f"{r['name']}  step {r['step']}  {r['bytes']} bytes  {r['status']}" for r in list_run(run_dir, deep=True)]

    def inspect(self, path: str) -> str:
        import ckpt
        from ckpt_cli.inspect_cmd import manifest_summary, render

        return render(manifest_summary(ckpt.open(path)), max_tensors=8)


@click.command("demo")
@click.argument("name", required=False, type=click.Choice(list(DEMOS)))
@click.option("--out", "out_dir", default="demo-out", show_default=True, type=click.Path(file_okay=False, path_type=str),
              help="Output directory: it must be new or empty (a demo never overwrites what an earlier one wrote).")
@click.option("--list", "list_", is_flag=True, help="List the demos, one line each, and exit.")
@click.option("--basic", is_flag=True, help="Alias of NAME=basic.")
@click.option("--quick", is_flag=True,
              help="diloco, stages, replicas, rollback: a smaller run (for tests; about 1 min each on 2 cores).")
@click.option("--transport", type=click.Choice(["gloo", "threads"]), default="gloo", show_default=True,
              help="diloco, stages: workers as processes over torch.distributed gloo, or as threads of one process.")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=10), help="basic: training steps.")
@json_option("§4.15")
@handle_errors
def demo_cmd(name: str | None, out_dir: str, list_: bool, basic: bool, quick: bool, transport: str, steps: int,
             as_json: bool) -> None:
    """Run a reference run (default: diloco, Decoupled DiLoCo under chaos) and print what it proves.

    Exit 0 when every check passed; 1 when one failed (each failed check is named);
    2 --out is not empty. With --json the report goes to stderr and stdout gets the checks."""
    if list_:
        if as_json:
            dump_json({"demos": [{"name": n, "line": d.line} for n, d in DEMOS.items()]})
            return
        for n, demo in DEMOS.items():
            click.echo(f"{n:<8} {demo.line}")
        return
    if basic:
        if name not in (None, "basic"):
            raise click.UsageError(f"--basic names the basic demo; got NAME {name}")
        name = "basic"
    name = name or next(iter(DEMOS))
    refuse_nonempty(out_dir, "--out", "a demo never overwrites an earlier one: pass a new or empty directory")
    mod_name, fn_name = DEMOS[name].entry.split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    options = {"transport": transport, "steps": steps, "shell": _Shell()}
    echo = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    checks = fn(out_dir, quick=quick, echo=echo, progress=progress_enabled(), options=options)
    _verdict(checks, name=name, out_dir=out_dir, as_json=as_json)


def _verdict(checks: Sequence[tuple[str, bool]], *, name: str = "", out_dir: str = "", as_json: bool = False) -> None:
    failed = [n for n, ok in checks if not ok]
    if as_json:
        import os

        dump_json({"demo": name, "out_dir": os.path.abspath(out_dir), "passed": not failed,
                   "checks": [{"name": n, "ok": bool(ok)} for n, ok in checks], "failed": failed})
    else:
        click.echo("checks: " + ", ".join(f"{n} {'ok' if ok else 'FAILED'}" for n, ok in checks))
        click.echo("demo: " + ("all checks passed" if not failed else "A CHECK FAILED: " + ", ".join(failed)))
    if failed:
        raise click.exceptions.Exit(1)
