"""ShardPlan: which slice of every weight (and of every LoRA adapter) one rank holds.

Megatron-style tensor parallelism over N ranks, named by the checkpoint's tensor names:

- column-parallel (split by output rows): q_proj by query heads, k_proj/v_proj by KV heads,
  gate_proj/up_proj (dense, shared and routed experts alike: each expert is split like a
  dense MLP, so the grouped expert compute runs unchanged on smaller experts);
- row-parallel (split by input columns, partial sums all-reduced): o_proj, down_proj. A
  row-parallel bias stays whole on rank 0 and is zero elsewhere, so it is added once;
- the lm_head split by vocabulary rows (ceil(V / N) per rank, the last one shorter), the
  logits gathered on rank 0;
- GPT-OSS's and Granite's stacked experts split like the others (each expert's intermediate
  rows, stacked_experts.rank_part), GPT-OSS's attention sinks by query heads;
- replicated: the embedding, every norm, per-head q/k norms, the experts' router, the shared
  expert's gate. OLMo 2's q/k norms span every head: each rank holds its heads' part of
  their weights, and averages its mean squares with the other ranks' (TpGroup.mean). The embedding is replicated rather than split: a vocabulary-parallel
  embedding costs one more all-reduce of [tokens, hidden] per step (on the 2-core CPU of
  bench/RESULTS.md run 8, an estimated ~1.2 ms of a 51 ms step) to save (N - 1) / N of V * hidden per
  rank (65 MB at 32k x 1024 fp32), and a tied lm_head reads its slice of the replicated
  embedding as a view, at no cost;
- DeepSeek's latent attention: q_b_proj (or q_proj) and kv_b_proj by query heads, q_a_proj
  and kv_a_proj_with_mqa replicated: every rank caches the whole latent rows (its one KV
  head, replicated as below) and absorbs its own heads' queries;
- KV heads: KVH / N per rank; with fewer KV heads than ranks (N a multiple of KVH), each
  rank holds the one KV head its query heads read, replicated N / KVH times, as vLLM does.

Anything that cannot be split N ways is refused at start-up with a message saying what.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from executors.lora import LoraAdapter
from executors.models import stacked_experts
from executors.models.config import DecoderConfig
from executors.models.errors import UnsupportedModel

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "q_b_proj", "kv_b_proj")
# Split by query heads: rows of q (and, for DeepSeek's latent attention, of q_b_proj and kv_b_proj).
BY_HEADS = ("q_proj", "q_b_proj", "kv_b_proj")
ROW_PARALLEL = ("o_proj", "down_proj", "w2")
ROUTER_SUFFIXES = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    full: DecoderConfig  # the model as served
    rank: int
    world: int

    def __post_init__(self) -> None:
        problems = refusals(self.full, self.world)
        if problems:
            raise UnsupportedModel(f"cannot split {self.full.architecture} over {self.world} tensor-parallel ranks: "
                                   + "; ".join(problems))

    # -- geometry -----------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.full.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1, replicated, when there are fewer than ranks)."""
        return max(self.full.num_kv_heads // self.world, 1)

    @property
    def first_kv_head(self) -> int:
        if self.full.num_kv_heads >= self.world:
            return self.rank * self.kv_heads
        return self.rank * self.full.num_kv_heads // self.world

    def kv_head_owners(self) -> list[int]:
        """Ranks whose KV heads, joined in rank order, are the model's KV heads once each: every
        rank, or (fewer KV heads than ranks) the first of the ranks that hold each head."""
        kv = self.full.num_kv_heads
        if kv >= self.world:
            return list(range(self.world))
        return [head * self.world // kv for head in range(kv)]  # world is a multiple of kv (refusals)

    @property
    def vocab_chunk(self) -> int:
        return -(-self.full.vocab_size // self.world)

    @property
    def head_rows(self) -> tuple[int, int]:
        lo = min(self.rank * self.vocab_chunk, self.full.vocab_size)
        return lo, min(lo + self.vocab_chunk, self.full.vocab_size)

    def local_config(self) -> DecoderConfig:
        c = self.full
        moe = c.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.world,
                                      shared_intermediate_size=moe.shared_intermediate_size // self.world)
        return dataclasses.replace(c, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=c.intermediate_size // self.world, moe=moe)

    # -- weights ------------------------------------------------------------------------
    def head_width(self, module: str) -> int:
        """The rows (o_proj: columns) a query head has in `module`: head_dim, or for DeepSeek's
        latent attention (whose head_dim is the cached rows') the query's, the expansion's
        (each head's key and value rows in kv_b_proj) and the value's."""
        m = self.full.mla
        if m is None:
            return self.full.head_dim
        return {"q_proj": m.qk_head_dim, "q_b_proj": m.qk_head_dim, "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim,
                "o_proj": m.v_head_dim}[module]

    def rows_of(self, module: str, out_features: int) -> tuple[int, int]:
        """This rank's output rows of a column-parallel projection with out_features rows."""
        d = self.full.head_dim
        if module in BY_HEADS:
            width = self.head_width(module)
            return self.rank * self.heads * width, (self.rank + 1) * self.heads * width
        if module in ("k_proj", "v_proj"):
            return self.first_kv_head * d, (self.first_kv_head + self.kv_heads) * d
        n = out_features // self.world
        return self.rank * n, (self.rank + 1) * n

    def columns_of(self, module: str, in_features: int) -> tuple[int, int]:
        """This rank's input columns of a row-parallel projection."""
        if module == "o_proj":
            d = self.head_width(module)
            return self.rank * self.heads * d, (self.rank + 1) * self.heads * d
        n = in_features // self.world
        return self.rank * n, (self.rank + 1) * n

    def read(self, name: str, tensor_slice, full_shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name`, reading only that part (a safetensors
        slice, or anything indexable the same way)."""
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if name in ("lm_head.weight", "lm_head.bias"):  # Phi's bias: the same vocabulary rows
            lo, hi = self.head_rows
            return tensor_slice[lo:hi]
        if name.endswith("self_attn.sinks"):  # GPT-OSS: a logit per query head, split with q's heads
            return tensor_slice[self.rank * self.heads:(self.rank + 1) * self.heads]
        if stacked_experts.is_stacked(name):  # GPT-OSS, Granite: every expert in one tensor, by intermediate rows
            inter = self.full.moe.intermediate_size
            n = inter // self.world
            return stacked_experts.rank_part(name, tensor_slice, self.rank * n, (self.rank + 1) * n, inter,
                                             self.rank == 0, self.full.moe.style)
        if module in ("q_norm", "k_norm") and self.full.qk_norm_across_heads:  # OLMo 2: by heads, as q/k
            lo, hi = self.rows_of("q_proj" if module == "q_norm" else "k_proj", full_shape[0])
            return tensor_slice[lo:hi]
        if module in ("q_norm", "k_norm") and len(full_shape) == 2:  # Command R+: a weight row per head
            d = self.full.head_dim
            lo, hi = self.rows_of("q_proj" if module == "q_norm" else "k_proj", full_shape[0] * d)
            return tensor_slice[lo // d:hi // d]
        if module in COLUMN_PARALLEL and kind in ("weight", "bias") and not name.endswith(ROUTER_SUFFIXES):
            lo, hi = self.rows_of(module, full_shape[0])
            return tensor_slice[lo:hi]
        if module in ROW_PARALLEL and kind == "weight":
            lo, hi = self.columns_of(module, full_shape[1])
            return tensor_slice[:, lo:hi]
        if module in ROW_PARALLEL and kind == "bias":
            whole = tensor_slice[:]
            return whole if self.rank == 0 else torch.zeros_like(whole)
        return tensor_slice[:]

    # -- LoRA -----------------------------------------------------------------------------
    def shard_adapter_weights(self, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
                              ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """An adapter's (A [r, in], B [out, r]) pairs cut like the projections they adapt:
        B's rows for a column-parallel projection, A's columns for a row-parallel one (each
        rank's partial delta then joins its partial output before the all-reduce)."""
        out = {}
        for (layer, module), (a, b) in weights.items():
            if module in ROW_PARALLEL:
                lo, hi = self.columns_of(module, a.shape[1])
                out[layer, module] = (a[:, lo:hi].contiguous(), b)
            else:
                lo, hi = self.rows_of(module, b.shape[0])
                out[layer, module] = (a, b[lo:hi].contiguous())
        return out

    def shard_adapter(self, adapter: LoraAdapter) -> LoraAdapter:
        weights = self.shard_adapter_weights(adapter.weights)
        unique = {id(t): t for pair in weights.values() for t in pair}  # a fused projection's parts share A
        nbytes = sum(t.numel() * t.element_size() for t in unique.values())
        return dataclasses.replace(adapter, weights=weights, nbytes=nbytes)


def refusals(c: DecoderConfig, world: int) -> list[str]:
    """Why `c` cannot be split `world` ways (empty: it can)."""
    if world < 1:
        return [f"the tensor-parallel size must be >= 1, got {world}"]
    problems = []
    if c.num_heads % world:
        problems.append(f"{c.num_heads} attention heads do not divide by {world}")
    kv = c.num_kv_heads
    if kv % world and world % kv:
        problems.append(f"{kv} KV heads neither divide by {world} nor divide {world} (to be replicated)")
    sparse_everywhere = c.moe is not None and all(c.moe.sparse_layers)
    if not sparse_everywhere and c.intermediate_size % world:
        problems.append(f"intermediate_size {c.intermediate_size} does not divide by {world}")
    if c.moe is not None:
        if c.moe.intermediate_size % world:
            problems.append(f"the experts' intermediate size {c.moe.intermediate_size} does not divide by {world}")
        if c.moe.shared_intermediate_size % world:
            problems.append(f"the shared expert's intermediate size {c.moe.shared_intermediate_size} "
                            f"does not divide by {world}")
    if c.vocab_size < world:
        problems.append(f"a vocabulary of {c.vocab_size} is smaller than {world} ranks")
    return problems
