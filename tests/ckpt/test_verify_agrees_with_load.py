"""``verify`` passes exactly what ``load`` loads, for packed (BPZ1) spans (issue 22 item 5).

Each case re-signs one span of a real compressed checkpoint (chunk digests, sizes, the
span's stored length, later offsets, content id and MANIFEST digest recomputed), so only
the span decoder stands between the bytes and the caller: a bad magic, a reserved codec,
wrong plane lengths, a zstd frame that lies about its content size, a truncated frame, a
short or long span, a flipped bit. For every case:

- ``verify`` passes  <=>  ``ckpt.load`` in place succeeds  <=>  ``state()`` succeeds
  <=>  the lazy ``tensor()`` read of the span succeeds  <=>  ``load(verify=False)`` succeeds
  (without dedup digests: a re-signed span that decodes is, by construction, content);
- a load that fails leaves every target tensor exactly as it was, and raises a content
  error naming the file (never ``CheckpointChangedError``: nothing changed the file);
- where a load succeeds, every way of reading gives the same values.
"""

from __future__ import annotations

import importlib.util
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import zstandard
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import CheckpointChangedError, CkptError, FormatError
from ckpt.format import bpz
from ckpt.knobs import override

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_v2_vectors", REPO / "spec" / "vectors" / "make_v2_vectors.py")
assert _spec is not None and _spec.loader is not None
v2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v2)

pytestmark = pytest.mark.filterwarnings("ignore::ckpt._load.ExactnessWarning")

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(32, 128, generator=g),  # 16 KiB of float32: 4 blocks of 4 KiB
            "h": torch.randn(3000, generator=g).to(torch.bfloat16),  # 2 blocks, the last short
            "d": torch.randn(600, generator=g).to(torch.float64),  # 2 blocks of 8 planes
            "i": torch.arange(100, dtype=torch.int64) * seed,  # unencoded, beside the packed file
        },
    }


def _build(path: Path, *, dedup: bool) -> Path:
    with override(chunk_size=4096, bpz_block=4096):
        ckpt.save(path, _state(1), step=1, compress=lambda key, dtype, nbytes: dtype in _FLOATS, dedup=dedup)
    return path


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spans")
    out = {"plain": _build(root / "plain" / "step-00000001", dedup=False),
           "dedup": _build(root / "dedup" / "step-00000001", dedup=True)}
    for p in out.values():
        r = ckpt.open(p)
        assert {t.key for t in r.tensor_entries() if t.encoding} == {"model/w", "model/h", "model/d"}
        assert all((t.digest is not None) == ("dedup" in str(p)) for t in r.tensor_entries())
    return out


# --- the span, taken apart and re-signed -------------------------------------------------------------------


def _entry(ck: Path, key: str) -> list[Any]:
    return v2._first_packed(v2.raw_body_v2(ck), key)


def _span_of(ck: Path, key: str) -> tuple[bytes, int, int]:
    """(span bytes, itemsize, nbytes) of tensor ``key``."""
    e = _entry(ck, key)
    data = (ck / v2._packed_file(ck)).read_bytes()
    t = next(t for t in ckpt.open(ck).tensor_entries() if t.key == key)
    return data[e[4] : e[4] + e[7][1]], {"float32": 4, "bfloat16": 2, "float64": 8}[t.dtype], t.nbytes


replace_span = v2.replace_span


def blocks(span: bytes, e: int, nbytes: int) -> list[tuple[int, list[int], list[int]]]:
    """(offset, codecs, stored lengths) of each block of a valid span."""
    (r,) = struct.unpack_from("<I", span, 8)
    out, pos = [], bpz.HEADER_SIZE
    for _ in range(-(-nbytes // r)):
        codecs = list(span[pos : pos + e])
        lengths = list(struct.unpack_from(f"<{e}I", span, pos + e))
        out.append((pos, codecs, lengths))
        pos += 5 * e + sum(lengths)
    assert pos == len(span)
    return out


def _plane_at(bl: tuple[int, list[int], list[int]], p: int) -> int:
    pos, codecs, lengths = bl
    return pos + 5 * len(codecs) + sum(lengths[:p])


def _with_plane(span: bytes, bl: tuple[int, list[int], list[int]], p: int, stored: bytes, *, length: int | None = None) -> bytes:
    """``span`` with plane ``p`` of block ``bl`` replaced by ``stored`` (its length field set
    to ``length``, default the new length)."""
    pos, codecs, lengths = bl
    e = len(codecs)
    at = _plane_at(bl, p)
    out = bytearray(span[:at] + stored + span[at + lengths[p] :])
    struct.pack_into("<I", out, pos + e + 4 * p, len(stored) if length is None else length)
    return bytes(out)


Draw = Callable[[Any], Any]


def m_header_byte(span: bytes, e: int, n: int, draw: Draw) -> bytes:
    """Any byte of the 16-byte header (magic, planes, reserved, block size) set to any value."""
    out = bytearray(span)
    out[draw(st.integers(0, bpz.HEADER_SIZE - 1))] = draw(st.integers(0, 255))
    return bytes(out)


def m_codec(span: bytes, e: int, n: int, draw: Draw) -> bytes:
    """A plane's codec set to any value: reserved ones, or the other codec."""
    bs = blocks(span, e, n)
    pos, _, _ = bs[draw(st.integers(0, len(bs) - 1))]
    out = bytearray(span)
    out[pos + draw(st.integers(0, e - 1))] = draw(st.sampled_from([0, 1, 2, 3, 127, 255]))
    return bytes(out)


def m_plane_length(span: bytes, e: int, n: int, draw: Draw) -> bytes:
    """A plane's stored length field off by a little or a lot, the bytes left as they are."""
    bs = blocks(span, e, n)
    pos, _, lengths = bs[draw(st.integers(0, len(bs) - 1))]
    p = draw(st.integers(0, e - 1))
    new = draw(st.sampled_from([0, 1, lengths[p] - 1, lengths[p] + 1, lengths[p] * 2, 2**32 - 1]))
    out = bytearray(span)
    struct.pack_into("<I", out, pos + e + 4 * p, max(0, min(new, 2**32 - 1)))
    return bytes(out)


def _zstd_planes(span: bytes, e: int, n: int) -> list[tuple[tuple[int, list[int], list[int]], int]]:
    return [(bl, p) for bl in blocks(span, e, n) for p in range(e) if bl[1][p] == 1]


def m_frame_content_size(span: bytes, e: int, n: int, draw: Draw) -> bytes:
    """A zstd plane re-framed declaring another content size (or none); the length field follows."""
    zs = _zstd_planes(span, e, n)
    if not zs:
        return m_plane_length(span, e, n, draw)
    bl, p = draw(st.sampled_from(zs))
    at = _plane_at(bl, p)
    plane = zstandard.ZstdDecompressor().decompress(span[at : at + bl[2][p]])
    declared = draw(st.sampled_from([None, len(plane) - 1, len(plane) + 1, 2 * len(plane), 1 << 30, len(plane)]))
    return _with_plane(span, bl, p, v2._zstd_with_size(plane, declared))


def m_frame_content(span: bytes, e: int, n: int, draw: Draw) -> bytes:
    """A zstd frame whose content disagrees with its plane: truncated, extended, trailing
    bytes, or a frame of more or fewer bytes that still declares the plane's length."""
    zs = _zstd_planes(span, e, n)
    if not zs:
        return m_header_byte(span, e, n, draw)
    bl, p = draw(st.sampled_from(zs))
    at = _plane_at(bl, p)
    frame = span[at : at + bl[2][p]]
    plane = zstandard.ZstdDecompressor().decompress(frame)
    how = draw(st.sampled_from(["cut", "trailing", "longer", "shorter"]))
    if how == "cut":
        new = frame[: draw(st.integers(1, len(frame) - 1))] if len(frame) > 1 else frame
    elif how == "trailing":
        new = frame + draw(st.binary(min_size=1, max_size=8))
    elif how == "longer":
        new = v2._zstd_with_size(plane + plane[: draw(st.integers(1, 64))], len(plane))
    else:
        new = v2._zstd_with_size(plane[: -draw(st.integers(1, min(64, len(plane) - 1)))], len(plane))
    return _with_plane(span, bl, p, new)


def m_span_length(span: bytes, e: int, n: int, draw: Draw) -> bytes:
    """Bytes cut from the end of the span, or appended to it."""
    if draw(st.booleans()):
        return span[: len(span) - draw(st.integers(1, min(64, len(span) - bpz.HEADER_SIZE)))]
    return span + draw(st.binary(min_size=1, max_size=32))


def m_flip(span: bytes, e: int, n: int, draw: Draw) -> bytes:
    """One bit anywhere in the span (block headers, frames, stored planes)."""
    out = bytearray(span)
    out[draw(st.integers(0, len(span) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(out)


MUTATORS = {f.__name__[2:]: f for f in (m_header_byte, m_codec, m_plane_length, m_frame_content_size,
                                        m_frame_content, m_span_length, m_flip)}


# --- the property ------------------------------------------------------------------------------------------


def _attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except CkptError as e:
        return None, e


def _targets() -> dict[str, Any]:
    return {"model": {k: torch.full_like(v, 7) for k, v in _state(1)["model"].items()}}


def _verify(ck: Path) -> None:
    ckpt.open(ck).verify()


def check_agreement(ck: Path, key: str) -> tuple[bool, BaseException | None]:
    """Every reader agrees with verify on ``ck``; returns (verified, verify's error)."""
    _, verr = _attempt(lambda: _verify(ck))
    ok = verr is None
    if verr is not None:
        assert verr.path is not None and str(ck) in verr.path, verr

    targets = _targets()
    before = {k: v.clone() for k, v in targets["model"].items()}
    _, lerr = _attempt(lambda: ckpt.load(ck, targets, restore_rng=False, exactness="off"))
    assert (lerr is None) == ok, f"verify {'passed' if ok else f'failed ({verr!r})'} but load {'passed' if lerr is None else f'failed ({lerr!r})'}"
    if lerr is not None:
        assert not isinstance(lerr, CheckpointChangedError), f"a content defect blamed on a file change: {lerr!r}"
        assert type(lerr) is type(verr), (lerr, verr)
        assert lerr.path is not None and str(ck) in lerr.path, lerr
        if isinstance(lerr, FormatError) and "BPZ1 span" in str(lerr):
            assert lerr.offset is not None, lerr
        for k, v in before.items():
            assert torch.equal(targets["model"][k], v), f"{k} changed by a failed load ({lerr!r})"

    fresh, serr = _attempt(lambda: ckpt.open(ck).state()["model"])
    assert (serr is None) == ok, (verr, serr)
    lazy, terr = _attempt(lambda: ckpt.open(ck).tensor(key))
    if ok:
        assert terr is None, terr
    unverified_targets = _targets()
    _, uerr = _attempt(lambda: ckpt.load(ck, unverified_targets, restore_rng=False, exactness="off", verify=False))
    if not any(t.digest is not None for t in _attempt(lambda: ckpt.open(ck).tensor_entries())[0] or ()):
        # No digest to compare: a span that decodes is the content, verified or not.
        assert (uerr is None) == ok, (verr, uerr)
    if ok:
        for k in before:
            assert torch.equal(targets["model"][k], fresh[k]), k
            assert torch.equal(unverified_targets["model"][k], fresh[k]), k
        assert torch.equal(lazy, fresh[key.split("/", 1)[1]])
    return ok, verr


@pytest.mark.timeout(600)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data(), base=st.sampled_from(["plain", "dedup"]), key=st.sampled_from(["model/w", "model/h", "model/d"]),
       name=st.sampled_from(sorted(MUTATORS)))
def test_verify_passes_exactly_what_load_loads(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
                                               data: Any, base: str, key: str, name: str) -> None:
    ck = tmp_path_factory.mktemp("case") / "step-00000001"
    shutil.copytree(bases[base], ck)
    span, e, n = _span_of(ck, key)
    new = MUTATORS[name](span, e, n, data.draw)
    replace_span(ck, key, new)
    ok, err = check_agreement(ck, key)
    event(f"{name}: {'loads' if ok else type(err).__name__}")


# --- fixed cases: the four defects, each must fail verify (and the CLI) -------------------------------


def _bad_magic(span: bytes, e: int, n: int) -> bytes:
    return b"BPZ2" + span[4:]


def _reserved_codec(span: bytes, e: int, n: int) -> bytes:
    pos = blocks(span, e, n)[0][0]
    return span[:pos] + b"\x02" + span[pos + 1 :]


def _wrong_plane_length(span: bytes, e: int, n: int) -> bytes:
    pos, _, lengths = blocks(span, e, n)[-1]
    out = bytearray(span)
    struct.pack_into("<I", out, pos + e, lengths[0] - 1)
    return bytes(out)


def _lying_frame(span: bytes, e: int, n: int) -> bytes:
    bl, p = _zstd_planes(span, e, n)[0]
    at = _plane_at(bl, p)
    plane = zstandard.ZstdDecompressor().decompress(span[at : at + bl[2][p]])
    return _with_plane(span, bl, p, v2._zstd_with_size(plane, len(plane) + 1))


FIXED = {"bad-magic": _bad_magic, "reserved-codec": _reserved_codec, "wrong-plane-length": _wrong_plane_length,
         "lying-zstd-frame": _lying_frame}


@pytest.mark.parametrize("what", sorted(FIXED))
@pytest.mark.parametrize("base", ["plain", "dedup"])
def test_a_resigned_span_defect_fails_verify_and_changes_no_target(bases: dict[str, Path], tmp_path: Path, what: str,
                                                                   base: str) -> None:
    """Each passed ``verify`` on 3930a40 without dedup digests, and ``load`` then wrote the other
    tensors and raised CheckpointChangedError."""
    ck = tmp_path / "step-00000001"
    shutil.copytree(bases[base], ck)
    span, e, n = _span_of(ck, "model/w")
    replace_span(ck, "model/w", FIXED[what](span, e, n))
    ok, err = check_agreement(ck, "model/w")
    assert not ok and isinstance(err, FormatError) and "BPZ1 span" in str(err), err
    assert err.path.endswith(".bpz") and err.key == "model/w" and err.offset is not None


def test_ckpt_verify_and_ls_deep_refuse_a_resigned_span(bases: dict[str, Path], tmp_path: Path) -> None:
    from ckpt_cli.main import cli

    ck = tmp_path / "run" / "step-00000001"
    shutil.copytree(bases["plain"], ck)
    span, e, n = _span_of(ck, "model/h")
    replace_span(ck, "model/h", _lying_frame(span, e, n))
    res = CliRunner().invoke(cli, ["verify", str(ck)])
    assert res.exit_code != 0 and "BPZ1 span" in res.output, res.output
    res = CliRunner().invoke(cli, ["ls", "--deep", "--json", str(tmp_path / "run")])
    assert '"valid"' not in res.output and "BPZ1 span" in res.output, res.output


def test_a_valid_resigned_span_still_loads(bases: dict[str, Path], tmp_path: Path) -> None:
    """The control: a span re-encoded with another block size is valid, and every reader takes it."""
    ck = tmp_path / "step-00000001"
    shutil.copytree(bases["plain"], ck)
    values = _state(1)["model"]["w"].numpy().tobytes()
    replace_span(ck, "model/w", bpz.encode(values, 4, block=8192))
    ok, err = check_agreement(ck, "model/w")
    assert ok, err
    assert torch.equal(ckpt.open(ck).tensor("model/w"), _state(1)["model"]["w"])


@pytest.mark.parametrize("what", ["bad-magic", "lying-zstd-frame"])
def test_the_pipelined_walk_reports_the_span_error_with_chunks_larger_than_its_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """Large files are hashed on a second thread while the next piece is read; after a span
    fails to decode, the walk hashes on to the end of that chunk only, so a chunk larger
    than a piece is never hashed half and reported as corrupt."""
    import ckpt._ranges as ranges

    monkeypatch.setattr(ranges, "PIPELINE_MIN_BYTES", 0)
    monkeypatch.setattr(ranges, "PIECE", 8192)
    ck = tmp_path / "step-00000001"
    with override(chunk_size=16384, bpz_block=4096):
        ckpt.save(ck, {"model": {f"w{i}": torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in range(6)}},
                  step=1, compress=lambda key, dtype, nbytes: True)
    span, e, n = _span_of(ck, "model/w1")
    replace_span(ck, "model/w1", FIXED[what](span, e, n))
    for _ in range(5):
        with pytest.raises(FormatError, match="BPZ1 span") as ei:
            ckpt.open(ck).verify()
        assert type(ei.value) is FormatError and ei.value.key == "model/w1"
        targets = {"model": {f"w{i}": torch.zeros(4096) for i in range(6)}}
        with pytest.raises(FormatError, match="BPZ1 span"):
            ckpt.load(ck, targets, restore_rng=False, exactness="off")
        assert all(not v.any() for v in targets["model"].values())
