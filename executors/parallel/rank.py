"""What every rank does alike: agreeing on the pool and backend, describing itself, and the
loop of a rank other than 0 (which runs what rank 0 sends until STOP or a failure)."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F

from executors.descriptions import RankInfo, RankMemory
from executors.lora import LoraAdapter
from executors.models.decoder import DecoderLM
from executors.parallel.comm import RankFailure, TpGroup
from executors.parallel.kv_ranks import gather_heads, receive_write
from executors.parallel.protocol import (
    HEADER_LEN,
    Op,
    decode_adapter,
    decode_step,
    memory_words,
    step_payload_len,
)
from executors.parallel.shard import ShardPlan
from executors.step_plan import run_plan, run_sequence
from kvcache.kv_pool import PagedKvPool

log = logging.getLogger(__name__)
HOST_BYTES = 64
BACKENDS = ("sdpa", "triton")


def agree(group: TpGroup, num_blocks: int, backend: str) -> tuple[int, str]:
    """Every rank's pool gets the fewest blocks any rank has room for (block ids are shared),
    and Triton attention only where every rank passed its check."""
    t = torch.tensor([num_blocks, BACKENDS.index(backend)], dtype=torch.int64)
    group.all_reduce_control(t, dist.ReduceOp.MIN, "agreeing on the KV pool size")
    return int(t[0]), BACKENDS[int(t[1])]


def describe(group: TpGroup) -> list[RankInfo] | None:
    """Every rank's process and device, on rank 0 (None elsewhere)."""
    host = socket.gethostname().encode()[:HOST_BYTES]
    dev = group.device
    words = torch.zeros(3 + HOST_BYTES, dtype=torch.int64)
    words[:3] = torch.tensor([os.getpid(), 1 if dev.type == "cuda" else 0, dev.index or 0])
    words[3:3 + len(host)] = torch.tensor(list(host), dtype=torch.int64)
    parts = group.gather_control(words, "describing the ranks")
    if parts is None:
        return None
    ranks = []
    for r, w in enumerate(parts):
        pid, cuda, index, *name = w.tolist()
        ranks.append(RankInfo(rank=r, device=f"cuda:{index}" if cuda else "cpu", pid=pid,
                              host=bytes(b for b in name if b).decode(errors="replace")))
    return ranks


def rank_memory(parts: list[torch.Tensor]) -> tuple[RankMemory, ...]:
    return tuple(RankMemory(r, *w.tolist()) for r, w in enumerate(parts))


def pad_logits(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """A rank's vocabulary slice of the logits widened to the common chunk (the last rank's is shorter)."""
    short = chunk - logits.shape[1]
    return F.pad(logits, (0, short)) if short else logits


class RankLoop:
    """A rank other than 0: runs rank 0's messages on its shard until STOP or a failure."""

    def __init__(self, group: TpGroup, model: DecoderLM, pool: PagedKvPool, plan: ShardPlan, backend: str,
                 dtype: torch.dtype) -> None:
        self.group, self.model, self.pool, self.plan = group, model, pool, plan
        self.backend, self.dtype, self.device = backend, dtype, group.device
        self.adapters: dict[int, LoraAdapter] = {}
        self.parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + model.packed_bytes()

    def run(self) -> bool:
        """True after a STOP, False when the group failed."""
        try:
            while True:
                h = self.group.broadcast_control(torch.empty(HEADER_LEN, dtype=torch.int64),
                                                 "waiting for rank 0's next message").tolist()
                if h[0] == Op.STOP:
                    return True
                self.handle(h)
        except RankFailure as e:
            log.error("rank %d leaves: %s", self.group.rank, e)
            return False

    @torch.inference_mode()
    def handle(self, h: list[int]) -> None:
        op, g = Op(h[0]), self.group
        if op is Op.STEP:
            payload = g.broadcast_control(torch.empty(step_payload_len(h), dtype=torch.int64), "receiving a step")
            plan, reference = decode_step(h, payload, self.adapters)
            logits, _ = run_plan(self.model, self.pool, plan, self.device, backend=self.backend, reference=reference)
            if logits is not None:
                g.gather_first(pad_logits(logits, self.plan.vocab_chunk))
        elif op is Op.SEQUENCE:
            ids = g.broadcast_control(torch.empty(h[1], dtype=torch.int64), "receiving a sequence").tolist()
            out = run_sequence(self.model, ids, bool(h[2]), self.device, reference=bool(h[3]))
            if not h[2]:
                g.gather_first(pad_logits(out, self.plan.vocab_chunk))
        elif op is Op.COPY:
            pairs = g.broadcast_control(torch.empty(2 * h[1], dtype=torch.int64), "receiving block copies").tolist()
            self.pool.copy_blocks(list(zip(pairs[:h[1]], pairs[h[1]:])))
        elif op is Op.ADAPTER:
            layout = g.broadcast_control(torch.empty(6 * h[2], dtype=torch.int64), "receiving an adapter's layout")
            values = g.broadcast_control(torch.empty(h[3], dtype=torch.float32), "receiving an adapter's weights")
            weights = self.plan.shard_adapter_weights(decode_adapter(layout, values, self.dtype, self.device))
            nbytes = sum(t.numel() * t.element_size() for pair in weights.values() for t in pair)
            self.adapters[h[1]] = LoraAdapter(name=f"#{h[1]}", key=f"#{h[1]}", rank=0, alpha=0.0, target_modules=(),
                                              weights=weights, scaling=0.0, num_parameters=0, nbytes=nbytes,
                                              source="rank 0")
        elif op is Op.DROP:
            self.adapters.pop(h[1], None)
        elif op is Op.READ_KV:
            gather_heads(g, self.plan, self.pool, *h[1:5])
        elif op is Op.WRITE_KV:
            receive_write(g, self.plan, self.pool, h)
        elif op is Op.PING:
            lora = sum(a.nbytes for a in self.adapters.values())
            g.gather_control(memory_words(self.parameter_bytes, self.pool.total_bytes, lora, self.device),
                             "answering the heartbeat")


def load_shard(config, group: TpGroup):
    """(the config with this rank's device, this rank's shard of the model wired to the
    group's all-reduce, its ShardPlan): what every rank loads at start-up."""
    from executors.models.loader import load_model

    config = dataclasses.replace(config, device=str(group.device))
    plans: list[ShardPlan] = []

    def shard(c) -> ShardPlan:
        plans.append(ShardPlan(c, group.rank, group.world))
        return plans[-1]

    model = load_model(config.model_dir, config.torch_dtype, config.device, shard=shard,
                       cpu_kernels=config.cpu_kernels, quantize_weights=config.quantization == "int8")
    model.all_reduce = group.all_reduce
    if model.config.qk_norm_across_heads:
        model.mean_over_ranks = group.mean
    return config, model, plans[0]


def serve_rank(config, group: TpGroup) -> int:
    """Ranks 1..N-1: load this rank's shard, agree with rank 0, then run its messages. The
    exit status: 0 after rank 0's STOP, 1 when the group failed."""
    from executors.llm import size_pool
    from executors.triton_setup import attention_backend

    config, model, plan = load_shard(config, group)
    local = model.config
    try:
        backend = attention_backend(config, local)
        num_blocks, _ = size_pool(config, model)
        num_blocks, backend = agree(group, num_blocks, backend)
        describe(group)
        pool = PagedKvPool(local.num_layers, num_blocks, config.block_size, local.num_kv_heads, local.head_dim,
                           config.torch_dtype, config.device, values_are_keys=local.values_are_keys)
        loop = RankLoop(group, model, pool, plan, backend, config.torch_dtype)
        log.info("rank %d serves its shard (%d KV blocks, %s attention)", group.rank, num_blocks, backend)
        stopped = loop.run()
    except RankFailure as e:
        log.error("rank %d leaves: %s", group.rank, e)
        stopped = False
    group.close()
    return 0 if stopped else 1
