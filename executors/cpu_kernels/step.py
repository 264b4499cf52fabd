"""ctypes views of decode_layer.h's two structures (decode_step.c runs them): a model (built once) and a step."""

from __future__ import annotations

import ctypes

_P, _I = ctypes.c_void_p, ctypes.c_int64

# The columns of the per-layer address table, in decode_layer.h's order: a FusedLayer's
# fields, the scales of its int8 matrices (0 for float32 panels), then the norms around the
# MLP of a layer that norms its outputs (Gemma 2 and 3, OLMo 2 and 3).
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "q_norm", "k_norm", "post_norm", "gate_up",
                "gate_up_bias", "down", "down_bias", "qkv_scales", "o_scales", "gate_up_scales", "down_scales",
                "pre_ff_norm", "post_ff_norm")
# DecoderSpec.rotary per layer: no rotation (NoPE), the model's table, the sliding layers' own.
ROTARY_NONE, ROTARY_GLOBAL, ROTARY_LOCAL = 0, 1, 2
SCALES_SUFFIX = "_scales"
MAX_STEP_ROWS = 64  # ME_STEP_MAX_ROWS
# DecoderSpec.norm_kind: RMSNorms, LayerNorms, LayerNorms with a bias (after each norm's weights).
NORM_RMS, NORM_LAYER, NORM_LAYER_BIAS = 0, 1, 2
UNSUPPORTED, OUT_OF_RANGE = -2, -3  # the kernel's refusals (the caller falls back to the op-by-op path)


class DecoderSpec(ctypes.Structure):
    """me_decoder: the shapes and the addresses of a model's tensors (which must outlive it)."""

    _fields_ = [("layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I),
                ("eps", ctypes.c_float), ("activation", ctypes.c_int32), ("weights", _P), ("windows", _P),
                ("scales", _P), ("final_norm", _P), ("cos", _P), ("signed_sin", _P), ("max_positions", _I), ("rotary", _P),
                ("local_cos", _P), ("local_sin", _P), ("softcaps", _P), ("qk_norm_across", ctypes.c_int32),
                ("norm_kind", ctypes.c_int32), ("parallel", ctypes.c_int32), ("ungated", ctypes.c_int32)]


class StepSpec(ctypes.Structure):
    """me_step: one step's rows, where they go in the pool, and its buffers."""

    _fields_ = [("rows", _I), ("positions", _P), ("slots", _P), ("tables", _P), ("ldt", _I), ("zero_slots", _P),
                ("zero_count", _I), ("kpool", _P), ("vpool", _P), ("layer_stride", _I), ("block_size", _I),
                ("pool_blocks", _I), ("x", _P), ("h", _P), ("qkv", _P), ("attn", _P), ("gu", _P), ("act", _P)]
