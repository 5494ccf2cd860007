"""Export one entry of a checkpoint to the Hugging Face layout (``ckpt export hf``).

What ``transformers``' ``save_pretrained`` writes and ``from_pretrained`` reads
(spec/cli.md §5 has the rules):

- ``model.safetensors`` with the entry's plain parameter names (``transformer.wte.weight``,
  no ``model/`` prefix, no optimizer tensors), or, above ``max_shard_size``, shards
  ``model-00001-of-00003.safetensors`` and ``model.safetensors.index.json``
  (``{"metadata": {"total_size": N}, "weight_map": {name: file}}``). Shards are filled
  in state-dict order and a tensor never straddles two; one larger than the limit gets
  a shard of its own, as ``huggingface_hub`` does.
- Tied weights: names that share one saved tensor (``lm_head.weight`` and
  ``transformer.wte.weight`` in GPT-2) are written once, under the first name in the
  module's order, as ``save_pretrained`` does; ``from_pretrained`` ties the other. When
  the config says ``tie_word_embeddings: false`` each name gets its own copy instead.
- ``config.json`` when the checkpoint holds a config that is an HF config (a map with
  ``model_type``), or holds one as a value (``CkptTrainer`` saves ``{"model": ...}``),
  or ``config_key`` names one.

No torch and no transformers: the bytes are copied tensor by tensor from the
checkpoint's safetensors file (each chunk verified as it is read, once) into stock
safetensors files, so memory is one output shard plus one read piece. Sharded (DTensor)
checkpoints are read as global tensors first (that path imports torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import CheckpointExistsError, FormatError, UnsupportedValueError
from ..format.manifest import is_sharded
from ..format import dtypes
from ..format.safetensors import TensorSlot, build_header
from ..format.tree import TensorRef
from ..storage import local

__all__ = ["export_hf", "HFExport", "DEFAULT_MAX_SHARD_SIZE", "parse_size"]

#: transformers' default ``max_shard_size`` ("5GB", decimal)
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


@dataclass(frozen=True, slots=True)
class HFExport:
    """What :func:`export_hf` wrote. ``tied``: (written name, name left to be tied) pairs."""

    src: str
    out_dir: str
    entry: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    tied: tuple[tuple[str, str], ...] = ()
    config: str | None = None  # the config file written, or None
    config_note: str | None = None  # why no config was written
    skipped: tuple[str, ...] = field(default=())  # non-tensor values of the entry (not representable)

    def __repr__(self) -> str:
        return (f"HFExport({self.out_dir!r}, entry {self.entry!r}, {self.tensors} tensors, {self.total_size} bytes "
                f"in {len(self.files)} file(s), tied {len(self.tied)}, config {self.config or 'none'})")

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "out_dir": self.out_dir, "entry": self.entry, "files": list(self.files),
                "tensors": self.tensors, "total_size": self.total_size, "tied": [list(t) for t in self.tied],
                "config": self.config, "config_note": self.config_note, "skipped": list(self.skipped)}


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1048576"`` -> bytes (transformers' units)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        num, mult = s, 1
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value * mult)


def _flatten(saved: Any, prefix: str, out: dict[str, Any], skipped: list[str]) -> None:
    if isinstance(saved, Mapping):
        for k, v in saved.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, skipped)
    elif isinstance(saved, TensorRef) or _is_tensor(saved):
        out[prefix] = saved
    else:
        skipped.append(prefix)


def _is_tensor(v: Any) -> bool:
    return type(v).__module__.startswith("torch") and hasattr(v, "untyped_storage")


def _hf_config(cfg: Any, key: str | None) -> tuple[dict[str, Any] | None, str | None]:
    if cfg is None:
        return None, "the checkpoint holds no config"
    if key is not None:
        sub = cfg.get(key) if isinstance(cfg, dict) else None
        if not isinstance(sub, dict):
            raise FormatError(f"the checkpoint's config has no map {key!r} (keys: {sorted(map(str, cfg or {}))})",
                              key=f"config/{key}")
        return sub, None
    if isinstance(cfg, dict) and "model_type" in cfg:
        return cfg, None
    if isinstance(cfg, dict):
        found = [k for k, v in cfg.items() if isinstance(v, dict) and "model_type" in v]
        if len(found) == 1:
            return cfg[found[0]], None
        if found:
            return None, f"several config values look like HF configs ({sorted(map(str, found))}): pass config_key"
    return None, "the checkpoint's config is not an HF config (no model_type): pass config_key to name one"


def _plan_shards(names: list[str], sizes: Mapping[str, int], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for n in names:
        if shards[-1] and used + sizes[n] > limit:
            shards.append([])
            used = 0
        shards[-1].append(n)
        used += sizes[n]
    return shards


def export_hf(
    src: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    entry: str = "model",
    part: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    config_key: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> HFExport:
    """Write entry ``entry`` of checkpoint ``src`` into ``out_dir`` in the HF layout.

    ``out_dir`` must be new or empty; ``overwrite=True`` replaces the files this writes
    (and removes stale ``model*.safetensors`` shards and index) but leaves other files.
    ``progress(done_bytes, total_bytes)`` follows the tensor bytes copied.
    """
    from .._statecheck import replica_target
    from ..reader import CheckpointReader

    limit = parse_size(max_shard_size)
    r = CheckpointReader(src)
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise CheckpointExistsError("the output directory is not empty (pass overwrite=True to replace the export)",
                                    path=out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointExistsError("the output path is a file", path=out)
    sharded = part is None and is_sharded(r.manifest)
    skipped: list[str] = []
    flat: dict[str, Any] = {}
    if sharded:
        _flatten(r.state(entry), "", flat, skipped)
        pe = None
    else:
        pe = r.part(part) if part is not None or len(r.parts) == 1 else _part_holding(r, entry)
        state = r.tree(pe.name, verify=verify)["state"]
        if entry not in state:
            raise FormatError(f"no entry {entry!r} in this checkpoint (it has {sorted(state)})", path=r.path, key=entry)
        pe, saved = replica_target(r, pe, entry, state[entry], verify=verify)
        _flatten(saved, "", flat, skipped)
    if not flat:
        raise UnsupportedValueError(f"entry {entry!r} holds no tensors: nothing to export", key=entry)
    cfg, note = _hf_config(r.config(pe.name if pe is not None else None) if not sharded else r.config(r.parts[0].name),
                           config_key)
    copies = isinstance(cfg, dict) and cfg.get("tie_word_embeddings") is False

    # Names that share one saved tensor: the first (module order) is written, the rest tied.
    entries = {t.key: t for t in pe.tensors} if pe is not None else {}
    first_of: dict[Any, str] = {}
    tied: list[tuple[str, str]] = []
    names: list[str] = []
    for name, v in flat.items():
        ident = v.key if isinstance(v, TensorRef) else (v.untyped_storage().data_ptr(), v.storage_offset(),
                                                         tuple(v.shape), tuple(v.stride()))
        if ident in first_of and not copies:
            tied.append((first_of[ident], name))
            continue
        first_of.setdefault(ident, name)
        names.append(name)

    def meta_of(name: str) -> tuple[str, tuple[int, ...], int]:
        v = flat[name]
        if isinstance(v, TensorRef):
            t = entries.get(v.key)
            if t is None:
                raise FormatError("structure refers to a tensor the manifest does not list", path=r.path, key=v.key)
            return t.dtype, tuple(t.shape), t.nbytes
        return dtypes.dtype_name(v.dtype), tuple(v.shape), v.numel() * v.element_size()

    metas = {n: meta_of(n) for n in names}
    for n, (dt, _, _) in metas.items():
        if dtypes.is_raw(dt):
            raise UnsupportedValueError(f"dtype {dt} has no safetensors name; the HF layout cannot hold it", key=n)
    sizes = {n: m[2] for n, m in metas.items()}
    total = sum(sizes.values())
    shards = _plan_shards(names, sizes, limit)
    files = [WEIGHTS_NAME] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                    for i in range(len(shards))]
    os.makedirs(out, exist_ok=True)
    if overwrite:
        for old in os.listdir(out):
            if (old.startswith("model") and old.endswith(".safetensors")) or old == INDEX_NAME:
                os.unlink(os.path.join(out, old))
    done = 0
    for fname, shard in zip(files, shards):
        # stock safetensors order: larger elements first (aligned for mapping), then by name
        order = sorted(shard, key=lambda n: (-dtypes.itemsize(metas[n][0]), n))
        slots = [TensorSlot(n, metas[n][0], metas[n][1], metas[n][2]) for n in order]
        header, _ = build_header(slots, {"format": "pt"})
        tmp = os.path.join(out, f".{fname}.tmp")
        # one shard in memory at a time, read in file order (each chunk hashed once)
        data = _shard_bytes(r, pe, [(n, flat[n]) for n in shard], entries, verify)
        with open(tmp, "wb") as f:
            f.write(header)
            for n in order:
                f.write(data.pop(n))
                done += sizes[n]
                if progress is not None:
                    progress(done, total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(out, fname))
    written = list(files)
    if len(files) > 1:
        weight_map = {n: fname for fname, shard in zip(files, shards) for n in shard}
        _write_json(os.path.join(out, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(INDEX_NAME)
    cfg_name = None
    if cfg is not None:
        _write_json(os.path.join(out, CONFIG_NAME), _jsonable(cfg))
        cfg_name = CONFIG_NAME
        written.append(CONFIG_NAME)
    local.fsync_dir(out)
    return HFExport(r.path, out, entry, tuple(written), len(names), total, tuple(tied), cfg_name,
                    None if cfg is not None else note, tuple(skipped))


def _part_holding(r: Any, entry: str) -> Any:
    """Of several parts (one per rank), the first whose entry holds the bytes itself."""
    from ..format.tree import ReplicaRef

    for pe in r.parts:
        st = r.tree(pe.name)["state"]
        if entry in st and not isinstance(st[entry], ReplicaRef):
            return pe
    return r.parts[0]


def _shard_bytes(r: Any, pe: Any, named: list[tuple[str, Any]], entries: Mapping[str, Any], verify: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    items = []
    for n, v in named:
        if isinstance(v, TensorRef):
            t = entries[v.key]
            out[n] = bytearray(t.nbytes)
            items.append((t, memoryview(out[n])))
        else:  # a global tensor of a sharded checkpoint, already in memory
            from ..writer import tensor_memoryview

            out[n] = tensor_memoryview(v.detach().cpu().contiguous())
    if items:
        r.read_tensors_into(pe, items, verify=verify)
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, bytes):
        return v.hex()
    return v


def _write_json(path: str, obj: Any) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

