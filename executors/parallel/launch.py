"""Starting a tensor-parallel world: spawned by the service itself on one host, or under torchrun.

`python -m service --tensor-parallel-size N` with no torch.distributed variables set is
rank 0: it starts N - 1 copies of its own command line as ranks 1..N-1 (RANK, WORLD_SIZE,
MASTER_ADDR/PORT set, on this host), which die with it: each asks the kernel for SIGTERM
when its parent exits, and leaves when rank 0's sockets close. Under torchrun every process
runs the same command and torchrun's variables say which rank it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from executors.parallel.comm import TpGroup, WorldSpec, join, world_from_env

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


@dataclass
class World:
    spec: WorldSpec
    group: TpGroup
    children: list[subprocess.Popen] = field(default_factory=list)  # ranks this process spawned


def die_with_parent() -> None:
    """Linux: SIGTERM this process when the process that spawned it exits (best effort elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError) as e:
        log.debug("no parent-death signal: %s", e)


def spawn(world: int, argv: list[str], timeout_s: float) -> tuple[WorldSpec, list[subprocess.Popen], dist.TCPStore]:
    """Start ranks 1..world-1 as copies of this command line; this process is rank 0.

    Rank 0's rendezvous store listens before any rank starts, on a port the kernel picks: a
    port found free, closed and handed to the store later could be taken meanwhile (another
    server's listener, or one of gloo's own, which bind free ports too). A server whose own
    gRPC port the store took could then never start, while a client found that port open."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    children = []
    for rank in range(1, world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "MODELEXEC_TP_SPAWNED": "1"}
        children.append(subprocess.Popen([sys.executable, "-m", "service", *argv], env=env))
    log.info("tensor parallelism: started %d rank process(es): %s", len(children),
             ", ".join(str(p.pid) for p in children))
    return WorldSpec(0, world, 0, "127.0.0.1", store.port, "spawn"), children, store


def start_world(tensor_parallel_size: int, device: str, timeout_s: float, argv: list[str]) -> World | None:
    """Join (or make) the world this process belongs to; None for a plain single process."""
    spec = world_from_env()
    if spec is None:
        if tensor_parallel_size == 1:
            return None
        spec, children, store = spawn(tensor_parallel_size, argv, timeout_s)
    else:
        children, store = [], None
        if spec.world != tensor_parallel_size:
            raise ValueError(f"this process is rank {spec.rank} of a world of {spec.world} processes (from "
                             f"{spec.launcher}), but --tensor-parallel-size is {tensor_parallel_size}: they must match")
        if spec.launcher == "spawn":
            die_with_parent()
            if os.getppid() == 1:  # the parent is already gone
                sys.exit("modelexec: the service that started this rank has exited")
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a host's cores: each takes its share instead of all of them (torchrun
        # sets OMP_NUM_THREADS=1 itself; an operator's setting wins).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", spec.world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    try:
        group = join(spec, device, timeout_s, store)
    except BaseException:
        for child in children:
            child.terminate()
        raise
    return World(spec, group, children)
