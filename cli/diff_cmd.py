"""``ckpt diff A B``: tensors, config keys, commit, topology, RNG and environment.

Tensor bytes are compared exactly (after chunk verification). Max abs diff is
computed with numpy when available, else torch, only for tensors that differ.
"""

from __future__ import annotations

from typing import Any

import click

from cli._common import dump_json, handle_errors


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def _read_bytes(r: Any, pe: Any, t: Any) -> bytearray:
    buf = bytearray(t.nbytes)
    r.read_tensor_bytes_into(pe, t, memoryview(buf), verify=True)
    return buf


def _max_abs_diff(a: bytes, b: bytes, dtype: str, shape: tuple[int, ...]) -> float | None:
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        table = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4", "int16": "<i2",
                 "int8": "i1", "uint8": "u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "bool": "?",
                 "complex64": "<c8", "complex128": "<c16"}
        if dtype in table:
            x = np.frombuffer(a, dtype=table[dtype]).astype(np.complex128 if "complex" in dtype else np.float64)
            y = np.frombuffer(b, dtype=table[dtype]).astype(np.complex128 if "complex" in dtype else np.float64)
            with np.errstate(invalid="ignore"):
                return float(np.nanmax(np.abs(x - y))) if x.size else 0.0
        if dtype == "bfloat16":
            x = (np.frombuffer(a, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            y = (np.frombuffer(b, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            with np.errstate(invalid="ignore"):
                return float(np.nanmax(np.abs(x - y))) if x.size else 0.0
    try:
        import torch

        from ckpt.format.dtypes import torch_dtype

        dt = torch_dtype(dtype)
        x = torch.frombuffer(bytearray(a), dtype=dt).to(torch.float64)
        y = torch.frombuffer(bytearray(b), dtype=dt).to(torch.float64)
        return float((x - y).abs().max()) if x.numel() else 0.0
    except Exception:
        return None


def diff_checkpoints(a_path: str, b_path: str) -> dict[str, Any]:
    from ckpt.context.env import env_differences
    from ckpt.reader import CheckpointReader

    a, b = CheckpointReader(a_path), CheckpointReader(b_path)
    report: dict[str, Any] = {"a": a.path, "b": b.path, "parts": {}, "identical": True, "notes": []}
    pa = {p.name: p for p in a.parts}
    pb = {p.name: p for p in b.parts}
    if set(pa) != set(pb):
        report["identical"] = False
        report["parts_only_in_a"] = sorted(set(pa) - set(pb))
        report["parts_only_in_b"] = sorted(set(pb) - set(pa))
    for name in sorted(set(pa) & set(pb)):
        x, y = pa[name], pb[name]
        part: dict[str, Any] = {"tensors": [], "config": None, "commit": None, "topology": [], "rng": [], "env": [], "data": []}
        tx = {t.key: t for t in x.tensors}
        ty = {t.key: t for t in y.tensors}
        for key in sorted(set(tx) | set(ty)):
            if key not in ty:
                part["tensors"].append({"name": key, "status": "only in A"})
                continue
            if key not in tx:
                part["tensors"].append({"name": key, "status": "only in B"})
                continue
            ex, ey = tx[key], ty[key]
            if ex.dtype != ey.dtype or ex.shape != ey.shape:
                part["tensors"].append({"name": key, "status": "changed", "dtype": [ex.dtype, ey.dtype], "shape": [list(ex.shape), list(ey.shape)]})
                continue
            ba, bb = _read_bytes(a, x, ex), _read_bytes(b, y, ey)
            if ba == bb:
                part["tensors"].append({"name": key, "status": "equal"})
            else:
                part["tensors"].append({"name": key, "status": "changed", "max_abs_diff": _max_abs_diff(ba, bb, ex.dtype, ex.shape)})
        ca, cb = a.context(name), b.context(name)
        cfa, cfb = ca.get("config"), cb.get("config")
        if (cfa or {}).get("hash") != (cfb or {}).get("hash"):
            from ckpt.format.codec import unpackb

            fa = _flat(unpackb(cfa["canonical"])) if cfa else {}
            fb = _flat(unpackb(cfb["canonical"])) if cfb else {}
            keys = sorted(k for k in set(fa) | set(fb) if fa.get(k, object()) != fb.get(k, object()))
            part["config"] = {"hash": [(cfa or {}).get("hash"), (cfb or {}).get("hash")], "keys": keys}
        if ca.get("commit") != cb.get("commit"):
            part["commit"] = [ca.get("commit"), cb.get("commit")]
        ta, tb = ca.get("topology") or {}, cb.get("topology") or {}
        part["topology"] = [f"{k}: {ta.get(k)!r} -> {tb.get(k)!r}" for k in sorted(set(ta) | set(tb)) if ta.get(k) != tb.get(k)]
        if ta.get("world_size") != tb.get("world_size"):
            report["notes"].append(
                "world size differs: the sample sequence can continue exactly, but numerics cannot be bit-identical "
                "(reduction order changes)"
            )
        ra, rb = ca.get("rng") or {}, cb.get("rng") or {}
        part["rng"] = [k for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k)]
        part["env"] = env_differences(ca.get("env") or {}, cb.get("env") or {}, keys=sorted(set(ca.get("env") or {}) | set(cb.get("env") or {})))
        part["data"] = ["data state differs"] if ca.get("data") != cb.get("data") else []
        changed = any(t["status"] != "equal" for t in part["tensors"]) or any(
            part[k] for k in ("config", "commit", "topology", "rng", "env", "data")
        )
        part["identical"] = not changed
        if changed:
            report["identical"] = False
        report["parts"][name] = part
    return report


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
            out.append(f"  rng streams differ: {', '.join(p['rng'])}")
        for line in p["data"]:
            out.append(f"  data: {line}")
    for n in rep["notes"]:
        out.append(f"note: {n}")
    out.append("identical" if rep["identical"] else "different")
    return "\n".join(out)


@click.command("diff")
@click.argument("a", type=click.Path(file_okay=False, path_type=str))
@click.argument("b", type=click.Path(file_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def diff_cmd(a: str, b: str, as_json: bool) -> None:
    """Exit 0 when identical (apart from volatile fields), 6 when different."""
    rep = diff_checkpoints(a, b)
    if as_json:
        dump_json(rep)
    else:
        click.echo(render(rep))
    if not rep["identical"]:
        raise click.exceptions.Exit(6)
