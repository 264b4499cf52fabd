"""The KV pool sized from device memory (executors/kv_sizing.py): the arithmetic, the warm-up
forward through a fake device on CPU, the config and flags, and the real CUDA probe."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from executors.kv_sizing import (
    CPU_NUM_BLOCKS,
    MAX_AUTO_BLOCKS,
    MemoryFigures,
    kv_blocks_for_memory,
    kv_bytes_per_block,
    lora_reserve_bytes,
    measure,
)
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.lora import LoraTargets
from executors.models.config import DecoderConfig
from executors.models.decoder import DecoderLM
from executors.models.layers import RotaryEmbedding
from executors.types import DecodeInput, PrefillInput
from kvcache.kv_pool import PagedKvPool
from service.config import ServeConfig, parse_args
from service.server import build_executor
from tests.models.test_cpu_paths import tiny_model

MIB = 1 << 20
GIB = 1 << 30


# -- the arithmetic ------------------------------------------------------------------------
def test_blocks_fill_the_fraction_left_after_weights_and_activations():
    blocks = kv_blocks_for_memory(total_bytes=80 * GIB, used_bytes=10 * GIB, activation_bytes=2 * GIB,
                                  memory_fraction=0.9, bytes_per_block=MIB)
    assert blocks == 60 * 1024  # 72 GiB of 80 GiB, less 12 GiB


def test_fraction_and_reserve_shrink_the_pool():
    common = {"total_bytes": 10 * GIB, "used_bytes": GIB, "activation_bytes": GIB, "bytes_per_block": MIB}
    assert kv_blocks_for_memory(memory_fraction=1.0, **common) == 8 * 1024
    assert kv_blocks_for_memory(memory_fraction=0.5, **common) == 3 * 1024
    assert kv_blocks_for_memory(memory_fraction=0.5, reserved_bytes=GIB, **common) == 2 * 1024
    # A partial block does not count.
    assert kv_blocks_for_memory(memory_fraction=1.0, **{**common, "bytes_per_block": 3 * MIB}) == 8 * 1024 // 3


def test_cap_bounds_the_pool():
    common = {"total_bytes": 10 * GIB, "used_bytes": 0, "activation_bytes": 0, "memory_fraction": 1.0,
              "bytes_per_block": MIB}
    assert kv_blocks_for_memory(max_blocks=100, **common) == 100
    assert kv_blocks_for_memory(max_blocks=10**9, **common) == 10 * 1024


def test_refuses_when_one_max_length_sequence_does_not_fit():
    common = {"total_bytes": 8 * GIB, "used_bytes": 5 * GIB, "activation_bytes": 2 * GIB, "memory_fraction": 0.9,
              "bytes_per_block": 2 * MIB}
    left = (int(8 * GIB * 0.9) - 7 * GIB) // (2 * MIB)  # 102 blocks
    assert kv_blocks_for_memory(min_blocks=left, **common) == left
    with pytest.raises(ValueError) as e:
        kv_blocks_for_memory(min_blocks=left + 1, **common)
    msg = str(e.value)
    for figure in ("total 8.00 GiB", "weights and other use 5.00 GiB", "activations 2.00 GiB", "fraction 0.9",
                   f"{2 * MIB} bytes per block", f"room for {left} blocks", f"needs {left + 1} blocks"):
        assert figure in msg, (figure, msg)
    # Used memory beyond the fraction: no room at all, still a precise refusal.
    with pytest.raises(ValueError, match="room for 0 blocks"):
        kv_blocks_for_memory(**{**common, "used_bytes": 8 * GIB})
    with pytest.raises(ValueError, match="LoRA reserve 1.00 GiB"):
        kv_blocks_for_memory(min_blocks=left, reserved_bytes=GIB, **common)


@pytest.mark.parametrize("fraction", [0, -0.1, 1.01, float("nan")])
def test_bad_fraction_is_refused(fraction):
    with pytest.raises(ValueError, match="memory_fraction"):
        kv_blocks_for_memory(total_bytes=GIB, used_bytes=0, activation_bytes=0, memory_fraction=fraction,
                             bytes_per_block=MIB)


def test_bytes_per_block_is_the_pools():
    for dtype in (torch.float32, torch.bfloat16):
        pool = PagedKvPool(3, 2, 16, 2, 32, dtype)
        assert kv_bytes_per_block(3, 2, 32, dtype, 16) == pool.bytes_per_block


def test_lora_reserve_is_max_loras_full_rank_adapters():
    targets = LoraTargets(num_layers=2, shapes={"q_proj": (8, 8), "down_proj": (16, 8)})
    assert lora_reserve_bytes(targets, 3, 4, torch.float32) == 3 * 4 * 2 * (16 + 24) * 4
    assert lora_reserve_bytes(targets, 0, 4, torch.float32) == 0


# -- the probe and the warm-up --------------------------------------------------------------
class FakeDevice:
    """A MemoryProbe over a pretend device: fixed totals, a warm-up that peaks at `activations`
    above what was allocated before it. `events` records the calls in order."""

    def __init__(self, total: int, used: int, activations: int) -> None:
        self.total, self.used, self.activations = total, used, activations
        self.events: list[str] = []
        self.allocated = 100 * MIB

    def total_bytes(self) -> int:
        return self.total

    def used_bytes(self) -> int:
        self.events.append("used")
        return self.used

    def allocated_bytes(self) -> int:
        return self.allocated

    def reset_peak(self) -> None:
        self.events.append("reset_peak")

    def peak_allocated_bytes(self) -> int:
        self.events.append("peak")
        return self.allocated + self.activations

    def release_cached(self) -> None:
        self.events.append("release")


def test_measure_reads_the_peak_around_the_warmup():
    probe = FakeDevice(total=GIB, used=300 * MIB, activations=40 * MIB)
    figures = measure(probe, lambda: probe.events.append("warmup"))
    assert figures == MemoryFigures(total=GIB, used=300 * MIB, activations=40 * MIB)
    assert probe.events == ["release", "reset_peak", "warmup", "peak", "release", "used"]


def spy(model):
    """Record the shapes of the model's forwards and lm_head calls."""
    calls = {"hidden": [], "logits": []}
    hidden_states, logits = model.hidden_states, model.logits

    def recording_hidden(ids, positions, ctx):
        calls["hidden"].append((ids.shape[0], int(positions.max()), [(s.q_start, s.q_len, s.start)
                                                                      for s in ctx.segments], ctx.pool))
        return hidden_states(ids, positions, ctx)

    def recording_logits(hidden, reference=False):
        calls["logits"].append(hidden.shape[0])
        return logits(hidden, reference=reference)

    model.hidden_states, model.logits = recording_hidden, recording_logits
    return calls


def test_auto_pool_is_sized_from_a_warmup_forward_on_a_fake_device():
    model = tiny_model("llama").fuse()
    calls = spy(model)
    probe = FakeDevice(total=16 * MIB, used=4 * MIB, activations=MIB)
    cfg = LlmExecutorConfig(model_dir="/nonexistent/tiny", block_size=4, max_batch_size=8, kv_memory_fraction=0.8)
    ex = LlmExecutor(cfg, model, memory_probe=probe)
    try:
        # The warm-up: max_batch_size 128-token prompts (1024 tokens), laid out as two
        # max-length (512) sequences without a pool, then the lm_head on a full batch.
        assert calls["hidden"] == [(1024, 511, [(0, 512, 0), (512, 512, 0)], None)]
        assert calls["logits"] == [8]
        mc = model.config
        per_block = kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, 4)
        reserve = lora_reserve_bytes(LoraTargets.from_config(mc), cfg.max_loras, cfg.max_lora_rank, torch.float32)
        expected = (int(16 * MIB * 0.8) - 5 * MIB - reserve) // per_block
        assert expected > 512 // 4
        assert ex.pool.num_blocks == ex.kv.allocator.num_total == expected
        assert ex.pool.bytes_per_block == per_block
        assert ex.capabilities().kv_total_blocks == expected
        assert ex.status().kv_pool.total_blocks == expected
    finally:
        ex.worker.close()


def test_auto_pool_refuses_a_device_too_small_for_one_sequence():
    # 0.9 * 8 MiB - 6 MiB - 1 MiB: room for 102 blocks of 2 KiB; 512 positions need 128.
    probe = FakeDevice(total=8 * MIB, used=6 * MIB, activations=MIB)
    cfg = LlmExecutorConfig(model_dir="/nonexistent/tiny", block_size=4, max_batch_size=2, max_loras=0)
    with pytest.raises(ValueError, match=r"total 8.00 MiB - weights and other use 6.00 MiB - activations 1.00 MiB "
                                         r"leaves 204.80 KiB, room for 102 blocks of 2048 bytes per block; "
                                         r"one max-length sequence needs 128 blocks"):
        LlmExecutor(cfg, tiny_model("llama"), memory_probe=probe)


def test_auto_on_cpu_keeps_the_default_without_a_warmup():
    model = tiny_model("llama").fuse()
    calls = spy(model)
    ex = LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/tiny", block_size=4), model)
    try:
        assert ex.pool.num_blocks == CPU_NUM_BLOCKS == 1024 and calls["hidden"] == []
    finally:
        ex.worker.close()


def test_explicit_num_blocks_skips_the_probe():
    probe = FakeDevice(total=GIB, used=0, activations=0)
    ex = LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/tiny", block_size=4, num_blocks=33),
                     tiny_model("llama"), memory_probe=probe)
    try:
        assert ex.pool.num_blocks == 33 and probe.events == []
    finally:
        ex.worker.close()


# -- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"kv_memory_fraction": 0.0}, {"kv_memory_fraction": 1.5},
                                 {"kv_memory_fraction": float("nan")}, {"num_blocks": 0}])
def test_config_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LlmExecutorConfig(model_dir="/nonexistent", **bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServeConfig(**bad)


def test_flags():
    assert LlmExecutorConfig(model_dir="m").num_blocks is None
    default = parse_args([])
    assert (default.num_blocks, default.kv_memory_fraction) == (None, 0.9)
    given = parse_args(["--num-blocks", "77", "--kv-memory-fraction", "0.5"])
    assert (given.num_blocks, given.kv_memory_fraction) == (77, 0.5)
    with pytest.raises(SystemExit):
        parse_args(["--kv-memory-fraction", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--num-blocks", "0"])


def test_paged_executor_keeps_its_default_pool():
    ex = build_executor(ServeConfig(executor="paged"))
    try:
        assert ex.capabilities().kv_total_blocks == 1024
    finally:
        ex.worker.close()
    ex = build_executor(ServeConfig(executor="paged", num_blocks=40))
    try:
        assert ex.capabilities().kv_total_blocks == 40
    finally:
        ex.worker.close()


# -- the real device ----------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_probe_sizes_a_pool_that_fits():
    # Enough KV per token (8 KiB in bfloat16) that even a large GPU stays under the block cap.
    cfg = DecoderConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DecoderLM(cfg).to(torch.bfloat16)
        model.rope = RotaryEmbedding(cfg)  # float32 tables, as the loader builds them
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.eval()
    config = LlmExecutorConfig(model_dir="/nonexistent/cuda", device="cuda", kv_memory_fraction=0.5, max_loras=0)
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    if free_before < 0.6 * total:
        pytest.skip("the GPU is busy: less than 60% of it is free")
    ex = LlmExecutor(config, model)
    try:
        blocks = ex.pool.num_blocks
        assert math.ceil(4096 / 16) <= blocks < MAX_AUTO_BLOCKS  # sized by memory, not by the cap
        # Within the fraction, with the pool allocated, and the device not full.
        free_after, _ = torch.cuda.mem_get_info()
        assert total - free_after <= 0.5 * total + 64 * MIB, (total, free_after, blocks)
        assert ex.pool.total_bytes < free_before
        # A real step runs on it.
        loop = asyncio.new_event_loop()
        out = loop.run_until_complete(ex.prefill(PrefillInput(input_ids=list(range(1, 300)))))
        step = loop.run_until_complete(ex.decode(DecodeInput(token_id=7, kv_cache=out.kv_cache)))
        assert step.kv_cache.sequence_length == 300
        loop.close()
    finally:
        ex.worker.close()
        del ex
        torch.cuda.empty_cache()


def test_a_block_of_rows_that_are_their_own_values_takes_half():
    """DeepSeek's latent rows: the pool holds K alone (kvcache.kv_pool's values_are_keys)."""
    from executors.kv_sizing import kv_bytes_per_block

    both = kv_bytes_per_block(61, 1, 576, torch.bfloat16, 16)
    assert both == 2 * 61 * 576 * 2 * 16 and kv_bytes_per_block(61, 1, 576, torch.bfloat16, 16, True) * 2 == both
