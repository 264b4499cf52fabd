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
CHUNK_GROUPS = 1 << 20  # groups dequantized at once: 64 MB of bfloat16 values
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[.., rows, groups, 16] uint8 nibbles and [.., rows, groups] uint8 scales -> [.., rows, groups * 32]
    in `dtype` (bfloat16 or float32): each byte's two values looked up at once (a 256-entry
    table of pairs, in `dtype`), times its group's power of two, also looked up; exact wherever
    the result is a normal number of `dtype` (bfloat16 has float32's exponent range). A chunk
    of groups at a time: a layer of gpt-oss-120b's experts is 2e9 values."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"MXFP4 dequantizes to bfloat16 or float32, not {dtype}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [.., groups, 16] and scales [.., groups] do not match: "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    values = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.arange(256)
    pairs = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1).to(dtype)  # [256, 2]: low nibble first
    # Each pair as one integer of its two values' bytes: one 4- (8-) byte load a byte, not two
    # (1.4x faster on gpt-oss-20b's experts, bench/RESULTS.md run 30).
    packed = pairs.view(torch.int32 if dtype.itemsize == 2 else torch.int64).view(256)
    powers = torch.ldexp(torch.ones(256), codes - 127).to(dtype)  # [256]: 2 ** (scale - 127)
    flat_blocks, flat_scales = blocks.reshape(-1, 16), scales.reshape(-1)
    out = torch.empty(flat_blocks.shape[0], 32, dtype=dtype)
    for g0 in range(0, flat_blocks.shape[0], CHUNK_GROUPS):
        chunk = packed[flat_blocks[g0:g0 + CHUNK_GROUPS].int()].view(dtype)  # [groups, 32]
        torch.mul(chunk, powers[flat_scales[g0:g0 + CHUNK_GROUPS].int()].unsqueeze(-1), out=out[g0:g0 + CHUNK_GROUPS])
    return out.view(*scales.shape[:-1], scales.shape[-1] * 32)


def parts(name: str) -> tuple[str, str] | None:
    """(the matrix's name, BLOCKS or SCALES) for a stored MXFP4 tensor's name; None for others."""
    for suffix in (BLOCKS, SCALES):
        if name.endswith(suffix):
            return name[:-len(suffix)], suffix
    return None
