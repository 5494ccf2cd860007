"""``ckpt diff A B``: renders ``ckpt.diff.diff_checkpoints`` (the comparison lives in the library).

"tensors differ" and "RNG state differs" are separate lines, and every plain value stored
(``lr``, ``iter_num``, ``extra``) is compared; ``--ignore KEY`` leaves a category, an RNG
stream (``rng.python``), a value or a tensor key prefix out, and the exit code follows
only what was compared: 6 when the training state differs, 8 when only the config (or
commit, topology, environment) does. RNG streams that the runs' step ledgers (``ledger/``
next to each checkpoint) show were never drawn from are "unused, not compared".
"""

from __future__ import annotations

from typing import Any

import click

from ckpt_cli._common import ANY_PATH, dump_json, handle_errors, json_option


def render(rep: dict[str, Any]) -> str:
    out = [f"A {rep['a']}", f"B {rep['b']}"]
    for only in ("parts_only_in_a", "parts_only_in_b"):
        if rep.get(only):
            out.append(f"{only.replace('_', ' ')}: {', '.join(rep[only])}")
    for name, p in rep["parts"].items():
        out.append(f"part {name}: {'identical' if p['identical'] else 'differs'}")
        n_eq = sum(t["status"] == "equal" for t in p["tensors"])
        out.append(f"  tensors: {n_eq} equal, {len(p['tensors']) - n_eq} not")
        for t in p["tensors"]:
            if t["status"] == "equal":
                continue
            extra = ""
            if "max_abs_diff" in t:
                extra = f"  max abs diff {t['max_abs_diff']}"
            if "dtype" in t:
                extra = f"  dtype {t['dtype'][0]} -> {t['dtype'][1]}, shape {t['shape'][0]} -> {t['shape'][1]}"
            out.append(f"    {t['status']:<9} {t['name']}{extra}")
        if p["config"]:
            out.append(f"  config: {p['config']['hash'][0]} -> {p['config']['hash'][1]}; keys {', '.join(p['config']['keys'])}")
        if p["commit"]:
            out.append(f"  commit: {(p['commit'][0] or {}).get('sha')} -> {(p['commit'][1] or {}).get('sha')}")
        for key in ("topology", "env"):
            for line in p[key]:
                out.append(f"  {key}: {line}")
        if p["rng"]:
            out.append(f"  RNG state differs: {', '.join(p['rng'])}")
        if p.get("rng_unused"):
            out.append(f"  rng {', '.join(p['rng_unused'])}: unused in both runs (step ledger), not compared")
        for line in p["data"]:
            out.append(f"  data: {line}")
        for v in p.get("values", []):
            out.append(f"  value {v['name']}: {v['a']!r} -> {v['b']!r}" if v["status"] == "changed"
                       else f"  value {v['name']}: {v['status']}")
    for n in rep["notes"]:
        out.append(f"note: {n}")
    if rep.get("ignored"):
        out.append(f"ignored: {', '.join(rep['ignored'])}")
    if any(t["status"] != "equal" for p in rep["parts"].values() for t in p["tensors"]):
        out.append("tensors differ")
    if any(p["rng"] for p in rep["parts"].values()):
        out.append("RNG state differs")
    if rep["identical"]:
        out.append("identical")
    elif rep.get("state_identical"):
        out.append("state identical; different: " + ", ".join(rep["differs"]) + " (not the training state)")
    else:
        out.append("different: " + ", ".join(rep["differs"]))
    return "\n".join(out)


@click.command("diff")
@click.argument("a", type=ANY_PATH)
@click.argument("b", type=ANY_PATH)
@click.option("--ignore", "ignore", multiple=True, metavar="KEY",
              help="Leave out a category (tensors, rng, data, config, commit, topology, env), an RNG stream "
                   "(rng.python) or a tensor key prefix (model/, optim); repeatable.")
@json_option("§4.4")
@handle_errors
def diff_cmd(a: str, b: str, ignore: tuple[str, ...], as_json: bool) -> None:
    """Exit 0 when everything compared is identical; 6 when the training state differs
    (tensors, RNG, plain values, data position, parts); 8 when the state is identical and
    only the config, commit, topology or environment differ (a resume whose config
    changed out_dir or init_from)."""
    from ckpt.diff import diff_checkpoints, ledger_unused_streams

    rep = diff_checkpoints(a, b, ignore=ignore, unused=ledger_unused_streams(a, b))
    if as_json:
        dump_json(rep)
    else:
        click.echo(render(rep))
    if not rep["identical"]:
        raise click.exceptions.Exit(8 if rep.get("state_identical") else 6)
