"""Moving KV caches to and from a tensor-parallel executor (executors/parallel/kv_ranks.py).

A two-rank server (`--tensor-parallel-size 2`, gloo) and a single-process server of the same
checkpoint name their weights alike, so caches move between them both ways: the chunks a
moved cache exports again are the bytes it came with (the heads put back in order from the
ranks, or sent to the ranks that hold them), and its next decode steps give the origin's
logits within the two executors' summation orders. Covered: two KV heads on two ranks, one
KV head replicated on both, bfloat16 pools (K and V as raw bytes on gloo) and int8 weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.service_process import stop
from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput
from executors.cpu_kernels import cpu_kernels
from executors.kv_transfer import digest_tensors
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models.config import DecoderConfig
from executors.models.loader import checkpoint_parameters
from executors.models.panel_modules import int8_weight_names
from executors.parallel.shard import ShardPlan
from service.config import ServeConfig
from tests.conftest import start_server
from tests.models.tiny_models import VOCAB, build
from tests.test_tensor_parallel import BLOCK, build_mqa, serve_tp

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
FULL = LogitsPolicy.full()
rng = np.random.default_rng(53)


@pytest.mark.parametrize(("kv_heads", "world", "owners"), [(2, 2, [0, 1]), (4, 2, [0, 1]), (1, 2, [0]),
                                                            (2, 4, [0, 2]), (1, 4, [0])])
def test_each_kv_head_is_read_from_one_rank_that_holds_it(kv_heads, world, owners):
    config = DecoderConfig.from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64,
                                          hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=kv_heads))
    plans = [ShardPlan(config, r, world) for r in range(world)]
    assert plans[0].kv_head_owners() == owners
    heads = [h for r in owners for h in range(plans[r].first_kv_head, plans[r].first_kv_head + plans[r].kv_heads)]
    assert heads == list(range(kv_heads))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2_moe", "mixtral", "gemma3", "phi3", "phi4_mini",
                                    "granite", "glm4", "cohere", "stablelm", "starcoder2", "phi",
                                    "glm4_moe", "mistral3", "minimax_m2", "command_r_plus", "qwen2_5_vl", "gpt_oss",
                                    "granitemoe", "granitemoeshared", "deepseek_v3", "deepseek_v2"])
def test_the_checkpoint_names_the_weights_as_the_loaded_model_does(family, tmp_path):
    """A tensor-parallel rank 0 digests the checkpoint; one process digests what it loaded."""
    build(family, tmp_path / family)
    kinds = [("float32", True, "none"), ("float32", False, "none"), ("bfloat16", False, "none")]
    if cpu_kernels() is not None:  # int8 weights run on the CPU kernels
        kinds.append(("float32", True, "int8"))
    for dtype, kernels, quantization in kinds:
        ex = LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path / family), num_blocks=16, dtype=dtype,
                                           cpu_kernels=kernels, quantization=quantization))
        try:
            int8 = int8_weight_names(ex.model)
            assert bool(int8) == (quantization == "int8")
            assert digest_tensors(checkpoint_parameters(tmp_path / family, ex.config.torch_dtype, int8)) \
                == ex._weights_digest(), (dtype, kernels, quantization)
        finally:
            ex.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-move")
    build("qwen3", root / "qwen3")
    build_mqa(root / "mqa")
    return {"qwen3": root / "qwen3", "mqa": root / "mqa"}


def chunks(c: ExecutorClient, handle) -> list[tuple[bytes, bytes]]:
    return [(m.chunk.key, m.chunk.value) for m in c.export_kv(handle, max_chunk_bytes=1024) if m.HasField("chunk")]


@pytest.mark.parametrize(("name", "dtype", "quantization"), [
    ("qwen3", "float32", "none"), ("mqa", "float32", "none"), ("qwen3", "bfloat16", "none"),
    pytest.param("qwen3", "float32", "int8", marks=pytest.mark.skipif(
        cpu_kernels() is None, reason="int8 weights run on the CPU kernels, which cannot be built here"))])
def test_caches_move_between_two_ranks_and_one_process(name, dtype, quantization, models):
    model_dir = models[name]
    one = start_server(ServeConfig(port=0, model=str(model_dir), quantization=quantization),
                       LlmExecutor(LlmExecutorConfig(model_dir=str(model_dir), block_size=BLOCK, num_blocks=128,
                                                     dtype=dtype, quantization=quantization)))
    tp = serve_tp(model_dir, "--dtype", dtype, "--quantization", quantization)
    # float32: the two executors sum in other orders; bfloat16 K and V round those differences.
    tol = 1e-5 if dtype == "float32" else 0.05
    try:
        with ExecutorClient(one.address, timeout=60) as a, ExecutorClient(tp.address, timeout=60) as b:
            assert b.capabilities().supports_kv_transfer
            prompt = rng.integers(0, VOCAB, size=11).tolist()
            origin = a.prefill(PrefillInput(prompt, logits_policy=FULL)).kv_cache
            sent = chunks(a, origin)
            assert len(sent) > 2  # several chunks, each of them a few layers' or positions' worth
            there = b.import_kv(a.export_kv(origin, max_chunk_bytes=1024), "moved").kv_cache
            assert there.sequence_length == len(prompt)
            assert chunks(b, there) == sent  # the heads came back from the ranks in order, bit for bit
            back = a.import_kv(b.export_kv(there), "back").kv_cache
            assert chunks(a, back) == sent
            native = b.prefill(PrefillInput(prompt, logits_policy=FULL)).kv_cache
            twin = b.import_kv(b.export_kv(native, max_chunk_bytes=1024), "twin").kv_cache  # ranks to ranks
            for t in rng.integers(0, VOCAB, size=3).tolist():
                want = a.decode(DecodeInput(t, origin, logits_policy=FULL))
                got = b.decode(DecodeInput(t, there, logits_policy=FULL))
                home = a.decode(DecodeInput(t, back, logits_policy=FULL))
                mine = b.decode(DecodeInput(t, native, logits_policy=FULL))
                copy = b.decode(DecodeInput(t, twin, logits_policy=FULL))
                np.testing.assert_allclose(got.logits.logits, want.logits.logits, atol=tol, rtol=0)
                np.testing.assert_allclose(got.logits.logits, mine.logits.logits, atol=tol, rtol=0)
                # The same executor over the same K and V: bit for bit in float32. (In bfloat16 a
                # step's attention rounds differently over contiguous and scattered blocks, moved
                # or not: a few bfloat16 ulps, as two prefills of one prompt show.)
                same = tol if dtype == "bfloat16" else 0
                np.testing.assert_allclose(home.logits.logits, want.logits.logits, atol=same, rtol=0)
                np.testing.assert_allclose(copy.logits.logits, mine.logits.logits, atol=same, rtol=0)
                origin, there, back = want.kv_cache, got.kv_cache, home.kv_cache
                native, twin = mine.kv_cache, copy.kv_cache
            for c in (a, b):
                for cache in c.list_caches():
                    c.release_cache(cache.cache_id)
                assert c.status().kv_pool.used_blocks == 0
    finally:
        stop(tp)
        one.stop()


def test_a_rank_reads_only_its_rows_of_a_fused_tensor(tmp_path):
    """RowWindow: rows [lo, hi) of a safetensors slice, sliced again as the whole part, the
    way ShardPlan.read cuts a rank's rows of q/k/v or gate/up out of Phi-3's and GLM-4's
    fused tensors without reading the rest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from executors.models.checkpoint_sections import RowWindow

    fused = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    save_file({"w": fused}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt", device="cpu") as f:
        window = RowWindow(f.get_slice("w"), 16, 32)  # a part: rows 16..31
        assert torch.equal(window[:], fused[16:32])
        assert torch.equal(window[4:8], fused[20:24])
        assert torch.equal(window[4:8, 1:], fused[20:24, 1:])
        assert torch.equal(window[10:], fused[26:32])
