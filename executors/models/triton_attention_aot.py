"""Ahead-of-time compilation of the paged-attention kernels for a GPU that is not here.

`compile_for` builds the kernels of triton_attention_kernels.py (and the fused ones of
triton_prologue.py and triton_glu.py, and triton_gemv.py's) for a CUDA compute capability
with Triton's own compiler and ptxas, as the first launch on such a GPU would, and reports
each variant's shared memory. The interpreter checks what the kernels compute; this checks
that they build for real hardware, on a machine without a GPU (README, the tests).

A file of its own because it is a build-time tool, not part of a step: nothing on the
serving path calls it, and it needs triton imported without TRITON_INTERPRET (the tests run
it in a subprocess). Importing this module needs the `triton` package.
"""

from __future__ import annotations

import triton

from executors.models.triton_attention_kernels import _decode_kernel, _merge_kernel, _prefill_kernel
from executors.models.triton_attention_launch import interpreted


def compile_for(capability: int, dtype: str = "bf16", head_dim: int = 128, group: int = 2,
                block_size: int = 16) -> dict[str, int]:
    """Compile both kernels (decode with and without partitions, prefill) for a CUDA compute
    capability (90: H100) without a GPU, as Triton would at the first launch on one; returns
    each variant's shared memory in bytes. A kernel that cannot be built for that GPU raises.

    The interpreter checks what the kernels compute; this checks that they build for real
    hardware (tl.dot shapes, types, shared memory). Needs triton imported without
    TRITON_INTERPRET (the tests run it in a subprocess)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreted():
        raise RuntimeError("compile_for needs triton imported without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", capability, 32)
    block_d = max(16, triton.next_power_of_2(head_dim))

    def signature(kernel, pointers: dict[str, str], constants: dict) -> dict[str, str]:
        return {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name == "scale_log2" else "i32")
                for name in kernel.arg_names}

    io = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "sinks_ptr")}
    shared = {}
    # Each kernel without sinks, and with them (GPT-OSS's; "_sinks"): the split decode adds none itself.
    for split, sinks in ((False, False), (True, False), (False, True)):
        constants = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                         BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=64, SPLIT=split, IEEE=dtype == "fp32",
                         HAS_SINKS=sinks)
        pointers = {**io, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "tables_ptr": "*i32", "rows_ptr": "*i32",
                    "lengths_ptr": "*i64", "partition_tokens_ptr": "*i64"}
        compiled = triton.compile(ASTSource(_decode_kernel, signature(_decode_kernel, pointers, constants), constants),
                                  target=target)
        shared[f"decode{'_split' if split else ''}{'_sinks' if sinks else ''}"] = compiled.metadata.shared
    for sinks in (False, True):
        constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_M=64,
                         BLOCK_N=64, IEEE=dtype == "fp32", HAS_SINKS=sinks)
        pointers = {**io, **{name: "*i32" for name in ("tables_ptr", "tile_seg_ptr", "tile_qoff_ptr",
                                                       "seg_qstart_ptr", "seg_qlen_ptr", "seg_start_ptr")}}
        compiled = triton.compile(ASTSource(_prefill_kernel, signature(_prefill_kernel, pointers, constants),
                                            constants), target=target)
        shared[f"prefill{'_sinks' if sinks else ''}"] = compiled.metadata.shared
        constants = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=8, HAS_SINKS=sinks)
        pointers = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{dtype}", "rows_ptr": "*i32",
                    "sinks_ptr": f"*{dtype}"}
        compiled = triton.compile(ASTSource(_merge_kernel, signature(_merge_kernel, pointers, constants), constants),
                                  target=target)
        shared[f"merge{'_sinks' if sinks else ''}"] = compiled.metadata.shared
    from executors.models.triton_prologue import _prologue_kernel  # the attention prologue's kernel

    for qk_norm in (True, False):
        constants = dict(HEADS=16, KV_HEADS=16 // group, HEAD_DIM=head_dim, BLOCK_D=block_d, QK_NORM=qk_norm)
        pointers = {"qkv_ptr": f"*{dtype}", "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
                    "slot_ptr": "*i64", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                    "norm_ptr": f"*{dtype}" if qk_norm else "*fp32", "eps": "fp32"}
        compiled = triton.compile(ASTSource(_prologue_kernel, signature(_prologue_kernel, pointers, constants),
                                            constants), target=target)
        shared[f"prologue{'_norm' if qk_norm else ''}"] = compiled.metadata.shared
    from executors.models.triton_glu import ACTIVATIONS, BLOCK, _glu_kernel  # the gated MLP's

    for name, act in ACTIVATIONS.items():
        constants = dict(ACT=act, BLOCK_N=BLOCK)
        pointers = {"gu_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
        compiled = triton.compile(ASTSource(_glu_kernel, signature(_glu_kernel, pointers, constants), constants),
                                  target=target)
        shared[f"glu_{name}"] = compiled.metadata.shared
    from executors.models.triton_gemv import _gemv_kernel, _split_sum_kernel  # the few-row matmuls

    for partial in (False, True):  # whole rows; a split's float32 partial sums
        constants = dict(HAS_BIAS=False, HAS_RES=not partial, PARTIAL=partial, BLOCK_M=1, BLOCK_N=16, BLOCK_K=256)
        pointers = {name: f"*{dtype}" for name in ("x_ptr", "w_ptr", "bias_ptr", "res_ptr")}
        pointers["out_ptr"] = "*fp32" if partial else f"*{dtype}"
        compiled = triton.compile(ASTSource(_gemv_kernel, signature(_gemv_kernel, pointers, constants), constants),
                                  target=target)
        shared["gemv_partial" if partial else "gemv"] = compiled.metadata.shared
    constants = dict(HAS_BIAS=True, HAS_RES=True, BLOCK_S=8, BLOCK_N=256)
    pointers = {"part_ptr": "*fp32", "bias_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
    compiled = triton.compile(ASTSource(_split_sum_kernel, signature(_split_sum_kernel, pointers, constants),
                                        constants), target=target)
    shared["gemv_split_sum"] = compiled.metadata.shared
    return shared
