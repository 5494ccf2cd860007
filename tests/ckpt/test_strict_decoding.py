"""Every decoding failure is a documented CkptError (issue: RecursionError, ValueError,
RuntimeError, TypeError escaped), and the decoding rules the vectors pin down hold for
the values a vector cannot easily carry."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import msgpack
import pytest
import torch
import xxhash

import ckpt
from tests.ckpt._manifest_kit import manifest_body, sign_manifest
from ckpt.errors import FormatError, UnsupportedValueError
from ckpt.format.codec import unpackb
from ckpt.format.tree import EXT_TUPLE, decode_tree
from ckpt.knobs import override
import hangs

SF = "rank-00000.safetensors"


@pytest.fixture()
def ck(tmp_path: Path) -> Path:
    p = tmp_path / "step-1"
    with override(chunk_size=4096):
        ckpt.save(p, {"m": {"w": torch.arange(600, dtype=torch.float32), "e": torch.zeros(0, 3)}}, step=1)
    return p




def _resign_file(ck: Path, name: str, data: bytes) -> None:
    (ck / name).write_bytes(data)
    body = manifest_body(ck)
    for f in body["parts"][0]["files"]:
        if f[0] == name:
            f[2] = len(data)
            f[4] = b"".join(xxhash.xxh3_128_digest(data[i : i + f[3]]) for i in range(0, len(data), f[3]))
    sign_manifest(ck, body)


def test_an_empty_tensor_whose_strides_overflow_is_refused(ck: Path) -> None:
    body = manifest_body(ck)
    t = next(t for t in body["parts"][0]["tensors"] if t[0] == "m/e")
    t[2] = [0, 2**62, 2**62]  # numel 0, nbytes 0: only the stride product overflows (torch: RuntimeError)
    sign_manifest(ck, body)
    with pytest.raises(FormatError, match="overflows"):
        ckpt.open(ck)


@pytest.mark.parametrize(
    "make",
    [
        lambda n: b"[" * (n // 2) + b"]" * (n // 2),  # RecursionError in the JSON decoder
        lambda n: b'{"a":' + b"9" * (n - 6) + b"}",  # ValueError: int digit limit
        lambda n: b'{"a":1,"a":2}' + b" " * (n - 13),  # duplicate key
        lambda n: b"\xff" * n,  # not UTF-8
    ],
)
def test_a_same_size_edit_of_the_safetensors_header_is_a_format_error(ck: Path, make) -> None:
    data = (ck / SF).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    new = make(n)
    assert len(new) == n
    _resign_file(ck, SF, data[:8] + new + data[8 + n :])
    with pytest.raises(FormatError):
        ckpt.open(ck).verify()


def test_header_members_are_typed_exactly(ck: Path) -> None:
    data = (ck / SF).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    h = json.loads(data[8 : 8 + n])
    h["m/w"]["data_offsets"] = [float(x) for x in h["m/w"]["data_offsets"]]
    h["__metadata__"] = {"format": "pt"}  # room for the longer floats, same header length
    new = json.dumps(h, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    _resign_file(ck, SF, data[:8] + new + data[8 + n :])
    with pytest.raises(FormatError, match="malformed dtype, shape or data_offsets"):
        ckpt.open(ck).verify()


def _doc(state: bytes) -> bytes:
    return b"\x82\xa5state" + state + b"\xa7context\x80"


@pytest.mark.parametrize(
    "raw",
    [
        b"\x81\xa1k\x82\xc3\xa1T\x01\xa1I",  # {true, 1}
        b"\x81\xa1k\x82\x00\xa1a\xcb" + struct.pack(">d", -0.0) + b"\xa1b",  # 0 and -0.0
        b"\x81\xa1k\x81\xcb" + struct.pack(">d", math.nan) + b"\xa1n",  # NaN key
        # tuple keys (1,) and (1.0,): different bytes, equal once decoded
        b"\x81\xa1k\x82" + msgpack.packb(msgpack.ExtType(EXT_TUPLE, msgpack.packb([1]))) + b"\xa1a"
        + msgpack.packb(msgpack.ExtType(EXT_TUPLE, msgpack.packb([1.0]))) + b"\xa1b",
        # a tuple key holding a list: unhashable once decoded (TypeError before)
        b"\x81\xa1k\x81" + msgpack.packb(msgpack.ExtType(EXT_TUPLE, msgpack.packb([[1]]))) + b"\xa1a",
    ],
)
def test_colliding_and_unusable_map_keys_are_refused(raw: bytes) -> None:
    with pytest.raises(FormatError):
        decode_tree(_doc(raw), path="x")


def test_keys_of_different_values_stay_distinct() -> None:
    got = unpackb(b"\x83\x01\xa1I\xa11\xa1S\xc2\xa1F")  # {1: 'I', '1': 'S', false: 'F'}
    assert len(got) == 3 and [type(k) for k in got] == [int, str, bool]
    assert got[1] == "I" and got["1"] == "S" and got[False] == "F"


def test_writers_refuse_a_nan_key(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValueError):
        ckpt.save(tmp_path / "step-1", {"t": {math.nan: 1}}, step=1)


def test_the_cli_maps_a_hostile_header_to_exit_3(ck: Path) -> None:
    """As users run it: `ckpt verify` on a re-signed checkpoint whose safetensors header is
    10^5 nested arrays prints one error line and exits 3 (corrupt), no traceback."""
    import subprocess
    import sys

    data = (ck / SF).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    _resign_file(ck, SF, data[:8] + b"[" * (n // 2) + b"]" * (n // 2) + data[8 + n :])
    repo = Path(__file__).resolve().parents[2]
    out = hangs.run([sys.executable, "-m", "ckpt_cli", "verify", str(ck)], cwd=repo, capture_output=True, text=True,
                    bound_s=hangs.hang_s(12))
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith(f"CORRUPT: {ck}: safetensors header is not valid JSON")
