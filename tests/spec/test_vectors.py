"""Every vector in spec/vectors/checkpoint/ behaves exactly as its expected.json says.

Valid vectors load with the recorded bytes (lazily, fresh and in place); invalid ones
raise exactly the recorded class at exactly the recorded stage, and every earlier
stage succeeds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
import ckpt.errors
from ckpt.format import dtypes
from ckpt.writer import tensor_memoryview

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "spec" / "vectors" / "checkpoint"
STAGES = ("open", "verify", "state")

_spec = importlib.util.spec_from_file_location("make_vectors", REPO / "spec" / "vectors" / "make_vectors.py")
assert _spec is not None and _spec.loader is not None
make_vectors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_vectors)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def vector_names() -> list[str]:
    return sorted(p.parent.name for p in VECTORS.glob("*/expected.json"))


def raw(t: torch.Tensor) -> bytes:
    c = t.detach().contiguous().cpu()
    return tensor_memoryview(c).tobytes()


def tensor_from(desc: dict[str, Any]) -> torch.Tensor:
    data = bytes.fromhex(desc["hex"])
    dt = dtypes.torch_dtype(desc["dtype"])
    if not data:
        return torch.empty(desc["shape"], dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(desc["shape"])


def assert_tensor(got: Any, desc: dict[str, Any], where: str) -> None:
    assert isinstance(got, torch.Tensor), where
    assert dtypes.dtype_name(got.dtype) == desc["dtype"] and list(got.shape) == desc["shape"], where
    assert raw(got).hex() == desc["hex"], f"{where}: bytes differ"
    want = tensor_from(desc)
    try:
        eq = torch.equal(got, want)
    except (NotImplementedError, RuntimeError):
        return  # no equal kernel for this dtype: the bytes decided
    if not (got.is_floating_point() and bool(torch.isnan(got).any())):
        assert eq, where


def assert_tree(got: Any, want: Any, where: str) -> None:
    """``want`` is tagged JSON whose tensors are inline descriptions."""
    if isinstance(want, dict) and set(want) == {"$tensor"}:
        assert_tensor(got, want["$tensor"], where)
        return
    if isinstance(want, dict) and len(want) == 1 and next(iter(want)).startswith("$") and next(iter(want)) != "$map":
        tag = next(iter(want))
        if tag == "$tuple":
            assert type(got) is tuple and len(got) == len(want[tag]), where
            for i, (g, w) in enumerate(zip(got, want[tag])):
                assert_tree(g, w, f"{where}/{i}")
            return
        expected = make_vectors.from_tagged(want, lambda key: None)
        assert type(got) is type(expected), f"{where}: {type(got).__name__} != {type(expected).__name__}"
        if isinstance(expected, float):
            assert struct.pack("<d", got) == struct.pack("<d", expected), where
        else:
            assert got == expected, where
        return
    if isinstance(want, dict) and set(want) == {"$map"}:
        assert isinstance(got, dict) and len(got) == len(want["$map"]), where
        for k, w in want["$map"]:
            key = make_vectors.from_tagged(k, lambda key: None)
            assert key in got and type(next(x for x in got if x == key)) is type(key), f"{where}: key {key!r}"
            assert_tree(got[key], w, f"{where}/{key}")
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(map(str, got))} != {sorted(want)}"
        for k, w in want.items():
            assert_tree(got[k], w, f"{where}/{k}")
        return
    if isinstance(want, list):
        assert type(got) is list and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_tree(g, w, f"{where}/{i}")
        return
    assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def lookup(tree: Any, path: str) -> Any:
    cur = tree
    for seg in path.split("/"):
        cur = cur[int(seg)] if isinstance(cur, list) else cur[seg]
    return cur


def _run_stage(stage: str, path: Path, r: Any) -> Any:
    if stage == "open":
        return ckpt.open(path)
    if stage == "verify":
        r.verify()
        return r
    for pe in r.parts:
        r.state(part=pe.name)
    return r


def test_there_are_vectors_of_both_kinds() -> None:
    names = vector_names()
    assert sum(n.startswith("valid-") for n in names) >= 5
    assert sum(n.startswith("invalid-") for n in names) >= 15
    total = sum(f.stat().st_size for f in VECTORS.rglob("*") if f.is_file())
    assert total < 200_000, f"vectors take {total} bytes"


@pytest.mark.parametrize("name", vector_names())
def test_vector(name: str) -> None:
    check_vector(VECTORS / name)


def check_vector(vec: Path) -> None:
    """What expected.json says of one vector (also used for the format 2.0 vectors)."""
    name = vec.name
    exp = json.loads((vec / "expected.json").read_text())
    path = vec / exp["path"]
    if exp["result"] == "error":
        cls = getattr(ckpt.errors, exp["error"])
        stage = exp["stage"]
        r: Any = None
        for s in STAGES[: STAGES.index(stage)]:
            r = _run_stage(s, path, r)  # every earlier stage succeeds
        with pytest.raises(cls) as ei:
            _run_stage(stage, path, r)
        assert type(ei.value) is cls, f"{name}: got {type(ei.value).__name__}: {ei.value}"
        assert ei.value.path is not None and f"file {ei.value.path}" in str(ei.value)
        return

    assert exp["result"] == "ok"
    r = ckpt.open(path)
    m = exp["manifest"]
    assert r.manifest.id == m["id"] and list(r.manifest.version) == m["version"]
    assert r.manifest.kind == m["kind"] and r.manifest.step == m["step"]
    assert struct.pack(">d", r.manifest.created_at).hex() == m["created_at"]["$float"]
    assert sorted(f.name for f in r.manifest.files) == m["files"]
    assert sorted(p.name for p in r.parts) == sorted(exp["parts"])
    r.verify()
    for part, pexp in exp["parts"].items():
        # the tensor table, read lazily one tensor at a time
        assert sorted(t.key for t in r.tensor_entries(part)) == sorted(pexp["tensors"])
        for key, desc in pexp["tensors"].items():
            assert_tensor(r.tensor(key, part=part), desc, f"{name}:{part}:{key}")
        # the whole state, fresh
        fresh = r.state(part=part)
        assert_tree(fresh, pexp["state"], f"{name}:{part}")
        for a, b in pexp["aliases"]:
            assert lookup(fresh, a) is lookup(fresh, b), (a, b)
        # the whole state, in place into plain dicts
        targets: dict[str, Any] = {k: {} if isinstance(v, dict) else [] for k, v in pexp["state"].items()}
        ckpt.load(path, targets, part=part, restore_rng=False, exactness="off")
        assert_tree(targets, pexp["state"], f"{name}:{part}:in-place")


def test_tiny_model_vector_loads_into_real_objects() -> None:
    exp = json.loads((VECTORS / "valid-tiny-model-optim" / "expected.json").read_text())
    path = VECTORS / "valid-tiny-model-optim" / exp["path"]
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    ckpt.load(path, {"model": model, "optim": opt}, restore_rng=False, exactness="off")
    state = exp["parts"]["rank-00000"]["state"]
    assert_tensor(model.weight.detach(), state["model"]["weight"]["$tensor"], "weight")
    assert_tensor(model.bias.detach(), state["model"]["bias"]["$tensor"], "bias")
    assert_tree(opt.state_dict(), state["optim"], "optim")
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.99)


def test_stock_safetensors_reads_the_vector_weights() -> None:
    import safetensors.torch

    exp = json.loads((VECTORS / "valid-every-dtype" / "expected.json").read_text())
    f = VECTORS / "valid-every-dtype" / exp["path"] / "rank-00000.safetensors"
    stock = safetensors.torch.load_file(str(f))
    for key, desc in exp["parts"]["rank-00000"]["tensors"].items():
        got = stock[key]
        if dtypes.is_raw(desc["dtype"]):
            assert got.dtype == torch.uint8 and raw(got).hex() == desc["hex"], key
        else:
            assert_tensor(got, desc, f"stock {key}")


@pytest.mark.timeout(120)
def test_the_generator_is_deterministic(tmp_path: Path) -> None:
    make_vectors.build(tmp_path / "a")
    make_vectors.build(tmp_path / "b")
    files_a = sorted(str(p.relative_to(tmp_path / "a")) for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(str(p.relative_to(tmp_path / "b")) for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b and files_a
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    # the committed vectors name the same files (regenerate them after a format change)
    committed = sorted(str(p.relative_to(VECTORS)) for p in VECTORS.rglob("*") if p.is_file())
    assert committed == files_a
    for rel in files_a:
        if rel.endswith(".safetensors"):  # no compressor involved: bytes must match exactly
            assert (VECTORS / rel).read_bytes() == (tmp_path / "a" / rel).read_bytes(), rel
    assert os.path.isdir(VECTORS)
