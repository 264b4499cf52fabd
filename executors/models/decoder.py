"""DecoderLM: one decoder-only transformer for every family of families.py (Qwen, Llama/SmolLM,
Mistral, Gemma, Phi, OLMo, GLM, Cohere, StarCoder2 and more, the mixtures of experts among
them, the text models of Gemma 3's and Mistral 3's multimodal checkpoints), by config flags.

Parameter names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj...),
so a safetensors state dict loads as it is. The forward takes a flat batch of tokens
([M]) with their positions and a StepContext that says how they split into sequences.

Two forwards compute the same thing. The reference runs the nn.Modules as written
(decoder_modules.py: three projections, rotary tables looked up per layer, attention through
attend_reference). The fast one (fast_forward.py; the default once `fuse()` ran, which the
loader and LlmExecutor do) walks plain per-layer tuples of tensors (fused_weights.py): q/k/v
fused into one [(H + 2 KVH) D, hidden] matmul, gate and up into one [2 I, hidden] matmul, the
residual adds folded into addmm, one fused RMSNorm op, the rotary tables looked up once per
step, and the planned attention of attention.py. The fused weights are the storage: the
modules' q_proj/k_proj/... parameters become views into them, so fusing costs no memory and
parameter counts do not change. In float32 on a CPU with the kernels of executors/cpu_kernels
built, every matmul weight is then stored as the kernels' 6-column panels instead (int8
16-column ones with `--quantization int8`), the modules becoming PanelLinear over them
(panel_modules.py); without the kernels, each kind of weight in
the layout its one-row matmuls read fastest (cpu_layout.py). One copy either way. This module
holds what ties those together: the model's buffers and per-layer options, `fuse()` choosing
the weights' layout for the device and dtype, the embedding, the choice of forward, the lm_head.

LoRA: when the step's context carries a LoraBatch (executors/lora_batch.py), both forwards add
each row's adapter delta to every adapted projection's output, in place. The fast one adds
q/k/v deltas into the column slices of the fused qkv output and gate/up deltas into those
of gate_up (before q/k norm, rope and the SiLU), and o/down deltas straight into the
residual stream after its fused add. Without adapters it pays one `is not None` test per
fused projection. Sparse (MoE) layers take adapters on attention only.

Family flags (config.py): a sparse layer's MLP is a SparseMoe (moe.py), its experts'
weights stacked for grouped compute; Gemma 3 norms attention's and the MLP's outputs
before the residual add ("sandwich" norms, so no add fuses into a matmul there), scales
the embeddings, uses a second rotary table on its sliding layers and soft-caps the final
logits; each layer's window and score scale reach attention through StepContext.layers.
"""

from __future__ import annotations

import torch
from torch import nn

from executors.cpu_kernels import CpuKernels, cpu_kernels
from executors.cpu_kernels.panels import Panels
from executors.cpu_kernels.qpanels import QPanels
from executors.models import cpu_layout, fast_forward, panel_modules, step_ops
from executors.models.attention import LayerAttention, StepContext
from executors.models.config import DecoderConfig
from executors.models.decoder_modules import DecoderModel, Reduce
from executors.models.fused_decode import FusedDecode
from executors.models.fused_weights import FusedLayer, fuse_layers
from executors.models.layers import RotaryEmbedding, activation
from executors.models.moe_grouped import grouped_backend

__all__ = ["DecoderLM", "FusedLayer"]  # FusedLayer: step_ops.py types its tuples by it, imported from here

class DecoderLM(nn.Module):
    def __init__(self, config: DecoderConfig, head_rows: tuple[int, int] | None = None) -> None:
        """`head_rows`: under tensor parallelism, the vocabulary rows [lo, hi) this rank's
        lm_head computes (a slice of the tied embedding, or an lm_head of hi - lo rows);
        `config` is then this rank's shard (executors/parallel/shard.py)."""
        super().__init__()
        self.config = config
        self.head_rows = head_rows
        # Set under tensor parallelism: the all-reduce after each row-parallel matmul, and
        # the mean over the ranks of OLMo 2's q/k norm statistics.
        self.all_reduce: Reduce | None = None
        self.mean_over_ranks: Reduce | None = None
        self.model = DecoderModel(config)
        self.attn_layers: tuple[LayerAttention, ...] = ()
        self.reset_buffers()
        self.act = activation(config.hidden_act)
        if not config.tie_word_embeddings:
            rows = config.vocab_size if head_rows is None else head_rows[1] - head_rows[0]
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=config.lm_head_bias)
        self.fused: list[FusedLayer] | None = None
        # The final norm's fused weight (with Gemma's offset added, a LayerNorm's bias stacked),
        # made once by fuse() rather than on every step.
        self.final_norm: torch.Tensor | None = None
        self.packed_head: torch.Tensor | None = None
        self.fused_fp32_packed: list[FusedLayer] | None = None  # float32: for PACKED_FP32_ROWS-row steps
        self.packed_head_fp32: torch.Tensor | None = None
        # float32 on a CPU: the AVX2 kernels (step_ops.py), when use_cpu_kernels allows and
        # they build here; the matmul weights are then stored as their panels (panel_modules.py).
        self.use_cpu_kernels = True
        # With the kernels: the panels as int8 with float32 scales (--quantization int8).
        self.quantize_weights = False
        self.cpu_kernels: CpuKernels | None = None
        self.head_panels: Panels | QPanels | None = None  # the lm_head as panels, with the kernels
        self.head_copy = False  # head_panels is a copy (a TP rank's slice of a tied embedding), not the storage
        self.fused_decode: FusedDecode | None = None  # with the kernels: decode steps in one call

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """The rotary tables and the expert-load counters (not in checkpoints: made here, on
        `device`, also after a load onto the meta device)."""
        c = self.config
        rope = c.rope_view()  # MLA: the tables of its rope dimensions, not of the latent rows
        self.rope = RotaryEmbedding(rope).to(device) if device is not None else RotaryEmbedding(rope)
        self.rope_local = None
        if c.local_rope_theta is not None:
            self.rope_local = RotaryEmbedding(c, local=True)
            if device is not None:
                self.rope_local = self.rope_local.to(device)
        if c.moe is not None:
            # Rows routed to each expert of each layer since start (dense layers' rows stay 0).
            self.register_buffer("expert_load", torch.zeros(c.num_layers, c.moe.num_experts, dtype=torch.int64,
                                                            device=device), persistent=False)
        self.attn_layers = self._attention_specs()

    def _attention_specs(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention options; () when every layer is plain (no window, default
        scale). GPT-OSS's sinks are the layers' parameters: made again wherever those may have
        been replaced (after a load, a move, fuse())."""
        c = self.config
        specs = tuple(LayerAttention(c.window(i), c.attn_scale, c.attn_softcap,
                                     layer.self_attn.sinks.detach() if c.attention_sinks else None)
                      for i, layer in enumerate(self.model.layers))
        return specs if c.attention_sinks or any(s != LayerAttention() for s in specs) else ()

    def rope_for(self, layer: int) -> RotaryEmbedding | None:
        """The rotary table of a layer: Gemma's sliding layers have their own base; SmolLM3's
        NoPE layers none."""
        if not self.config.rotates(layer):
            return None
        if self.rope_local is not None and self.config.window(layer) is not None:
            return self.rope_local
        return self.rope

    def fuse(self) -> DecoderLM:
        """Build the fast forward's fused weights (idempotent; no extra memory, see the module doc)."""
        if self.fused is not None:
            return self
        c = self.config
        fused = fuse_layers(self.model, c)
        self.fused = fused
        self.attn_layers = self._attention_specs()
        self.final_norm = self.model.norm.fused_weight()
        if c.moe is not None:  # pick the grouped GEMM for this device and dtype now, not inside a graph capture
            embed = self.model.embed_tokens.weight
            grouped_backend(embed.device, embed.dtype)
        if cpu_layout.wanted(self):
            self.cpu_kernels = cpu_kernels() if self.use_cpu_kernels else None
            if self.cpu_kernels is None or not all(map(self.cpu_kernels.accepts, self._matmul_weights())):
                self.cpu_kernels = None
                cpu_layout.relayout(self)  # MKL's one-row matmuls: each kind of weight in its faster layout
            else:
                panel_modules.pack_model(self, self.quantize_weights)  # the kernels' layout, the weights' one copy
            self.fused_decode = FusedDecode.build(self)
            fused = self.fused
        if self.head_panels is not None:
            return self
        head = self.head_weight()
        if step_ops.should_pack(head, torch.bfloat16):
            # bfloat16 on CPU: oneDNN prepacked weights (AMX / avx512_bf16 layout) instead of
            # F.linear, which re-lays the weight out on every call: 1.3-1.5x faster matmuls
            # at M = 1..512 here (bench/RESULTS.md). A second copy of the matmul weights.
            fused = [step_ops.packed(w) for w in fused]
            self.packed_head = step_ops.pack(head)
        elif (self.cpu_kernels is None and step_ops.should_pack(head, torch.float32)
              and sum(p.numel() for p in self.parameters()) * 4 <= step_ops.PACK_FP32_MAX_BYTES):
            # float32 on CPU without the kernels (whose tiles match these without a copy): oneDNN
            # prepacked copies for steps of PACKED_FP32_ROWS rows (batched decode), 1.25-1.4x
            # faster than MKL's sgemm there; slower at 1 row and no better
            # for prefill-sized steps, which keep F.linear. Doubles the weights' memory, so
            # only for models up to PACK_FP32_MAX_BYTES.
            self.fused_fp32_packed = [step_ops.packed(w) for w in fused]
            self.packed_head_fp32 = step_ops.pack(head)
        self.fused = fused
        return self

    def head_weight(self) -> torch.Tensor:
        """The lm_head's weight: the embedding when tied; under tensor parallelism this rank's
        vocabulary rows (of a tied embedding: a view, no copy). Stored as panels, it is unpacked
        (a new tensor): for the reference forward, not the fast one."""
        if self.head_panels is not None:
            return self.head_panels.unpack()
        if not self.config.tie_word_embeddings:
            return self.lm_head.weight.detach()
        w = self.model.embed_tokens.weight.detach()
        return w if self.head_rows is None else w[self.head_rows[0]:self.head_rows[1]]

    def _matmul_weights(self) -> list[torch.Tensor]:
        dense = [t for w in self.fused for t in w.matmuls()]
        experts = [t for w in self.fused if w.moe is not None for t in w.moe.matrices()]
        return [*dense, *experts, self.head_weight()]

    def packed_bytes(self) -> int:
        """Memory of copies of the matmul weights kept beside the parameters: oneDNN's packed
        ones, or a tensor-parallel rank's panels of its slice of a tied embedding."""
        if self.head_panels is not None:
            return self.head_panels.nbytes if self.head_copy else 0
        layers = [w for group in (self.fused_fp32_packed, self.fused) for w in group or ()]
        tensors = [t for w in layers for t in w.matmuls()]
        tensors += [self.packed_head, self.packed_head_fp32]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.is_mkldnn)

    def num_parameters(self) -> int:
        """The checkpoint's parameter count (panels' padding not counted)."""
        return panel_modules.logical_numel(self)

    def logical_parameters(self):
        """named_parameters() in the checkpoint's layout (panels unpacked, one at a time)."""
        return panel_modules.logical_parameters(self)

    def _apply(self, fn, recurse: bool = True):
        """.to(), .cuda(), .half() and the like: the fused tensors are not parameters, so they
        would stay behind (on the old device or dtype) while each parameter moves on its own.
        Drop them, move the parameters, and fuse again where the model was fused."""
        fused = self.fused is not None
        if self.head_panels is not None:  # row-major modules again, to move and re-fuse
            panel_modules.unpack_model(self)
        self.fused = self.packed_head = self.fused_fp32_packed = self.packed_head_fp32 = self.cpu_kernels = None
        self.final_norm = None
        self.fused_decode = None
        out = super()._apply(fn, recurse)
        self.attn_layers = self._attention_specs()
        if fused:
            self.fuse()
        return out

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Final (normed) hidden states of a flat batch: [M] ids -> [M, hidden]."""
        if self.attn_layers and not ctx.layers:
            ctx.layers = self.attn_layers
        x = self._embed(input_ids)
        if self.fused is not None and not ctx.reference:
            return fast_forward.hidden_states(self, x, positions, ctx)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rope_for(i), ctx, self.expert_load[i] if layer.sparse else None,
                      self.all_reduce, self.mean_over_ranks)
        return self.model.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # nn.Embedding, or PanelEmbedding over the tied head's panels
        if self.config.embed_scale is not None:  # Gemma's sqrt(hidden), Granite's multiplier; in the model's dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """float32 logits of the given hidden rows; the lm_head runs only on these rows."""
        rows = hidden.shape[0]
        if self.packed_head is not None and not reference:
            out = step_ops.linear(hidden.contiguous(), self.packed_head, None).float()
        elif self.head_panels is not None and not reference:
            out = self.cpu_kernels.linear(hidden, self.head_panels)
        elif self.packed_head_fp32 is not None and not reference and rows in step_ops.PACKED_FP32_ROWS:
            out = step_ops.linear(hidden.contiguous(), self.packed_head_fp32, None)
        else:
            out = torch.nn.functional.linear(hidden, self.head_weight()).float()
        if self.config.lm_head_bias:  # Phi's (on the lm_head module, or its PanelLinear)
            out = out + self.lm_head.bias.float()
        if self.config.logits_divisor is not None:  # Granite's logits_scaling
            out = out / self.config.logits_divisor
        cap = self.config.final_softcap
        return out if cap is None else torch.tanh(out / cap) * cap
