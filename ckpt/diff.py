"""Checkpoint diff: what differs between two committed checkpoints, by category.

Categories are kept apart so a caller compares what it asked for: ``tensors`` (bytes
compared exactly after chunk verification; the maximum absolute difference is computed
only for tensors that differ), ``rng`` (per stream: ``python``, ``numpy``,
``torch_cpu``, ``cuda:N``, ``generator:NAME``), ``values`` (every plain value stored:
the state's non-tensor leaves, ``iter_num``, ``best_val_loss``, and ``extra`` under
``extra.``; floats by their bits), ``data``, ``config``, ``commit``, ``topology`` and
``env``. ``config_only``: the configs differ and nothing of the state does (a resume with
``out_dir``/``init_from`` changed); ``ckpt diff`` gives that its own exit code. ``ignore`` takes category names, RNG streams as ``rng.NAME``
and tensor keys or key prefixes (``model/`` or ``optim``); ignored items are listed,
never compared. Streams named in ``unused`` (never drawn from in either run, as the
step ledger knows) are reported "unused, not compared". ``ckpt diff`` is this module
plus rendering; the tensor byte comparison here is the one the repository uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = ["diff_checkpoints", "plain_values", "STATE", "rng_streams", "tensor_diff", "TensorDelta", "max_abs_diff", "CATEGORIES",
           "ledger_unused_streams"]

CATEGORIES = ("tensors", "rng", "values", "data", "config", "commit", "topology", "env")
"""What ``diff_checkpoints`` compares, and what ``--ignore`` takes besides a stream or a key prefix."""
STATE = ("parts", "tensors", "rng", "values", "data")
"""The categories that are the training state: a difference in any is "the state differs" (exit code 6)."""


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def plain_values(tree: Any, context: Mapping[str, Any]) -> dict[str, Any]:
    """Every plain (non-tensor) value a part stores: the state tree's leaves by their
    dotted path, and ``extra``'s under ``extra.`` (tensors are compared as tensors)."""
    from .format.tree import TensorRef

    out: dict[str, Any] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, TensorRef):
            return
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, (list, tuple)) and any(isinstance(x, (dict, list, tuple, TensorRef)) for x in v):
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]")
        else:
            out[path] = v

    walk(tree, "")
    if context.get("extra") is not None:
        walk(context["extra"], "extra")
    return out


def _same_value(a: Any, b: Any) -> bool:
    import struct

    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


def _read_bytes(r: Any, pe: Any, t: Any) -> bytearray:
    buf = bytearray(t.nbytes)
    r.read_tensor_bytes_into(pe, t, memoryview(buf), verify=True)
    return buf


def max_abs_diff(a: bytes, b: bytes, dtype: str) -> float | None:
    """Max |a-b| of two equally shaped tensors' raw bytes, or None for a dtype with no numeric view."""
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

        from .format.dtypes import torch_dtype

        dt = torch_dtype(dtype)
        x = torch.frombuffer(bytearray(a), dtype=dt).to(torch.float64)
        y = torch.frombuffer(bytearray(b), dtype=dt).to(torch.float64)
        return float((x - y).abs().max()) if x.numel() else 0.0
    except Exception:
        return None


def rng_streams(rng: Mapping[str, Any] | None) -> dict[str, Any]:
    """A checkpoint's RNG field as one value per stream, named as the ledger names them."""
    rng = rng or {}
    out: dict[str, Any] = {}
    for k in ("python", "numpy", "torch_cpu"):
        if rng.get(k) is not None:
            out[k] = rng[k]
    for i, s in enumerate(rng.get("cuda") or []):
        out[f"cuda:{i}"] = s
    for name, g in (rng.get("generators") or {}).items():
        out[f"generator:{name}"] = g
    return out


def _ignored(key: str, ignore: set[str]) -> bool:
    return any(key == i or key.startswith(i.rstrip("/") + "/") or key.startswith(i + ".") for i in ignore)


def ledger_unused_streams(*checkpoint_paths: str) -> set[str]:
    """Streams never drawn from in any of the runs whose ledgers sit next to these
    checkpoints (``<parent>/ledger``, the manager's and the documented plain layout);
    empty when a checkpoint has no readable ledger (then every stream is compared)."""
    from .ledger.compare import used_streams
    from .ledger.tapefile import read_ledger_dir

    names: set[str] = set()
    used: set[str] = set()
    from .storage import url_scheme

    for p in checkpoint_paths:
        if url_scheme(os.fspath(p)) is not None:
            return set()  # an object store keeps no ledger beside its checkpoints
        tapes, _ = read_ledger_dir(os.path.join(os.path.dirname(os.path.abspath(p)), "ledger"))
        if not tapes:
            return set()
        for t in tapes:
            names |= {n for o in t.opens for n, _ in o.rng}
            used |= used_streams(t.opens, t.steps)
    return names - used


def diff_checkpoints(a_path: str, b_path: str, *, ignore: Iterable[str] = (), unused: Iterable[str] = ()) -> dict[str, Any]:
    """Compare two checkpoints; ``report["identical"]`` covers only what was compared."""
    from .context.env import env_differences
    from .reader import CheckpointReader

    ign = set(ignore)
    unused_set = set(unused)
    a, b = CheckpointReader(a_path), CheckpointReader(b_path)
    report: dict[str, Any] = {"a": a.path, "b": b.path, "parts": {}, "identical": True, "notes": [],
                              "ignored": sorted(ign), "differs": []}
    pa = {p.name: p for p in a.parts}
    pb = {p.name: p for p in b.parts}
    if set(pa) != set(pb):
        report["identical"] = False
        report["differs"].append("parts")
        report["parts_only_in_a"] = sorted(set(pa) - set(pb))
        report["parts_only_in_b"] = sorted(set(pb) - set(pa))
    differs: set[str] = set()
    for name in sorted(set(pa) & set(pb)):
        x, y = pa[name], pb[name]
        part: dict[str, Any] = {"tensors": [], "config": None, "commit": None, "topology": [], "rng": [],
                                "rng_unused": [], "env": [], "data": [], "values": []}
        if "tensors" not in ign:
            tx = {t.key: t for t in x.tensors}
            ty = {t.key: t for t in y.tensors}
            for key in sorted(set(tx) | set(ty)):
                if _ignored(key, ign):
                    continue
                if key not in ty:
                    part["tensors"].append({"name": key, "status": "only in A"})
                    continue
                if key not in tx:
                    part["tensors"].append({"name": key, "status": "only in B"})
                    continue
                ex, ey = tx[key], ty[key]
                if ex.dtype != ey.dtype or ex.shape != ey.shape:
                    part["tensors"].append({"name": key, "status": "changed", "dtype": [ex.dtype, ey.dtype],
                                            "shape": [list(ex.shape), list(ey.shape)]})
                    continue
                ba, bb = _read_bytes(a, x, ex), _read_bytes(b, y, ey)
                if ba == bb:
                    part["tensors"].append({"name": key, "status": "equal"})
                else:
                    part["tensors"].append({"name": key, "status": "changed", "max_abs_diff": max_abs_diff(ba, bb, ex.dtype)})
        ca, cb = a.context(name), b.context(name)
        cfa, cfb = ca.get("config"), cb.get("config")
        if "config" not in ign and (cfa or {}).get("hash") != (cfb or {}).get("hash"):
            from .format.codec import unpackb

            fa = _flat(unpackb(cfa["canonical"])) if cfa else {}
            fb = _flat(unpackb(cfb["canonical"])) if cfb else {}
            keys = sorted(k for k in set(fa) | set(fb) if fa.get(k, object()) != fb.get(k, object()))
            part["config"] = {"hash": [(cfa or {}).get("hash"), (cfb or {}).get("hash")], "keys": keys}
        if "commit" not in ign and ca.get("commit") != cb.get("commit"):
            part["commit"] = [ca.get("commit"), cb.get("commit")]
        ta, tb = ca.get("topology") or {}, cb.get("topology") or {}
        if "topology" not in ign:
            part["topology"] = [f"{k}: {ta.get(k)!r} -> {tb.get(k)!r}" for k in sorted(set(ta) | set(tb))
                                if ta.get(k) != tb.get(k)]
        if ta.get("world_size") != tb.get("world_size"):
            report["notes"].append(
                "world size differs: the sample sequence can continue exactly, but numerics cannot be bit-identical "
                "(reduction order changes)"
            )
        if "rng" not in ign:
            ra, rb = rng_streams(ca.get("rng")), rng_streams(cb.get("rng"))
            for k in sorted(set(ra) | set(rb)):
                if _ignored(f"rng.{k}", ign):
                    continue
                if k in unused_set:
                    part["rng_unused"].append(k)
                elif ra.get(k) != rb.get(k):
                    part["rng"].append(k)
        if "env" not in ign:
            ea, eb = ca.get("env") or {}, cb.get("env") or {}
            part["env"] = env_differences(ea, eb, keys=sorted(set(ea) | set(eb)))
        if "data" not in ign:
            part["data"] = ["data state differs"] if ca.get("data") != cb.get("data") else []
        if "values" not in ign:
            va = plain_values(a.tree(name)["state"], ca)
            vb = plain_values(b.tree(name)["state"], cb)
            part["values"] = [{"name": k, "a": va.get(k), "b": vb.get(k),
                               "status": "only in A" if k not in vb else "only in B" if k not in va else "changed"}
                              for k in sorted(set(va) | set(vb)) if not _ignored(k, ign)
                              and not (k in va and k in vb and _same_value(va[k], vb[k]))]
        here = {c for c in ("config", "commit", "topology", "rng", "env", "data", "values") if part[c]}
        if any(t["status"] != "equal" for t in part["tensors"]):
            here.add("tensors")
        part["identical"] = not here
        differs |= here
        report["parts"][name] = part
    report["differs"] += [c for c in CATEGORIES if c in differs]
    report["identical"] = not report["differs"]
    report["state_identical"] = not any(c in STATE for c in report["differs"])
    report["config_only"] = report["differs"] == ["config"]
    return report


_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


@dataclass(frozen=True, slots=True)
class TensorDelta:
    """How two tensors differ, bit for bit. ``differing``: elements whose bits differ
    (all of them when dtype or shape differ); ``first``: the first such element (flat
    index); ``max_abs``: max |x - y| over the elements, None when not numeric or shapes differ."""

    equal: bool
    differing: int | None = None
    first: int | None = None
    max_abs: float | None = None
    reason: str = ""


def tensor_diff(x: Any, y: Any, *, max_abs: bool = True) -> TensorDelta:
    """The one tensor comparison: ``ckpt diff`` (through :func:`max_abs_diff` on bytes),
    ``ckpt check-resume`` and ``ckpt replay`` all use it. NaN payloads and -0.0 count."""
    import torch

    a, b = x.detach().cpu(), y.detach().cpu()
    if a.shape != b.shape:
        return TensorDelta(False, int(max(a.numel(), b.numel())), 0, None,
                           f"dtype/shape {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
    if a.dtype != b.dtype:
        mad = float((a.double() - b.double()).abs().max().item()) if max_abs and a.numel() else None
        return TensorDelta(False, int(a.numel()), 0, mad, f"dtype/shape {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
    es = a.element_size()
    view = getattr(torch, _INT_VIEW.get(es, "uint8"))
    if es not in _INT_VIEW:  # complex128 and such: compare bytes, count elements
        view = torch.uint8
    ab = a.contiguous().reshape(-1).view(view)
    bb = b.contiguous().reshape(-1).view(view)
    ne = ab != bb
    if ne.dim() and es not in _INT_VIEW:
        ne = ne.reshape(-1, es).any(dim=1)
    n = int(ne.sum().item())
    if n == 0:
        return TensorDelta(True, 0, None, 0.0 if max_abs else None)
    first = int(ne.nonzero()[0].item())
    mad = None
    if max_abs and not a.is_complex() and a.dtype != torch.bool:
        mad = float((a.double() - b.double()).abs().max().item())
    return TensorDelta(False, n, first, mad)
