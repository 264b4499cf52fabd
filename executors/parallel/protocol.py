"""What rank 0 sends the other ranks: a fixed header, then one payload, as host tensors.

Every message is a broadcast of an int64 header of HEADER_LEN words (the operation and
the sizes of what follows), then, when the operation has one, a broadcast of an int64
payload whose length the header gives. No pickles: a rank never waits on a Python object.

    STEP      [op, M, S, T, Z, R, reference]   a StepPlan: M tokens in S segments, T block
              ids, Z stale slots, R logits rows
    SEQUENCE  [op, M, hidden]                  a whole sequence without the cache (Forward)
    COPY      [op, P]                          P (source, destination) block copies
    ADAPTER   [op, id, pairs, floats]          a LoRA adapter's (A, B) pairs, whole; each
              rank keeps its shard (then a float32 payload of `floats` values)
    DROP      [op, id]                         an adapter unloaded
    PING      [op]                             heartbeat; each rank answers with its memory
    STOP      [op]                             leave the loop
    READ_KV   [op, layer, layers, slot, count] K and V of consecutive slots, gathered on rank 0
              (an export's chunk; kv_ranks.py)
    WRITE_KV  [op, layer, layers, count]       K and V of every head for `count` slots (an
              import's chunk): the slots, then the bytes; each rank stores its heads
"""

from __future__ import annotations

import enum

import torch

from executors.models.attention import Segment
from executors.step_plan import StepPlan

HEADER_LEN = 8
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Op(enum.IntEnum):
    STEP = 1
    SEQUENCE = 2
    COPY = 3
    ADAPTER = 4
    DROP = 5
    PING = 6
    STOP = 7
    READ_KV = 8
    WRITE_KV = 9


def header(op: Op, *fields: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = int(op)
    if fields:
        h[1:1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return h


# -- steps --------------------------------------------------------------------------------
def encode_step(plan: StepPlan, adapter_ids: list[int], reference: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step; adapter_ids: per segment, 0 for none."""
    segs = plan.segments
    blocks = [b for s in segs for b in s.block_ids]
    words = (plan.ids + plan.positions + plan.slots + [s.q_start for s in segs] + [s.q_len for s in segs]
             + [s.start for s in segs] + adapter_ids + [len(s.block_ids) for s in segs] + blocks + plan.stale
             + plan.rows)
    head = header(Op.STEP, len(plan.ids), len(segs), len(blocks), len(plan.stale), len(plan.rows), int(reference))
    return head, torch.tensor(words, dtype=torch.int64)


def step_payload_len(h: list[int]) -> int:
    m, s, t, z, r = h[1:6]
    return 3 * m + 5 * s + t + z + r


def decode_step(h: list[int], payload: torch.Tensor, adapters: dict) -> tuple[StepPlan, bool]:
    """The StepPlan a STEP message carries (adapters: id -> this rank's adapter) and its reference flag."""
    m, s, t, z, r, reference = h[1:7]
    words = payload.tolist()
    cut = _Cutter(words)
    ids, positions, slots = cut(m), cut(m), cut(m)
    q_starts, q_lens, starts, adapter_ids, nblocks = cut(s), cut(s), cut(s), cut(s), cut(s)
    blocks = cut(t)
    stale, rows = cut(z), cut(r)
    segments, first = [], 0
    for q_start, q_len, start, n in zip(q_starts, q_lens, starts, nblocks):
        segments.append(Segment(q_start=q_start, q_len=q_len, start=start, block_ids=blocks[first:first + n]))
        first += n
    plan = StepPlan(ids, positions, slots, stale, segments, [adapters[a] if a else None for a in adapter_ids], rows)
    return plan, bool(reference)


class _Cutter:
    def __init__(self, words: list[int]) -> None:
        self.words, self.at = words, 0

    def __call__(self, n: int) -> list[int]:
        out = self.words[self.at:self.at + n]
        self.at += n
        return out


# -- LoRA adapters ------------------------------------------------------------------------
def encode_adapter(adapter_id: int, weights: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(header, int64 layout payload, float32 values) of an adapter's whole (A, B) pairs."""
    layout, values = [], []
    for (layer, module), (a, b) in sorted(weights.items()):
        layout += [layer, MODULES.index(module), *a.shape, *b.shape]
        values += [a.detach().float().cpu().flatten(), b.detach().float().cpu().flatten()]
    flat = torch.cat(values) if values else torch.zeros(0)
    return header(Op.ADAPTER, adapter_id, len(weights), flat.numel()), torch.tensor(layout, dtype=torch.int64), flat


def decode_adapter(layout: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, device) -> dict:
    """{(layer, module): (A, B)} from an ADAPTER message's payloads."""
    words, weights, at = layout.tolist(), {}, 0
    for i in range(0, len(words), 6):
        layer, module, ar, ac, br, bc = words[i:i + 6]
        a = values[at:at + ar * ac].view(ar, ac)
        at += ar * ac
        b = values[at:at + br * bc].view(br, bc)
        at += br * bc
        weights[layer, MODULES[module]] = (a.to(dtype=dtype, device=device), b.to(dtype=dtype, device=device))
    return weights


# -- memory -------------------------------------------------------------------------------
MEMORY_WORDS = 5  # parameters, KV pool, adapters, device allocated, device peak


def memory_words(parameter_bytes: int, pool_bytes: int, lora_bytes: int, device: torch.device) -> torch.Tensor:
    allocated = peak = 0
    if device.type == "cuda":
        allocated, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    return torch.tensor([parameter_bytes, pool_bytes, lora_bytes, allocated, peak], dtype=torch.int64)
