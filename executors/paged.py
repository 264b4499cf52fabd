"""PagedAttentionExecutor: a weight-free executor that really attends through the paged cache.

As ferrum's testkit executor describes it: identity projections; a token's embedding is a
one-hot vector of length num_kv_heads*head_dim at index token_id mod that length; Q = K = V
= the embedding (Q repeated over the query heads of each KV group); K and V are written
into the paged pool in every layer; causal softmax attention with scale 1/sqrt(head_dim)
reads K and V back through the block table; logits[i mod vocab] += attention output
element i. Each layer attends over its own layer of the pool and the hidden state is the
mean of the layers' outputs, so a block table that points one layer at the wrong block
shows up in the logits. Unlike the original, every method is implemented, so schedulers
can be tested against it without weights or a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from executors.descriptions import AttentionType, ExecutorCapabilities, MemoryRequirements, ModelInfo, ModelType
from executors.kv_executor import KvCacheExecutor, Rows, StepItem, StepLogits
from executors.kv_transfer import digest_tensors
from executors.types import DType


@dataclass(frozen=True, slots=True)
class PagedExecutorConfig:
    vocab_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 8
    max_sequence_length: int = 512
    block_size: int = 16
    num_blocks: int = 1024
    max_batch_size: int = 64
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_sequence_length", "block_size", "num_blocks", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


class PagedAttentionExecutor(KvCacheExecutor):
    name = "paged"

    def __init__(self, config: PagedExecutorConfig = PagedExecutorConfig()) -> None:
        self.config = config
        super().__init__(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            max_sequence_length=config.max_sequence_length,
            max_batch_size=config.max_batch_size,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            prefix_caching=config.prefix_caching,
        )
        c = config
        self.group = c.num_heads // c.num_kv_heads
        self.scale = 1.0 / math.sqrt(c.head_dim)
        # Output element i of [heads * head_dim] adds to logit i mod vocab.
        self.vocab_index = torch.arange(c.num_heads * c.head_dim) % c.vocab_size

    model_id = "paged-test-model"

    def _weights_digest(self) -> str:
        # Weight-free: what its K and V depend on is the geometry.
        c = self.config
        named = [(k, torch.tensor(getattr(c, k))) for k in ("vocab_size", "num_layers", "num_heads", "num_kv_heads",
                                                            "head_dim")]
        return digest_tensors(named)

    # -- the "model" ----------------------------------------------------------------------
    def _embed(self, tokens: list[int]) -> torch.Tensor:
        c = self.config
        width = c.num_kv_heads * c.head_dim
        emb = torch.zeros(len(tokens), width)
        emb[torch.arange(len(tokens)), torch.tensor(tokens) % width] = 1.0
        return emb.view(len(tokens), c.num_kv_heads, c.head_dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q [n, KVH, D] at positions start.., k and v [L, KVH, D] -> output [n, H*D]."""
        n, length = q.shape[0], k.shape[0]
        q = q.repeat_interleave(self.group, dim=1)  # query head h reads kv head h // group
        k = k.repeat_interleave(self.group, dim=1)
        v = v.repeat_interleave(self.group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * self.scale
        visible = torch.arange(length)[None, :] <= (start + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
        return out.reshape(n, -1)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size)
        return logits.index_add_(1, self.vocab_index, hidden)

    def _forward_step(self, items: list[StepItem]) -> StepLogits:
        rows: list[torch.Tensor] = []
        spans: list[tuple[int, int] | None] = []
        for it in items:
            end = it.start + len(it.tokens)
            emb = self._embed(it.tokens)
            new_slots = torch.tensor(it.table.slots(it.start, end))
            all_slots = torch.tensor(it.table.slots(0, end))
            hidden = torch.zeros(len(it.tokens), self.config.num_heads * self.config.head_dim)
            for layer in range(self.config.num_layers):
                self.pool.write(layer, new_slots, emb, emb)
                k, v = self.pool.read(layer, all_slots)
                hidden += self._attend(emb, k, v, it.start)
            hidden /= self.config.num_layers
            if it.rows is Rows.NONE:
                spans.append(None)
            else:
                rows.append(self._logits(hidden if it.rows is Rows.ALL else hidden[-1:]))
                spans.append((sum(map(len, rows[:-1])), len(rows[-1])))
        return StepLogits(torch.cat(rows) if rows else None, spans)

    def _forward_sequence(self, tokens: list[int], hidden: bool) -> torch.Tensor:
        emb = self._embed(tokens)
        h = self._attend(emb, emb, emb, 0)  # every layer computes the same without a cache
        return h if hidden else self._logits(h)

    # -- description ----------------------------------------------------------------------
    def info(self) -> ModelInfo:
        c = self.config
        return ModelInfo(
            model_id=self.model_id,
            model_type=ModelType.CUSTOM,
            model_type_name="paged-test",
            num_parameters=0,
            hidden_size=c.num_heads * c.head_dim,
            num_layers=c.num_layers,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            vocab_size=c.vocab_size,
            max_sequence_length=c.max_sequence_length,
            dtype=DType.FLOAT32,
            device="cpu",
            version="test-1.0",
            metadata={"modelexec_executor": "paged"},
        )

    def capabilities(self) -> ExecutorCapabilities:
        c = self.config
        mechanisms = (AttentionType.PAGED,
                      AttentionType.GROUPED_QUERY if self.group > 1 else AttentionType.MULTI_HEAD)
        return ExecutorCapabilities(
            max_batch_size=c.max_batch_size,
            max_sequence_length=c.max_sequence_length,
            attention_mechanisms=mechanisms,
            supports_dynamic_batching=True,
            supports_continuous_batching=True,
            supports_speculative_decoding=True,
            supports_tensor_parallelism=False,
            supports_pipeline_parallelism=False,
            supported_dtypes=(DType.FLOAT32,),
            supported_devices=("cpu",),
            memory_requirements=MemoryRequirements(
                parameter_memory=0,
                activation_memory_per_token=4 * c.num_heads * c.head_dim,
                kv_cache_memory_per_token=self.pool.bytes_per_token,
                overhead_memory=0,
            ),
            kv_capacity=self.kv_capacity(),
            supports_native_unified_decode=True,
            kv_block_size=c.block_size,
            kv_total_blocks=c.num_blocks,
            supports_prefix_caching=self.kv.prefix_caching,
            supports_kv_transfer=True,
        )
