"""A commit that goes ahead without a part (a snapshot leaving a participant out) stays a
checkpoint that opens: files of the left-out part are removed before the rename, a part
writer still in flight is waited for, and a part written after the commit is refused
instead of landing in the committed directory (its descriptors would follow the rename)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ckpt
from ckpt.errors import DistributedUsageError
import hangs


def _state(v: float) -> dict:
    return {"w": {"t": torch.full((1024,), v)}}


def test_files_of_a_part_left_out_are_not_committed(tmp_path):
    p = ckpt.begin(str(tmp_path / "step-1"))
    a = ckpt.write_part(p, "a", _state(1.0), step=1)
    ckpt.write_part(p, "b", _state(2.0), step=1)  # written, then left out of the commit
    with open(os.path.join(p.tmp_dir, "b.partial"), "wb") as f:  # a writer that died mid-file
        f.write(b"x" * 100)
    ckpt.commit(p, [a], step=1)
    r = ckpt.open(str(tmp_path / "step-1"))
    assert r.manifest.parts.names == ("a",)
    assert sorted(os.listdir(tmp_path / "step-1")) == sorted(
        ["MANIFEST"] + [n for n, _, _ in r.manifest.parts.file_sizes()])
    assert torch.equal(r.state(part="a")["w"]["t"], torch.full((1024,), 1.0))
    assert ckpt.open(str(tmp_path / "step-1")).verify().files > 0  # raises on any damage


def test_a_part_written_after_the_commit_is_refused(tmp_path):
    p = ckpt.begin(str(tmp_path / "step-1"))
    a = ckpt.write_part(p, "a", _state(1.0), step=1)
    ckpt.commit(p, [a], step=1)
    with pytest.raises(DistributedUsageError, match="committed or aborted"):
        ckpt.write_part(p, "late", _state(3.0), step=1)
    assert sorted(os.listdir(tmp_path / "step-1")) == sorted(
        ["MANIFEST"] + [n for n, _, _ in ckpt.open(str(tmp_path / "step-1")).manifest.parts.file_sizes()])


def test_the_commit_waits_for_a_part_writer_in_flight(tmp_path, monkeypatch):
    import ckpt.writer as w

    p = ckpt.begin(str(tmp_path / "step-1"))
    a = ckpt.write_part(p, "a", _state(1.0), step=1)
    inside, release = threading.Event(), threading.Event()
    real = w.check_name  # the first thing a part writer does once it holds the lock

    def slow(*args, **kw):  # a part writer that is mid-write when the commit starts
        inside.set()
        assert release.wait(hangs.hang_s(3))
        return real(*args, **kw)

    monkeypatch.setattr(w, "check_name", slow)
    late: list[BaseException | None] = []

    def writer() -> None:
        try:
            ckpt.write_part(p, "b", _state(2.0), step=1)
            late.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            late.append(e)

    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(hangs.hang_s(3))
    committed = threading.Event()

    def committer() -> None:
        ckpt.commit(p, [a], step=1)
        committed.set()

    c = threading.Thread(target=committer)
    c.start()
    assert not committed.wait(0.2)  # held by the writer's shared lock (a condition, not a race)
    release.set()
    t.join(hangs.hang_s(3))  # a hang bound: the assertion below names a thread still blocked
    c.join(hangs.hang_s(3))
    assert committed.is_set() and late == [None]
    r = ckpt.open(str(tmp_path / "step-1"))  # b's files were removed before the rename
    assert r.manifest.parts.names == ("a",)
    assert ckpt.open(str(tmp_path / "step-1")).verify().files > 0  # raises on any damage
