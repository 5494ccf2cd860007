"""Generate the sharded-checkpoint test vectors in ``spec/vectors/sharded/``.

    python spec/vectors/make_sharded_vectors.py [OUT_DIR]

Each vector is a directory holding one checkpoint and an ``expected.json``:

    {"description": ..., "path": "<checkpoint dir>", "result": "ok" | "error",
     "global": {fqn: {"dtype", "shape", "hex"}},      # result == "ok": every global tensor
     "values": {fqn: <tagged JSON value>},             # result == "ok"
     "error": "<class from ckpt.errors>", "stage": "open" | "layout"}   # result == "error"

Stage ``layout`` is decoding ``meta.sharded`` against the MANIFEST (spec/sharded-format.md
§S.3). The parts are written by the same deterministic writer as the format vectors
(``make_vectors._write``: fixed context and created_at), then ``meta.sharded`` is added
to the MANIFEST (the content id covers parts only, so it does not change).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402
from make_vectors import STEP_DIR, _dump, _write, tensor_hex, to_tagged  # noqa: E402

from ckpt.format.sharded import Chunk, ShardedLayout, TensorRecord, ValueRecord  # noqa: E402
from ckpt.format.manifest import MANIFEST_NAME, decode_manifest, encode_manifest  # noqa: E402

W = (torch.arange(12, dtype=torch.float32).reshape(4, 3) / 4 - 1).contiguous()
S = torch.tensor(7, dtype=torch.int64)


def _layout(second_offset: int = 2) -> ShardedLayout:
    w = TensorRecord("model.w", "float32", (4, 3), (
        Chunk((0, 0), (2, 3), "rank-00000", "shards/model.w/0,0"),
        Chunk((second_offset, 0), (2, 3), "rank-00001", "shards/model.w/2,0"),
    ))
    s = TensorRecord("optim.step", "int64", (), (Chunk((), (), "rank-00001", "shards/optim.step/"),))
    return ShardedLayout(
        world_size=2,
        tensors={"model.w": w, "optim.step": s},
        values={"optim.lr": ValueRecord("optim.lr", "rank-00000")},
        paths={"model.w": ("model", "w"), "optim.step": ("optim", "step"), "optim.lr": ("optim", "lr")},
        mesh={"shape": [2], "dim_names": None},
        placements={"model.w": ("Shard(0)",)},
        dcp_version="1.0.0",
    )


def _checkpoint(ck: Path, layout: ShardedLayout) -> None:
    parts = [
        ("rank-00000", {"shards": {"model.w": {"0,0": W[0:2].clone()}}, "values": {"optim.lr": 0.25}}),
        ("rank-00001", {"shards": {"model.w": {"2,0": W[2:4].clone()}, "optim.step": {"": S.clone()}}, "values": {}}),
    ]
    _write(ck, {}, parts=parts)
    m = decode_manifest((ck / MANIFEST_NAME).read_bytes())
    (ck / MANIFEST_NAME).write_bytes(encode_manifest(dataclasses.replace(m, meta={"sharded": layout.to_wire()})))


def build(out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    made = []

    def vec(name: str) -> Path:
        v = out / name
        shutil.rmtree(v, ignore_errors=True)
        v.mkdir()
        made.append(name)
        return v

    v = vec("valid-sharded")
    _checkpoint(v / STEP_DIR, _layout())
    _dump(v, {
        "description": "A 4x3 float32 tensor in two row chunks on rank-00000 and rank-00001, a 0-d int64 on rank-00001, a value on rank-00000.",
        "path": STEP_DIR,
        "result": "ok",
        "global": {
            "model.w": {"dtype": "float32", "shape": [4, 3], "hex": tensor_hex(W)},
            "optim.step": {"dtype": "int64", "shape": [], "hex": tensor_hex(S)},
        },
        "values": {"optim.lr": to_tagged(0.25)},
    })
    v = vec("invalid-sharded-overlap")
    _checkpoint(v / STEP_DIR, _layout(second_offset=1))
    _dump(v, {"description": "The second chunk of model.w starts at row 1: chunks overlap (and row 3 is not covered).",
              "path": STEP_DIR, "result": "error", "error": "FormatError", "stage": "layout"})
    v = vec("invalid-sharded-missing-part")
    lay = dataclasses.replace(_layout(), world_size=3)
    _checkpoint(v / STEP_DIR, lay)
    _dump(v, {"description": "world_size 3, but there is no part rank-00002.",
              "path": STEP_DIR, "result": "error", "error": "FormatError", "stage": "layout"})
    return made


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else HERE / "sharded"
    for name in build(out):
        print(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
