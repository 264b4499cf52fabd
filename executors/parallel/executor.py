"""TensorParallelExecutor: rank 0 of a tensor-parallel executor, behind the one gRPC endpoint.

Rank 0 is an LlmExecutor over its own shard of the model (shard.py) with every piece of
bookkeeping (caches, block tables, prefix cache, adapters' registry) and the only copy of
it. Whatever touches the other ranks' shards or KV pools goes through one place:

- a step: its StepPlan, sent as tensors (protocol.py); every rank then runs it on its shard,
  the all-reduces inside the layers keep them in step, and the logits' vocabulary slices
  are gathered here, where the policies run;
- a Forward without cache; block copies for copy-on-write (a pool that mirrors them);
- an adapter loaded or unloaded: sent whole, each rank keeps its shard;
- a moved cache's K and V (ExportKv, ImportKv): gathered from every rank's heads, or sent to
  every rank for its heads, a chunk at a time (kv_ranks.py); the weights are named by the
  digest one process of the checkpoint would give, so caches move to and from executors
  split any other way;
- a heartbeat every `heartbeat_s` that also brings back each rank's memory.

All of it runs on the executor's one worker thread, so the ranks see one order. A failed
or timed-out collective (comm.py) breaks the executor for good: calls then fail with
UNAVAILABLE, listeners (the server's health) hear of it, and the ranks this process
spawned are stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import threading

import torch

from executors.descriptions import ExecutorCapabilities, ExecutorStatus, ModelInfo, ParallelLayout
from executors.errors import Unavailable
from executors.kv_transfer import digest_tensors
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.lora import LoraAdapter
from executors.models.decoder import DecoderLM
from executors.models.loader import checkpoint_parameters
from executors.models.panel_modules import int8_weight_names
from executors.parallel.comm import RankFailure, TpGroup
from executors.parallel.kv_ranks import gather_heads, store_heads, write_bytes, write_shape
from executors.parallel.protocol import Op, encode_adapter, encode_step, header, memory_words
from executors.parallel.rank import agree, describe, load_shard, pad_logits, rank_memory
from executors.step_plan import StepPlan
from kvcache.kv_pool import PagedKvPool

log = logging.getLogger(__name__)


class MirroredKvPool(PagedKvPool):
    """Rank 0's pool: block copies (copy-on-write) happen on every rank's pool."""

    send_copies = None  # set by the executor: (pairs) -> None, before any step

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs and self.send_copies is not None:
            self.send_copies(pairs)
        super().copy_blocks(pairs)


class TensorParallelExecutor(LlmExecutor):
    pool_class = MirroredKvPool
    builds_in_passing_thread = False  # the shard loads here first; the collectives stay on this thread

    def __init__(self, config: LlmExecutorConfig, group: TpGroup, *, launcher: str,
                 children: list[subprocess.Popen] | None = None, heartbeat_s: float | None = None,
                 reference: bool = False) -> None:
        self.group, self.launcher, self.children = group, launcher, list(children or [])
        self.heartbeat_s = heartbeat_s or min(1.0, group.timeout_s / 4)
        self._adapter_ids: dict[str, int] = {}
        self._stopped = False  # STOP was sent: nothing more goes to the other ranks
        self._next_adapter_id = 1
        self.ranks = ()
        self.rank_memory = ()
        config, model, self.shard_plan = load_shard(config, group)
        full = self.shard_plan.full
        super().__init__(config, model, reference=reference, decode_graphs=False, served_config=full)
        with torch.device("meta"):
            self.num_parameters = sum(p.numel() for p in DecoderLM(full).parameters())
        self.pool.send_copies = self._send_copies
        self._ping_now()
        self._closing = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    # -- agreement (during LlmExecutor.__init__) --------------------------------------------
    def _agree(self, num_blocks: int, backend: str) -> tuple[int, str]:
        agreed = agree(self.group, num_blocks, backend)
        self.ranks = tuple(describe(self.group))  # the other ranks do the same, in the same order
        return agreed


    # -- steps -------------------------------------------------------------------------------
    def _run_plan(self, plan: StepPlan) -> torch.Tensor | None:
        ids = [0 if a is None else self._adapter_ids[a.key] for a in plan.adapters]
        head, payload = encode_step(plan, ids, self.reference)
        self._send(head, payload)
        logits = super()._run_plan(plan)  # this rank's vocabulary slice
        return None if logits is None else self._gather_logits(logits)

    def _forward_sequence(self, tokens: list[int], hidden: bool) -> torch.Tensor:
        self._send(header(Op.SEQUENCE, len(tokens), int(hidden), int(self.reference)),
                   torch.tensor(tokens, dtype=torch.int64))
        out = super()._forward_sequence(tokens, hidden)
        return out if hidden else self._gather_logits(out)

    def _gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        parts = self.group.gather_first(pad_logits(logits, self.shard_plan.vocab_chunk))
        return torch.cat(parts, dim=1)[:, :self.vocab_size]

    def _send_copies(self, pairs: list[tuple[int, int]]) -> None:
        self._send(header(Op.COPY, len(pairs)), torch.tensor([s for s, _ in pairs] + [d for _, d in pairs]))

    def _send(self, head: torch.Tensor, *payloads: torch.Tensor) -> None:
        self.group.broadcast_control(head, "sending a message to the other ranks")
        for p in payloads:
            self.group.broadcast_control(p, "sending a message's payload to the other ranks")

    # -- adapters ----------------------------------------------------------------------------
    def _adapter_placed(self, adapter: LoraAdapter) -> LoraAdapter:
        adapter_id = self._next_adapter_id
        head, layout, values = encode_adapter(adapter_id, adapter.weights)
        self._send(head, layout, values)
        self._next_adapter_id += 1
        self._adapter_ids[adapter.key] = adapter_id
        return self.shard_plan.shard_adapter(adapter)

    def _adapter_dropped(self, adapter: LoraAdapter) -> None:
        self._send(header(Op.DROP, self._adapter_ids.pop(adapter.key)))

    # -- health ------------------------------------------------------------------------------
    async def _run(self, fn, *args, on_abandon=None, overlaps=False):
        if self.group.failure is not None:
            raise Unavailable(f"the executor lost a tensor-parallel rank: {self.group.failure}")
        if self._stopped:
            raise Unavailable("the executor is stopping: its tensor-parallel ranks have left")
        try:
            return await super()._run(fn, *args, on_abandon=on_abandon, overlaps=overlaps)
        except RankFailure as e:
            raise Unavailable(f"the executor lost a tensor-parallel rank: {e}") from None

    def add_failure_listener(self, listener) -> None:
        """listener(why) is called once, from whichever thread saw the failure."""
        self.group.listeners.append(listener)

    @property
    def failure(self) -> str | None:
        return self.group.failure

    def _ping_now(self) -> None:
        if self._stopped:
            return
        self._send(header(Op.PING))
        mine = memory_words(self._param_bytes + self._packed_bytes, self.pool.total_bytes, self.loras.nbytes,
                            self.group.device)
        self.rank_memory = rank_memory(self.group.gather_control(mine, "the heartbeat"))

    def _watch(self) -> None:
        """Heartbeats on the worker thread, and the spawned ranks' exits, until closed or broken."""
        while not self._closing.wait(self.heartbeat_s) and self.group.failure is None:
            for proc in self.children:
                if proc.poll() is not None:
                    self.group.fail(f"tensor-parallel rank process {proc.pid} exited with status {proc.returncode}")
            if self.group.failure is not None:
                break
            try:
                self.worker.schedule(self._ping_now).result()
            except RuntimeError as e:  # RankFailure, or a worker shut down by close()
                if self.group.failure is None and not self._closing.is_set():
                    log.warning("tensor-parallel heartbeat: %s", e)
        if self.group.failure is not None:
            self._stop_children(grace_s=2.0)

    def close(self) -> None:
        """Stop the other ranks (STOP, then signals for the ones this process spawned)."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.group.failure is None:
            try:
                self.worker.schedule(self._stop_now).result(timeout=self.group.timeout_s)
            except Exception as e:  # peers already gone: they are stopped below
                log.info("stopping the other ranks: %s", e)
        self._stop_children(grace_s=10.0)
        self.group.close()
        super().close()

    def _stop_now(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._send(header(Op.STOP))

    def _stop_children(self, grace_s: float) -> None:
        for proc in self.children:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    proc.terminate()
        for proc in self.children:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- moving caches (kv_ranks.py) ---------------------------------------------------------
    def _weights_digest(self) -> str:
        # The digest one process of this checkpoint computes (this rank holds only its slices):
        # caches then move between executors however each is split. The int8 weights are the
        # same ones in rank 0's shard as in one process's model.
        int8 = int8_weight_names(self.model) if self.config.quantization == "int8" else frozenset()
        return digest_tensors(checkpoint_parameters(self.config.model_dir, self.config.torch_dtype, int8))

    @property
    def _moved_kv_heads(self) -> int:
        return self.shard_plan.full.num_kv_heads

    def _read_kv(self, layer_start: int, layer_count: int, first_slot: int,
                 count: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._send(header(Op.READ_KV, layer_start, layer_count, first_slot, count))
        return gather_heads(self.group, self.shard_plan, self.pool, layer_start, layer_count, first_slot, count)

    def _write_kv(self, layer_start: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        data = write_bytes(k, v, self.pool.dtype)
        slots = slots.cpu()
        self._send(header(Op.WRITE_KV, layer_start, k.shape[0], k.shape[1]), slots, data)
        whole = data.view(self.pool.dtype).view(write_shape(self.shard_plan, k.shape[0], k.shape[1]))
        store_heads(self.shard_plan, self.pool, layer_start, slots, whole)

    # -- description (memory_usage is rank 0's; status().ranks has every rank's) ---------------
    def info(self) -> ModelInfo:
        return dataclasses.replace(super().info(), num_parameters=self.num_parameters,
                                   parallel=self.layout())

    def layout(self) -> ParallelLayout:
        return ParallelLayout(tensor_parallel_size=self.group.world, backend=self.group.backend,
                              launcher=self.launcher, ranks=self.ranks)

    def capabilities(self) -> ExecutorCapabilities:
        return dataclasses.replace(super().capabilities(), supports_tensor_parallelism=True,
                                   supports_kv_transfer=True,
                                   tensor_parallel_size=self.group.world)

    def status(self) -> ExecutorStatus:
        return dataclasses.replace(super().status(), ranks=self.rank_memory)
