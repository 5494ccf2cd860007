"""Part manifests (format 2.0, spec/format-2.md §V.5): a checkpoint of many parts lists them by
reference, so opening it reads the MANIFEST alone and each part's detail is read when that part
is needed."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.format.manifest import PartRef, encode_manifest
from ckpt.storage import LocalStorage
from ckpt.writer import PendingCheckpoint, begin, commit, part_name_for_rank, write_part

N = 40


class _Reads(LocalStorage):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def read(self, path: str, offset: int, size: int) -> bytes:
        self.names.append(os.path.basename(path))
        return super().read(path, offset, size)

    def pread_into(self, path: str, offset: int, buf: memoryview) -> int:
        self.names.append(os.path.basename(path))
        return super().pread_into(path, offset, buf)


def _state(r: int) -> dict:
    return {"model": {"w": torch.full((8,), float(r)), "b": torch.arange(r + 1)}, "rank": {"r": r}}


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parts") / "step-00000001"
    pending = begin(path, part_manifests=True)
    refs = [write_part(pending, part_name_for_rank(r), _state(r), step=1, rng=False) for r in range(N)]
    assert all(isinstance(x, PartRef) for x in refs)
    commit(pending, [x.to_dict() for x in refs], step=1)  # as records travel from the ranks
    return path


def test_opening_reads_the_manifest_alone_and_a_part_reads_its_own(many: Path) -> None:
    storage = _Reads()
    r = ckpt.open(many, storage=storage)
    assert r.manifest.version == (2, 0) and r.manifest.parts.refs == N
    assert set(storage.names) == {"MANIFEST"}
    assert len(os.listdir(many)) == 1 + 3 * N  # MANIFEST; per part a part manifest, a state and a tensor file
    got = r.tensor("model/w", part="rank-00017")
    assert torch.equal(got, torch.full((8,), 17.0))
    assert {n for n in storage.names if n.endswith(".part")} == {"rank-00017.part"}
    assert r.state(part="rank-00031")["rank"] == {"r": 31}


def test_inspect_reads_one_part_manifest(many: Path) -> None:
    from ckpt_cli.inspect_cmd import manifest_summary, render

    storage = _Reads()
    s = manifest_summary(ckpt.open(many, storage=storage))
    assert {n for n in storage.names if n.endswith(".part")} == {"rank-00000.part"}
    assert sum(p.get("by_reference", False) for p in s["parts"]) == N - 1
    text = render(s)
    assert f"{N - 1} more part(s) listed by reference" in text


def test_verify_and_load_read_every_part_and_the_id_stays_put(many: Path) -> None:
    r = ckpt.open(many)
    r.verify(quick=True)
    rep = r.verify()
    assert rep.files == 2 * N  # the data files of every part (part manifests are checked by digest)
    for k in (0, 5, N - 1):
        ckpt.load(many, target := {"model": {}, "rank": {}}, part=part_name_for_rank(k), restore_rng=False, exactness="off")
        assert target["rank"]["r"] == k and torch.equal(target["model"]["b"], torch.arange(k + 1))
    # reading parts changes nothing the MANIFEST says: encoding it again gives the same bytes
    assert encode_manifest(r.manifest) == (many / "MANIFEST").read_bytes()


def test_inline_and_referenced_parts_mix(tmp_path: Path) -> None:
    pending = begin(tmp_path / "mixed")
    by_ref = dataclasses.replace(pending, part_manifests=True)
    parts = [write_part(pending, "rank-00000", _state(0), rng=False), write_part(by_ref, "rank-00001", _state(1), rng=False)]
    commit(pending, parts)
    r = ckpt.open(tmp_path / "mixed")
    assert r.manifest.parts.refs == 1 and r.manifest.version == (2, 0)
    r.verify()
    assert r.state(part="rank-00001")["rank"] == {"r": 1} and r.state(part="rank-00000")["rank"] == {"r": 0}


def test_a_pending_checkpoint_rebuilt_in_another_process_keeps_the_choice(tmp_path: Path) -> None:
    pending = begin(tmp_path / "c", part_manifests=True)
    again = PendingCheckpoint(final=pending.final, tmp_dir=pending.tmp_dir, part_manifests=True)
    assert isinstance(write_part(again, "rank-00003", _state(3), rng=False), PartRef)
    ckpt.abort(pending)
