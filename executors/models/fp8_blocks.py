"""Block-wise FP8 checkpoints, as DeepSeek V3 and R1, Kimi K2 and Qwen3's FP8 releases ship
them, dequantized at load.

`quantization_config: {quant_method: "fp8", weight_block_size: [B0, B1], ...}`: a quantized
matrix W [n, k] is stored as `NAME.weight` (float8_e4m3fn) and `NAME.weight_scale_inv`
(float32 [ceil(n / B0), ceil(k / B1)]), and W = weight * scale_inv of its block, as DeepSeek's
own conversion (fp8_cast_bf16.py) and transformers' dequantization compute it: in float32,
then rounded once to the serving dtype. Matrices the config leaves unquantized
(`modules_to_not_convert`: norms, the router, the embedding, the lm_head) are stored as they
are, with no scale beside them. The weights then take the serving dtype's bytes (2x the
file's in bfloat16); kernels that read FP8 as it is are not built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from executors.models.errors import UnsupportedModel

SCALE_SUFFIX = "_scale_inv"  # NAME.weight_scale_inv beside NAME.weight
CHUNK_ROWS = 1 << 12  # row blocks dequantized at once: a 7168-wide matrix's float32 rows, 117 MB


def block_size(cfg: dict[str, Any]) -> tuple[int, int] | None:
    """The config's FP8 block (rows, columns), None where its weights are not block-wise FP8."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedModel(f"quant_method fp8 needs weight_block_size [rows, columns] (block-wise scales); "
                               f"got {block!r}: per-tensor or per-channel FP8 is not read")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModel(f"quant_method fp8 with fmt {fmt!r} is not supported; e4m3 is")
    return block[0], block[1]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[n, k] float8_e4m3fn and [ceil(n / B0), ceil(k / B1)] float32 -> [n, k] float32."""
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedModel(f"an FP8 weight with a scale beside it must be float8_e4m3fn, got {weight.dtype}")
    if weight.dim() != 2:
        raise UnsupportedModel(f"block-wise FP8 weights are matrices, got shape {tuple(weight.shape)}")
    rows, cols = block
    n, k = weight.shape
    want = (-(-n // rows), -(-k // cols))
    if tuple(scale_inv.shape) != want:
        raise UnsupportedModel(f"an FP8 weight [{n}, {k}] in blocks of {list(block)} needs scales {list(want)}, "
                               f"got {list(scale_inv.shape)}")
    scales = scale_inv.float().repeat_interleave(cols, dim=1)[:, :k]  # [row blocks, k]
    out = torch.empty(n, k, dtype=torch.float32)
    step = rows * max(1, CHUNK_ROWS // rows)  # whole row blocks at a time
    for r0 in range(0, n, step):
        end = min(n, r0 + step)
        row_scales = scales[r0 // rows:-(-end // rows)].repeat_interleave(rows, dim=0)[:end - r0]
        torch.mul(weight[r0:end].float(), row_scales, out=out[r0:end])
    return out


class ScaledWeights:
    """A block-wise FP8 checkpoint's scales, found by name in whichever file holds each, and
    its weights read dequantized, for the loader; with no block, a plain reader."""

    def __init__(self, files: list[Path], block: tuple[int, int] | None) -> None:
        self.block = block
        self.where: dict[str, Path] = {}  # a scale's stored name -> its file
        if self.block is not None:
            for path in files:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    self.where.update((k, path) for k in f.keys() if k.endswith(SCALE_SUFFIX))

    def is_scale(self, stored: str) -> bool:
        return stored in self.where

    def scaled(self, stored: str) -> bool:
        """Whether the tensor is FP8 with a scale beside it."""
        return stored + SCALE_SUFFIX in self.where

    def weight(self, f, path: Path, stored: str) -> torch.Tensor:
        """Tensor `stored` of file `path` (open as f), dequantized to float32 where it has a scale."""
        tensor = f.get_tensor(stored)
        if not self.scaled(stored):
            if tensor.dtype == torch.float8_e4m3fn:
                raise UnsupportedModel(f"FP8 tensor {stored} has no {stored + SCALE_SUFFIX} beside it")
            return tensor
        scale = stored + SCALE_SUFFIX
        if self.where[scale] == path:  # (DeepSeek's files keep each scale beside its weight)
            return dequantize(tensor, f.get_tensor(scale), self.block)
        with safe_open(str(self.where[scale]), framework="pt", device="cpu") as g:
            return dequantize(tensor, g.get_tensor(scale), self.block)
