"""The gated MLP's activation as one Triton kernel: act(gate) * up of the fused gate/up output.

torch runs it as two kernels a layer (the activation of the gate half, then the in-place
multiply by the up half), each one more launch in a GPU step and one more pass over the
[M, intermediate] activations. Here one program per (row, block of columns) reads both
halves once and writes the product, in float32 with one rounding at the store (torch rounds
the activation to bfloat16 before the multiply). SiLU (SwiGLU) and GELU with the tanh
approximation (Gemma's GeGLU), as layers.activation.

`glu` is what fast_forward calls on the triton path once `self_check` passed at start-up
(executors/llm.py); otherwise the torch ops run, with a warning that says why. Importing
this module needs `triton`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from executors.models import layers

BLOCK = 1024
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _sigmoid(z):
    """1 / (1 + e^-z) without overflow: e^-|z| is at most 1."""
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _glu_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < inter
    gate = tl.load(gu_ptr + m * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + m * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate * _sigmoid(gate)
    else:  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), and 0.5 (1 + tanh(y)) = sigmoid(2y)
        act = gate * _sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    tl.store(out_ptr + m * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def glu(gu: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gu[:, :I]) * gu[:, I:] for gu [M, 2I] -> [M, I]."""
    m, inter = gu.shape[0], gu.shape[1] // 2
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    out = gu.new_empty(m, inter)
    if m:
        _glu_kernel[(m, triton.cdiv(inter, BLOCK))](gu, out, inter, gu.stride(0), out.stride(0),
                                                    ACT=ACTIVATIONS[activation], BLOCK_N=BLOCK)
    return out


def torch_glu(gu: torch.Tensor, activation: str) -> torch.Tensor:
    """What the kernel computes, in float32 torch ops (the check's reference)."""
    inter = gu.shape[1] // 2
    g = gu.float()
    return (layers.activation(activation)(g[:, :inter]) * g[:, inter:]).to(gu.dtype)


class FusedGlu:
    """fast_forward's GLU on the triton path, for the model's activation."""

    def __init__(self, activation: str) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"no GLU kernel for activation {activation!r}")
        self.activation = activation

    def __call__(self, gu: torch.Tensor) -> torch.Tensor:
        return glu(gu, self.activation)


def self_check(device: torch.device | str, dtype: torch.dtype, activation: str) -> str | None:
    """The kernel against torch_glu on random rows (a partial last column block too): None when
    they agree; otherwise what differed (or why it failed to build or run)."""
    if activation not in ACTIVATIONS:
        return f"no GLU kernel for activation {activation!r}"
    g = torch.Generator().manual_seed(0)
    gu = (3 * torch.randn(3, 2 * (BLOCK + 40), generator=g)).to(device, dtype)
    try:
        got = glu(gu, activation).float()
    except Exception as e:  # noqa: BLE001 - any failure to build or launch is the answer
        return f"the GLU kernel failed to run: {type(e).__name__}: {e}"
    want = torch_glu(gu, activation).float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: both round once, an ulp apart at most
    err = ((got - want).abs() / (want.abs() + 1)).max().item()
    if not err <= tol or not math.isfinite(err):
        return f"the GLU kernel differs from the torch ops by {err:.3g} (relative, tolerance {tol:g}), {dtype}"
    return None
