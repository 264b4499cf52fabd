"""LlmExecutor over gRPC against transformers' Qwen3, Llama and Qwen2 (fp32, max abs diff <= 1e-4).

Each family gets a tiny random checkpoint saved by transformers, loaded by our loader and
served by a real server; transformers recomputes every sequence from scratch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput, UnifiedBatchItem
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models.config import UnsupportedModel
from executors.models.loader import load_model
from service.config import ServeConfig
from tests.conftest import start_server
from tests.models.tiny_models import VOCAB, build

TOL = 1e-4
FAMILIES = ["qwen3", "llama", "qwen2"]
rng = np.random.default_rng(7)


class Served:
    """A family's tiny model: the transformers oracle, its directory, a server and a client."""

    def __init__(self, family: str, root) -> None:
        self.dir = root / family
        self.oracle = build(family, self.dir)
        self.executor = LlmExecutor(LlmExecutorConfig(model_dir=str(self.dir), block_size=4, num_blocks=512))
        self.forwards = 0
        inner = self.executor.model.hidden_states

        def counting(*args, **kwargs):
            self.forwards += 1
            return inner(*args, **kwargs)

        self.executor.model.hidden_states = counting
        self.lm_head_rows: list[int] = []
        head = self.executor.model.logits

        def counting_head(hidden):
            self.lm_head_rows.append(hidden.shape[0])
            return head(hidden)

        self.executor.model.logits = counting_head
        self.running = start_server(ServeConfig(port=0, executor="llm", model=str(self.dir)), self.executor)
        self.client = ExecutorClient(self.running.address, timeout=60)

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.oracle(torch.tensor([tokens])).logits[0].float().numpy()

    @torch.no_grad()
    def hidden(self, tokens: list[int]) -> np.ndarray:
        return self.oracle.model(torch.tensor([tokens])).last_hidden_state[0].float().numpy()

    def close(self) -> None:
        self.client.close()
        self.running.stop()


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    s = Served(request.param, tmp_path_factory.mktemp("tiny"))
    yield s
    s.close()



def prompt(n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def close(actual, expected) -> None:
    np.testing.assert_allclose(actual, expected, atol=TOL, rtol=0)


def test_prefill_chunked_prefill_and_decode(served):
    c = served.client
    tokens = prompt(30)
    ref = served.logits(tokens + [5, 6, 7])
    whole = c.prefill(PrefillInput(tokens))
    close(whole.logits.logits, ref[29])
    handle = None
    for a, b in [(0, 5), (5, 16), (16, 17), (17, 30)]:  # chunks of 5, 11, 1, 13
        out = c.prefill(PrefillInput(tokens[a:b], kv_cache=handle))
        handle = out.kv_cache
        close(out.logits.logits, ref[b - 1])
    for i, t in enumerate([5, 6, 7]):
        step = c.decode(DecodeInput(t, handle))
        handle = step.kv_cache
        close(step.logits.logits, ref[30 + i])
    c.release_cache(handle)
    c.release_cache(whole.kv_cache)


def test_batch_prefill_and_batch_decode_are_one_forward_each(served):
    c = served.client
    prompts = [prompt(n) for n in (1, 6, 13, 24)]
    before = served.forwards
    outs = c.batch_prefill([PrefillInput(p) for p in prompts])
    assert served.forwards == before + 1
    for p, o in zip(prompts, outs):
        close(o.logits.logits, served.logits(p)[-1])
    nxt = prompt(4)
    before = served.forwards
    steps = c.batch_decode([DecodeInput(t, o.kv_cache) for t, o in zip(nxt, outs)])
    assert served.forwards == before + 1
    for p, t, s in zip(prompts, nxt, steps):
        close(s.logits.logits, served.logits(p + [t])[-1])
        c.release_cache(s.kv_cache)


def test_unified_batch_of_chunks_and_decodes_is_one_forward(served):
    c = served.client
    decoding, chunked, fresh = prompt(9), prompt(26), prompt(12)
    dec = c.prefill(PrefillInput(decoding)).kv_cache
    part = c.prefill(PrefillInput(chunked[:10])).kv_cache
    before = served.forwards
    served.lm_head_rows.clear()
    results = c.unified_decode([
        UnifiedBatchItem("", fresh, 0, True),
        UnifiedBatchItem(part.cache_id, chunked[10:18], 10, False),
        UnifiedBatchItem(dec.cache_id, [3], 9, True),
    ])
    assert served.forwards == before + 1
    assert served.lm_head_rows == [2], "the lm_head runs once, on the two final items' last rows only"
    close(results[0].logits.logits, served.logits(fresh)[-1])
    assert results[1].logits is None
    close(results[2].logits.logits, served.logits(decoding + [3])[-1])
    last = c.unified_decode([UnifiedBatchItem(part.cache_id, chunked[18:], 18, True)])
    close(last[0].logits.logits, served.logits(chunked)[-1])
    for r in results:
        c.release_cache(r.seq_id)


def test_forward_verify_and_forward(served):
    c = served.client
    tokens, drafts = prompt(11), prompt(5)
    ref = served.logits(tokens + drafts)
    handle = c.prefill(PrefillInput(tokens)).kv_cache
    before = served.forwards
    ver = c.forward_verify(handle, drafts)
    assert served.forwards == before + 1 and len(ver.outputs) == 5
    for i, row in enumerate(ver.outputs):
        close(row.logits, ref[11 + i])
    c.release_cache(ver.kv_cache)
    seq = tokens + drafts
    close(c.forward(seq).output, ref)
    close(c.forward(seq, output="hidden_states").output, served.hidden(seq))
    lp = torch.log_softmax(torch.tensor(ref[:-1]), -1).numpy()[np.arange(len(seq) - 1), seq[1:]]
    close(c.forward(seq, output="token_logprobs").output, lp)


def greedy(c, tokens: list[int], steps: int, chunk: int | None = None, mates: list[list[int]] = ()) -> list[int]:
    """Greedy tokens of `tokens` through unified steps, optionally chunked and with batch mates."""
    policy = LogitsPolicy.argmax()
    pieces = [tokens[i:i + chunk] for i in range(0, len(tokens), chunk)] if chunk else [tokens]
    ids = [""] + [""] * len(mates)
    pos = 0
    mate_items = [UnifiedBatchItem("", m, 0, True, logits_policy=policy) for m in mates]
    mate_next: list[int] = []
    for k, piece in enumerate(pieces):
        final = k == len(pieces) - 1
        items = [UnifiedBatchItem(ids[0], piece, pos, final, logits_policy=policy)] + (mate_items if k == 0 else [])
        res = c.unified_decode(items)
        ids[0] = res[0].seq_id
        if k == 0:
            ids[1:] = [r.seq_id for r in res[1:]]
            mate_next = [r.logits.token_id for r in res[1:]]
        pos += len(piece)
    out = [res[0].logits.token_id]
    mate_pos = [len(m) for m in mates]
    for _ in range(steps - 1):
        items = [UnifiedBatchItem(ids[0], [out[-1]], pos, True, logits_policy=policy)]
        items += [UnifiedBatchItem(i, [t], p, True, logits_policy=policy) for i, t, p in zip(ids[1:], mate_next, mate_pos)]
        res = c.unified_decode(items)
        pos += 1
        mate_pos = [p + 1 for p in mate_pos]
        mate_next = [r.logits.token_id for r in res[1:]]
        out.append(res[0].logits.token_id)
    for i in ids:
        c.release_cache(i)
    return out


def test_greedy_tokens_do_not_depend_on_batch_mates_or_chunking_or_truncation(served):
    c = served.client
    tokens = prompt(21)
    alone = greedy(c, tokens, 10)
    assert greedy(c, tokens, 10, mates=[prompt(3), prompt(30), prompt(17)]) == alone
    assert greedy(c, tokens, 10, chunk=4) == alone
    assert greedy(c, tokens, 10, chunk=1) == alone
    # Decode past the prompt, roll back, decode again: the same tokens.
    out = c.prefill(PrefillInput(tokens, logits_policy=LogitsPolicy.argmax()))
    handle, first = out.kv_cache, out.logits.token_id
    for t in [first] + prompt(6):
        handle = c.decode(DecodeInput(t, handle, logits_policy=LogitsPolicy.argmax())).kv_cache
    handle = c.truncate_kv(handle, len(tokens)).kv_cache
    again, tok = [first], first
    for _ in range(9):
        step = c.decode(DecodeInput(tok, handle, logits_policy=LogitsPolicy.argmax()))
        handle, tok = step.kv_cache, step.logits.token_id
        again.append(tok)
    assert again == alone
    c.release_cache(handle)


def test_info_describes_the_model(served):
    info = served.client.info()
    cfg = served.oracle.config
    assert (info.vocab_size, info.num_layers, info.num_heads, info.num_kv_heads) == (VOCAB, 3, 4, 2)
    assert info.hidden_size == cfg.hidden_size
    assert info.num_parameters == sum(p.numel() for p in served.oracle.parameters())  # tied weights once
    caps = served.client.capabilities()
    assert caps.supports_native_unified_decode and caps.kv_block_size == 4


# -- loading ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    model = build("llama", d)
    return d, model


def run_prefill(model_dir, tokens, **cfg) -> np.ndarray:
    import asyncio

    from executors.types import PrefillInput as DomainPrefill

    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(model_dir), block_size=4, num_blocks=64, **cfg))
    out = asyncio.run(ex.prefill(DomainPrefill(input_ids=tokens)))
    ex.worker.close()
    return out.logits.logits.array


def test_older_config_keys_and_sharded_checkpoints_load_the_same(llama_dir, tmp_path):
    d, model = llama_dir
    tokens = prompt(9)
    expected = model(torch.tensor([tokens])).logits[0, -1].detach().numpy()
    # Older transformers: rope_theta, rope_scaling and torch_dtype at the top level.
    cfg = json.loads((d / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    old = dict(cfg, rope_theta=rope.pop("rope_theta"), rope_scaling=rope, torch_dtype=cfg.pop("dtype"))
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    (old_dir / "config.json").write_text(json.dumps(old))
    (old_dir / "model.safetensors").symlink_to(d / "model.safetensors")
    close(run_prefill(old_dir, tokens), expected)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    close(run_prefill(sharded, tokens), expected)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_a_loaded_float32_model_keeps_no_view_of_its_weights_file(llama_dir):
    """float32 on a CPU, a tensor read from the file is a view of safetensors' memory map, and one
    left in the model (a norm's weight) kept the whole map resident beside the model's own copy:
    `make serve`'s server held 2.31 GB resident where 1.77 GB is its due."""
    d, _ = llama_dir
    weights = str((d / "model.safetensors").resolve())
    model = load_model(d, torch.float32, "cpu")
    if model.cpu_kernels is None:
        pytest.skip("the CPU kernels do not build here: without them the row-major matrices are served from the map")
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(weights)]
    assert mapped == [], f"{weights} is still mapped after the load: {mapped}"


def test_bfloat16_serving_stays_close_to_float32(llama_dir):
    d, model = llama_dir
    tokens = prompt(12)
    expected = model(torch.tensor([tokens])).logits[0, -1].detach().numpy()
    np.testing.assert_allclose(run_prefill(d, tokens, dtype="bfloat16"), expected, atol=0.1)


def broken_copy(src, dst, *, config=None, drop=None, reshape=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    state = load_file(str(src / "model.safetensors"))
    if drop:
        del state[drop]
    if reshape:
        state[reshape] = state[reshape][:-1]
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "damage, message",
    [
        (dict(config=lambda c: dict(c, architectures=["GPT2LMHeadModel"])), "GPT2LMHeadModel"),
        (dict(drop="model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"),
        (dict(reshape="model.layers.0.self_attn.k_proj.weight"), "model.layers.0.self_attn.k_proj.weight"),
        (dict(config=lambda c: {k: v for k, v in c.items() if k != "vocab_size"}), "vocab_size"),
        (dict(config=lambda c: dict(c, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2})),
         "rope scaling type 'dynamic' is not supported"),
    ],
    ids=["architecture", "missing_tensor", "shape", "missing_key", "rope_type"],
)
def test_unservable_models_fail_at_start_naming_the_problem(llama_dir, tmp_path, damage, message):
    bad = broken_copy(llama_dir[0], tmp_path / "bad", **damage)
    with pytest.raises(UnsupportedModel, match=message.replace(".", r"\.")):
        LlmExecutor(LlmExecutorConfig(model_dir=str(bad)))


def test_the_cli_refuses_an_unservable_model_with_a_message(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    done = subprocess.run([sys.executable, "-m", "service", "--model", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "BertModel" in done.stderr and "Traceback" not in done.stderr
