"""`python -m service` in a process of its own, on a TCP port or a unix socket: for bench parts
that need servers apart from the process that measures (bench/transfer.py, bench/offline.py),
and, through tests/server_process.py, for the load, shutdown and fault tests."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Server:
    proc: subprocess.Popen
    address: str  # 127.0.0.1:PORT or unix:///PATH
    where: Path

    @property
    def target(self) -> str:
        return self.address

    @property
    def log(self) -> Path:
        return self.where / "server.log"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self) -> str:
        return self.output()[-3000:]


def _ephemeral_ports() -> range:
    """The ports the kernel hands out to bind(0) and to outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default; elsewhere a guess that only narrows the choice


def free_port() -> int:
    """A loopback port free now, outside the ephemeral range where there is room.

    The server binds it seconds later, after its model loads; meanwhile any bind(0) on the
    host could be given a port of the ephemeral range: another server's rendezvous store, a
    gloo pair's listener, a client's connection. Such a theft leaves the server unable to
    bind while something else answers on its port (the likeliest cause of a tensor-parallel
    test's server once found listening and never serving). Ports outside that range are only
    taken by a process that asks for them by number."""
    ephemeral = _ephemeral_ports()
    spans = [range(10000, ephemeral.start), range(ephemeral.stop, 65536)]
    pool = max(spans, key=len)
    if len(pool) >= 1000:
        chooser = random.SystemRandom()
        for _ in range(64):
            port = chooser.choice(pool)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TorchrunNode:
    """One of `nodes` torchrun agents of a multi-node world, all on this host (loopback), as
    separate hosts would run them: the rendezvous at 127.0.0.1:master_port, which node 0 serves."""

    rank: int
    nodes: int
    master_port: int


def launch(transport: str, args: list[str], *, torchrun_nproc: int | None = None,
           torchrun_node: TorchrunNode | None = None) -> Server:
    """`torchrun_nproc`: run the service under torchrun with that many processes on this host
    (tensor parallelism), as one node or, with `torchrun_node`, as one of several; the server
    then leads a process group of its own, which stop() ends."""
    where = Path(tempfile.mkdtemp(prefix="mx-", dir="/tmp"))  # short: unix socket paths are capped
    if transport == "unix":
        listen, address = ["--unix-socket", str(where / "s.sock")], f"unix://{where / 's.sock'}"
    else:
        port = free_port()
        listen, address = ["--host", "127.0.0.1", "--port", str(port)], f"127.0.0.1:{port}"
    with open(where / "server.log", "w") as out:
        runner = [sys.executable, "-m", "service"]
        if torchrun_nproc is not None:
            # --standalone: torchrun's rendezvous store binds a free port itself. A port picked
            # here (bound, closed, passed on) could be taken by another process before torchrun,
            # a second or so later, bound it: EADDRINUSE, seen once in a parallel test run.
            nodes = (["--standalone", "--nnodes", "1"] if torchrun_node is None else
                     ["--nnodes", str(torchrun_node.nodes), "--node-rank", str(torchrun_node.rank),
                      "--master-addr", "127.0.0.1", "--master-port", str(torchrun_node.master_port)])
            runner = [sys.executable, "-m", "torch.distributed.run", *nodes,
                      "--nproc-per-node", str(torchrun_nproc), "-m", "service"]
        proc = subprocess.Popen([*runner, *listen, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    return Server(proc, address, where)


def wait_ready(server: Server, timeout: float = 300.0) -> None:
    """Wait for the listener first (a channel that finds none backs off for seconds), then SERVING."""
    from client import ExecutorClient

    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not listen within {timeout} s:\n{server.log_tail()}")
        if server.address.startswith("unix://"):
            if Path(server.address.removeprefix("unix://")).exists():
                break
        else:
            host, port = server.address.rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), 0.5).close()
                break
            except OSError:
                pass
        time.sleep(0.05)
    from client.errors import ExecutorError

    with ExecutorClient(server.address) as c:
        while True:
            try:  # in slices, so that a server that exits meanwhile is said at once, with its log
                c.wait_ready(max(min(deadline - time.monotonic(), 1.0), 0.1))
                return
            except ExecutorError as e:  # listening but not serving (yet): what the server said is the clue
                if server.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {server.proc.returncode} before it was SERVING:\n"
                                       f"{server.log_tail()}") from e
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the server listened but was not SERVING within {timeout} s ({e}):\n"
                                       f"{server.log_tail()}") from e


def stop(server: Server, graceful: bool = True) -> None:
    """SIGTERM (or SIGKILL when not `graceful`) if it still runs; then its directory goes."""
    if server.proc.poll() is None:
        if graceful:
            server.proc.terminate()
        else:
            server.proc.kill()
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(30)
    # The server leads a session of its own: whatever it started (tensor-parallel ranks,
    # torchrun's workers) goes with it, also after a SIGKILL that left them no chance.
    wait_session_gone(server.proc.pid, 15)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    shutil.rmtree(server.where, ignore_errors=True)


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (Linux /proc; empty elsewhere)."""
    members = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # session id, state (zombies do not count)
            members.append(int(entry.name))
    return members


def wait_session_gone(sid: int, timeout_s: float) -> list[int]:
    """Wait up to timeout_s for session `sid` to have no live process; those still left."""
    deadline = time.monotonic() + timeout_s
    while (left := session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) a process has used: this one when pid is None."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14 and 15 of stat
