"""Checkpoint streams: one committed checkpoint as one verified byte sequence
(spec/checkpoint-stream.md), and a torchft ``CheckpointTransport`` built on them.

    info = ckpt.stream.write_stream("run/step-00000100", sock.sendall)
    got = ckpt.stream.read_stream(reader, "spool/step-00000100")   # every frame checked on arrival
    ckpt.load(got.path, state, data=loader)

``TorchftTransport`` needs torchft (extra ``[torchft]``) and is imported on first use.
"""

from __future__ import annotations

from typing import Any

from .format import DEFAULT_CHUNK, DEFAULT_MAX_BYTES, StreamInfo, read_stream, stream_files, write_stream

__all__ = ["write_stream", "read_stream", "stream_files", "StreamInfo", "DEFAULT_CHUNK", "DEFAULT_MAX_BYTES",
           "TorchftTransport", "ReceivedState"]


def __getattr__(name: str) -> Any:
    if name in ("TorchftTransport", "ReceivedState"):
        from . import torchft

        value = getattr(torchft, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckpt.stream' has no attribute {name!r}")
