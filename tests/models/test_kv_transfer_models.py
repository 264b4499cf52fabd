"""Moving caches of tiny real models (fp32 on the CPU) between two real servers.

Exported from one server and imported into another, a cache continues with bitwise the
logits of the original when both executors compute alike: same dtype, device kind, block
size and weight layouts. (On a CPU each executor times its float32 weight layouts at load,
cpu_layout.py, so two loads may sum in different orders; and the CPU attention reads whole
blocks, masked, so another block size sums over another padded length.) The bitwise pair
therefore shares one loaded model; a third server, loaded apart with another block size,
agrees within float32 rounding, and all within 1e-4 of transformers. A
cache bound to a LoRA adapter moves with its binding, and only to a server that has the
adapter; a server of other weights refuses the stream.
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
import torch

from client import DecodeInput, ExecutorClient, FailedPreconditionError, LogitsPolicy, NotFoundError, PrefillInput
from executors.llm import LlmExecutor, LlmExecutorConfig
from generated.modelexec.v1 import executor_pb2 as pb
from service.config import ServeConfig
from tests.conftest import start_server
from tests.models.tiny_models import VOCAB, build

FULL = LogitsPolicy.full()
rng = np.random.default_rng(41)


def serve(model_dir, block_size: int, lora_dir=None, model=None, dtype: str = "float32"):
    executor = LlmExecutor(LlmExecutorConfig(model_dir=str(model_dir), block_size=block_size, num_blocks=128,
                                             lora_dir=str(lora_dir) if lora_dir else None, max_loras=1,
                                             max_lora_rank=8, dtype=dtype), model)
    return start_server(ServeConfig(port=0, executor="llm", model=str(model_dir)), executor)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"move-{request.param}")
    reference = build(request.param, root / "model")
    first = serve(root / "model", 4)
    servers = [first, serve(root / "model", 4, model=first.executor.model), serve(root / "model", 8)]
    clients = [ExecutorClient(s.address, timeout=60) for s in servers]
    yield reference, clients
    for c, s in zip(clients, servers):
        c.close()
        s.stop()


@torch.no_grad()
def expected(model, tokens: list[int]) -> np.ndarray:
    return model(torch.tensor([tokens])).logits[0, -1].float().numpy()


def test_a_moved_cache_continues_bitwise_and_matches_transformers(pair):
    reference, (a, same, other) = pair
    prompt = rng.integers(0, VOCAB, size=23).tolist()
    orig = a.prefill(PrefillInput(prompt, logits_policy=FULL)).kv_cache
    moved = same.import_kv(a.export_kv(orig, max_chunk_bytes=4096), "moved").kv_cache
    relaid = other.import_kv(a.export_kv(orig), "moved").kv_cache
    tokens = list(prompt)
    for t in rng.integers(0, VOCAB, size=4).tolist():
        do = a.decode(DecodeInput(t, orig, logits_policy=FULL))
        dm = same.decode(DecodeInput(t, moved, logits_policy=FULL))
        dr = other.decode(DecodeInput(t, relaid, logits_policy=FULL))
        tokens.append(t)
        np.testing.assert_array_equal(do.logits.logits, dm.logits.logits)
        np.testing.assert_allclose(dr.logits.logits, do.logits.logits, atol=1e-6, rtol=0)
        np.testing.assert_allclose(dm.logits.logits, expected(reference, tokens), atol=1e-4, rtol=0)
        orig, moved, relaid = do.kv_cache, dm.kv_cache, dr.kv_cache
    for c, h in ((a, orig), (same, moved), (other, relaid)):
        c.release_cache(h)
        assert c.status().kv_pool.used_blocks == 0


def test_the_weights_digest_tells_models_apart(pair, tmp_path):
    _, (a, _, _) = pair
    other = build("qwen2", tmp_path / "other")
    del other
    running = serve(tmp_path / "other", 4)
    try:
        with ExecutorClient(running.address, timeout=60) as c:
            h = a.prefill(PrefillInput([1, 2, 3, 4, 5])).kv_cache
            with pytest.raises(FailedPreconditionError) as e:
                c.import_kv(a.export_kv(h), "x")
            assert e.value.reason == "KV_FINGERPRINT_MISMATCH"
            assert c.status().kv_pool.used_blocks == 0
            a.release_cache(h)
    finally:
        running.stop()


def test_a_cache_moves_with_its_lora_adapter(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = build("qwen3", tmp_path / "base")
    torch.manual_seed(5)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False), adapter_name="tuned")
    peft.eval()
    peft.save_pretrained(tmp_path / "saved")
    loras = tmp_path / "loras"
    loras.mkdir()
    shutil.copytree(tmp_path / "saved" / "tuned", loras / "tuned")
    first = serve(tmp_path / "base", 4, loras)
    servers = [first, serve(tmp_path / "base", 4, loras, first.executor.model), serve(tmp_path / "base", 4)]
    a, b, bare = (ExecutorClient(s.address, timeout=60) for s in servers)
    try:
        prompt = rng.integers(0, VOCAB, size=13).tolist()
        h = a.prefill(PrefillInput(prompt, lora_adapter="tuned")).kv_cache
        with pytest.raises(NotFoundError):
            bare.import_kv(a.export_kv(h), "x")
        moved = b.import_kv(a.export_kv(h), "x").kv_cache
        assert b.list_lora_adapters()[0].bound_caches == 1
        step = b.decode(DecodeInput(7, moved, logits_policy=FULL))
        with torch.no_grad():
            want = peft(torch.tensor([prompt + [7]])).logits[0, -1].numpy()
        np.testing.assert_allclose(step.logits.logits, want, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(step.logits.logits,
                                      a.decode(DecodeInput(7, h, logits_policy=FULL)).logits.logits)

        # The adapter unloaded while an import bound to it streams: the import fails at its
        # end, and no cache is left bound to weights the server no longer holds.
        b.release_cache(moved)
        free = b.status().kv_pool.free_blocks

        def unloaded_midway():
            export = iter(a.export_kv(h, max_chunk_bytes=1024))
            yield next(export)  # the description: the import begins, reserving its blocks
            while b.status().kv_pool.free_blocks == free:
                time.sleep(0.01)
            b.unload_lora_adapter("tuned")
            yield from export

        with pytest.raises(FailedPreconditionError) as refused:
            b.import_kv(unloaded_midway(), "y")
        assert "unloaded while the import was streaming" in str(refused.value)
        assert b.list_caches() == [] and b.status().kv_pool.free_blocks == free
    finally:
        for c, s in zip((a, b, bare), servers):
            c.close()
            s.stop()


def test_a_bfloat16_cache_moves_bit_for_bit(tmp_path):
    build("llama", tmp_path / "model")
    first = serve(tmp_path / "model", 4, dtype="bfloat16")
    servers = [first, serve(tmp_path / "model", 4, model=first.executor.model, dtype="bfloat16"),
               serve(tmp_path / "model", 4)]
    a, b, fp32 = (ExecutorClient(s.address, timeout=60) for s in servers)
    try:
        prompt = rng.integers(0, VOCAB, size=19).tolist()
        h = a.prefill(PrefillInput(prompt)).kv_cache
        first_message = next(a.export_kv(h))
        assert first_message.description.fingerprint.kv_dtype == pb.DATA_TYPE_BFLOAT16
        with pytest.raises(FailedPreconditionError, match="kv_dtype is BFLOAT16 in the stream but FLOAT32 here"):
            fp32.import_kv(a.export_kv(h), "x")
        moved = b.import_kv(a.export_kv(h, max_chunk_bytes=1000), "x").kv_cache
        np.testing.assert_array_equal(a.decode(DecodeInput(3, h, logits_policy=FULL)).logits.logits,
                                      b.decode(DecodeInput(3, moved, logits_policy=FULL)).logits.logits)
    finally:
        for c, s in zip((a, b, fp32), servers):
            c.close()
            s.stop()
