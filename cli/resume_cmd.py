"""``ckpt check-resume``: kill a training entry point with SIGKILL, resume it, compare bits.

No torch at import time: the check imports it when it runs.
"""

from __future__ import annotations

import click

from ckpt_cli._common import Progress, dump_json, handle_errors, json_option

__all__ = ["check_resume_cmd"]


def _kill_steps(values: tuple[str, ...]) -> list[int]:
    out = []
    for v in values:
        for part in v.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise click.BadParameter(f"{part!r} is not a step number", param_hint="--kill-at") from None
    return out


@click.command("check-resume", context_settings={"allow_interspersed_args": False})
@click.option("--entry", default=None, metavar="MODULE:FUNCTION", help="Training entry point train(ctx); see ckpt.testing.resume_entry.")
@click.option("--kills", type=click.IntRange(min=1), default=1, show_default=True,
              help="With -- COMMAND and no --kill-at: how many random kill steps.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--steps", type=click.IntRange(min=2), default=12, show_default=True, help="Optimizer steps per run.")
@click.option("--kill-at", "kill_at", multiple=True, metavar="K", help="Step(s) to SIGKILL at, in order (repeat or comma-separate).")
@click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True, help="Processes (gloo ranks) per attempt.")
@click.option("--save-every", type=click.IntRange(min=1), default=3, show_default=True, help="Checkpoint interval in steps.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE", help="Passed to the entry as ctx.options.")
@click.option("--sync", "sync", is_flag=True, help="Blocking saves (default: async).")
@click.option("--isolation", type=click.Choice(["forkserver", "exec"]), default="forkserver", show_default=True,
              help="forkserver: fork attempts from a process that only imported torch; exec: a new interpreter each.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=str), default=None, help="Keep run dirs and logs here.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds per attempt.")
@json_option("§4.5")
def check_resume_cmd(
    entry: str | None,
    kills: int,
    command: tuple[str, ...],
    steps: int,
    kill_at: tuple[str, ...],
    world_size: int,
    save_every: int,
    seed: int,
    options: tuple[str, ...],
    sync: bool,
    isolation: str,
    work_dir: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Run ENTRY straight through and killed-and-resumed; compare parameters, optimizer
    state, RNG and every step's loss bit for bit.

    Exit 0 IDENTICAL; 6 DIFFERENT, or REFUSED when the attempts' environments or world
    sizes differ or nothing resumed (no exactness claim is made); 1 when an attempt crashed.

    Or ``ckpt check-resume [--kill-at K | --kills N] -- COMMAND ...``: run an unmodified
    script in this directory (it finds its config and data files as always), SIGKILL it at
    chosen or random steps, let it resume, and compare the step ledgers and final
    checkpoints (ckpt.testing.resume_command). The check installs its kill switch in the
    script's ckpt.save/ckpt.load default ledger, CheckpointManager or ckpt.ledger.Ledger
    (a sitecustomize on PYTHONPATH; ckpt.testing.kill_switch). Each run needs its own output place: write {run} where the command
    names its output directory (--out_dir={run}); it becomes WORK/straight or
    WORK/resumed (also $CKPT_CHECK_RUN). A ledger outside it is refused, naming both
    directories. A script that resumes only when told (--init_from=resume) gets
    {resume}: 'scratch' in a run's first attempt, 'resume' after a kill
    (--init_from={resume}; also $CKPT_CHECK_RESUME=0/1):

    \b
      ckpt check-resume --kill-at 40 -- python train.py --out_dir={run} --init_from={resume}

    Exit 0 IDENTICAL, 6 DIFFERENT, 2 NO CLAIM (no ledger, no checkpoint reached, or the
    command failed).
    """
    if command:
        if entry:
            raise click.UsageError("give either --entry or -- COMMAND, not both")
        from ckpt.testing.resume_command import check_command

        with Progress("runs", 1) as bar:
            res = check_command(list(command), kill_at=_kill_steps(kill_at), kills=kills, seed=seed, work=work_dir,
                                timeout=timeout, progress=bar.to)
        if as_json:
            dump_json({"mode": "command", "verdict": res.verdict, "exit_code": res.exit_code, "lines": list(res.lines),
                       "kill_at": list(res.kill_at), "work_dir": res.work})
        else:
            click.echo(res.text)
        raise click.exceptions.Exit(res.exit_code)
    if not entry:
        raise click.UsageError("give --entry MODULE:FUNCTION or -- COMMAND ...")
    opts = {}
    for o in options:
        key, sep, value = o.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{o!r} is not KEY=VALUE", param_hint="--option")
        opts[key] = value
    kills = _kill_steps(kill_at)
    # Exit codes are raised out here: handle_errors would print click's Exit as an error.
    code = _run(entry, steps, kills, world_size, save_every, seed, opts, sync, isolation, work_dir, timeout, as_json)
    if code:
        raise click.exceptions.Exit(code)


@handle_errors
def _run(
    entry: str,
    steps: int,
    kill_at: list[int],
    world_size: int,
    save_every: int,
    seed: int,
    options: dict[str, str],
    sync: bool,
    isolation: str,
    work_dir: str | None,
    timeout: float,
    as_json: bool,
) -> int:
    from ckpt.testing.resume_entry import check_resume

    try:
        with Progress("attempts", 1) as bar:
            result = check_resume(
                entry,
                steps=steps,
                kill_at=kill_at,
                world_size=world_size,
                save_every=save_every,
                seed=seed,
                options=options,
                async_save=not sync,
                work_dir=work_dir,
                timeout=timeout,
                isolation=isolation,
                progress=bar.to,
            )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        dump_json(
            {
                "mode": "entry",
                "verdict": result.verdict,
                "exit_code": result.exit_code,
                "identical": result.identical,
                "refused": list(result.refused),
                "divergences": [
                    {"where": d.where, "step": d.step, "field": d.field, "key": d.tensor, "rank": d.rank, "detail": d.detail}
                    for d in result.divergences
                ],
                "resumes": [{"attempt": e.attempt, "checkpoint": e.checkpoint, "step": e.step, "killed_at": e.killed_at} for e in result.resumes],
                "losses_compared": result.losses_compared,
                "tensors_compared": result.tensors_compared,
                "work_dir": result.work_dir,
            }
        )
    else:
        click.echo(result.summary())
    return result.exit_code
