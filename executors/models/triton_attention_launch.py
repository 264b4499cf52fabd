"""Launching the paged-attention kernels: a step's layout on the device, and the wrappers.

- `PrefillLaunch` / `prefill_launch` and `DecodeLaunch` / `decode_launch`: a step's segments
  laid out as int32 device tensors (padded block tables, query tiles, rows and lengths),
  built once per step on the host and read by every layer's launch.
- `decode_partitions` / `partition_length`: how many context partitions (flash-decoding) a
  decode launch splits into, and how long each is (a CUDA graph fixes them once).
- `paged_prefill` / `paged_decode`: check the pool's strides, pick the block sizes and
  launch the kernels of triton_attention_kernels.py; the decode wrapper also merges the
  partitions by log-sum-exp.
- `interpreted`: whether those launches run in Triton's interpreter (TRITON_INTERPRET=1).

Separate from the kernels so the device code stays one file of @triton.jit source, and from
the step-level entry point (triton_attention.py), which plans a step with these and checks
them at start-up. Importing this module needs the `triton` package.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import triton

from executors.models.block_tables import padded_block_tables
from executors.models.triton_attention_kernels import _decode_kernel, _merge_kernel, _prefill_kernel

LOG2E = 1.4426950408889634
log = logging.getLogger(__name__)
# The partition merge's kernel came after the attention kernels' first GPU run: should it fail
# to build or launch on a device, torch's ops merge instead (once warned), rather than the
# start-up check turning the whole triton backend off.
_merge_kernel_failed: list[str] = []


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return bool(triton.knobs.runtime.interpret)


def _check_pool(key: torch.Tensor, value: torch.Tensor, q: torch.Tensor) -> None:
    # The kernels address the head dimension with unit stride.
    if key.stride(-1) != 1 or value.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged attention needs unit stride along the head dimension")


# -- prefill --------------------------------------------------------------------------------
@dataclass(slots=True)
class PrefillLaunch:
    """One step's prefill segments laid out for `paged_prefill` (built once, used by every layer)."""

    tables: torch.Tensor  # [S, max blocks] int32: the segments' block tables, padded
    tile_seg: torch.Tensor  # [T] int32: segment of each query tile
    tile_qoff: torch.Tensor  # [T] int32: first query of the tile within its segment
    seg_qstart: torch.Tensor  # [S] int32: first row of the segment in the flat batch
    seg_qlen: torch.Tensor  # [S] int32: new tokens
    seg_start: torch.Tensor  # [S] int32: tokens cached before them
    block_m: int


def prefill_launch(segments: list[tuple[int, int, int, list[int]]], block_size: int,
                   device: torch.device, block_m: int | None = None) -> PrefillLaunch:
    """`segments`: (first row, new tokens, cached tokens, block ids) for each sequence."""
    if block_m is None:
        block_m = 64 if device.type == "cuda" else 16
    width = max(-(-(start + n) // block_size) for _, n, start, _ in segments)
    tables, tile_seg, tile_qoff = [], [], []
    for s, (_, n, start, ids) in enumerate(segments):
        need = -(-(start + n) // block_size)
        tables.append(list(ids[:need]) + [0] * (width - need))
        for off in range(0, n, block_m):
            tile_seg.append(s)
            tile_qoff.append(off)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    tables = [[max(b, 0) for b in t] for t in tables]  # FREED blocks: never loaded (window), any id will do
    return PrefillLaunch(i32(tables), i32(tile_seg), i32(tile_qoff), i32([s[0] for s in segments]),
                         i32([s[1] for s in segments]), i32([s[2] for s in segments]), block_m)


def _window_arg(window: int | None) -> int:
    return NO_WINDOW if window is None else window


# A window no sequence reaches (int32): the kernels' one code path for global layers too.
NO_WINDOW = 1 << 30


def _scale_log2(d: int, scale: float | None) -> float:
    return LOG2E * (scale if scale is not None else 1 / math.sqrt(d))


def paged_prefill(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                  launch: PrefillLaunch, block_n: int | None = None, window: int | None = None,
                  scale: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Attention of the segments' rows of q ([M, H, D]) over their paged contexts, into out's rows;
    `window`: a sliding layer's, `scale`: of q.k (None: 1/sqrt(D)), `sinks`: GPT-OSS's [H]."""
    _check_pool(key, value, q)
    heads, d = q.shape[1], q.shape[2]
    kv_heads, block_size = key.shape[2], key.shape[1]
    block_n = block_n or (64 if q.is_cuda else 16)
    grid = (launch.tile_seg.shape[0], heads)
    _prefill_kernel[grid](
        q, key, value, out, launch.tables, _sinks_arg(sinks, q, heads),
        launch.tile_seg, launch.tile_qoff, launch.seg_qstart, launch.seg_qlen, launch.seg_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        launch.tables.stride(0),
        _scale_log2(d, scale), _window_arg(window),
        GROUP=heads // kv_heads, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size,
        BLOCK_M=launch.block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, HAS_SINKS=sinks is not None,
    )


# -- decode ---------------------------------------------------------------------------------
@dataclass(slots=True)
class DecodeLaunch:
    """One step's decode rows laid out for `paged_decode`."""

    rows: torch.Tensor  # [B] int32: the rows of the flat batch
    tables: torch.Tensor  # [B, max blocks] int32
    lengths: torch.Tensor  # [B] int32: keys each row sees (its cached tokens plus itself)
    partitions: int  # context partitions per row (1: no split)
    partition_tokens: torch.Tensor  # [1] integer: keys per partition (partition_length of the longest row)


def decode_partitions(batch: int, kv_heads: int, max_length: int, device: torch.device,
                      min_partition_tokens: int = 512) -> int:
    """How many context partitions keep the GPU busy: split only while (rows x KV heads)
    programs are too few to fill it, and never into partitions shorter than min_partition_tokens."""
    if device.type != "cuda":
        return max(1, -(-max_length // min_partition_tokens))
    programs = batch * kv_heads
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), -(-max_length // min_partition_tokens)))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def partition_length(max_length: int, partitions: int) -> int:
    """Keys per partition when contexts up to max_length split into `partitions` (a multiple of 16)."""
    return _round_up(-(-max_length // partitions), 16)


def decode_launch(rows: list[int], tables: list[list[int]], lengths: list[int], block_size: int,
                  kv_heads: int, device: torch.device, partitions: int | None = None) -> DecodeLaunch:
    """`partitions`: None picks them with decode_partitions."""
    # FREED blocks: never loaded (window), any id will do.
    padded = np.maximum(padded_block_tables(tables, [-(-n // block_size) for n in lengths]), 0)
    if partitions is None:
        partitions = decode_partitions(len(rows), kv_heads, max(lengths), device)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    # The partitions' length rides after the lengths: one copy to the device for both.
    counts = i32([*lengths, partition_length(max(lengths), partitions)])
    return DecodeLaunch(i32(rows), torch.from_numpy(padded).to(device), counts[:-1], partitions, counts[-1:])


def paged_decode(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                 launch: DecodeLaunch, block_n: int | None = None, window: int | None = None,
                 scale: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """One query token per row of launch.rows (q and out [M, H, D]) over its paged context."""
    _check_pool(key, value, q)
    heads, d = q.shape[1], q.shape[2]
    kv_heads, block_size = key.shape[2], key.shape[1]
    group = heads // kv_heads
    batch, parts = launch.rows.shape[0], launch.partitions
    block_n = block_n or (64 if q.is_cuda else 16)
    split = parts > 1
    if split:
        part_out = torch.empty(batch, heads, parts, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, parts, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(batch, kv_heads, parts)](
        q, key, value, out, part_out, part_lse, launch.tables, launch.rows, launch.lengths,
        _sinks_arg(sinks, q, heads),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        launch.tables.stride(0),
        part_out.stride(0) if split else 0, part_out.stride(1) if split else 0,
        part_out.stride(2) if split else 0, part_lse.stride(0) if split else 0, part_lse.stride(1) if split else 0,
        _scale_log2(d, scale), launch.partition_tokens, _window_arg(window),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT=split, IEEE=q.dtype == torch.float32, HAS_SINKS=sinks is not None,
    )
    if split:
        merge_partitions(part_out, part_lse, out, launch.rows, sinks)


def _sinks_arg(sinks: torch.Tensor | None, q: torch.Tensor, heads: int) -> torch.Tensor:
    """The kernels' sinks pointer: the [heads] sinks, or any tensor where HAS_SINKS is off (never read)."""
    if sinks is None:
        return q
    if sinks.shape != (heads,) or sinks.device != q.device or sinks.stride(0) != 1:
        raise ValueError(f"attention sinks must be a contiguous [{heads}] tensor on {q.device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    return sinks


def merge_partitions(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> None:
    """out[rows[b], h] = the partitions of (b, h) merged exactly: each partition's output weighted
    by 2^(lse_p - log2-sum-exp2 over partitions and the head's sink, where `sinks` [H] is
    given). One kernel; torch's ops if it cannot run."""
    batch, heads, parts, d = part_out.shape
    if not _merge_kernel_failed:
        try:
            _merge_kernel[(batch, heads)](
                part_out, part_lse, out, rows, _sinks_arg(sinks, part_out, heads), parts,
                part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
                out.stride(0), out.stride(1),
                HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_P=max(2, triton.next_power_of_2(parts)),
                HAS_SINKS=sinks is not None,
            )
            return
        except Exception as e:  # noqa: BLE001 - a kernel that cannot build here: the torch ops below
            _merge_kernel_failed.append(f"{type(e).__name__}: {e}")
            log.warning("the decode partitions' merge kernel failed, torch ops merge them instead: %s",
                        _merge_kernel_failed[0])
    logits = part_lse * math.log(2.0)
    if sinks is not None:  # a partition of its own with no value: its weight dropped
        sink = sinks.float().view(1, heads, 1).expand(batch, heads, 1)
        weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1].unsqueeze(-1)
    else:
        weights = torch.softmax(logits, dim=-1).unsqueeze(-1)
    out.index_copy_(0, rows.long(), (part_out * weights).sum(2).to(out.dtype))
