"""LlmExecutor: a real decoder-only model behind the executor interface.

The model's KV lives in the paged pool, keyed by cache id (KvCacheExecutor does the
bookkeeping). Every step — prefill, batch prefill, decode, batch decode, unified batches,
verification — is one flat forward over all the items' tokens, with attention segmented
per sequence and the lm_head run only on the rows that need logits.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from executors.adapters import LoraLimits, LoraRegistry
from executors.cpu_kernels import kernels_unavailable_reason
from executors.cpu_kernels.qpanels import QPanels
from executors.descriptions import (
    AttentionType,
    ExecutorCapabilities,
    ExecutorStatus,
    MemoryRequirements,
    ModelInfo,
    ModelType,
)
from executors.kv_executor import KvCacheExecutor, Rows, StepItem, StepLogits
from executors.kv_sizing import MemoryProbe, auto_num_blocks, lora_reserve_bytes
from executors.kv_transfer import digest_tensors
from executors.llm_config import LlmExecutorConfig
from executors.lora import LoraAdapter, LoraTargets
from executors.models.config import DecoderConfig
from executors.models.decoder import DecoderLM
from executors.models.loader import load_model
from executors.models.moe import load_report
from executors.omp_pool import in_passing_thread
from executors.step_plan import StepPlan, plan_step, run_plan, run_sequence
from executors.triton_setup import attention_backend, few_row_matmuls, fused_ops
from executors.types import DType

log = logging.getLogger(__name__)

FAMILY_TYPES = {"llama": ModelType.LLAMA, "qwen2": ModelType.QWEN, "qwen3": ModelType.QWEN,
                "qwen2_moe": ModelType.QWEN, "qwen3_moe": ModelType.QWEN, "mistral": ModelType.MISTRAL,
                "mixtral": ModelType.MISTRAL, "ministral": ModelType.MISTRAL, "gemma": ModelType.GEMMA, "gemma2": ModelType.GEMMA,
                "gemma3": ModelType.GEMMA, "phi3": ModelType.PHI, "smollm3": ModelType.LLAMA,
                "granite": ModelType.CUSTOM, "olmo2": ModelType.CUSTOM,
                "olmo3": ModelType.CUSTOM, "exaone4": ModelType.CUSTOM,
                "glm4": ModelType.CUSTOM, "helium": ModelType.CUSTOM, "seed_oss": ModelType.CUSTOM,
                "cohere": ModelType.CUSTOM, "cohere2": ModelType.CUSTOM,
                "stablelm": ModelType.CUSTOM, "starcoder2": ModelType.CUSTOM, "olmoe": ModelType.CUSTOM,
                "phi": ModelType.PHI, "glm4_moe": ModelType.CUSTOM,
                "minimax_m2": ModelType.CUSTOM, "gpt_oss": ModelType.CUSTOM,
                "granitemoe": ModelType.CUSTOM, "granitemoeshared": ModelType.CUSTOM,
                "deepseek_v2": ModelType.CUSTOM, "deepseek_v3": ModelType.CUSTOM}  # model_type_name says which
# Models whose every layer slides: a cache keeps this many positions before its window, so
# that a truncation by up to this many tokens (rejected speculative drafts) still has the
# K and V it needs; blocks further back go back to the pool (KvCacheManager.slide).
WINDOW_ROLLBACK_TOKENS = 64


def size_pool(config: LlmExecutorConfig, model: DecoderLM, memory_probe: MemoryProbe | None = None,
              reference: bool = False) -> tuple[int, int]:
    """(KV blocks, max sequence length) for this model (one rank's shard of it, under tensor
    parallelism) on config's device."""
    mc = model.config
    max_sequence_length = min(config.max_sequence_length or mc.max_position_embeddings, mc.max_position_embeddings)
    num_blocks = config.num_blocks
    if num_blocks is None:  # auto: after the weights, before the pool claims its memory
        num_blocks = auto_num_blocks(
            model, device=config.device, kv_dtype=config.torch_dtype, block_size=config.block_size,
            max_batch_size=config.max_batch_size, max_sequence_length=max_sequence_length,
            memory_fraction=config.kv_memory_fraction, probe=memory_probe, reference=reference,
            reserved_bytes=lora_reserve_bytes(LoraTargets.from_config(mc), config.max_loras,
                                              config.max_lora_rank, config.torch_dtype))
    return num_blocks, max_sequence_length


class LlmExecutor(KvCacheExecutor):
    name = "llm"

    def __init__(self, config: LlmExecutorConfig, model: DecoderLM | None = None, *, reference: bool = False,
                 memory_probe: MemoryProbe | None = None, decode_graphs: bool | None = None,
                 served_config: DecoderConfig | None = None) -> None:
        """`reference`: run the plain reference computation (per-layer modules, per-sequence
        slot gathers) instead of the fast path; the tests compare the two. `memory_probe`: what
        sizes an auto pool (num_blocks None) instead of the CUDA allocator; tests pass a fake.
        `decode_graphs`: None lets the config decide (CUDA graphs on CUDA with the triton
        backend); True on a CPU runs the same fixed-shape decode step eagerly, for tests.
        `served_config`: the whole model's config when `model` is one rank's shard of it
        (tensor parallelism); what GetInfo reports and adapters are checked against."""
        args = (config, model, reference, memory_probe, decode_graphs, served_config)
        if config.device == "cpu" and self.builds_in_passing_thread:
            in_passing_thread(self._build, *args)  # its OpenMP pool goes with it (omp_pool.py)
        else:
            self._build(*args)

    # The load and the KV pool's fill run on a thread that ends with them, so that the worker
    # keeps the process's one OpenMP pool (omp_pool.py). Tensor parallelism loads its shard
    # before, on the caller's thread, and keeps its collectives there.
    builds_in_passing_thread = True

    def _build(self, config: LlmExecutorConfig, model: DecoderLM | None, reference: bool,
               memory_probe: MemoryProbe | None, decode_graphs: bool | None,
               served_config: DecoderConfig | None) -> None:
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
        self.config = config
        self.reference = reference
        if model is not None and not config.cpu_kernels:  # as load_model does for the models it loads
            model.use_cpu_kernels = False
        self.model = (model or load_model(config.model_dir, config.torch_dtype, config.device,
                                          cpu_kernels=config.cpu_kernels,
                                          quantize_weights=config.quantization == "int8")).fuse()
        if config.quantization == "int8" and not isinstance(self.model.head_panels, QPanels):
            raise ValueError(f"quantization int8 needs the float32 CPU kernels, which cannot run here: "
                             f"{kernels_unavailable_reason() or 'the model was loaded without int8 weights'}")
        local = self.model.config  # this rank's shard under tensor parallelism, else the model
        mc = self.model_config = served_config or local
        # The reference computation never reads the backend: no kernel check for it.
        self.attention_backend = "sdpa" if reference else attention_backend(config, local)
        cuda = config.device.startswith("cuda")
        if decode_graphs is None:
            decode_graphs = cuda and config.cuda_graphs and self.attention_backend == "triton" and not reference
        if decode_graphs and self.attention_backend != "triton":
            raise ValueError("decode graphs need the triton attention backend")
        num_blocks, max_sequence_length = size_pool(config, self.model, memory_probe, reference)
        num_blocks, self.attention_backend = self._agree(num_blocks, self.attention_backend)
        self.qkv_prologue = self.fused_glu = None
        if self.attention_backend == "triton" and config.triton_fused_ops:
            self.qkv_prologue, self.fused_glu = fused_ops(config, self.model)
        super().__init__(
            num_layers=mc.num_layers,
            num_kv_heads=local.num_kv_heads,
            head_dim=mc.head_dim,
            vocab_size=mc.vocab_size,
            max_sequence_length=max_sequence_length,
            max_batch_size=config.max_batch_size,
            num_blocks=num_blocks,
            block_size=config.block_size,
            kv_dtype=config.torch_dtype,
            device=config.device,
            prefix_caching=config.prefix_caching,
            scratch_blocks=1 if decode_graphs else 0,  # where a graph's padding rows write
            values_are_keys=mc.values_are_keys,  # DeepSeek's latent rows: K alone (mla.py)
        )
        if mc.all_layers_sliding:
            self.kv.enable_sliding(max(mc.layer_windows), WINDOW_ROLLBACK_TOKENS)
        self.policy_kernels = self.model.cpu_kernels
        self.graphs = None
        if decode_graphs:
            from executors.decode_graphs import DecodeGraphs, describe_failure

            try:
                self.graphs = DecodeGraphs(self.model, self.pool, config.max_batch_size, max_sequence_length,
                                           capture=cuda, prologue=self.qkv_prologue, glu=self.fused_glu,
                                           matmuls=few_row_matmuls(config, self.model), feeds=config.step_overlap)
            except Exception as e:  # a capture that fails leaves eager decode, which works
                if not cuda:
                    raise
                log.warning("decode CUDA graphs are off, decode steps run eagerly: the capture failed: %s",
                            describe_failure(e))
        if config.triton_gemv and self.graphs is None:
            log.warning("triton_gemv is on but decode CUDA graphs are not: it applies only to their steps")
        self.num_parameters = self.model.num_parameters()
        # What the weights take in memory as stored (float32 CPU panels: their padding included).
        self._param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self._packed_bytes = self.model.packed_bytes()
        if self._packed_bytes:
            log.info("oneDNN packed copies of the matmul weights: %.0f MB beside %.0f MB of parameters (status "
                     "counts both)", self._packed_bytes / 1e6, self._param_bytes / 1e6)
        self.loras = LoraRegistry(LoraTargets.from_config(mc), LoraLimits(config.max_loras, config.max_lora_rank,
                                                                         config.lora_dir),
                                  config.torch_dtype, config.device, placed=self._adapter_placed,
                                  dropped=self._adapter_dropped)
        if config.lora_dir is not None:
            self.loras.load_directory(config.lora_dir)

    def _adapter_placed(self, adapter: LoraAdapter) -> LoraAdapter:
        """An adapter as the registry keeps it (tensor parallelism: this rank's shard)."""
        return adapter

    def _adapter_dropped(self, adapter: LoraAdapter) -> None:
        """An adapter left the registry."""

    def _agree(self, num_blocks: int, backend: str) -> tuple[int, str]:
        """The pool size and attention backend every rank will use (tensor parallelism
        settles them over the ranks); one process keeps its own."""
        return num_blocks, backend

    @property
    def parameter_bytes(self) -> int:
        # Base weights, their packed copies (oneDNN, for some CPU steps) and the adapters loaded.
        return self._param_bytes + self._packed_bytes + self.loras.nbytes

    @property
    def model_id(self) -> str:
        return Path(self.config.model_dir).name

    def _weights_digest(self) -> str:
        # The parameters as served (dtype included), in their logical layout: the same
        # checkpoint gives the same digest on a CPU (whose float32 layouts differ) and a GPU.
        return digest_tensors(self.model.logical_parameters())

    # -- the forward ----------------------------------------------------------------------
    def _forward_step(self, items: list[StepItem]) -> StepLogits:
        if any(it.adapter is not None for it in items):
            # Lay the flat batch out adapter by adapter, so each adapter's rows are one
            # contiguous run: its deltas then take two matmuls on views instead of a gather
            # and a scatter per projection (LoraBatch). Spans go back in the callers' order.
            order = sorted(range(len(items)), key=lambda i: "" if items[i].adapter is None else items[i].adapter.key)
            step = self._forward_flat([items[i] for i in order])
            spans: list[tuple[int, int] | None] = [None] * len(items)
            for i, span in zip(order, step.spans):
                spans[i] = span
            return StepLogits(step.logits, spans)
        if self._graphed(items):
            return self._decode_graphed(items)
        return self._forward_flat(items)

    def _graphed(self, items: list[StepItem]) -> bool:
        """Whether these items' forward replays the decode graphs: one-token decodes without an
        adapter, no more than the largest bucket."""
        return self.graphs is not None and len(items) <= self.graphs.max_batch and all(
            len(it.tokens) == 1 and it.start > 0 and it.rows is Rows.LAST and it.adapter is None for it in items)

    def _feeds_on_device(self, items: list[StepItem]) -> bool:
        return self._graphed(items)  # the graph gathers fed tokens from the last replay's ids

    @property
    def overlaps_steps(self) -> bool:
        return self.graphs is not None and self.config.step_overlap

    def _decode_graphed(self, items: list[StepItem]) -> StepLogits:
        """A decode step through the fixed-shape graphs (executors/decode_graphs.py)."""
        logits, pairs = self.graphs.run([it.tokens[0] for it in items], [it.start for it in items],
                                        [it.table.slots(it.start, it.start + 1)[0] for it in items],
                                        [it.table.ids_array() for it in items], [it.fed_row for it in items])
        return StepLogits(logits, [(i, 1) for i in range(len(items))], pairs)

    def _forward_flat(self, items: list[StepItem]) -> StepLogits:
        # The triton kernels never load past a sequence's length; the sdpa path reads whole
        # blocks under a mask, so stale slots in a block's tail must be cleared for it.
        clear_stale = self.attention_backend == "sdpa" and not self.reference
        plan, spans = plan_step(items, self.pool.block_size, clear_stale)
        return StepLogits(self._run_plan(plan), spans)

    def _run_plan(self, plan: StepPlan) -> torch.Tensor | None:
        """The plan's logits ([rows, vocab], float32; None when no row needs them)."""
        logits, applications = run_plan(self.model, self.pool, plan, self.config.device,
                                        backend=self.attention_backend, reference=self.reference,
                                        prologue=self.qkv_prologue, glu=self.fused_glu)
        self.loras.projection_applications += applications
        return logits

    def _forward_sequence(self, tokens: list[int], hidden: bool) -> torch.Tensor:
        return run_sequence(self.model, tokens, hidden, self.config.device, reference=self.reference)

    # -- description ----------------------------------------------------------------------
    def status(self) -> ExecutorStatus:
        load = load_report(self.model)  # a mixture of experts: tokens routed to each expert
        return super().status() if load is None else dataclasses.replace(super().status(), expert_load=load)

    def info(self) -> ModelInfo:
        mc = self.model_config
        return ModelInfo(
            model_id=self.model_id,
            model_type=FAMILY_TYPES[mc.family],
            model_type_name=mc.architecture,
            num_parameters=self.num_parameters,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            vocab_size=mc.vocab_size,
            max_sequence_length=self.max_sequence_length,
            dtype=DType(str(self.config.torch_dtype).removeprefix("torch.")),
            device=self.config.device,
            metadata={"architecture": mc.architecture, "family": mc.family,
                      "eos_token_ids": list(mc.eos_token_ids), "bos_token_id": mc.bos_token_id,
                      # How steps run here: a GPU check (or a person) can see that the Triton
                      # kernels passed their start-up check and which decode graphs were captured.
                      "attention_backend": self.attention_backend,
                      "triton_fused_ops": [name for name, op in (("prologue", self.qkv_prologue),
                                                                 ("glu", self.fused_glu)) if op is not None],
                      "weight_quantization": self.config.quantization,
                      "few_row_matmuls": (self.graphs.matmuls.chosen() if self.graphs is not None
                                          and self.graphs.matmuls is not None else {}),
                      "cuda_graph_buckets": self.graphs.captured if self.graphs is not None else []},
        )

    def capabilities(self) -> ExecutorCapabilities:
        mc = self.model_config
        attention = AttentionType.GROUPED_QUERY if mc.num_kv_heads < mc.num_heads else AttentionType.MULTI_HEAD
        return ExecutorCapabilities(
            max_batch_size=self.max_batch_size,
            max_sequence_length=self.max_sequence_length,
            attention_mechanisms=(attention, AttentionType.PAGED),
            supports_dynamic_batching=True,
            supports_continuous_batching=True,
            supports_speculative_decoding=True,
            supports_tensor_parallelism=False,
            supports_pipeline_parallelism=False,
            supported_dtypes=(DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16),
            supported_devices=("cpu", "cuda"),
            memory_requirements=MemoryRequirements(
                parameter_memory=self._param_bytes,
                activation_memory_per_token=4 * (mc.hidden_size * 4 + mc.intermediate_size * 2),
                kv_cache_memory_per_token=self.pool.bytes_per_token,
                overhead_memory=0,
            ),
            kv_capacity=self.kv_capacity(),
            supports_native_unified_decode=True,
            kv_block_size=self.kv.block_size,
            kv_total_blocks=self.kv.allocator.num_total,
            supports_prefix_caching=self.kv.prefix_caching,
            supports_kv_transfer=True,
            max_lora_adapters=self.config.max_loras,
            max_lora_rank=self.config.max_lora_rank,
        )
