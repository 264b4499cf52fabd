"""float32 CPU models with the kernels: the matmul weights stored once, as panels
(executors/models/panel_modules.py). What must hold: no row-major copy left behind, the
checkpoint's view of the weights unchanged (names, values, count, digest), the reference
forward still reading the same weights, a tensor-parallel rank's slice of a tied embedding
served from the panels (or, where no panel starts there, a copy status counts), and a move
to another dtype restoring plain modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from executors.cpu_kernels import cpu_kernels
from executors.cpu_kernels.panels import PANEL
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models.attention import Segment, StepContext
from executors.models.decoder import DecoderLM
from executors.models.panel_modules import PanelEmbedding, PanelLinear, PanelStack
from tests.models.test_cpu_paths import FAMILIES, TOL, tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build here "
                                "(tests/models/test_cpu_kernels.py says why)")


def forward(model: DecoderLM, tokens: list[int], reference: bool = False) -> torch.Tensor:
    n = len(tokens)
    ctx = StepContext([Segment(0, n, 0)], reference=reference)
    return model.logits(model.hidden_states(torch.tensor(tokens), torch.arange(n), ctx), reference=reference)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_panels_are_the_only_copy(family):
    model = tiny_model(family)
    logical = sum(p.numel() for p in model.parameters())
    model.fuse()
    assert model.cpu_kernels is not None and model.head_panels is not None
    # (an untied embedding is no matmul's; DeepSeek's kv_b_proj is read per head by batched matmuls)
    assert not [name for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)
                and not (name == "model.embed_tokens" and not model.config.tie_word_embeddings)
                and not name.endswith("self_attn.kv_b_proj")]
    attn = model.model.layers[0].self_attn
    first, *others = (getattr(attn, name) for name in attn.fused_names)  # DeepSeek's: q_a_proj (q_proj), kv_a_proj
    assert all(p.panels is first.panels for p in others)  # one fused q/k/v
    assert model.fused[0].qkv.data.data_ptr() == first.panels.data_ptr()
    if model.fused[0].q_b is not None:
        assert model.fused[0].q_b.data.data_ptr() == attn.q_b_proj.panels.data_ptr()
    if model.config.tie_word_embeddings:
        assert isinstance(model.model.embed_tokens, PanelEmbedding)
        assert model.head_panels.data.data_ptr() == model.model.embed_tokens.panels.data_ptr()
    stored = sum(p.numel() for p in model.parameters())
    padding = stored - logical
    stacks = sum(m.shape[0] * m.shape[2] for m in model.modules() if isinstance(m, PanelStack))  # experts x inputs
    assert 0 <= padding < 16 * sum(m.in_features for m in model.modules() if isinstance(m, PanelLinear)) + 16 * 64 \
        + 16 * stacks
    assert model.num_parameters() == logical and model.packed_bytes() == 0
    # One allocation (host_memory's huge pages when large enough) holds every packed weight.
    arenas = {m.panels.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, (PanelLinear, PanelStack))}
    assert arenas == {model.head_panels.data.untyped_storage().data_ptr()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_reference_forward_reads_the_same_weights(family):
    model = tiny_model(family)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    before = forward(model, tokens, reference=True)  # unfused, plain modules
    model.fuse()
    torch.testing.assert_close(forward(model, tokens, reference=True), before, atol=1e-5, rtol=0)
    torch.testing.assert_close(forward(model, tokens), before, atol=TOL, rtol=0)


def test_the_digest_does_not_depend_on_the_layout():
    digests = []
    for kernels in (True, False):
        model = tiny_model("llama")
        model.use_cpu_kernels = kernels
        ex = LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/llama", num_blocks=16, cpu_kernels=kernels), model)
        try:
            assert (model.head_panels is not None) == kernels
            digests.append(ex._weights_digest())
            assert ex.info().num_parameters == model.num_parameters()
        finally:
            ex.worker.close()
    assert digests[0] == digests[1]


@pytest.mark.parametrize("rows", [(18, 150), (150, 300), (10, 150)])
def test_a_rank_slice_of_a_tied_embedding(rows):
    """Tensor parallelism: this rank's lm_head is rows [lo, hi) of the tied embedding. A
    slice that starts on a panel boundary is a view of the embedding's panels; one that does
    not is packed as a copy, and packed_bytes (hence status) counts it."""
    full = tiny_model("llama")
    model = DecoderLM(full.config, head_rows=rows)
    model.load_state_dict(full.state_dict())
    model.eval().fuse()
    lo, hi = rows
    embed = full.model.embed_tokens.weight.detach()
    hidden = torch.randn(5, full.config.hidden_size)
    torch.testing.assert_close(model.logits(hidden), F.linear(hidden, embed[lo:hi]), atol=1e-5, rtol=1e-5)
    if lo % PANEL == 0:
        assert not model.head_copy and model.packed_bytes() == 0
        assert model.head_panels.data.data_ptr() == model.model.embed_tokens.panels[lo // PANEL].data_ptr()
    else:
        assert model.head_copy and model.packed_bytes() == model.head_panels.nbytes > 0
        assert type(model.model.embed_tokens) is nn.Embedding


def test_moving_restores_plain_modules():
    model = tiny_model("qwen2").fuse()
    tokens = [7, 3, 9]
    before = forward(model, tokens)
    model.to(torch.float64)  # not a dtype the kernels take: row-major views of the fused tensors again
    assert model.head_panels is None and model.cpu_kernels is None
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == model.fused[0].qkv.data_ptr()
    model.to(torch.float32)  # and panels once more
    assert isinstance(model.model.layers[0].self_attn.q_proj, PanelLinear)
    torch.testing.assert_close(forward(model, tokens), before, atol=1e-6, rtol=0)


def test_an_embedding_lookup_out_of_range_is_refused():
    model = tiny_model("llama").fuse()
    with pytest.raises(IndexError, match=r"\[0, 300\)"):
        model.model.embed_tokens(torch.tensor([1, 300]))
    with pytest.raises(IndexError):
        model.model.embed_tokens(torch.tensor([-1]))


def test_loading_a_state_dict_into_panels_says_what_to_do():
    model = tiny_model("qwen3").fuse()
    with pytest.raises(RuntimeError, match="stored as panels"):
        model.load_state_dict(model.state_dict())


@pytest.mark.parametrize("family", ["gpt_oss", "granitemoeshared"])
def test_stacked_experts_move_back_to_tensors_and_panels_again(family):
    """GPT-OSS's and Granite's stacked experts: packed as PanelStacks, tensors again (in their
    parameters' order) when the model moves, packed once more; the digest's names, order and
    values the unpacked model's throughout."""
    model = tiny_model(family)
    plain = [(name, t.detach().clone()) for name, t in model.named_parameters()]
    model.fuse()
    experts = model.model.layers[0].mlp.experts if family == "gpt_oss" else model.model.layers[0].block_sparse_moe.experts
    assert isinstance(experts.gate_up_proj, PanelStack) and isinstance(experts.down_proj, PanelStack)
    tokens = [7, 3, 9, 4]
    before = forward(model, tokens)

    def same_as_plain():
        got = list(model.logical_parameters())
        assert [n for n, _ in got] == [n for n, _ in plain]
        for (_, a), (_, b) in zip(got, plain):
            torch.testing.assert_close(a, b, atol=0, rtol=0)

    same_as_plain()
    model.to(torch.float64)  # not the kernels' dtype: the stacks are parameters again
    assert isinstance(experts.gate_up_proj, nn.Parameter)
    assert [n for n, _ in experts.named_parameters()][:2] == ["gate_up_proj", "down_proj"]
    model.to(torch.float32)
    assert isinstance(experts.gate_up_proj, PanelStack)
    same_as_plain()
    torch.testing.assert_close(forward(model, tokens), before, atol=1e-6, rtol=0)
