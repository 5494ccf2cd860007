"""Every format 2.0 vector (spec/vectors/checkpoint-v2/, spec/format-2.md §V.10) behaves as its
expected.json says, with the checks of the 1.0 vectors (tests/spec/test_vectors.py)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

import ckpt
from tests.spec.test_vectors import check_vector

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "spec" / "vectors" / "checkpoint-v2"

_spec = importlib.util.spec_from_file_location("make_v2_vectors", REPO / "spec" / "vectors" / "make_v2_vectors.py")
assert _spec is not None and _spec.loader is not None
make_v2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_v2)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def names() -> list[str]:
    return sorted(p.parent.name for p in VECTORS.glob("*/expected.json"))


def test_there_are_vectors_of_every_feature() -> None:
    n = names()
    for feature in ("packed", "shared", "part-manifest"):
        assert any(feature in x for x in n), feature
    assert sum(x.startswith("invalid-") for x in n) >= 15
    total = sum(f.stat().st_size for f in VECTORS.rglob("*") if f.is_file())
    assert total < 200_000, f"vectors take {total} bytes"


@pytest.mark.parametrize("name", names())
def test_v2_vector(name: str) -> None:
    check_vector(VECTORS / name)


def test_valid_vectors_are_version_2_and_use_their_feature() -> None:
    for name in names():
        exp = json.loads((VECTORS / name / "expected.json").read_text())
        if exp["result"] != "ok":
            continue
        r = ckpt.open(VECTORS / name / exp["path"])
        assert r.manifest.version == (2, 0), name
        files = r.manifest.files
        if "packed" in name:
            assert any(f.role == "packed" for f in files) and any(t.encoding == "bpz1" for p in r.parts for t in p.tensors)
        if "shared" in name:
            shared = [f for f in files if f.origin is not None]
            assert [f.origin for f in shared] == ["step-00000001"] * 2 and {f.role for f in shared} == {"tensors", "packed"}
            assert r.verify().shared == 2
        if "part-manifests" in name:
            assert r.manifest.parts.refs == 3


@pytest.mark.timeout(120)
def test_the_v2_generator_is_deterministic(tmp_path: Path) -> None:
    make_v2.build(tmp_path / "a")
    make_v2.build(tmp_path / "b")
    rel = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())  # noqa: E731
    files = rel(tmp_path / "a")
    assert files == rel(tmp_path / "b") and files
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    # the committed vectors are what the generator makes (regenerate after a format change)
    assert rel(VECTORS) == files
    for f in files:
        assert (VECTORS / f).read_bytes() == (tmp_path / "a" / f).read_bytes(), f
    assert os.path.isdir(VECTORS)
