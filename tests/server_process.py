"""`python -m service` in a subprocess on a unix socket, for load, shutdown and fault tests
(bench/service_process.py launches it).

The server gets a process (and a core) of its own, as in production; its log goes to a
file so a chatty server never blocks on a full pipe.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from bench.service_process import Server as ServerProcess
from bench.service_process import launch, wait_ready
from bench.service_process import stop as stop_server

__all__ = ["ServerProcess", "ready", "serve_paged", "start", "stop"]


def start(*args: str) -> ServerProcess:
    """Start `python -m service ARGS` on a unix socket of its own; `ready` waits for it."""
    return launch("unix", list(args))


def ready(server: ServerProcess, timeout: float = 60.0) -> None:
    """Wait until the server answers health checks with SERVING; raise with its log if it exits first."""
    wait_ready(server, timeout)


def stop(server: ServerProcess) -> None:
    """Kill the server if it still runs and remove its directory."""
    stop_server(server, graceful=False)


@contextmanager
def serve_paged(*args: str, ready_timeout: float = 60.0) -> Iterator[ServerProcess]:
    """Start the paged executor with extra CLI `args`; killed afterwards if still running."""
    server = start("--executor", "paged", *args)
    try:
        ready(server, ready_timeout)
        yield server
    finally:
        stop(server)
