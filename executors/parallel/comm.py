"""TpGroup: the torch.distributed groups of one tensor-parallel executor, and its failure.

Two groups: `data` carries the activations (the all-reduces inside every layer, the logits
gathered on rank 0): NCCL on CUDA, gloo on CPUs. `control` is always gloo, on host memory:
the step plans rank 0 sends and the heartbeat, which the other ranks need on the host
anyway (their block tables are Python lists), so no step waits on a device copy to learn
its shape. On a CPU the two are the same gloo group.

Any collective that fails (a rank died: its sockets closed) or outlives the group's
timeout (a rank hangs) marks the group broken and raises RankFailure; the executor turns
that into UNAVAILABLE and health into NOT_SERVING, and never touches the group again.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A collective failed or timed out: the tensor-parallel group is broken for good."""


@dataclass
class TpGroup:
    rank: int
    world: int
    device: torch.device
    backend: str  # of the data group: "gloo" or "nccl"
    timeout_s: float
    data: object = None  # process groups (None: the default group)
    control: object = None
    failure: str | None = None  # why the group broke; None while it works
    listeners: list = field(default_factory=list)  # called with the failure, from the thread that saw it

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # -- collectives --------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place (the decoder's row-parallel outputs)."""
        self._guard("an all-reduce of a layer's output", dist.all_reduce, t, group=self.data)
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of t over the ranks, in place (OLMo 2's q/k norm statistics: each rank
        holds as many of a row's dimensions, so the mean of their mean squares is the row's)."""
        return self.all_reduce(t).div_(self.world)

    def gather_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's t (equal shapes) on rank 0, in rank order; None elsewhere."""
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.is_first else None
        self._guard("the gather of the logits", dist.gather, t.contiguous(), parts, dst=0, group=self.data)
        return parts

    def broadcast_control(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Rank 0's host tensor t to every rank (t must have the same shape and dtype everywhere)."""
        self._guard(what, dist.broadcast, t, src=0, group=self.control)
        return t

    def gather_control(self, t: torch.Tensor, what: str) -> list[torch.Tensor] | None:
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.is_first else None
        self._guard(what, dist.gather, t, parts, dst=0, group=self.control)
        return parts

    def all_reduce_control(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        self._guard(what, dist.all_reduce, t, op=op, group=self.control)
        return t

    def _guard(self, what: str, fn, *args, **kwargs) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)
        try:
            fn(*args, **kwargs)
        except Exception as e:  # gloo and NCCL raise RuntimeError subclasses (DistBackendError...)
            self.fail(f"tensor-parallel rank {self.rank}: {what} failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else 'no message'}); another rank died or hangs")
            raise RankFailure(self.failure) from e

    def fail(self, why: str) -> None:
        if self.failure is not None:
            return
        self.failure = why
        log.error("%s", why)
        for listener in list(self.listeners):
            try:
                listener(why)
            except Exception:  # a listener's bug must not hide the failure
                log.exception("a tensor-parallel failure listener failed")

    def close(self) -> None:
        """Leave the groups (best effort: after a failure the peers may be gone)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:
                log.debug("destroying the process group: %s", e)


@dataclass(frozen=True, slots=True)
class WorldSpec:
    """Where this process sits: from torchrun's variables, or from the service that spawned it."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" or "spawn"


def world_from_env(environ: dict[str, str] | None = None) -> WorldSpec | None:
    """The torch.distributed world this process was started in (RANK, WORLD_SIZE...), or None."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    launcher = "spawn" if env.get("MODELEXEC_TP_SPAWNED") == "1" else "torchrun"
    return WorldSpec(rank=int(env["RANK"]), world=int(env["WORLD_SIZE"]), local_rank=int(env.get("LOCAL_RANK", 0)),
                     master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)),
                     launcher=launcher)


def rank_device(device: str, local_rank: int) -> torch.device:
    """cpu, or the GPU of this rank's local index (cuda:LOCAL_RANK)."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"with tensor parallelism --device is cpu or cuda (each rank takes cuda:LOCAL_RANK), "
                         f"not {device!r}")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank with local index {local_rank} needs cuda:{local_rank}, but torch sees "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", local_rank)


def join(spec: WorldSpec, device: str, timeout_s: float, store: dist.Store | None = None) -> TpGroup:
    """Join the world (blocks until every rank has) and make the two groups. `store`: the
    rendezvous store this process hosts (rank 0 of the service's own spawn)."""
    dev = rank_device(device, spec.local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)
    if spec.launcher == "torchrun":
        # The agent already hosts the rendezvous store on MASTER_PORT; env:// joins it.
        dist.init_process_group(backend, init_method="env://", rank=spec.rank, world_size=spec.world, timeout=timeout)
    else:
        # The service's own spawn: rank 0 hosts the store (`store`), the other ranks join it
        # as clients. Both hand their store over as it is (an init_method would add a prefix
        # to the keys on one side only).
        if store is None:
            store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world, timeout=timeout)
    group = TpGroup(spec.rank, spec.world, dev, backend, timeout_s)
    group.control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    log.info("tensor-parallel rank %d of %d joined (%s, %s, launched by %s on %s)", spec.rank, spec.world, backend,
             dev, spec.launcher, socket.gethostname())
    return group
