"""Checkpoint streams (spec/checkpoint-stream.md): round trip, every refusal, and the torchft
transport between two replica ranks of a real torchft ProcessGroupGloo."""

from __future__ import annotations

import io
import os
import struct
import threading
from datetime import timedelta

import msgpack
import pytest
import torch
import xxhash

import ckpt
import ckpt.stream as cs
from ckpt.errors import (ChecksumMismatchError, FormatError, LimitExceededError, SizeMismatchError, UnsafePathError,
                         UnsupportedVersionError)


def _state(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(3, 8)).sum().backward()
    o.step()
    return m, o


@pytest.fixture
def saved(tmp_path):
    m, o = _state()
    g = torch.Generator().manual_seed(7)
    torch.randn(5, generator=g)
    p = tmp_path / "src" / "step-00000003"
    ckpt.save(p, {"model": m, "optim": o}, step=3, generators={"aug": g}, config={"lr": 1e-3})
    return p, m, o, g


def _stream(path, **kw) -> bytes:
    buf = io.BytesIO()
    cs.write_stream(path, buf.write, **kw)
    return buf.getvalue()


def test_round_trip_loads_all_fields_exactly(saved, tmp_path):
    p, m, o, g = saved
    raw = _stream(p, chunk_bytes=4096)
    info = cs.read_stream(io.BytesIO(raw).read, tmp_path / "got")
    assert info.nbytes == sum(s for _, s in cs.stream_files(p)) and info.wire_bytes == len(raw)
    assert [n for n, _ in info.files][-1] == "MANIFEST"
    m2, o2 = _state(seed=1)
    g2 = torch.Generator().manual_seed(0)
    res = ckpt.load(info.path, {"model": m2, "optim": o2}, generators={"aug": g2})
    assert res.step == 3
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(g.get_state(), g2.get_state())
    assert o2.state_dict()["state"][0]["step"] == o.state_dict()["state"][0]["step"]
    # the same checkpoint streamed twice names the same content
    assert cs.write_stream(p, lambda b: None, chunk_bytes=4096).digest == info.digest


def _frames_start(raw: bytes) -> int:
    (hlen,) = struct.unpack_from("<I", raw, 12)
    return 16 + hlen + 16


def _resign_header(raw: bytes, header: dict) -> bytes:
    h = msgpack.packb(header, use_bin_type=True)
    pre = b"CKSTREAM" + struct.pack("<HHI", 1, 0, len(h)) + h
    return pre + xxhash.xxh3_128_digest(pre) + raw[_frames_start(raw):]


def _header(raw: bytes) -> dict:
    (hlen,) = struct.unpack_from("<I", raw, 12)
    return msgpack.unpackb(raw[16 : 16 + hlen], raw=False)


def _refused(raw: bytes, dest, exc):
    with pytest.raises(exc) as ei:
        cs.read_stream(io.BytesIO(raw).read, dest)
    assert not os.path.exists(dest)
    assert [n for n in os.listdir(os.path.dirname(dest))] == []  # no temporary directory left
    return ei.value


def test_a_flipped_bit_in_a_frame_is_named_on_arrival(saved, tmp_path):
    p, *_ = saved
    raw = bytearray(_stream(p, chunk_bytes=4096))
    at = _frames_start(raw) + 20 + 100  # inside the first frame's data
    raw[at] ^= 0x10
    (tmp_path / "rx").mkdir()
    e = _refused(bytes(raw), str(tmp_path / "rx" / "got"), ChecksumMismatchError)
    assert "arrived damaged" in str(e) and e.key == cs.stream_files(p)[0][0] and e.offset == _frames_start(raw)


def test_tamper_hook_corrupts_after_the_digest(saved, tmp_path):
    p, *_ = saved
    buf = io.BytesIO()

    def flip(i: int, b: bytearray) -> None:
        if i == 1:
            b[0] ^= 1

    cs.write_stream(p, buf.write, chunk_bytes=4096, tamper=flip)
    (tmp_path / "rx").mkdir()
    _refused(buf.getvalue(), str(tmp_path / "rx" / "got"), ChecksumMismatchError)


@pytest.mark.parametrize("cut", [3, 20, -40, -1])
def test_truncation_anywhere_is_refused(saved, tmp_path, cut):
    p, *_ = saved
    raw = _stream(p, chunk_bytes=4096)
    (tmp_path / "rx").mkdir()
    _refused(raw[:cut], str(tmp_path / "rx" / "got"), SizeMismatchError)


def test_header_refusals(saved, tmp_path):
    p, *_ = saved
    raw = _stream(p, chunk_bytes=4096)
    (tmp_path / "rx").mkdir()
    dest = str(tmp_path / "rx" / "got")
    _refused(b"NOTSTREAM" + raw[9:], dest, FormatError)
    _refused(raw[:8] + struct.pack("<H", 2) + raw[10:], dest, UnsupportedVersionError)
    _refused(raw[:12] + struct.pack("<I", (1 << 20) + 1) + raw[16:], dest, LimitExceededError)
    bad = bytearray(raw)
    bad[20] ^= 1
    _refused(bytes(bad), dest, ChecksumMismatchError)
    h = _header(raw)
    for name in ("../evil", "/etc/passwd", ".hidden", ""):
        h2 = dict(h, files=[[name, 1]] + h["files"])
        _refused(_resign_header(raw, h2), dest, UnsafePathError)
    _refused(_resign_header(raw, dict(h, files=h["files"][:1] + h["files"])), dest, UnsafePathError)
    _refused(_resign_header(raw, dict(h, files=h["files"][::-1])), dest, FormatError)  # MANIFEST not last
    with pytest.raises(LimitExceededError):
        cs.read_stream(io.BytesIO(raw).read, dest, max_bytes=100)
    _refused(_resign_header(raw, dict(h, chunk=17)), dest, FormatError)


def test_an_existing_destination_is_refused_with_the_documented_error(saved, tmp_path):
    p, *_ = saved
    raw = _stream(p, chunk_bytes=4096)
    dest = tmp_path / "there"
    dest.mkdir()
    with pytest.raises(ckpt.errors.CheckpointExistsError, match="the destination exists") as ei:
        cs.read_stream(io.BytesIO(raw).read, dest)
    assert ei.value.path == str(dest) and os.listdir(dest) == []


def test_a_header_repeating_a_key_is_refused(saved, tmp_path):
    """spec §3: exactly these keys; a repeated one (msgpack lets the last win) is refused."""
    p, *_ = saved
    raw = _stream(p, chunk_bytes=4096)
    (tmp_path / "rx").mkdir()
    h = _header(raw)
    body = msgpack.packb(h, use_bin_type=True)
    # a fifth pair repeating "name": a map of 5 entries (fixmap 0x85) over the same bytes
    dup = b"\x85" + body[1:] + msgpack.packb("name") + msgpack.packb("other")
    pre = b"CKSTREAM" + struct.pack("<HHI", 1, 0, len(dup)) + dup
    bad = pre + xxhash.xxh3_128_digest(pre) + raw[_frames_start(raw):]
    e = _refused(bad, str(tmp_path / "rx" / "got"), FormatError)
    assert "repeats the key 'name'" in str(e)


def test_bytes_after_the_trailer_are_refused_when_the_transport_holds_them(saved, tmp_path):
    p, *_ = saved
    raw = _stream(p, chunk_bytes=4096) + b"junk"
    src = io.BytesIO(raw)
    (tmp_path / "rx").mkdir()
    dest = str(tmp_path / "rx" / "got")
    with pytest.raises(FormatError, match="4 bytes follow the stream trailer"):
        cs.read_stream(src.read, dest, unread=lambda: len(raw) - src.tell())
    assert os.listdir(tmp_path / "rx") == []
    src = io.BytesIO(raw[:-4])
    cs.read_stream(src.read, dest, unread=lambda: len(raw) - 4 - src.tell())  # exactly the stream: received


def test_a_file_longer_than_announced_is_refused(saved, tmp_path):
    p, *_ = saved
    raw = _stream(p, chunk_bytes=4096)
    h = _header(raw)
    files = [list(f) for f in h["files"]]
    files[0][1] -= 1  # the sender's frame then holds one byte more than the layout allows
    (tmp_path / "rx").mkdir()
    _refused(_resign_header(raw, dict(h, files=files)), str(tmp_path / "rx" / "got"), FormatError)


# -- the torchft transport between two replica ranks ------------------------------------------
torchft = pytest.importorskip("torchft")


class _Cursor:
    """A data position (the data field) as a run keeps one."""

    def __init__(self, position: int = 0, epoch: int = 0) -> None:
        self.position, self.epoch = position, epoch

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, sd: dict) -> None:
        self.position, self.epoch = sd["position"], sd["epoch"]


def _pair(store_port: int, prefix: str):
    from torchft.process_group import ProcessGroupGloo

    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=30)) for _ in range(2)]
    threads = [threading.Thread(target=pg.configure, args=(f"localhost:{store_port}/{prefix}", str(r), r, 2))
               for r, pg in enumerate(pgs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return pgs


def test_torchft_transport_carries_all_seven_fields(tmp_path):
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pgs = _pair(store.port, "t1")
    src_m, src_o = _state(0)
    dst_m, dst_o = _state(1)
    src_l, dst_l = _Cursor(position=24, epoch=1), _Cursor()
    src_g, dst_g = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    torch.rand(3, generator=src_g)
    sent, got = [], []
    tx = cs.TorchftTransport(pgs[0], data=src_l, generators={"aug": src_g}, config={"run": 1},
                             spool_dir=str(tmp_path), chunk_bytes=4096, segment_bytes=5000,
                             on_sent=lambda *a: sent.append(a))
    rx = cs.TorchftTransport(pgs[1], data=dst_l, generators={"aug": dst_g}, config={"run": 1},
                             spool_dir=str(tmp_path), chunk_bytes=4096, segment_bytes=5000,
                             on_received=lambda *a: got.append(a))
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=rx.recv_checkpoint(0, rx.metadata(), 5, timedelta(seconds=30))))
    t.start()
    tx.send_checkpoint([1], 5, {"user": {"default": {"model": src_m, "optim": src_o}},
                                "torchft": {"step": 5, "batches_committed": 10}}, timedelta(seconds=30))
    t.join()
    r = out["r"]
    assert r["torchft"] == {"step": 5, "batches_committed": 10}
    r["user"]["default"].load({"model": dst_m, "optim": dst_o})
    for a, b in zip(src_m.state_dict().values(), dst_m.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(src_g.get_state(), dst_g.get_state())
    assert dst_l.state_dict() == src_l.state_dict()
    assert sent[0][2].digest == got[0][2].digest and sent[0][:2] == (1, 5) and got[0][:2] == (0, 5)
    assert not os.path.exists(r["user"]["default"].path) and os.listdir(tmp_path) == []


def test_torchft_transport_refuses_bytes_flipped_on_the_wire(tmp_path):
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pgs = _pair(store.port, "t2")
    m, o = _state(0)

    def flip(i: int, b: bytearray) -> None:
        if i == 0:
            b[len(b) // 2] ^= 0x01

    tx = cs.TorchftTransport(pgs[0], spool_dir=str(tmp_path), chunk_bytes=4096, tamper=flip)
    rx = cs.TorchftTransport(pgs[1], spool_dir=str(tmp_path), chunk_bytes=4096)
    errs: list = []

    def recv() -> None:
        try:
            rx.recv_checkpoint(0, rx.metadata(), 2, timedelta(seconds=30))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            errs.append(e)

    t = threading.Thread(target=recv)
    t.start()
    tx.send_checkpoint([1], 2, {"user": {"default": {"model": m, "optim": o}},
                                "torchft": {"step": 2, "batches_committed": 2}}, timedelta(seconds=30))
    t.join()
    assert isinstance(errs[0], ChecksumMismatchError) and "arrived damaged" in str(errs[0])
    assert os.listdir(tmp_path) == []
