"""`python -m service` in a subprocess on a unix socket, for load and shutdown tests.

The server gets a process (and a core) of its own, as in production; its log goes to a
file so a chatty server never blocks on a full pipe.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from client import ExecutorClient

REPO = Path(__file__).resolve().parent.parent


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    target: str  # unix:///path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start(*args: str) -> ServerProcess:
    """Start `python -m service ARGS` on a unix socket of its own; `ready` waits for it."""
    # A short directory: unix socket paths are limited to about 100 bytes.
    where = Path(tempfile.mkdtemp(prefix="mx-", dir="/tmp"))
    sock, log = where / "executor.sock", where / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--unix-socket", str(sock), *args],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return ServerProcess(proc, f"unix://{sock}", log)


def ready(server: ServerProcess, timeout: float = 60.0) -> None:
    """Wait until the server answers health checks with SERVING; raise with its log if it exits first."""
    sock = Path(server.target.removeprefix("unix://"))
    # Wait for the socket before connecting: a channel that finds nothing there backs
    # off for seconds before it tries again.
    deadline = time.monotonic() + timeout
    while not sock.exists():
        assert server.proc.poll() is None, f"the server exited with {server.proc.returncode}: {server.output()[-3000:]}"
        assert time.monotonic() < deadline, f"no socket after {timeout} s: {server.output()[-3000:]}"
        time.sleep(0.05)
    with ExecutorClient(server.target) as c:
        c.wait_ready(max(deadline - time.monotonic(), 1.0))


def stop(server: ServerProcess) -> None:
    """Kill the server if it still runs and remove its directory."""
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(30)
    shutil.rmtree(server.log.parent, ignore_errors=True)


@contextmanager
def serve_paged(*args: str, ready_timeout: float = 60.0) -> Iterator[ServerProcess]:
    """Start the paged executor with extra CLI `args`; killed afterwards if still running."""
    server = start("--executor", "paged", *args)
    try:
        ready(server, ready_timeout)
        yield server
    finally:
        stop(server)
