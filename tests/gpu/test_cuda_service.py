"""The real server on a CUDA device, through the real client, against transformers in float32 on the CPU.

Tiny random Qwen3, Llama and Qwen2 checkpoints (transformers' own config classes), each with
a PEFT LoRA adapter, are served by `python -m service --device cuda` in processes of their
own, in float32 and in bfloat16: six servers, started together. Every RPC runs through the
typed client: prefill (whole and chunked), decode across block boundaries, batch_prefill,
batch_decode through the decode CUDA graphs' buckets (with padding rows), unified batches
mixing fresh prompts, chunks and decodes, Forward, ForwardVerify, TruncateKv, ReleaseCache,
prefix reuse, LoRA rows beside base rows, ARGMAX greedy steps, and greedy steps with two fed
steps in flight in a StepSession (left in flight on the device: executors/step_overlap.py).
After every test the pool is back to all free with no cache left.

The reference is transformers (and PEFT for adapter rows) in float32 on the CPU, recomputing
each sequence from scratch.
- float32: max abs difference <= 1e-4, as on the CPU; greedy tokens equal.
- bfloat16: per row, the relative L2 error ||ours - ref|| / ||ref|| <= BF16_REL_TOL. A
  bfloat16 value carries 8 significant bits (relative rounding up to 2^-9 ~ 2e-3); every
  matmul output, norm and residual add of the model is rounded to it, and the errors of
  ~10 roundings per layer add up over the layers. transformers' own bfloat16 forward lands
  at 0.7-1.3e-2 from its float32 forward on these models (on a CPU; measured alongside on
  each run by test_report_bf16_error_budget); 3e-2 leaves room for a different but equally valid order of
  accumulation, and is still ~30x below what a wrong mask, position or block (errors of
  order 1) gives. Greedy tokens: each token we pick must be within the bfloat16 error of
  the reference's best (near-ties may flip), and the reference follows our tokens.

Skips without CUDA. `pytest tests/gpu --service-device cpu` runs the same servers on the CPU
(SDPA), which checks this test itself on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput, UnifiedBatchItem
from client.convert import metadata_from_proto
from tests import server_process
from tests.models.tiny_models import VOCAB, build

FAMILIES = ("qwen3", "llama", "qwen2")
DTYPES = ("float32", "bfloat16")
# Servers beside those: a key's flags after its family and dtype. qwen2 has q/k/v biases, so the
# few-row matmuls (executors/models/few_row_matmuls.py) run with and without bias and residual.
EXTRA_SERVERS = {"qwen2-bfloat16-gemv": ["--triton-gemv"]}
FP32_TOL = 1e-4
BF16_REL_TOL = 3e-2
BLOCK = 16  # the production block size: sequences below cross block boundaries
MAX_BATCH = 8  # decode graph buckets 1, 2, 4 and 8
ADAPTER = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]}
rng = np.random.default_rng(11)


def prompt(n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


@dataclass
class Family:
    """A tiny checkpoint, its transformers + PEFT oracle (float32, CPU) and its LoRA directory."""

    name: str
    model_dir: Path
    lora_dir: Path
    peft: object
    cache: dict = field(default_factory=dict)

    @torch.no_grad()
    def logits(self, tokens: list[int], adapter: str | None = None) -> np.ndarray:
        key = (tuple(tokens), adapter)
        if key not in self.cache:
            model = self.peft.get_base_model()
            with self.peft.disable_adapter() if adapter is None else contextlib.nullcontext():
                self.cache[key] = model(torch.tensor([tokens])).logits[0].float().numpy()
        return self.cache[key]


def make_family(name: str, root: Path) -> Family:
    from peft import LoraConfig, get_peft_model

    base = build(name, root / "base")
    torch.manual_seed(31)
    peft = get_peft_model(base, LoraConfig(**ADAPTER, init_lora_weights=False), adapter_name="wide").eval()
    peft.save_pretrained(root / "saved")
    lora_dir = root / "loras"
    lora_dir.mkdir()
    shutil.copytree(root / "saved" / "wide", lora_dir / "wide")
    return Family(name, root / "base", lora_dir, peft)


@dataclass
class Served:
    family: Family
    dtype: str
    device: str
    server: server_process.ServerProcess
    client: ExecutorClient
    flags: list[str] = field(default_factory=list)  # beyond every server's

    def close(self, actual: np.ndarray, expected: np.ndarray) -> None:
        """actual against the float32 reference, within this dtype's tolerance."""
        actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
        assert actual.shape == expected.shape and np.isfinite(actual).all()
        if self.dtype == "float32":
            np.testing.assert_allclose(actual, expected, atol=FP32_TOL, rtol=0)
            return
        for a, e in zip(actual.reshape(-1, actual.shape[-1]), expected.reshape(-1, expected.shape[-1])):
            rel = float(np.linalg.norm(a - e) / np.linalg.norm(e))
            assert rel <= BF16_REL_TOL, f"bfloat16 row {rel:.3g} from the float32 reference (tolerance {BF16_REL_TOL})"

    def same_choice(self, token: int, expected: np.ndarray) -> None:
        """A greedy pick: the reference's argmax in float32; in bfloat16 a token whose reference
        logit is within the bfloat16 error (BF16_REL_TOL of the logits' RMS, twice) of the best."""
        best = int(np.argmax(expected))
        if self.dtype == "float32":
            assert token == best
            return
        slack = 2 * BF16_REL_TOL * float(np.sqrt(np.mean(expected.astype(np.float64) ** 2)))
        assert expected[token] >= expected[best] - slack, (token, best, expected[token], expected[best], slack)


def pytest_generate_tests(metafunc):
    if "served" in metafunc.fixturenames:
        metafunc.parametrize("served", [f"{f}-{d}" for f in FAMILIES for d in DTYPES] + list(EXTRA_SERVERS),
                             indirect=True)


@pytest.fixture(scope="module")
def device(request) -> str:
    wanted = request.config.getoption("--service-device")
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (--service-device cpu runs this on the CPU)")
    return wanted


@pytest.fixture(scope="module")
def fleet(device, tmp_path_factory):
    """Every family in every dtype, served at once (start-up runs in parallel)."""
    pytest.importorskip("peft")
    families = {f: make_family(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}
    servers = {}
    try:
        keys = [f"{f}-{d}" for f in FAMILIES for d in DTYPES] + list(EXTRA_SERVERS)
        for key in keys:
            f, dtype = key.split("-")[:2]
            servers[key] = server_process.start(
                "--executor", "llm", "--model", str(families[f].model_dir), "--device", device, "--dtype", dtype,
                "--block-size", str(BLOCK), "--num-blocks", "96", "--max-batch-size", str(MAX_BATCH),
                "--lora-dir", str(families[f].lora_dir), "--max-loras", "2", "--max-lora-rank", "8",
                "--cache-ttl-seconds", "0", *EXTRA_SERVERS.get(key, []),
                *(["--attention-backend", "triton"] if device.startswith("cuda") else []))
        for server in servers.values():
            server_process.ready(server, timeout=300)
        served = {}
        for key, server in servers.items():
            f, dtype = key.split("-")[:2]
            served[key] = Served(families[f], dtype, device, server, ExecutorClient(server.target, timeout=120),
                                 EXTRA_SERVERS.get(key, []))
        yield served
        for s in served.values():
            s.client.close()
    finally:
        for server in servers.values():
            server_process.stop(server)


@pytest.fixture
def served(request, fleet) -> Served:
    s = fleet[request.param]
    yield s
    # Whatever a test made, it released: no cache left, every block free (cached prefixes
    # count as free), no adapter binding.
    kv = s.client.status().kv_pool
    assert kv.active_caches == 0 and kv.free_blocks == kv.total_blocks, kv
    assert s.client.lora_metrics().active_cache_bindings == 0


def test_info_says_where_and_how_it_runs(served):
    info = served.client.info()
    meta = metadata_from_proto(info.metadata)
    caps = served.client.capabilities()
    assert caps.kv_block_size == BLOCK and caps.kv_total_blocks == 96
    if served.device.startswith("cuda"):
        # The Triton kernels passed their start-up check and every decode bucket was captured.
        assert meta["attention_backend"] == "triton"
        assert meta["cuda_graph_buckets"] == [1, 2, 4, 8]
        # The fused kernels passed their start-up checks on this device.
        assert meta["triton_fused_ops"] == ["prologue", "glu"]
        # With --triton-gemv every bucket's matmul shapes were timed and chosen before capture.
        gemv = "--triton-gemv" in served.flags
        assert {key.split("x")[0] for key in meta["few_row_matmuls"]} == ({"1", "2", "4", "8"} if gemv else set())
    log = served.server.output()
    assert "are off" not in log and "is off" not in log and "Traceback" not in log, log[-3000:]


def test_prefill_chunks_and_decode_across_blocks(served):
    c, fam = served.client, served.family
    tokens = prompt(40)
    ref = fam.logits(tokens + [5, 6, 7, 8])
    whole = c.prefill(PrefillInput(tokens))
    served.close(whole.logits.logits, ref[39])
    handle = None
    for a, b in [(0, 5), (5, 17), (17, 18), (18, 40)]:  # chunks that start and end inside blocks
        out = c.prefill(PrefillInput(tokens[a:b], kv_cache=handle))
        handle = out.kv_cache
        served.close(out.logits.logits, ref[b - 1])
    for i, t in enumerate([5, 6, 7, 8]):
        step = c.decode(DecodeInput(t, handle))
        handle = step.kv_cache
        served.close(step.logits.logits, ref[40 + i])
    assert handle.sequence_length == 44 and len(handle.block_ids) == 3
    c.release_cache(handle)
    c.release_cache(whole.kv_cache)


def test_batch_prefill_and_batch_decode_through_every_bucket(served):
    """Batches of 7, 3, 1, 5 and 2 rows: the 8, 4, 1, 8 and 2 buckets, padding rows included."""
    c, fam = served.client, served.family
    seqs = [prompt(n) for n in (1, 9, 16, 17, 30, 33, 47)]
    outs = c.batch_prefill([PrefillInput(p) for p in seqs])
    for p, o in zip(seqs, outs):
        served.close(o.logits.logits, fam.logits(p)[-1])
    handles = [o.kv_cache for o in outs]
    for n in (7, 3, 1, 5, 2):
        chosen = rng.permutation(len(seqs))[:n]
        nxt = prompt(n)
        steps = c.batch_decode([DecodeInput(t, handles[i]) for t, i in zip(nxt, chosen)])
        for t, i, s in zip(nxt, chosen, steps):
            seqs[i] = seqs[i] + [t]
            handles[i] = s.kv_cache
            served.close(s.logits.logits, fam.logits(seqs[i])[-1])
    for h in handles:
        c.release_cache(h)


def test_unified_batch_of_fresh_prompt_chunk_and_decode(served):
    c, fam = served.client, served.family
    decoding, chunked, fresh = prompt(21), prompt(45), prompt(12)
    dec = c.prefill(PrefillInput(decoding)).kv_cache
    part = c.prefill(PrefillInput(chunked[:10])).kv_cache
    results = c.unified_decode([
        UnifiedBatchItem("", fresh, 0, True),
        UnifiedBatchItem(part.cache_id, chunked[10:30], 10, False),
        UnifiedBatchItem(dec.cache_id, [3], 21, True),
    ])
    served.close(results[0].logits.logits, fam.logits(fresh)[-1])
    assert results[1].logits is None
    served.close(results[2].logits.logits, fam.logits(decoding + [3])[-1])
    last = c.unified_decode([UnifiedBatchItem(part.cache_id, chunked[30:], 30, True),
                             UnifiedBatchItem(dec.cache_id, [4], 22, True)])
    served.close(last[0].logits.logits, fam.logits(chunked)[-1])
    served.close(last[1].logits.logits, fam.logits(decoding + [3, 4])[-1])
    for r in results:
        c.release_cache(r.seq_id)


def test_forward_verify_truncate_and_forward(served):
    c, fam = served.client, served.family
    tokens, draft = prompt(14), prompt(5)
    out = c.prefill(PrefillInput(tokens))
    verify = c.forward_verify(out.kv_cache, draft)
    ref = fam.logits(tokens + draft)
    assert len(verify.outputs) == len(draft) and verify.kv_cache.sequence_length == 19
    for i, o in enumerate(verify.outputs):
        served.close(o.logits, ref[13 + i + 1])
    # Keep two draft tokens, then decode on from there.
    cut = c.truncate_kv(verify.kv_cache, 16)
    assert cut.kv_cache.sequence_length == 16
    step = c.decode(DecodeInput(9, cut.kv_cache))
    served.close(step.logits.logits, fam.logits(tokens + draft[:2] + [9])[-1])
    assert c.release_cache(step.kv_cache).released
    assert not c.release_cache(step.kv_cache).released  # idempotent
    whole = c.forward(tokens)
    served.close(whole.output, fam.logits(tokens))


def test_prefix_reuse_gives_the_same_logits(served):
    c, fam = served.client, served.family
    system, q1, q2 = prompt(2 * BLOCK + 3), prompt(6), prompt(4)
    first = c.prefill(PrefillInput(system + q1))
    c.release_cache(first.kv_cache)  # its two whole blocks stay cached
    before = c.cache_metrics()
    again = c.prefill(PrefillInput(system + q2))
    after = c.cache_metrics()
    assert after.hits == before.hits + 1 and after.saved_prefill_tokens - before.saved_prefill_tokens == 2 * BLOCK
    served.close(again.logits.logits, fam.logits(system + q2)[-1])
    # A second live sequence on the same prefix shares those blocks; both decode apart.
    other = c.prefill(PrefillInput(system + q1))
    assert other.kv_cache.block_ids[:2] == again.kv_cache.block_ids[:2]
    a = c.decode(DecodeInput(1, again.kv_cache))
    b = c.decode(DecodeInput(2, other.kv_cache))
    served.close(a.logits.logits, fam.logits(system + q2 + [1])[-1])
    served.close(b.logits.logits, fam.logits(system + q1 + [2])[-1])
    c.release_cache(a.kv_cache)
    c.release_cache(b.kv_cache)


def test_lora_rows_beside_base_rows(served):
    c, fam = served.client, served.family
    plan = [("wide", 19), (None, 6), ("wide", 33), (None, 17)]
    seqs = [prompt(n) for _, n in plan]
    outs = c.batch_prefill([PrefillInput(p, lora_adapter=a) for (a, _), p in zip(plan, seqs)])
    for (adapter, _), p, o in zip(plan, seqs, outs):
        served.close(o.logits.logits, fam.logits(p, adapter)[-1])
    nxt = prompt(len(outs))
    steps = c.batch_decode([DecodeInput(t, o.kv_cache) for t, o in zip(nxt, outs)])
    for (adapter, _), p, t, s in zip(plan, seqs, nxt, steps):
        served.close(s.logits.logits, fam.logits(p + [t], adapter)[-1])
        c.release_cache(s.kv_cache)


def test_greedy_steps_follow_the_reference(served):
    """ARGMAX decode for 24 steps on two sequences at once (graph replays at batch 2)."""
    c, fam = served.client, served.family
    seqs = [prompt(11), prompt(29)]
    outs = c.batch_prefill([PrefillInput(p, logits_policy=LogitsPolicy.argmax()) for p in seqs])
    handles = [o.kv_cache for o in outs]
    tokens = [o.logits.token_id for o in outs]
    for _ in range(24):
        for i in range(2):
            served.same_choice(tokens[i], fam.logits(seqs[i])[-1])
            seqs[i] = seqs[i] + [tokens[i]]
        steps = c.batch_decode([DecodeInput(t, h, logits_policy=LogitsPolicy.argmax())
                                for t, h in zip(tokens, handles)])
        handles = [s.kv_cache for s in steps]
        tokens = [s.logits.token_id for s in steps]
    for h in handles:
        c.release_cache(h)


def test_fed_steps_in_flight_follow_the_reference(served):
    """A StepSession keeping two fed ARGMAX steps in flight (the graphed executor launches each
    before the one before settles, its tokens gathered on the device: executors/step_overlap.py)
    for 20 steps on two sequences; each token is checked once its result is read."""
    c, fam = served.client, served.family
    seqs = [prompt(13), prompt(31)]
    outs = c.batch_prefill([PrefillInput(p, logits_policy=LogitsPolicy.argmax()) for p in seqs])
    handles = [o.kv_cache for o in outs]
    for i, o in enumerate(outs):
        served.same_choice(o.logits.token_id, fam.logits(seqs[i])[-1])
        seqs[i] = seqs[i] + [o.logits.token_id]
    lengths = [h.sequence_length for h in handles]

    def fed(k: int) -> list[UnifiedBatchItem]:
        return [UnifiedBatchItem(h.cache_id, [], n + k, True, logits_policy=LogitsPolicy.argmax(),
                                 feed_sampled_token=True) for h, n in zip(handles, lengths)]

    steps = 20
    with c.step_session() as session:
        session.send(fed(0))
        session.send(fed(1))
        for k in range(steps):
            results = session.receive()
            if k + 2 < steps:
                session.send(fed(k + 2))
            for i, r in enumerate(results):
                assert r.kv_cache.sequence_length == lengths[i] + k + 1
                served.same_choice(r.logits.token_id, fam.logits(seqs[i])[-1])
                seqs[i] = seqs[i] + [r.logits.token_id]
    for h in handles:
        c.release_cache(h)


def test_report_bf16_error_budget(served, record_property):
    """transformers' own bfloat16 error against its float32 on this model, beside ours: the
    figures behind BF16_REL_TOL (printed into the GPU check's report)."""
    if served.dtype != "bfloat16":
        pytest.skip("bfloat16 only")
    c, fam = served.client, served.family
    tokens = prompt(48)
    ref = fam.logits(tokens)
    with torch.no_grad(), fam.peft.disable_adapter():
        hf16 = copy.deepcopy(fam.peft.get_base_model()).to(torch.bfloat16)
        hf16 = hf16(torch.tensor([tokens])).logits[0].float().numpy()
    ours = c.forward(tokens).output

    def rel(x):
        return float(np.max(np.linalg.norm(x - ref, axis=-1) / np.linalg.norm(ref, axis=-1)))

    figures = {"family": " ".join([fam.name, *served.flags]), "ours_max_rel": rel(ours), "transformers_bf16_max_rel": rel(hf16)}
    print("bf16 error budget:", json.dumps(figures))
    record_property("bf16_budget", json.dumps(figures))
    assert figures["ours_max_rel"] <= BF16_REL_TOL
