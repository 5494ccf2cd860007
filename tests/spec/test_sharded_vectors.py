"""The sharded-checkpoint vectors (spec/vectors/sharded/, spec/sharded-format.md §S.7)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import ckpt
import ckpt.errors
from ckpt._unshard import full_tensor
from ckpt.format.sharded import decode_layout
from ckpt.format import dtypes
from ckpt.writer import tensor_memoryview

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "spec" / "vectors" / "sharded"
sys.path.insert(0, str(REPO / "spec" / "vectors"))
_spec = importlib.util.spec_from_file_location("make_sharded_vectors", REPO / "spec" / "vectors" / "make_sharded_vectors.py")
assert _spec is not None and _spec.loader is not None
make_sharded_vectors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_sharded_vectors)


def _untag(v: object) -> object:
    import struct

    if isinstance(v, dict) and "$float" in v:
        return struct.unpack(">d", bytes.fromhex(v["$float"]))[0]
    return v


def _names() -> list[str]:
    return sorted(p.parent.name for p in VECTORS.glob("*/expected.json"))


def test_vectors_of_both_kinds_exist() -> None:
    names = _names()
    assert any(n.startswith("valid-") for n in names) and any(n.startswith("invalid-") for n in names)


@pytest.mark.parametrize("name", _names())
def test_sharded_vector(name: str) -> None:
    vec = VECTORS / name
    exp = json.loads((vec / "expected.json").read_text())
    r = ckpt.open(vec / exp["path"])  # stage open: a plain 1.0 checkpoint either way
    r.verify()
    if exp["result"] == "error":
        with pytest.raises(getattr(ckpt.errors, exp["error"])):
            decode_layout(r.manifest, path=r.path)
        with pytest.raises(getattr(ckpt.errors, exp["error"])):
            r.state()
        return
    layout = decode_layout(r.manifest, path=r.path)
    assert set(layout.tensors) == set(exp["global"])
    for fqn, desc in exp["global"].items():
        got = full_tensor(r, fqn)
        assert dtypes.dtype_name(got.dtype) == desc["dtype"] and list(got.shape) == desc["shape"], fqn
        assert bytes(tensor_memoryview(got.contiguous())).hex() == desc["hex"], fqn
    full = r.state()  # nested by the saved key paths
    for fqn, tagged in exp["values"].items():
        node = full
        for seg in layout.paths[fqn]:
            node = node[seg]
        assert node == _untag(tagged), fqn
    assert torch.equal(full["model"]["w"], full_tensor(r, "model.w"))


def test_the_sharded_generator_is_deterministic(tmp_path: Path) -> None:
    make_sharded_vectors.build(tmp_path / "a")
    files = sorted(str(p.relative_to(tmp_path / "a")) for p in (tmp_path / "a").rglob("*") if p.is_file())
    committed = sorted(str(p.relative_to(VECTORS)) for p in VECTORS.rglob("*") if p.is_file())
    assert files == committed
    for rel in files:
        if rel.endswith(".safetensors"):  # no compressor involved: bytes must match exactly
            assert (VECTORS / rel).read_bytes() == (tmp_path / "a" / rel).read_bytes(), rel
