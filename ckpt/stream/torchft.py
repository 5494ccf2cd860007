"""A torchft ``CheckpointTransport`` that moves a recovering replica's state as a checkpoint
stream (spec/checkpoint-stream.md §6) instead of torch's pickle-based serialisation.

torchft asks the transport to send ``{"user": {key: state}, "torchft": manager_state}`` to
the replicas that are behind. Here that state is saved with ``ckpt.save`` (all seven
fields: the transport holds the replica's data loader and named generators, and the run's
config), streamed over the replica process group torchft reconfigures at every quorum,
checked frame by frame on arrival, and loaded on the receiver with ``ckpt.load``: the
joiner gets its peer's exact weights, optimizer, RNG and data position.

Needs torchft (extra ``[torchft]``); ``import ckpt`` never imports this module.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
from torchft.checkpointing.transport import CheckpointTransport

from ..errors import FormatError, StateMismatchError, UnsupportedValueError
from .format import DEFAULT_CHUNK, DEFAULT_MAX_BYTES, MAX_CHUNK, StreamInfo, Tamper, read_stream, write_stream

__all__ = ["TorchftTransport", "ReceivedState", "METADATA"]

METADATA = "ckpt-stream/1"
_LEN_TAG = 0x5C0
_DATA_TAG = 0x5C1

# (peer replica rank, step, what went over the wire)
Hook = Callable[[int, int, StreamInfo], None]


@dataclass
class ReceivedState:
    """A received checkpoint, handed to the user's ``load_state_dict`` by torchft."""

    path: str
    info: StreamInfo
    key: str
    transport: "TorchftTransport"

    def load(self, state: Mapping[str, Any], **load_kwargs: Any) -> Any:
        """``ckpt.load`` it into ``state`` (the same mapping the sender's ``state_dict``
        function returned), with the transport's data loader and generators; the spool
        directory is removed afterwards."""
        import ckpt

        t = self.transport
        kw: dict[str, Any] = {"data": t.data, "generators": t.generators, "exactness": "off", "ledger": False}
        kw.update(load_kwargs)
        try:
            return ckpt.load(self.path, dict(state), **kw)
        finally:
            shutil.rmtree(self.path, ignore_errors=True)


class TorchftTransport(CheckpointTransport[dict]):
    """Checkpoint streams over a torchft ``ProcessGroup`` (the manager's replica group).

    ``data``: the replica's data loader (its offsets travel as the data field);
    ``generators``: named ``torch.Generator``\\ s (RNG field); ``config``: the run's config
    (config hash field). ``on_sent`` / ``on_received`` are called with (peer replica rank,
    step, :class:`StreamInfo`) after each transfer (a run tapes them). ``tamper`` corrupts
    frames after their digest is taken, ``tamper_received(segment index, bytes)`` what
    arrives before it is read (fault injection, in the sender or on the wire: the
    receiver must refuse them).
    """

    def __init__(self, pg: Any, *, timeout: timedelta = timedelta(seconds=60), data: Any = None,
                 generators: Mapping[str, torch.Generator] | None = None, config: Any = None,
                 spool_dir: str | None = None, chunk_bytes: int = DEFAULT_CHUNK, segment_bytes: int = 4 << 20,
                 max_bytes: int = DEFAULT_MAX_BYTES, on_sent: Hook | None = None, on_received: Hook | None = None,
                 tamper: Tamper | None = None,
                 tamper_received: Callable[[int, bytearray], None] | None = None) -> None:
        self._pg = pg
        self._timeout = timeout
        self.data = data
        self.generators = dict(generators or {})
        self.config = config
        self._spool = spool_dir
        self._chunk = chunk_bytes
        self._segment = segment_bytes
        self._max = max_bytes
        self.on_sent = on_sent
        self.on_received = on_received
        self.tamper = tamper
        self.tamper_received = tamper_received
        self._lock = threading.Lock()

    # -- torchft's interface ------------------------------------------------------------
    def metadata(self) -> str:
        return METADATA

    def disallow_checkpoint(self) -> None:
        pass  # sends complete before send_checkpoint returns: nothing is served later

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        import ckpt

        user = state_dict["user"]
        if len(user) != 1:
            raise UnsupportedValueError(f"TorchftTransport carries one registered state, got keys {sorted(user)}",
                                        key="user")
        (key, state), = user.items()
        if not isinstance(state, Mapping):
            raise UnsupportedValueError("the registered state_dict function must return a mapping name -> "
                                        "module/optimizer/tree", key=key)
        spool = tempfile.mkdtemp(prefix="ckpt-send-", dir=self._spool)
        try:
            path = os.path.join(spool, f"step-{step:08d}")
            ckpt.save(path, dict(state), config=self.config, data=self.data, step=step, generators=self.generators,
                      extra={"torchft": dict(state_dict["torchft"]), "key": key}, this_rank_only=True,
                      ledger=False)
            for dst in dst_ranks:
                info = self._send_stream(path, dst, step, timeout)
                if self.on_sent is not None:
                    self.on_sent(dst, step, info)
        finally:
            shutil.rmtree(spool, ignore_errors=True)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        import ckpt

        if metadata != METADATA:
            raise FormatError(f"the source replica serves {metadata!r}, not a checkpoint stream ({METADATA})")
        spool = self._spool or tempfile.gettempdir()
        dest = os.path.join(spool, f"ckpt-recv-{uuid.uuid4().hex}")
        read = self._reader(src_rank, timeout)
        info = read_stream(read, dest, max_bytes=self._max, unread=read.unread)  # type: ignore[attr-defined]
        r = ckpt.open(dest)
        if r.step != step:
            shutil.rmtree(dest, ignore_errors=True)
            raise StateMismatchError(f"received the checkpoint of step {r.step}, torchft asked for step {step}",
                                     path=dest)
        extra = r.context()["extra"]
        if self.on_received is not None:
            self.on_received(src_rank, step, info)
        key = str(extra["key"])
        return {"user": {key: ReceivedState(dest, info, key, self)}, "torchft": dict(extra["torchft"])}

    def shutdown(self, wait: bool = True) -> None:
        pass

    # -- the wire: (int64 length, uint8 bytes) message pairs on the replica group --------------
    def _send_stream(self, path: str, dst: int, step: int, timeout: timedelta) -> StreamInfo:
        buf = bytearray()
        pg = self._pg

        def flush() -> None:
            # never an empty segment: the receiver reads exactly the stream's bytes, and an
            # unmatched message would be left pending on the group
            if not buf:
                return
            n = torch.tensor([len(buf)], dtype=torch.int64)
            pg.send([n], dst, _LEN_TAG).wait(timeout)
            pg.send([torch.frombuffer(bytearray(buf), dtype=torch.uint8)], dst, _DATA_TAG).wait(timeout)
            buf.clear()

        def write(b: bytes) -> None:
            buf.extend(b)
            if len(buf) >= self._segment:
                flush()

        info = write_stream(path, write, chunk_bytes=self._chunk, meta={"step": step}, tamper=self.tamper)
        flush()
        return info

    def _reader(self, src: int, timeout: timedelta) -> Callable[[int], bytes]:
        pg = self._pg
        pending = bytearray()
        limit = self._segment + MAX_CHUNK + 64  # a segment is flushed once it reaches segment_bytes
        seen = [0]

        def read(n: int) -> bytes:
            while not pending:
                ln = torch.zeros(1, dtype=torch.int64)
                pg.recv([ln], src, _LEN_TAG).wait(timeout)
                size = int(ln.item())
                if not 0 < size <= limit:
                    raise FormatError(f"stream segment of {size} bytes announced by replica {src} (limit {limit})")
                t = torch.empty(size, dtype=torch.uint8)
                pg.recv([t], src, _DATA_TAG).wait(timeout)
                seg = bytearray(t.numpy().tobytes())
                if self.tamper_received is not None:
                    self.tamper_received(seen[0], seg)
                seen[0] += 1
                pending.extend(seg)
            out = bytes(pending[:n])
            del pending[:n]
            return out

        read.unread = lambda: len(pending)  # type: ignore[attr-defined]  # bytes past the trailer, checked there
        return read
