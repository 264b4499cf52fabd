"""A whole decode step in one call of the CPU kernels (executors/cpu_kernels/decode_step.c).

float32 on a CPU with the kernels built: a step whose rows are all decode rows (one new
token each, with a cache), at most FUSED_MAX_ROWS of them (batched decode included),
without LoRA or tensor parallelism, runs every layer in one kernel call, its threads
meeting at barriers instead of returning to Python between ~300 op calls (bench/RESULTS.md
run 10). The matrices may be float32 panels or int8 ones (`--quantization int8`: the layer
table then holds each int8 matrix's scales too). Every dense family qualifies: per layer
the kernel takes a window, a score scale and cap (Gemma 2), a rotary table or none (Gemma
3's sliding layers' own, SmolLM3's NoPE layers), q/k norms per head or over every head
(OLMo 2 and 3), and norms of attention's and the MLP's outputs with or without input norms
(Gemma 2 and 3, GLM-4; OLMo 2 and 3, EXAONE 4), LayerNorms with or without biases, parallel
attention and MLP (Cohere, StableLM, Phi) and ungated MLPs (StarCoder2, Phi); what does not
(experts, odd head sizes) keeps the op-by-op path of decoder.py, as does any step the kernel refuses (a position, slot or block
out of range: nothing is written then, and the op-by-op path raises its usual error). A
refusal is counted (FusedDecode.refused) and the first one of a model logged with the step's
positions, so that a step the op-by-op path serves without an error does not lose the one
call silently. The kernel checks only the block-table entries a row reads: under a window
every layer slides, the entries behind it may be FREED (-1) (kvcache's KvCacheManager.slide).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from executors.cpu_kernels import GLU_ACTIVATIONS, MAX_HEADS, MAX_ROPE_DIM, CpuKernels
from executors.cpu_kernels.panels import Panels
from executors.cpu_kernels.qpanels import QPanels
from executors.cpu_kernels.step import (
    LAYER_FIELDS,
    MAX_STEP_ROWS,
    NORM_LAYER,
    NORM_LAYER_BIAS,
    NORM_RMS,
    OUT_OF_RANGE,
    ROTARY_GLOBAL,
    ROTARY_LOCAL,
    ROTARY_NONE,
    SCALES_SUFFIX,
    DecoderSpec,
    StepSpec,
)
from executors.models.attention import StepContext
from executors.models.block_tables import padded_block_tables, segment_table

if TYPE_CHECKING:
    from executors.models.decoder import DecoderLM

log = logging.getLogger(__name__)

FUSED_MAX_ROWS = MAX_STEP_ROWS
MATMUL_FIELDS = ("qkv", "o", "gate_up", "down")  # the layer fields stored as panels
FUSED_DECODE = True  # False: every step op by op (tests compare the two)


class FusedDecode:
    """One model's decode steps through me_decode_step_f32; `build` says None where it cannot."""

    def __init__(self, model: DecoderLM, kernels: CpuKernels) -> None:
        c = model.config
        self.kernels = kernels
        self.refused = 0  # steps the kernel refused (OUT_OF_RANGE), served op by op instead
        fused = model.fused
        self.hidden, self.inter, self.width = c.hidden_size, c.intermediate_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.hq = c.num_heads * c.head_dim
        self.weights = torch.tensor([[_address(w, f) for f in LAYER_FIELDS] for w in fused], dtype=torch.int64)
        self.windows = torch.tensor([c.window(i) or 0 for i in range(c.num_layers)], dtype=torch.int32)
        self.scales = torch.tensor([c.attn_scale or c.head_dim ** -0.5] * c.num_layers, dtype=torch.float32)
        self.final_norm = model.final_norm.contiguous()
        local = model.rope_local
        self.rotary = torch.tensor([ROTARY_NONE if not c.rotates(i) else ROTARY_LOCAL if model.rope_for(i) is local
                                    else ROTARY_GLOBAL for i in range(c.num_layers)], dtype=torch.int32)
        self.softcaps = (torch.tensor([c.attn_softcap] * c.num_layers, dtype=torch.float32)
                         if c.attn_softcap is not None else None)
        # The tensors whose addresses the spec holds stay referenced here (and by the model).
        self._tensors = (fused, self.final_norm, model.rope.cos, model.rope.signed_sin, local)
        self.spec = DecoderSpec(
            layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, inter=c.intermediate_size, eps=c.rms_norm_eps,
            activation=GLU_ACTIVATIONS[c.hidden_act], weights=self.weights.data_ptr(),
            windows=self.windows.data_ptr(), scales=self.scales.data_ptr(), final_norm=self.final_norm.data_ptr(),
            cos=model.rope.cos.data_ptr(), signed_sin=model.rope.signed_sin.data_ptr(),
            max_positions=model.rope.cos.shape[0], rotary=self.rotary.data_ptr(),
            local_cos=local.cos.data_ptr() if local is not None else None,
            local_sin=local.signed_sin.data_ptr() if local is not None else None,
            softcaps=self.softcaps.data_ptr() if self.softcaps is not None else None,
            qk_norm_across=int(c.qk_norm_across_heads),
            norm_kind=NORM_RMS if not c.layer_norm else NORM_LAYER_BIAS if c.norm_bias else NORM_LAYER,
            parallel=int(c.parallel_residual), ungated=int(not c.mlp_gated))

    @classmethod
    def build(cls, model: DecoderLM) -> FusedDecode | None:
        kernels = model.cpu_kernels
        if kernels is None or model.fused is None or unsupported(model) is not None:
            return None
        return cls(model, kernels)

    def hidden_states(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """The final normed hidden states of a step of decode rows ([m, hidden], x's storage
        reused), or None where the step is not one this kernel runs."""
        m = x.shape[0]
        pool, segments = ctx.pool, ctx.segments
        if (not FUSED_DECODE or m > FUSED_MAX_ROWS or ctx.lora is not None or pool is None or ctx.reference
                or ctx.backend != "sdpa" or pool.dtype != torch.float32 or pool.device.type != "cpu"
                or ctx.slot_mapping is None or ctx.slot_mapping.dtype != torch.int64 or len(segments) != m):
            return None
        bs = pool.block_size
        for row, seg in enumerate(segments):
            if seg.q_len != 1 or seg.start == 0 or seg.q_start != row or seg.block_ids is None:
                return None
        # Entries behind a window may be FREED: never read.
        tables = torch.from_numpy(padded_block_tables([segment_table(seg) for seg in segments],
                                                      [seg.start // bs + 1 for seg in segments]))
        width = tables.shape[1]
        positions = positions.to(torch.int64).contiguous()
        zero = ctx.zero_slots
        if zero is not None and zero.dtype != torch.int64:
            return None
        x = x.contiguous()
        qkv, attn = x.new_empty(m, self.width), x.new_empty(m, self.hq)
        gu, act = x.new_empty(m, 2 * self.inter), x.new_empty(m, self.inter)
        key, value = pool.key, pool.value
        step = StepSpec(
            rows=m, positions=positions.data_ptr(), slots=ctx.slot_mapping.data_ptr(), tables=tables.data_ptr(),
            ldt=width, zero_slots=None if zero is None else zero.data_ptr(), zero_count=0 if zero is None else zero.numel(),
            kpool=key[0].data_ptr(), vpool=value[0].data_ptr(),
            layer_stride=key[0].numel(),  # the layers' pools are consecutive in one allocation
            block_size=bs, pool_blocks=key[0].shape[0], x=x.data_ptr(), h=None, qkv=qkv.data_ptr(),
            attn=attn.data_ptr(), gu=gu.data_ptr(), act=act.data_ptr())
        status = self.kernels.decode_step(self.spec, step)
        if status == OUT_OF_RANGE:
            self._refused(positions, tables)
            return None
        return x

    def _refused(self, positions: torch.Tensor, tables: torch.Tensor) -> None:
        self.refused += 1
        if self.refused == 1:
            log.warning("the one-call decode step refused a step (a position, slot or block out of range; positions "
                        "%s, block tables %s): it runs op by op; further refusals are counted in "
                        "FusedDecode.refused", positions.tolist()[:8], tables[:8, :16].tolist())


def unsupported(model: DecoderLM) -> str | None:
    """Why the model's decode steps cannot run as one kernel call; None when they can."""
    c = model.config
    if c.mla is not None:
        return "multi-head latent attention"
    if c.hidden_act not in GLU_ACTIVATIONS:
        return f"activation {c.hidden_act}"
    if c.head_dim % 8 or c.head_dim > MAX_ROPE_DIM or c.num_heads > MAX_HEADS or c.num_heads % c.num_kv_heads:
        return f"attention shape {c.num_heads} heads / {c.num_kv_heads} KV heads of {c.head_dim}"
    if model.head_rows is not None:
        return "a tensor-parallel shard"
    if c.qk_norm and c.layer_norm:
        return "q/k LayerNorms with a weight per head"
    if c.attention_sinks:
        return "attention sinks"
    for table in (model.rope, model.rope_local):
        if table is not None and (table.cos.dtype != torch.float32 or not table.cos.is_contiguous()
                                  or not table.signed_sin.is_contiguous() or table.cos.shape != model.rope.cos.shape):
            return "rotary tables not float32"
    for w in model.fused:
        if w.gate_up is None or w.moe is not None:
            return "experts"
        for name in w._fields:
            t = getattr(w, name)
            if name in MATMUL_FIELDS and not isinstance(t, (Panels, QPanels)):
                return f"{name} not stored as panels"
            if isinstance(t, QPanels):  # what the kernels' wrapper checks (CpuKernels.linear)
                tensors = ((t.data, torch.int8), (t.scales, torch.float32))
            elif name in LAYER_FIELDS:
                tensors = ((t.data if isinstance(t, Panels) else t, torch.float32),)
            else:
                continue
            for tensor, dtype in tensors:
                if tensor is not None and (tensor.device.type != "cpu" or tensor.dtype != dtype
                                           or not tensor.is_contiguous()):
                    return f"{name} not a contiguous {dtype} CPU tensor"
    return None


def _address(w, field: str) -> int:
    """The address of a FusedLayer's field `field` in the kernel's table: an int8 matrix's
    scales under its name + SCALES_SUFFIX; 0 where absent."""
    if field.endswith(SCALES_SUFFIX):
        t = getattr(w, field.removesuffix(SCALES_SUFFIX))
        return t.scales.data_ptr() if isinstance(t, QPanels) else 0
    t = getattr(w, field)
    if isinstance(t, (Panels, QPanels)):
        return t.data.data_ptr()
    return 0 if t is None else t.data_ptr()
