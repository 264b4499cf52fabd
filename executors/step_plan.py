"""StepPlan: one flat forward laid out as plain lists, and the code that runs it on a model.

LlmExecutor plans a step from its StepItems (bookkeeping it alone holds) and runs the plan
on its model. Under tensor parallelism (executors/parallel/) rank 0 plans, sends the plan
to the other ranks as one int64 tensor, and every rank runs the same plan on its shard of
the model and its share of the KV pool: the plan is the whole of what a step needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from executors.lora import LoraAdapter
from executors.lora_batch import LoraBatch
from executors.models.attention import Segment, StepContext
from executors.models.decoder import DecoderLM
from executors.step_items import Rows
from kvcache.kv_pool import PagedKvPool

if TYPE_CHECKING:  # it imports triton
    from executors.models.triton_glu import FusedGlu
    from executors.models.triton_prologue import QkvPrologue


@dataclass(slots=True)
class StepPlan:
    ids: list[int]  # the flat batch's tokens
    positions: list[int]
    slots: list[int]  # pool slot of every token
    stale: list[int]  # slots to clear before attention reads whole blocks (the sdpa path)
    segments: list[Segment]  # one per sequence, with its block table
    adapters: list[LoraAdapter | None]  # per segment
    rows: list[int]  # rows of the flat batch that need logits, in output order

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


def plan_step(items: Sequence, block_size: int, clear_stale: bool) -> tuple[StepPlan, list[tuple[int, int] | None]]:
    """The plan of a step over StepItems, and per item where its logits rows are (None: none)."""
    plan = StepPlan([], [], [], [], [], [], [])
    spans: list[tuple[int, int] | None] = []
    for it in items:
        start, n = it.start, len(it.tokens)
        end = start + n
        q_start = len(plan.ids)
        plan.ids.extend(it.tokens)
        plan.positions.extend(range(start, end))
        plan.slots.extend(it.table.slots(start, end))
        block_ids = it.table.ids_tuple()  # the step's snapshot of the table
        if clear_stale and end % block_size and (start == 0 or (end - 1) // block_size > (start - 1) // block_size):
            # This step enters the block holding position end-1: clear its slots past the
            # sequence's end, which may hold a previous owner's K/V. The fast attention
            # reads (masked) whole blocks, and a masked NaN would still poison its row.
            first = block_ids[(end - 1) // block_size] * block_size
            plan.stale.extend(range(first + end % block_size, first + block_size))
        plan.segments.append(Segment(q_start=q_start, q_len=n, start=start, block_ids=block_ids,
                                     table=it.table.ids_array()))
        plan.adapters.append(it.adapter)
        if it.rows is Rows.NONE:
            spans.append(None)
            continue
        first = q_start if it.rows is Rows.ALL else q_start + n - 1
        spans.append((len(plan.rows), q_start + n - first))
        plan.rows.extend(range(first, q_start + n))
    return plan, spans


def run_plan(model: DecoderLM, pool: PagedKvPool | None, plan: StepPlan, device, *, backend: str,
             reference: bool, prologue: QkvPrologue | None = None,
             glu: FusedGlu | None = None) -> tuple[torch.Tensor | None, int]:
    """Run the plan: K and V into the pool, logits of plan.rows (from this model's lm_head,
    a slice of the vocabulary under tensor parallelism), and the LoRA deltas applied."""
    lora = LoraBatch.build([(seg.q_start, seg.q_len, adapter) for seg, adapter in zip(plan.segments, plan.adapters)],
                           plan.num_tokens, device)
    ctx = StepContext(plan.segments, pool, torch.tensor(plan.slots, device=device), reference=reference,
                      zero_slots=torch.tensor(plan.stale, device=device) if plan.stale else None, lora=lora,
                      backend=backend, prologue=prologue, glu=glu)
    hidden = model.hidden_states(torch.tensor(plan.ids, device=device),
                                 torch.tensor(plan.positions, device=device), ctx)
    applications = lora.applications if lora is not None else 0
    if not plan.rows:
        return None, applications
    # Every row (decode steps): no gather.
    picked = hidden if len(plan.rows) == hidden.shape[0] else hidden[torch.tensor(plan.rows, device=device)]
    return (model.logits(picked, reference=True) if reference else model.logits(picked)), applications


def run_sequence(model: DecoderLM, tokens: Sequence[int], hidden: bool, device, *, reference: bool) -> torch.Tensor:
    """A whole sequence without any cache: its final hidden states, or its logits."""
    ctx = StepContext([Segment(0, len(tokens), 0)], reference=reference)
    h = model.hidden_states(torch.tensor(list(tokens), device=device), torch.arange(len(tokens), device=device), ctx)
    if hidden:
        return h
    return model.logits(h, reference=True) if reference else model.logits(h)
