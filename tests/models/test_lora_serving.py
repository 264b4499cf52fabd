"""Multi-LoRA through a real server and the real client, against transformers + PEFT.

A tiny random Qwen3 is served with one PEFT adapter loaded at start-up from --lora-dir;
a second is uploaded over gRPC. A batch mixing both adapters and none must give every
sequence exactly its own adapter's logits; decode steps keep the adapter their cache was
created with; the prefix cache never hands one adapter's K and V to another; the
metrics and the errors say what happened.
"""

from __future__ import annotations

import contextlib
import shutil

import grpc
import numpy as np
import pytest
import torch

from client import DecodeInput, ExecutorClient, ExecutorError, LogitsPolicy, PrefillInput, UnifiedBatchItem
from executors.llm import LlmExecutor, LlmExecutorConfig
from service.config import ServeConfig
from tests.conftest import start_server
from tests.models.tiny_models import VOCAB, build

TOL = 1e-4
rng = np.random.default_rng(23)
ADAPTERS = {
    "wide": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]},
    "narrow": {"r": 4, "lora_alpha": 12, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]},
}


def prompt(n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def close(actual, expected) -> None:
    np.testing.assert_allclose(actual, expected, atol=TOL, rtol=0)


class Served:
    def __init__(self, root) -> None:
        from peft import LoraConfig, get_peft_model

        base = build("qwen3", root / "base")
        torch.manual_seed(29)
        self.peft = get_peft_model(base, LoraConfig(**ADAPTERS["wide"], init_lora_weights=False), adapter_name="wide")
        self.peft.add_adapter("narrow", LoraConfig(**ADAPTERS["narrow"], init_lora_weights=False))
        self.peft.eval()
        self.peft.save_pretrained(root / "saved")
        self.lora_dir = root / "loras"  # only "wide" is there at start-up; "narrow" is uploaded
        self.lora_dir.mkdir()
        shutil.copytree(root / "saved" / "wide", self.lora_dir / "wide")
        self.narrow_dir = root / "saved" / "narrow"
        self.executor = LlmExecutor(LlmExecutorConfig(model_dir=str(root / "base"), block_size=4, num_blocks=256,
                                                      lora_dir=str(self.lora_dir), max_loras=2, max_lora_rank=8))
        self.running = start_server(ServeConfig(port=0, executor="llm", model=str(root / "base")), self.executor)
        self.client = ExecutorClient(self.running.address, timeout=60)
        self.client.upload_lora_adapter("narrow", self.narrow_dir)

    @torch.no_grad()
    def logits(self, tokens: list[int], adapter: str | None) -> np.ndarray:
        model = self.peft.get_base_model()
        if adapter is not None:
            self.peft.set_adapter(adapter)
        with self.peft.disable_adapter() if adapter is None else contextlib.nullcontext():
            return model(torch.tensor([tokens])).logits[0].float().numpy()

    def close(self) -> None:
        self.client.close()
        self.running.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("lora"))
    yield s
    s.close()



def test_a_mixed_batch_gives_each_sequence_its_own_adapter(served):
    c = served.client
    plan = [("wide", 9), (None, 6), ("narrow", 11), ("wide", 5), (None, 1)]
    prompts = [prompt(n) for _, n in plan]
    before = c.lora_metrics().projection_applications
    outs = c.batch_prefill([PrefillInput(p, lora_adapter=a) for (a, _), p in zip(plan, prompts)])
    # Each adapter's deltas run once per step, however many sequences use it: 3 layers.
    assert c.lora_metrics().projection_applications - before == 3 * 7 + 3 * 3
    for (adapter, _), p, o in zip(plan, prompts, outs):
        close(o.logits.logits, served.logits(p, adapter)[-1])
    # Decode steps carry no adapter name: each cache keeps the one it was created with.
    nxt = prompt(len(outs))
    steps = c.batch_decode([DecodeInput(t, o.kv_cache) for t, o in zip(nxt, outs)])
    for (adapter, _), p, t, s in zip(plan, prompts, nxt, steps):
        close(s.logits.logits, served.logits(p + [t], adapter)[-1])
    assert c.lora_metrics().active_cache_bindings == 3
    bound = {a.name: a.bound_caches for a in c.list_lora_adapters()}
    assert bound == {"narrow": 1, "wide": 2}
    for s in steps:
        c.release_cache(s.kv_cache)


def test_unified_steps_and_chunks_under_an_adapter(served):
    c = served.client
    tokens = prompt(14)
    first = c.unified_decode([UnifiedBatchItem("", tokens[:6], 0, False, lora_adapter="narrow")])[0]
    rest = c.unified_decode([UnifiedBatchItem(first.seq_id, tokens[6:], 6, True)])[0]
    full = c.unified_decode([UnifiedBatchItem(first.seq_id, [3], 14, True, logits_policy=LogitsPolicy.full())])[0]
    close(full.logits.logits, served.logits(tokens + [3], "narrow")[-1])
    assert rest.logits is not None
    c.release_cache(first.seq_id)


def test_the_prefix_cache_never_crosses_adapters(served):
    c = served.client
    tokens = prompt(17)
    base = c.prefill(PrefillInput(tokens)).kv_cache
    saved = c.cache_metrics().saved_prefill_tokens
    wide = c.prefill(PrefillInput(tokens, lora_adapter="wide"))
    assert c.cache_metrics().saved_prefill_tokens == saved, "base K and V are not the adapter's"
    close(wide.logits.logits, served.logits(tokens, "wide")[-1])
    again = c.prefill(PrefillInput(tokens, lora_adapter="wide"))
    assert c.cache_metrics().saved_prefill_tokens == saved + 16, "the same adapter reuses its own"
    close(again.logits.logits, served.logits(tokens, "wide")[-1])
    for h in (base, wide.kv_cache, again.kv_cache):
        c.release_cache(h)


def status_of(excinfo) -> grpc.StatusCode:
    return excinfo.value.code


def test_errors_name_the_problem(served):
    c = served.client
    with pytest.raises(ExecutorError) as e:
        c.prefill(PrefillInput(prompt(3), lora_adapter="nope"))
    assert status_of(e) == grpc.StatusCode.NOT_FOUND and "nope" in str(e.value) and "wide" in str(e.value)
    h = c.prefill(PrefillInput(prompt(5), lora_adapter="wide")).kv_cache
    with pytest.raises(ExecutorError) as e:
        c.decode(DecodeInput(1, h, lora_adapter="narrow"))
    assert status_of(e) == grpc.StatusCode.FAILED_PRECONDITION and "created with LoRA adapter 'wide'" in str(e.value)
    with pytest.raises(ExecutorError) as e:
        c.unload_lora_adapter("wide")
    assert status_of(e) == grpc.StatusCode.FAILED_PRECONDITION and "1 live cache" in str(e.value)
    c.release_cache(h)
    with pytest.raises(ExecutorError) as e:
        c.unload_lora_adapter("never-loaded")
    assert status_of(e) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ExecutorError) as e:
        c.upload_lora_adapter("narrow", served.narrow_dir)
    assert status_of(e) == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(ExecutorError) as e:  # max_loras=2 and two are loaded
        c.upload_lora_adapter("third", served.narrow_dir)
    assert status_of(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(ExecutorError) as e:
        c.load_lora_adapter("escape", "../saved/narrow")
    assert status_of(e) == grpc.StatusCode.INVALID_ARGUMENT and "leaves the adapter directory" in str(e.value)


def test_load_unload_cycle_and_refusals_at_load(served, tmp_path):
    from peft import LoraConfig, get_peft_model

    c = served.client
    allocated = c.status().memory_usage.allocated_bytes
    info = c.unload_lora_adapter("narrow")
    assert info.name == "narrow" and info.rank == 4 and info.source == "inline"
    assert c.status().memory_usage.allocated_bytes == allocated - info.bytes > 0
    # Rank 16 > --max-lora-rank 8.
    big = get_peft_model(build("qwen3", tmp_path / "m"), LoraConfig(r=16, target_modules=["q_proj"]))
    big.save_pretrained(tmp_path / "big")
    with pytest.raises(ExecutorError) as e:
        c.upload_lora_adapter("big", tmp_path / "big")
    assert status_of(e) == grpc.StatusCode.INVALID_ARGUMENT and "16" in str(e.value) and "8" in str(e.value)
    head = get_peft_model(build("qwen3", tmp_path / "m2"), LoraConfig(r=2, target_modules=["lm_head"]))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(ExecutorError) as e:
        c.upload_lora_adapter("head", tmp_path / "head")
    assert status_of(e) == grpc.StatusCode.INVALID_ARGUMENT and "lm_head" in str(e.value)
    # Reload by path under --lora-dir; a fresh load gets fresh prefix-cache entries.
    shutil.copytree(served.narrow_dir, served.lora_dir / "narrow-by-path")
    info = c.load_lora_adapter("narrow", "narrow-by-path")
    assert info.source.endswith("narrow-by-path") and info.bound_caches == 0
    assert sorted(a.name for a in c.list_lora_adapters()) == ["narrow", "wide"]
    m = c.lora_metrics()
    assert m.enabled and m.adapter_count == 2 and m.position == "real-inference"
    caps = c.capabilities()
    assert (caps.max_lora_adapters, caps.max_lora_rank) == (2, 8)
    tokens = prompt(7)
    out = c.prefill(PrefillInput(tokens, lora_adapter="narrow"))
    close(out.logits.logits, served.logits(tokens, "narrow")[-1])
    c.release_cache(out.kv_cache)
