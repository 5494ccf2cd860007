"""Read and re-sign a checkpoint's MANIFEST (spec §5), so that a test can craft a
document that passes every digest and reaches the decoder's own rules."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import xxhash


def manifest_body(ck: Path) -> dict:
    """The MANIFEST's msgpack document, decoded leniently (a test edits it)."""
    data = (ck / "MANIFEST").read_bytes()
    (n,) = struct.unpack_from("<Q", data, 16)
    return msgpack.unpackb(data[24 : 24 + n], raw=False, strict_map_key=False)


def sign_manifest(ck: Path, body: dict) -> None:
    """Write ``body`` back with a recomputed content id (§5.2) and MANIFEST digest."""
    ids = [[p["name"], [[f[0], f[2], f[4]] for f in p["files"]]] for p in body["parts"]]
    body["id"] = xxhash.xxh3_128_digest(msgpack.packb(ids, use_bin_type=True)).hex()
    b = msgpack.packb(body, use_bin_type=True)
    h = struct.pack("<8sHHIQ", b"CKPTMNFT", 1, 0, 0, len(b))
    (ck / "MANIFEST").write_bytes(h + b + xxhash.xxh3_128_digest(h + b))
