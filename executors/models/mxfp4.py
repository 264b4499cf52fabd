"""MXFP4 weights, as GPT-OSS's published checkpoints store their experts, dequantized at load.

A matrix W [.., rows, cols] is stored as `NAME_blocks` (uint8 [.., rows, cols / 32, 16]: 32
4-bit E2M1 values a group, two a byte, the low nibble first) and `NAME_scales` (uint8
[.., rows, cols / 32]: each group's power-of-two scale, an E8M0 exponent biased by 127).
W = value(nibble) * 2 ** (scale - 127). The decoder serves the dequantized matrix in the
serving dtype (bfloat16 holds every such value exactly: a 2-bit mantissa times a power of
two), so the experts take 4x the memory of the file's bytes; kernels that read MXFP4 as it
is are not built.
"""

from __future__ import annotations

import torch

BLOCKS, SCALES = "_blocks", "_scales"
# The E2M1 values of the 16 nibbles: sign, 2 exponent bits, 1 mantissa bit.
CHUNK_GROUPS = 1 << 20  # groups dequantized at once: 128 MB of float32 values
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[.., rows, groups, 16] uint8 nibbles and [.., rows, groups] uint8 scales -> [.., rows, groups * 32]
    in `dtype` (exact in bfloat16 unless a scale is beyond its exponent range). Computed in
    float32 a chunk of groups at a time: a layer of gpt-oss-120b's experts is 2e9 values."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [.., groups, 16] and scales [.., groups] do not match: "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    table = torch.tensor(E2M1, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, 16), scales.reshape(-1)
    out = torch.empty(flat_blocks.shape[0], 32, dtype=dtype)
    for g0 in range(0, flat_blocks.shape[0], CHUNK_GROUPS):
        chunk = flat_blocks[g0:g0 + CHUNK_GROUPS]
        values = torch.stack([table[(chunk & 0x0F).long()], table[(chunk >> 4).long()]], dim=-1).flatten(-2)
        exponents = flat_scales[g0:g0 + CHUNK_GROUPS].to(torch.int32).unsqueeze(-1) - 127
        out[g0:g0 + CHUNK_GROUPS] = torch.ldexp(values, exponents)  # low nibble first
    return out.view(*scales.shape[:-1], scales.shape[-1] * 32)


def parts(name: str) -> tuple[str, str] | None:
    """(the matrix's name, BLOCKS or SCALES) for a stored MXFP4 tensor's name; None for others."""
    for suffix in (BLOCKS, SCALES):
        if name.endswith(suffix):
            return name[:-len(suffix)], suffix
    return None
