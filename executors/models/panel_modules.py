"""A float32 CPU model's matmul weights stored once, as the CPU kernels' panels.

With the kernels of executors/cpu_kernels built, DecoderLM.fuse() packs every matmul weight
(the fused q/k/v, o, the fused gate/up, down, a sparse layer's experts and shared expert,
DeepSeek's q_b_proj, and the lm_head; a tied lm_head with the embedding; not DeepSeek's
kv_b_proj, which batched matmuls read head by head, mla.py) into panels (cpu_kernels/panels.py),
layer by layer, and drops the row-major tensors: the panels are the weights' one copy, and
what status counts. The nn.Linear modules become PanelLinear, stacked experts' matrices
PanelStack (panel_layers.py): they keep the modules' names, logical shapes and state_dict
keys, and give their weights back on request (unpacked, new tensors) for what reads them
outside the fast forward: the reference forward, the weights' digest, `unpack_model` before
the model moves to another device or dtype.

With `quantized` (DecoderLM.quantize_weights, `--quantization int8`), the same weights are
stored as int8 16-column panels with their float32 scales instead (cpu_kernels/qpanels.py): the
modules then give the dequantized weights back, which is the model that serves. (A sparse
layer's router stays a float32 tensor, as does the shared expert's gate: tiny, and the choice
of experts is not approximated.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from executors.cpu_kernels.panels import PANEL, Panels, pack, panels_numel
from executors.cpu_kernels.qpanels import Q8PANEL, QPanels, qpanels_numel, quantize
from executors.models.panel_layers import PanelEmbedding, PanelLinear, PanelStack, stored
from kvcache import host_memory

if TYPE_CHECKING:
    from executors.models.decoder import DecoderLM
    from executors.models.moe import MoeWeights

# Stacked experts' parameters in the order they are registered (stacked_experts.StackedExperts):
# the order the digest reads them in, packed or not.
STACKED_ORDER = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def _parameters(p: Panels | QPanels) -> tuple[nn.Parameter, nn.Parameter | None]:
    scales = nn.Parameter(p.scales, requires_grad=False) if isinstance(p, QPanels) else None
    return nn.Parameter(p.data, requires_grad=False), scales


def _replace(owner: nn.Module, names: list[str], panels: Panels | QPanels) -> Panels | QPanels:
    """Owner's Linear children `names`, consecutive row ranges of one weight, as PanelLinear;
    the weight as their shared parameters hold it."""
    (shared, scales), row = _parameters(panels), 0
    for name in names:
        linear = getattr(owner, name)
        rows = linear.out_features
        setattr(owner, name, PanelLinear(shared, panels.n, row, row + rows, linear.bias, scales))
        row += rows
    return stored(shared, scales, panels.n)


class _Arena:
    """One allocation on huge pages (kvcache.host_memory) that the packed weights are cut
    from in turn (two where int8: the bytes and the scales): a step streams them all, and
    2 MiB pages stream faster than 4 KiB ones. Its pages are taken as each weight is packed,
    not before."""

    def __init__(self, shapes: list[tuple[int, int]], quantized: bool) -> None:
        self.quantized = quantized
        sizes = [qpanels_numel(n, k) if quantized else (panels_numel(n, k), 0) for n, k in shapes]
        self.data = host_memory.zeros(sum(d for d, _ in sizes), dtype=torch.int8 if quantized else torch.float32,
                                      claim=False)
        self.scales = host_memory.zeros(sum(s for _, s in sizes), claim=False)
        self.used = [0, 0]  # elements of data and of scales handed out

    def _take(self, which: int, size: int) -> torch.Tensor:
        buffer, start = (self.data, self.scales)[which], self.used[which]
        self.used[which] += size
        return buffer[start:start + size]

    def pack(self, w: torch.Tensor) -> Panels | QPanels:
        if not self.quantized:
            return pack(w, self._take(0, panels_numel(*w.shape)))
        size, floats = qpanels_numel(*w.shape)
        return quantize(w, self._take(0, size), self._take(1, floats))

    def pack_stack(self, stack: torch.Tensor) -> PanelStack:
        """Each expert's matrix of stack [E, n, k] packed in turn, consecutively: a PanelStack."""
        experts = [self.pack(w) for w in stack]
        first = experts[0]
        panels = self._consecutive([p.data for p in experts])
        scales = self._consecutive([p.scales for p in experts]) if self.quantized else None
        return PanelStack(nn.Parameter(panels, requires_grad=False),
                          None if scales is None else nn.Parameter(scales, requires_grad=False), first.n)

    @staticmethod
    def _consecutive(parts: list[torch.Tensor]) -> torch.Tensor:
        """Equal tensors cut one after another from one buffer, as one [len(parts), ...] view of it."""
        first = parts[0]
        size = first.numel() * first.element_size()
        if any(p.data_ptr() != first.data_ptr() + i * size for i, p in enumerate(parts)):
            raise AssertionError("a stack's panels must lie one after another in the arena")
        return torch.as_strided(first, (len(parts), *first.shape), (first.numel(), *first.stride()))


def pack_model(model: DecoderLM, quantized: bool = False) -> None:
    """Store model.fused's dense matmul weights and the lm_head as panels (int8 ones where
    `quantized`), one layer at a time (the peak is one layer's weights above the model), the
    modules as PanelLinear."""
    c = model.config
    width = Q8PANEL if quantized else PANEL  # a panel view of the tied embedding starts at a panel
    tied_view = c.tie_word_embeddings and (model.head_rows is None or model.head_rows[0] % width == 0)
    head = (model.model.embed_tokens.weight if tied_view else
            model.lm_head.weight if not c.tie_word_embeddings else model.head_weight())
    # A tensor-parallel rank's slice of a tied embedding that no panel boundary starts: the head
    # gets panels of its own, and, where int8, the embedding an int8 table of its own (below).
    tied_apart = c.tie_word_embeddings and not tied_view
    embedding = model.model.embed_tokens.weight
    experts = [tuple(t.shape) for w in model.fused if w.moe is not None for t in w.moe.matrices()]
    arena = _Arena([tuple(t.shape) for w in model.fused for t in w.matmuls()]
                   + experts + [tuple(head.shape)] + ([tuple(embedding.shape)] if tied_apart and quantized else []),
                   quantized)
    for i, (layer, w) in enumerate(zip(model.model.layers, model.fused)):
        a, ffn = layer.self_attn, layer.ffn
        changes = dict(qkv=_replace(a, list(a.fused_names), arena.pack(w.qkv)),
                       o=_replace(a, ["o_proj"], arena.pack(w.o)))
        if w.q_b is not None:  # DeepSeek's q_b_proj
            changes.update(q_b=_replace(a, ["q_b_proj"], arena.pack(w.q_b)))
        if w.gate_up is not None:
            changes.update(gate_up=_replace(ffn, ffn.gate_up_names, arena.pack(w.gate_up)),
                           down=_replace(ffn, ["down_proj"], arena.pack(w.down)))
        if w.moe is not None:
            changes.update(moe=_pack_experts(ffn, w.moe, arena, model))
        model.fused[i] = w._replace(**changes)
    if not c.tie_word_embeddings:
        model.head_panels = _replace(model, ["lm_head"], arena.pack(head.detach()))
    elif tied_view:
        packed = arena.pack(head.detach())
        shared, scales = _parameters(packed)
        model.model.embed_tokens = PanelEmbedding(shared, packed.n, scales)
        table = stored(shared, scales, packed.n)
        model.head_panels = table if model.head_rows is None else table.rows(*model.head_rows)
    else:  # tied_apart
        model.head_panels = arena.pack(head)  # int8 rows are quantized one by one: the table's own rows
        model.head_copy = True
        if quantized:
            # Every rank embeds its tokens itself, so each must look them up in the table one
            # process serves, the int8 one, as the ranks whose slice starts a panel do through
            # the view above; a float32 embedding here made this rank's residual stream differ
            # from the others' (logits 2.6e-3 from one process's, vocabulary 328 over two ranks).
            packed = arena.pack(embedding.detach())
            shared, scales = _parameters(packed)
            model.model.embed_tokens = PanelEmbedding(shared, packed.n, scales)


def _pack_experts(moe: nn.Module, w: MoeWeights, arena: _Arena, model: DecoderLM) -> MoeWeights:
    """A sparse layer's experts (and shared expert) as panels, their modules PanelLinear (stacked
    experts': PanelStack); the stacks they were views of go (the panels are the one copy)."""
    if w.stacked:  # GPT-OSS, Granite: the stacked parameters become PanelStacks
        stacks = []
        for name, stack in (("gate_up_proj", w.gate_up), ("down_proj", w.down)):
            del moe.experts._parameters[name]
            setattr(moe.experts, name, arena.pack_stack(stack))
            stacks.append(getattr(moe.experts, name))
        panels = [(stacks[0].expert(e), stacks[1].expert(e)) for e in range(stacks[0].shape[0])]
    else:
        panels = []
        for i, expert in enumerate(moe.experts):
            gate, up, down = expert.names
            panels.append((_replace(expert, [gate, up], arena.pack(w.gate_up[i])),
                           _replace(expert, [down], arena.pack(w.down[i]))))
    shared = None
    if w.shared_gate_up is not None:
        s = moe.shared
        shared = (_replace(s, ["gate_proj", "up_proj"], arena.pack(w.shared_gate_up)),
                  _replace(s, ["down_proj"], arena.pack(w.shared_down)))
    return w._replace(gate_up=None, down=None, shared_gate_up=None, shared_down=None, expert_panels=tuple(panels),
                      shared_panels=shared, kernels=model.cpu_kernels, glu=model.config.hidden_act)


def unpack_model(model: DecoderLM) -> None:
    """Undo pack_model: nn.Linear / nn.Embedding modules with row-major weights again (stacked
    experts' parameters, in their order)."""
    for module in list(model.modules()):
        stacks = {name: child for name, child in module.named_children() if isinstance(child, PanelStack)}
        if stacks:
            params = dict(module._parameters)
            for name in stacks:
                del module._modules[name]
            module._parameters.clear()
            for name in STACKED_ORDER:
                if name in stacks:
                    module._parameters[name] = nn.Parameter(stacks[name].weight, requires_grad=False)
                elif params.get(name) is not None:
                    module._parameters[name] = params[name]
        for name, child in list(module.named_children()):
            if isinstance(child, PanelLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device="meta")
                linear.weight = nn.Parameter(child.weight, requires_grad=False)
                linear.bias = child.bias
                setattr(module, name, linear)
            elif isinstance(child, PanelEmbedding):
                embedding = nn.Embedding(child.num_embeddings, child.embedding_dim, device="meta")
                embedding.weight = nn.Parameter(child.weight, requires_grad=False)
                setattr(module, name, embedding)
    model.head_panels = None
    model.head_copy = False


def logical_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """named_parameters() as the unpacked model would list them: PanelLinear and
    PanelEmbedding give their [out, in] weight (one at a time) under the name `weight`."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        dot = prefix + "." if prefix else ""
        if isinstance(module, PanelStack):
            continue  # its owner gave it, in order
        if any(isinstance(child, PanelStack) for child in module.children()):  # packed stacked experts
            for name in STACKED_ORDER:
                held = getattr(module, name, None)
                if held is not None:
                    yield dot + name, held.weight if isinstance(held, PanelStack) else held
            continue
        if isinstance(module, (PanelLinear, PanelEmbedding)):
            yield dot + "weight", module.weight
            if getattr(module, "bias", None) is not None and id(module.bias) not in seen:
                seen.add(id(module.bias))
                yield dot + "bias", module.bias
            continue
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield dot + name, p


def int8_weight_names(model: nn.Module) -> frozenset[str]:
    """Names (as named_parameters() gives them) of the weights the model serves as int8 panels."""
    return frozenset(prefix if isinstance(module, PanelStack) else f"{prefix}.weight"
                     for prefix, module in model.named_modules()
                     if isinstance(module, (PanelLinear, PanelEmbedding, PanelStack)) and module.scales is not None)


def logical_numel(model: nn.Module) -> int:
    """The model's parameter count without the panels' padding (and without unpacking)."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, PanelLinear):
            total += module.in_features * module.out_features
        elif isinstance(module, PanelEmbedding):
            total += module.num_embeddings * module.embedding_dim
        elif isinstance(module, PanelStack):
            experts, n, k = module.shape
            total += experts * n * k
        for name, p in module.named_parameters(recurse=False):
            if name not in ("panels", "scales") and id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total
