"""``ckpt inspect``: the seven fields in summary, a tensor table and the provenance.

Reads MANIFEST only (plus a directory listing), so its time does not depend on the
checkpoint's size, and it never imports torch.
"""

from __future__ import annotations

from typing import Any

import click

from ckpt.format.manifest import is_sharded
from ckpt_cli._common import classify, dump_json, handle_errors, human_bytes, json_option, not_found, when, wrong_kind


def _values(r: Any, part: str) -> dict[str, Any] | str:
    """Every plain value the part stores (``ckpt.diff.plain_values``), JSON-safe; the
    reason when the structure file cannot be read (the rest of the summary stands)."""
    from ckpt.diff import plain_values
    from ckpt.errors import CkptError

    try:
        vals = plain_values(r.tree(part)["state"], r.context(part))
    except CkptError as e:
        return f"unreadable: {e}"
    return {k: (v.hex() if isinstance(v, (bytes, bytearray)) else v) for k, v in vals.items()}


def manifest_summary(r: Any) -> dict[str, Any]:
    m = r.manifest
    parts = []
    # Parts listed by reference (format 2.0, many ranks): only the first part's manifest is
    # read for the detail; the others are named with their files' sizes (MANIFEST only).
    detail = len(m.parts) if not m.parts.refs else 1
    # a replicated entry is described by the part that holds its bytes (when detailed here)
    by_part = {m.parts[i].name: m.parts[i].summary.get("entries") or {} for i in range(detail)}
    for i, entry in enumerate(m.parts.listed()):
        if i >= detail:
            sizes = entry.sizes if hasattr(entry, "sizes") else [(f.name, f.size) for f in entry.files]
            parts.append({"name": entry.name, "files": [{"name": n, "bytes": z} for n, z in sizes], "by_reference": True})
            continue
        p = m.parts[i]
        s = p.summary
        parts.append(
            {
                "name": p.name,
                "files": [
                    {"name": f.name, "role": f.role, "bytes": f.size, "chunks": len(f.digests) // 16, "shared_from": f.origin}
                    for f in p.files
                ],
                "packed": _packed(p),
                "entries": {k: _entry(k, v, by_part) for k, v in (s.get("entries") or {}).items()},
                "tensors": [
                    {"name": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                     **({"encoding": t.encoding, "stored": t.stored} if t.encoding else {})}
                    for t in p.tensors
                ],
                "rng": s.get("rng"),
                "data": s.get("data"),
                "config_hash": s.get("config_hash"),
                "topology": s.get("topology"),
                "commit": s.get("commit"),
                "env": s.get("env"),
                "lineage": s.get("lineage"),
                "step": s.get("step"),
                "values": _values(r, p.name),
            }
        )
    return {
        "path": r.path,
        "id": m.id,
        "kind": m.kind,
        "format_version": f"{m.version[0]}.{m.version[1]}",
        "package_version": m.package_version,
        "step": m.step,
        "created_at": m.created_at,
        "bytes": m.total_bytes,
        "meta": m.meta,
        "parts": parts,
        "sharded": sharded_summary(r) if is_sharded(m) else None,
    }


def _entry(name: str, e: dict[str, Any], by_part: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An entry's summary with its field; a replicated one takes its type (and the field
    it belongs to) from the part that holds its bytes, and says which part that is."""
    src = e.get("replica_of")
    if isinstance(src, str):
        # follow the chain to the part holding the bytes (a reader follows at most 4 hops,
        # spec §9; a longer chain or a cycle stops there, and verify names it)
        held = (by_part.get(src) or {}).get(name) or {}
        for _ in range(4):
            nxt = held.get("replica_of")
            if not isinstance(nxt, str) or nxt == src:
                break
            src, held = nxt, (by_part.get(nxt) or {}).get(name) or {}
        typ = held.get("type", e.get("type", ""))
        return {**e, "type": typ, "field": classify(typ, held.get("tensors"), name),
                "replica": {"part": src, "tensors": held.get("tensors"), "bytes": held.get("bytes")}}
    return {**e, "field": classify(e.get("type", ""), e.get("tensors"), name), "replica": None}


def _packed(p: Any) -> dict[str, Any] | None:
    """Encoded tensors of a part (format 2.0 §V.3): stock safetensors cannot read them."""
    enc = [t for t in p.tensors if t.encoding]
    if not enc:
        return None
    return {"tensors": len(enc), "bytes": sum(t.nbytes for t in enc), "stored": sum(t.stored for t in enc),
            "encoding": sorted({t.encoding for t in enc})}


def sharded_summary(r: Any) -> dict[str, Any]:
    """Global tensors and their shard layout (spec/sharded-format.md), validated, no torch."""
    from ckpt.format.sharded import decode_layout

    lay = decode_layout(r.manifest, path=r.path)
    return {
        "world_size": lay.world_size,
        "mesh": lay.mesh,
        "tensors": [
            {
                "fqn": t.fqn,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "bytes": t.nbytes,
                "placements": list((lay.placements or {}).get(t.fqn, ())),
                "chunks": [{"part": c.part, "offsets": list(c.offsets), "sizes": list(c.sizes), "key": c.key} for c in t.chunks],
            }
            for t in lay.tensors.values()
        ],
        "values": {v.fqn: v.part for v in lay.values.values()},
    }


def _sharded_lines(sh: dict[str, Any], max_tensors: int) -> list[str]:
    mesh = sh.get("mesh") or {}
    names = mesh.get("dim_names")
    mesh_text = "x".join(map(str, mesh.get("shape") or [])) + (f" ({', '.join(map(str, names))})" if names else "") if mesh else "-"
    out = [f"sharded: saved on {sh['world_size']} rank(s), mesh {mesh_text}; global tensors and their chunks:"]
    rows = sh["tensors"][:max_tensors]
    w = max((len(t["fqn"]) for t in rows), default=4)
    for t in rows:
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        boxes = " | ".join(
            f"{c['part']} [" + ", ".join(f"{o}:{o + n}" for o, n in zip(c["offsets"], c["sizes"])) + "]" for c in t["chunks"]
        )
        pl = f"  {'/'.join(t['placements'])}" if t["placements"] else ""
        out.append(f"    {t['fqn']:<{w}}  {t['dtype']:<9} {shape:<12}{pl}  {boxes}")
    if len(sh["tensors"]) > max_tensors:
        out.append(f"    ... {len(sh['tensors']) - max_tensors} more (use --all or --json)")
    if sh["values"]:
        out.append("  values: " + ", ".join(f"{k} ({p})" for k, p in sorted(sh["values"].items())))
    return out


def _format2_lines(p: dict[str, Any]) -> list[str]:
    out = []
    pk = p.get("packed")
    if pk:
        ratio = pk["bytes"] / pk["stored"] if pk["stored"] else 0.0
        out.append(
            f"  packed: {pk['tensors']} tensors encoded ({', '.join(pk['encoding'])}: byte planes + zstd), "
            f"{human_bytes(pk['bytes'])} stored in {human_bytes(pk['stored'])} ({ratio:.2f}x); "
            "stock safetensors cannot read them"
        )
    shared = [f for f in p["files"] if f.get("shared_from")]
    if shared:
        out.append("  shared: " + ", ".join(f"{f['name']} ({human_bytes(f['bytes'])}, written by {f['shared_from']})" for f in shared))
    return out


def _commit_line(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    if not c.get("available"):
        return f"unavailable ({c.get('reason')})"
    dirty = f", dirty (diff sha256 {str(c.get('diff_sha256'))[:12]})" if c.get("dirty") else ", clean"
    return f"{c.get('sha')}{dirty}"


def _topo_line(t: dict[str, Any] | None) -> str:
    if not t:
        return "-"
    dev = t.get("device_kind", "?")
    if t.get("device_count"):
        dev += f" x{t['device_count']} ({', '.join(t.get('device_names') or [])})"
    back = f", backend {t['backend']}" if t.get("backend") else ""
    return f"world {t.get('world_size')}, rank {t.get('rank')}, host {t.get('hostname')}, {dev}{back}"


def render(s: dict[str, Any], *, tensors: bool = True, max_tensors: int = 50) -> str:
    out = []
    out.append(f"checkpoint  {s['path']}")
    out.append(
        f"  committed, {s['kind']}, format {s['format_version']}, written by ckpt-replay {s['package_version']}"
    )
    out.append(f"  id {s['id']}   step {s['step']}   {when(s['created_at'])}   {human_bytes(s['bytes'])} in {len(s['parts'])} part(s)")
    multi = len(s["parts"]) > 1
    brief = [p for p in s["parts"] if p.get("by_reference")]
    for p in s["parts"]:
        if p.get("by_reference"):
            continue
        if multi:
            out.append(f"part {p['name']}")
        out.extend(_format2_lines(p))
        out.append("  seven fields:")
        by_field: dict[str, list[str]] = {}
        for name, e in p["entries"].items():
            rep = e.get("replica")
            by_field.setdefault(e["field"], []).append(
                f"{name}: replicated, held by part {rep['part']} ({rep.get('tensors') or 0} tensors, "
                f"{human_bytes(rep.get('bytes'))} there; {e.get('type')})" if rep else
                f"{name} (plain values)" if e["field"] == "other" else
                f"{name}: {e.get('tensors', 0)} tensors, {human_bytes(e.get('bytes'))} ({e.get('type')})"
            )
        out.append(f"    weights    {'; '.join(by_field.get('weights', [])) or '-'}")
        opt = by_field.get("optimizer", []) + by_field.get("scheduler", []) + by_field.get("scaler", [])
        out.append(f"    optimizer  {'; '.join(opt) or '-'}")
        out.append(f"    rng        {', '.join(p['rng'] or []) or 'not captured'}")
        d = p.get("data")
        out.append(f"    data       {('-' if not d else str(d.get('type')) + ' ' + str(d.get('state') or {}))}")
        out.append(f"    config     {p.get('config_hash') or '-'}")
        out.append(f"    topology   {_topo_line(p.get('topology'))}")
        out.append(f"    commit     {_commit_line(p.get('commit'))}")
        if by_field.get("messages"):  # not one of the seven: messages held at a snapshot's cut
            out.append(f"  messages     {'; '.join(by_field['messages'])}")
        if by_field.get("other"):  # not one of the seven: plain values next to them
            out.append(f"  other state  {'; '.join(by_field['other'])}")
        vals = p.get("values")
        if isinstance(vals, str):
            out.append(f"  values       {vals}")
        elif vals:
            shown = [f"{k} {v!r}" for k, v in list(vals.items())[:max_tensors]]
            more = f", ... {len(vals) - max_tensors} more (--json)" if len(vals) > max_tensors else ""
            out.append(f"  values       {', '.join(shown)}{more}")
        env = p.get("env") or {}
        out.append("  environment  " + ", ".join(f"{k} {v}" for k, v in env.items()))
        lin = p.get("lineage") or {}
        out.append(f"  lineage      run {lin.get('run_id') or '-'}, resumed from {lin.get('resumed_from') or '-'}")
        if tensors and p["tensors"]:
            out.append("  tensors:")
            w = max(len(t["name"]) for t in p["tensors"][:max_tensors])
            out.append(f"    {'name':<{w}}  {'dtype':<16} {'shape':<20} bytes")
            for t in p["tensors"][:max_tensors]:
                shape = "[" + ", ".join(map(str, t["shape"])) + "]"
                out.append(f"    {t['name']:<{w}}  {t['dtype']:<16} {shape:<20} {t['bytes']}")
            if len(p["tensors"]) > max_tensors:
                out.append(f"    ... {len(p['tensors']) - max_tensors} more (use --all or --json)")
    if brief:
        out.append(f"{len(brief)} more part(s) listed by reference (their part manifests not read):")
        for p in brief[:max_tensors]:
            out.append(f"    {p['name']}: " + ", ".join(f"{f['name']} {human_bytes(f['bytes'])}" for f in p["files"]))
        if len(brief) > max_tensors:
            out.append(f"    ... {len(brief) - max_tensors} more (use --all or --json)")
    meta = s["meta"]
    if s.get("sharded"):
        out.extend(_sharded_lines(s["sharded"], max_tensors))
    if s["kind"] == "snapshot" and meta.get("format") == "replay-snapshot":
        out.extend(_snapshot_lines(meta))
    elif meta:
        out.append("  meta: " + ", ".join(sorted(map(str, meta))))
    return "\n".join(out)


def _clock_text(raw: object) -> str:
    from replay.clock import VectorClock

    try:
        return repr(VectorClock.decode(raw)) if isinstance(raw, bytes) else repr(raw)
    except ValueError as e:
        return f"<undecodable clock: {e}>"


def _snapshot_lines(meta: dict[str, Any]) -> list[str]:
    """A Chandy-Lamport snapshot: processes, their shards, the cut and channel states."""
    out = [f"snapshot {meta.get('snapshot')} (coordinator {meta.get('coordinator')})"]
    out.append(f"  processes  {', '.join(map(str, meta.get('participants') or []))}")
    if meta.get("excluded"):
        out.append(f"  excluded   {', '.join(map(str, meta['excluded']))}")
    out.append("  cut:")
    for actor, clock in sorted((meta.get("cut") or {}).items()):
        out.append(f"    {actor:<16} {_clock_text(clock)}")
    out.append("  channel states (messages in flight at the cut):")
    any_msgs = False
    for actor, chans in sorted((meta.get("channels") or {}).items()):
        for src, rec in sorted((chans or {}).items()):
            count = rec.get("count", 0) if isinstance(rec, dict) else rec
            first = rec.get("first_seq") if isinstance(rec, dict) else None
            if count:
                any_msgs = True
                out.append(f"    {src} -> {actor}: {count} message(s) from seq {first}")
    if not any_msgs:
        out.append("    (all channels empty)")
    return out


@click.command("inspect")
@click.argument("path")
@json_option("§4.1")
@click.option("--all", "show_all", is_flag=True, help="List every tensor.")
@click.option("--latest", is_flag=True, help="PATH is a run directory: inspect its newest committed checkpoint.")
@handle_errors
def inspect_cmd(path: str, as_json: bool, show_all: bool, latest: bool) -> None:
    """Summarise a checkpoint without loading it (and without importing torch).

    Exit 0; 3 corrupt; 4 incomplete; 5 missing; 7 not a checkpoint (a file, a run
    directory without --latest, a tape, a DCP or Hugging Face directory: named)."""
    from ckpt import CheckpointReader

    if latest:
        path = newest_checkpoint(path)
    s = manifest_summary(CheckpointReader(path))
    if as_json:
        dump_json(s)
    else:
        click.echo(render(s, max_tensors=10**9 if show_all else 50))


def newest_checkpoint(run_dir: str) -> str:
    """The newest committed checkpoint of a run directory, by step (``--latest``)."""
    from ckpt.probe import probe_path

    found = probe_path(run_dir)
    if found.kind == "checkpoint":
        return run_dir
    if found.kind == "missing":
        raise not_found(run_dir)
    if found.kind != "run" or not found.checkpoints:
        raise wrong_kind(f"--latest: {run_dir} holds no committed checkpoint: it is {found.what}")
    import os

    return os.path.join(run_dir, found.checkpoints[-1])
