"""int8 weights (`--quantization int8`, executors/cpu_kernels/qpanels.py).

The int8 kernels turn each weight into (float)q * scale as they load it and must then compute
exactly what the float32 kernels compute over the panels of those dequantized weights, on
every path (the dot products of up to 6 rows, with AVX2 and with AVX-512 where the CPU has
it, and the dequantized tiles past that), bit for bit.
A served model must match transformers loaded with the same dequantized weights within 1e-4
(float32), through a real server and the real client, and the int8 fast path must match the
reference forward over the same weights.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from client import DecodeInput, ExecutorClient, PrefillInput
from executors.cpu_kernels import cpu_kernels
from executors.cpu_kernels.panels import pack
from executors.cpu_kernels.qpanels import Q8PANEL, QGROUP, QPanels, quantize, quantize_rows
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import fused_decode
from executors.types import DecodeInput as Decode
from executors.types import PrefillInput as Prefill
from service.config import ServeConfig, parse_args
from tests.conftest import start_server
from tests.models.test_cpu_paths import BLOCK, tiny_model
from tests.models.test_cpu_paths import VOCAB as TINY_VOCAB
from tests.models.tiny_models import VOCAB, build

TOL = 1e-4
kernels = cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the CPU kernels cannot be built here")
rng = np.random.default_rng(29)


def test_quantize_gives_a_q8_0_checkpoint_back_exactly():
    """A Q8_0 GGUF dequantized to float32 (gguf_import) quantizes back to its own q and scales."""
    torch.manual_seed(0)
    n, groups = 10, 5
    q = torch.randint(-127, 128, (n, groups, QGROUP), dtype=torch.int8)
    q[:, :, 3] = torch.where(torch.rand(n, groups) < 0.5, 127, -127).to(torch.int8)  # llama.cpp: max |q| is 127
    d = (torch.rand(n, groups) * 0.01 + 1e-4).half().float()
    q[2, 1] = 0
    d[2, 1] = 0  # an all-zero group
    w = (q.float() * d[..., None]).view(n, groups * QGROUP)
    got_q, got_scales = quantize_rows(w)
    assert torch.equal(got_q, q.view(n, -1)) and torch.equal(got_scales, d)


def test_quantize_error_is_half_a_step_and_non_finite_weights_are_refused():
    w = torch.randn(17, 70) * torch.logspace(-3, 1, 70)  # groups of very different ranges, k not a multiple of 32
    p = quantize(w)
    assert p.data.dtype == torch.int8 and p.data.shape == (2, 70, Q8PANEL) and p.scales.shape == (2, 3, Q8PANEL)
    step = p.scales.transpose(1, 2).reshape(-1, 3)[:17].repeat_interleave(QGROUP, dim=1)[:, :70]
    assert ((p.unpack() - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(p.embedding(torch.tensor([16, 0, 5, 6])), p.unpack()[[16, 0, 5, 6]])
    assert torch.equal(p.rows(16, 17).unpack(), p.unpack()[16:])
    assert torch.equal(p.unpack(3, 12), p.unpack()[3:12])
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.tensor([[1.0, float("nan")]]))


@pytest.mark.parametrize("n, k", [(13, 50), (49, 576), (40, 33), (1, 1), (112, 96)])
def test_int8_kernels_compute_exactly_the_float32_kernels_over_the_dequantized_weights(n, k, isa):
    torch.manual_seed(n * k)
    w = quantize(torch.randn(n, k))
    dense = w.dequantized()
    bias = torch.randn(n)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64, 130):  # dot products to 6 rows, tiles past
        x, residual = torch.randn(m, k), torch.randn(m, n)
        for b, r in ((bias, residual), (None, None)):
            got = kernels.linear(x, w, b, r)
            assert torch.equal(got, kernels.linear(x, dense, b, r)), (m, b is None)
        torch.testing.assert_close(got, x @ w.unpack().T, atol=1e-4, rtol=1e-5)
    view = w.rows(Q8PANEL, n) if n > Q8PANEL else w
    x = torch.randn(3, k)
    assert torch.equal(kernels.linear(x, view), kernels.linear(x, pack(w.unpack()[n - view.n:])))


@needs_kernels
def test_int8_kernels_refuse_weights_not_laid_out_as_they_read_them():
    w = quantize(torch.randn(12, 64))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="w.scales"):
        kernels.linear(x, QPanels(w.data, w.scales[:, :1], w.n))
    with pytest.raises(TypeError, match="w.data"):
        kernels.linear(x, QPanels(w.data.to(torch.uint8), w.scales, w.n))
    six = pack(torch.zeros(12, 64, dtype=torch.int8)).data  # the float32 kernels' 6-column layout
    with pytest.raises(ValueError, match="panels of 16 columns"):
        kernels.linear(x, QPanels(six, w.scales, w.n))


class Pair:
    """An int8 model's fast executor and its reference (which reads the dequantized weights)."""

    def __init__(self, family: str) -> None:
        model = tiny_model(family)
        model.quantize_weights = True
        cfg = LlmExecutorConfig(model_dir=f"/nonexistent/{family}", block_size=BLOCK, num_blocks=160,
                                quantization="int8")
        self.fast = LlmExecutor(cfg, model)
        self.ref = LlmExecutor(cfg, model, reference=True)
        self.loop = asyncio.new_event_loop()

    def both(self, method: str, *args):
        return [self.loop.run_until_complete(getattr(ex, method)(*args)) for ex in (self.fast, self.ref)]

    def close(self) -> None:
        for ex in (self.fast, self.ref):
            ex.worker.close()
        self.loop.close()


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "op-by-op"])
# gemma2 and olmo2: the one-call step's output norms (and OLMo's q/k norms across heads) over int8
# matrices; stablelm_parallel: LayerNorms with biases, attention and the MLP in parallel; starcoder2:
# an ungated MLP.
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "olmo2", "stablelm_parallel",
                                    "starcoder2"])
def test_int8_fast_path_matches_the_reference_over_the_same_weights(family, one_call, isa, monkeypatch):
    monkeypatch.setattr(fused_decode, "FUSED_DECODE", one_call)
    p = Pair(family)
    try:
        assert p.fast.model.fused_decode is not None
        tokens = lambda n: rng.integers(0, TINY_VOCAB, size=n).tolist()
        outs = p.both("batch_prefill", [Prefill(input_ids=tokens(n)) for n in (1, 5, 9, 9, 16, 23, 3, 40)])
        for a, b in zip(*outs):
            np.testing.assert_allclose(a.logits.logits.array, b.logits.logits.array, atol=TOL, rtol=0)
        handles = [o.kv_cache for o in outs[0]]
        for rows in (8, 3, 1):  # 8 rows: the dequantized tiles; fewer: the dot products
            a, b = p.both("batch_decode", [Decode(token_id=t, kv_cache=h) for t, h in zip(tokens(rows), handles)])
            for x, y in zip(a, b):
                np.testing.assert_allclose(x.logits.logits.array, y.logits.logits.array, atol=TOL, rtol=0)
            handles = [x.kv_cache for x in a] + handles[rows:]
    finally:
        p.close()


@needs_kernels
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss", "granitemoeshared", "deepseek_v3"])
def test_int8_experts_match_the_reference_over_the_same_weights(family, tmp_path):
    """A mixture of experts' routed and shared experts are int8 panels too, run expert by expert
    (GPT-OSS's and Granite's stacked experts: each expert's matrices of the stacks)."""
    build(family, tmp_path / family)
    cfg = LlmExecutorConfig(model_dir=str(tmp_path / family), block_size=BLOCK, num_blocks=160, quantization="int8")
    fast = LlmExecutor(cfg)
    ref = LlmExecutor(cfg, fast.model, reference=True)
    loop = asyncio.new_event_loop()
    both = lambda method, *args: [loop.run_until_complete(getattr(ex, method)(*args)) for ex in (fast, ref)]  # noqa: E731
    try:
        moe = next(w.moe for w in fast.model.fused if w.moe is not None)
        shared = [moe.shared_panels] if family in ("qwen2_moe", "granitemoeshared", "deepseek_v3") else []
        assert moe.gate_up is None and all(type(p) is QPanels for pair in [*moe.expert_panels, *shared]
                                           for p in pair)
        outs = both("batch_prefill", [Prefill(input_ids=rng.integers(0, VOCAB, size=n).tolist()) for n in (1, 7, 19)])
        for a, b in zip(*outs):
            np.testing.assert_allclose(a.logits.logits.array, b.logits.logits.array, atol=TOL, rtol=0)
        handles = [o.kv_cache for o in outs[0]]
        for _ in range(2):
            a, b = both("batch_decode", [Decode(token_id=5, kv_cache=h) for h in handles])
            for x, y in zip(a, b):
                np.testing.assert_allclose(x.logits.logits.array, y.logits.logits.array, atol=TOL, rtol=0)
            handles = [x.kv_cache for x in a]
    finally:
        for ex in (fast, ref):
            ex.worker.close()
        loop.close()


class Served:
    """A tiny checkpoint served with --quantization int8, and transformers holding the same
    (dequantized) weights."""

    def __init__(self, family: str, root) -> None:
        self.oracle = build(family, root / family)
        self.running = start_server(ServeConfig(port=0, model=str(root / family), quantization="int8",
                                                block_size=4, num_blocks=256))
        self.executor = self.running.server.executor
        weights = dict(self.executor.model.logical_parameters())
        missing, unexpected = self.oracle.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        self.client = ExecutorClient(self.running.address, timeout=60)

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.oracle(torch.tensor([tokens])).logits[0].float().numpy()

    def close(self) -> None:
        self.client.close()
        self.running.stop()


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def served(request, tmp_path_factory):
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built here")
    s = Served(request.param, tmp_path_factory.mktemp("int8"))
    yield s
    s.close()


def test_served_int8_model_matches_transformers_on_the_dequantized_weights(served):
    info = served.client.info()
    assert info.metadata["weight_quantization"].string_value == "int8"
    seqs = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 12, 7, 9, 3, 11, 6, 8)]
    outs = served.client.batch_prefill([PrefillInput(input_ids=s) for s in seqs])
    handles = []
    for seq, out in zip(seqs, outs):
        np.testing.assert_allclose(out.logits.logits, served.logits(seq)[-1], atol=TOL, rtol=0)
        handles.append(out.kv_cache)
    for step in range(3):  # 8 rows (the dequantized tiles), then one row (the dot products)
        rows = handles if step < 2 else handles[:1]
        nexts = rng.integers(0, VOCAB, size=len(rows)).tolist()
        outs = served.client.batch_decode([DecodeInput(token_id=t, kv_cache=h) for t, h in zip(nexts, rows)])
        for i, (t, out) in enumerate(zip(nexts, outs)):
            seqs[i] = seqs[i] + [t]
            np.testing.assert_allclose(out.logits.logits, served.logits(seqs[i])[-1], atol=TOL, rtol=0)
            handles[i] = out.kv_cache
    for h in handles:
        served.client.release_cache(h.cache_id)


def test_int8_weights_take_about_a_quarter_of_the_memory(served):
    quantized = served.executor._param_bytes
    plain = sum(p.numel() * 4 for _, p in served.executor.model.logical_parameters())
    embedding = served.executor.model.model.embed_tokens
    untied = embedding.weight.numel() * 4 if not served.executor.model_config.tie_word_embeddings else 0
    assert quantized < 0.32 * (plain - untied) + untied, (quantized, plain)


@pytest.mark.parametrize("flags, words", [
    (["--quantization", "int8", "--dtype", "bfloat16"], "--dtype float32"),
    (["--quantization", "int8", "--device", "cuda"], "--device cpu"),
    (["--quantization", "int8", "--no-cpu-kernels"], "CPU kernels"),
    (["--quantization", "int4"], "invalid choice"),
    (["--executor", "paged", "--quantization", "int8"], "--quantization is a flag of --executor llm"),
])
def test_int8_is_refused_where_it_cannot_run(flags, words, capsys):
    with pytest.raises((ValueError, SystemExit)) as raised:
        parse_args(flags)
    message = str(raised.value) if raised.type is ValueError else capsys.readouterr().err
    assert words in message, message


@needs_kernels
def test_k_and_v_never_move_between_int8_and_float32_executors():
    """Their logits differ, so their K and V do: the weights' digest (of the dequantized
    weights) tells them apart, and an import names it."""
    loop = asyncio.new_event_loop()
    executors = []
    try:
        for quantized in (False, True):
            model = tiny_model("llama")
            model.quantize_weights = quantized
            executors.append(LlmExecutor(LlmExecutorConfig(
                model_dir="/nonexistent/llama", block_size=BLOCK, num_blocks=32,
                quantization="int8" if quantized else "none"), model))
        plain, int8 = (loop.run_until_complete(ex.kv_fingerprint()) for ex in executors)
        assert plain.model_id == int8.model_id and plain.weights_digest != int8.weights_digest
        assert "weights_digest" in int8.mismatch(plain)
    finally:
        for ex in executors:
            ex.worker.close()
        loop.close()


@needs_kernels
def test_lora_adapters_over_int8_weights_match_peft_on_the_dequantized_weights(tmp_path):
    """An adapter's deltas add to what the int8 matmuls compute (the op-by-op path, as any
    step with LoRA rows): transformers + PEFT over the same dequantized base weights."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base = build("qwen3", tmp_path / "base")
    torch.manual_seed(31)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False),
                   adapter_name="wide").save_pretrained(tmp_path / "saved")
    (tmp_path / "loras").mkdir()
    (tmp_path / "saved" / "wide").rename(tmp_path / "loras" / "wide")
    running = start_server(ServeConfig(port=0, model=str(tmp_path / "base"), quantization="int8", block_size=4,
                                       num_blocks=128, lora_dir=str(tmp_path / "loras"), max_loras=1, max_lora_rank=8))
    try:
        oracle = build("qwen3", tmp_path / "again")  # the same seed: the same float32 base
        oracle.load_state_dict(dict(running.server.executor.model.logical_parameters()), strict=False)
        oracle = PeftModel.from_pretrained(oracle, tmp_path / "loras" / "wide").eval()
        with ExecutorClient(running.address, timeout=60) as c:
            prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 4)]
            outs = c.batch_prefill([PrefillInput(p, lora_adapter="wide") for p in prompts]
                                   + [PrefillInput(prompts[0])])
            steps = c.batch_decode([DecodeInput(3, o.kv_cache) for o in outs])
            with torch.no_grad():
                for p, o, s in zip(prompts, outs, steps):
                    want = oracle(torch.tensor([p + [3]])).logits[0].float().numpy()
                    np.testing.assert_allclose(o.logits.logits, want[-2], atol=TOL, rtol=0)
                    np.testing.assert_allclose(s.logits.logits, want[-1], atol=TOL, rtol=0)
                with oracle.disable_adapter():  # the row without an adapter: the int8 base alone
                    want = oracle(torch.tensor([prompts[0] + [3]])).logits[0].float().numpy()
            np.testing.assert_allclose(steps[2].logits.logits, want[-1], atol=TOL, rtol=0)
            for s in steps:
                c.release_cache(s.kv_cache)
    finally:
        running.stop()
