"""A real S3-compatible server on localhost for the tests: moto's S3 (``moto[server]``).

Run as a program, it serves moto's WSGI application with werkzeug on 127.0.0.1 and
prints ``PORT <n>`` once it listens (port 0 picks a free one), then serves until killed.
:func:`start` runs it as a subprocess and waits for that line (no sleeps).

Why requests are serialised: moto 5.x evaluates ``If-None-Match`` / ``If-Match`` in
its request handler and stores the object afterwards, with no lock between the check
and the store, so under its threaded server two concurrent conditional PUTs of one key
can both succeed. AWS S3 evaluates the condition atomically with the write (one of two
racing ``If-None-Match: *`` PUTs gets 412). One lock around moto's application makes
every request atomic, which is what the commit protocol relies on of a real store
(spec/object-storage.md §O.7). Requests still arrive on many connections at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any


def _serve(port: int) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    inner = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        with lock:
            # Read the whole response inside the lock: moto may build it lazily.
            return list(inner(environ, start_response))

    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"PORT {server.server_address[1]}", flush=True)
    # Nothing else may go to the pipe the parent stopped reading.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    server.serve_forever()


@dataclass
class Server:
    endpoint: str
    proc: subprocess.Popen[str]

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }

    def create_bucket(self, name: str) -> None:
        import urllib.request

        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(req) as r:
            assert r.status == 200, r.status

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start() -> Server:
    env = {**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"}
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the server listens (or dies)
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"moto server did not start (got {line!r}); is moto[server] installed?")
    return Server(f"http://127.0.0.1:{int(line.split()[1])}", proc)


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
