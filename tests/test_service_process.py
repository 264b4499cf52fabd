"""The harness that starts servers in processes of their own (bench/service_process.py), on
which the load, shutdown, fault and tensor-parallel tests stand: the ports it picks, and what
it says when a server does not come up."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.service_process import Server, _ephemeral_ports, free_port, stop, wait_ready


def test_ports_are_picked_outside_the_ephemeral_range():
    """A server binds its port seconds after the harness picked it: any bind(0) meanwhile (a
    rendezvous store, a gloo listener, a client's connection) takes ports of that range only."""
    ephemeral = _ephemeral_ports()
    if ephemeral.start - 10000 < 1000 and 65536 - ephemeral.stop < 1000:
        pytest.skip(f"the ephemeral range {ephemeral.start}-{ephemeral.stop - 1} leaves no room outside it")
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1
    assert not any(p in ephemeral for p in ports), (sorted(ports), ephemeral)


def test_a_listener_that_exits_before_serving_is_reported_at_once():
    """Something answers on the port but is not a serving gRPC server, and exits: wait_ready
    says the process exited, with its log, instead of waiting out its timeout."""
    port = free_port()
    where = Path(tempfile.mkdtemp(prefix="mx-", dir="/tmp"))
    listener = ("import socket, time\n"
                f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
                "print('a listener that speaks no gRPC', flush=True); time.sleep(3)\n")
    with open(where / "server.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", listener], stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, f"127.0.0.1:{port}", where)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"(?s)exited with 0 before it was SERVING.*speaks no gRPC"):
            wait_ready(server, 60)
        assert time.monotonic() - started < 20
    finally:
        stop(server)
    assert not where.exists()
