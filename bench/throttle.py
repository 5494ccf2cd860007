"""A bandwidth-capped TCP proxy for the benchmarks (a bench helper, not library code).

The local S3-compatible server (moto, ``tests/s3server.py``) answers as fast as the CPU lets
it; a real object store is reached over a link of some hundreds of MB/s per writer. This
proxy sits between the client and the server and caps the link: one token bucket per
direction, shared by every connection (the link's capacity, not a per-connection limit),
so ``obstore``'s parallel multipart parts and ranged reads share the cap as they would
share a NIC. Point ``AWS_ENDPOINT_URL`` at :attr:`Proxy.endpoint`.

Shape of the cap: a bucket of ``burst`` bytes (default 256 KiB) refilled at ``rate`` bytes
per second; each piece forwarded (at most 64 KiB) waits for its tokens first, in arrival
order. Latency is not added. ``rate`` <= 0 forwards uncapped (the A/A and overhead control).

As a program it prints ``PORT <n>`` once it listens and serves until killed::

    python bench/throttle.py --upstream http://127.0.0.1:PORT --mb-per-s 50

:func:`start` runs it as a subprocess (the default: the proxy's own Python work does not
compete for the benchmark's GIL) or on a thread of this process (``thread=True``: tests,
which then read the byte counters).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

PIECE = 64 << 10


class Bucket:
    """Tokens (bytes) refilled at ``rate`` per second up to ``burst``; FIFO waiters."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = max(burst, PIECE)
        self.tokens = float(self.burst)
        self.t = time.monotonic()
        self.lock = asyncio.Lock()
        self.bytes = 0  # forwarded through this bucket

    async def take(self, n: int) -> None:
        self.bytes += n
        if self.rate <= 0:
            return
        async with self.lock:  # one waiter at a time: arrival order across connections
            while True:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
                self.t = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                await asyncio.sleep((n - self.tokens) / self.rate)


@dataclass
class Counters:
    """What went through (live: the buckets count as they forward)."""

    up_bucket: Bucket
    down_bucket: Bucket
    connections: int = 0

    @property
    def up(self) -> int:  # client -> server bytes
        return self.up_bucket.bytes

    @property
    def down(self) -> int:  # server -> client bytes
        return self.down_bucket.bytes


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: Bucket) -> None:
    try:
        while True:
            data = await reader.read(PIECE)
            if not data:
                break
            await bucket.take(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            pass


async def _serve(upstream: tuple[str, int], counters: Counters, port: int, ready: Any,
                 stop: asyncio.Event | None = None) -> None:
    up, down = counters.up_bucket, counters.down_bucket
    handlers: set[asyncio.Task[Any]] = set()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            try:
                sr, sw = await asyncio.open_connection(*upstream)
            except OSError:
                cw.close()
                return
            counters.connections += 1
            try:
                await asyncio.gather(_pipe(cr, sw, up), _pipe(sr, cw, down))
            finally:
                for w in (sw, cw):
                    w.close()
        except asyncio.CancelledError:
            pass  # the proxy is stopping
        finally:
            handlers.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    ready(server.sockets[0].getsockname()[1])
    if stop is None:
        async with server:
            await server.serve_forever()
        return
    await stop.wait()
    server.close()
    for t in list(handlers):
        t.cancel()
    await asyncio.gather(*handlers, return_exceptions=True)
    await server.wait_closed()


def _host_port(url: str) -> tuple[str, int]:
    u = urlsplit(url if "://" in url else f"http://{url}")
    return u.hostname or "127.0.0.1", u.port or 80


@dataclass
class Proxy:
    endpoint: str
    rate: float  # bytes per second per direction (<= 0: uncapped)
    proc: subprocess.Popen[str] | None = None
    counters: Counters | None = None  # on a thread only
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if self._loop is not None and self._thread is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()


def start(upstream: str, mb_per_s: float, *, burst: int = 256 << 10, thread: bool = False) -> Proxy:
    """A proxy to ``upstream`` (``http://host:port``) capped at ``mb_per_s`` MB/s (10^6
    bytes) each way; ``mb_per_s <= 0``: uncapped."""
    rate = mb_per_s * 1e6
    if not thread:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--upstream", upstream, "--mb-per-s", str(mb_per_s),
             "--burst", str(burst)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until it listens (or dies)
        if not line.startswith("PORT "):
            proc.kill()
            raise RuntimeError(f"throttling proxy did not start (got {line!r})")
        return Proxy(f"http://127.0.0.1:{int(line.split()[1])}", rate, proc)
    loop = asyncio.new_event_loop()
    got: list[int] = []
    listening = threading.Event()
    counters = Counters(Bucket(rate, burst), Bucket(rate, burst))
    stop = asyncio.Event()

    def ready(port: int) -> None:
        got.append(port)
        listening.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(_serve(_host_port(upstream), counters, 0, ready, stop))
        finally:
            loop.close()
            listening.set()

    t = threading.Thread(target=run, name="throttle-proxy", daemon=True)
    t.start()
    listening.wait()
    if not got:
        raise RuntimeError("throttling proxy did not start")
    return Proxy(f"http://127.0.0.1:{got[0]}", rate, None, counters, loop, t, stop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="http://host:port of the server")
    ap.add_argument("--mb-per-s", type=float, required=True, help="cap each way, MB/s (10^6 bytes); <= 0: uncapped")
    ap.add_argument("--burst", type=int, default=256 << 10)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()

    def ready(port: int) -> None:
        print(f"PORT {port}", flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # nothing else may go to a pipe the parent stopped reading

    rate = args.mb_per_s * 1e6
    asyncio.run(_serve(_host_port(args.upstream), Counters(Bucket(rate, args.burst), Bucket(rate, args.burst)), args.port, ready))


if __name__ == "__main__":
    main()
