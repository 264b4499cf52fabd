"""Speculative decoding over two real servers (client/speculative.py): greedy output equals plain greedy.

Targets are the tiny random transformers-built models of tests/models/tiny_models.py and the
embedded SmolLM2; drafts are a perturbed copy of the target's weights (acceptance partial),
the same weights (everything accepted), another architecture (almost nothing accepted), and
SmolLM2 at bfloat16.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from client import AsyncExecutorClient, DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput
from client.speculative import SpeculativeDecoder, accept_greedy, accept_sampled
from service.config import ServeConfig
from tests.conftest import start_server
from tests.models.tiny_models import VOCAB, build

ARGMAX = LogitsPolicy.argmax()
rng = np.random.default_rng(5)
PROMPTS = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in (1, 3, 8, 15, 24)]
TOKENS = 40


def serve(model_dir: Path, **overrides):
    config = {"port": 0, "executor": "llm", "model": str(model_dir), "block_size": 4, "num_blocks": 512}
    return start_server(ServeConfig(**{**config, **overrides}))


def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """The same weights plus Gaussian noise of `scale` times each tensor's own spread."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    model.save_pretrained(dst)
    return dst


def plain_greedy(address: str, prompt: list[int], n: int) -> list[int]:
    with ExecutorClient(address, timeout=120) as c:
        out = c.prefill(PrefillInput(prompt, logits_policy=ARGMAX))
        tokens = [out.logits.token_id]
        while len(tokens) < n:
            out = c.decode(DecodeInput(tokens[-1], out.kv_cache, logits_policy=ARGMAX))
            tokens.append(out.logits.token_id)
        c.release_cache(out.kv_cache)
    return tokens


def assert_clean(*addresses: str) -> None:
    for a in addresses:
        with ExecutorClient(a) as c:
            kv = c.status().kv_pool
            assert kv.active_caches == 0 and kv.free_blocks == kv.total_blocks


def run_speculative(target: str, draft: str, prompts, n_tokens: int, **kwargs):
    async def go():
        t, d = AsyncExecutorClient(target, timeout=120), AsyncExecutorClient(draft, timeout=120)
        try:
            spec = SpeculativeDecoder(t, d, **kwargs)
            results = [await spec.generate(p, max_tokens=n_tokens) for p in prompts]
            return results, spec.stats
        finally:
            await t.close()
            await d.close()

    return asyncio.run(go())


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    """A tiny target, its greedy reference, and servers for three drafts."""
    root = tmp_path_factory.mktemp(f"spec-{request.param}")
    build(request.param, root / "target")
    other = "qwen2"  # a different architecture with the same vocabulary
    build(other, root / "other")
    # The tied-embedding llama is more robust to noise than qwen3's separate head.
    perturbed_copy(root / "target", root / "perturbed", scale={"llama": 0.2, "qwen3": 0.1}[request.param])
    servers = {name: serve(root / d) for name, d in
               (("target", "target"), ("perturbed", "perturbed"), ("same", "target"), ("other", "other"))}
    reference = [plain_greedy(servers["target"].address, p, TOKENS) for p in PROMPTS]
    yield request.param, servers, reference
    for s in servers.values():
        s.stop()


@pytest.mark.parametrize("n_draft", [1, 4])
def test_greedy_speculative_output_equals_plain_greedy_on_the_target(tiny, n_draft):
    family, servers, reference = tiny
    results, stats = run_speculative(servers["target"].address, servers["perturbed"].address, PROMPTS, TOKENS,
                                     num_draft_tokens=n_draft)
    assert [r.token_ids for r in results] == reference
    assert all(r.finish_reason == "length" for r in results)
    # Partial acceptance: both the accept and the reject-and-roll-back paths ran.
    assert 0 < stats.accepted < stats.proposed, stats
    assert stats.full_accepts > 0 or n_draft > 1
    print(f"\n{family} perturbed draft, N={n_draft}: acceptance {stats.acceptance_rate:.2f}, "
          f"{stats.tokens_per_round:.2f} tokens per target call")
    assert_clean(servers["target"].address, servers["perturbed"].address)


def test_identical_draft_accepts_everything_and_a_foreign_one_almost_nothing(tiny):
    _, servers, reference = tiny
    same, s_same = run_speculative(servers["target"].address, servers["same"].address, PROMPTS, TOKENS,
                                   num_draft_tokens=4)
    other, s_other = run_speculative(servers["target"].address, servers["other"].address, PROMPTS, TOKENS,
                                     num_draft_tokens=3)
    assert [r.token_ids for r in same] == reference == [r.token_ids for r in other]
    assert s_same.acceptance_rate == 1.0 and s_same.full_accepts == s_same.rounds
    assert s_other.acceptance_rate < 0.5
    # Everything accepted: 5 tokens per target call; the draft catches up with the bonus token.
    assert s_same.tokens_per_round > 4
    assert_clean(*(s.address for s in servers.values()))


def test_a_draft_with_a_shorter_limit_does_not_cut_the_target_short(tiny, tmp_path):
    """The output is the target's: a draft that holds 30 positions only proposes less."""
    import json

    family, servers, reference = tiny
    build(family, tmp_path / "short")
    config = json.loads((tmp_path / "short" / "config.json").read_text())
    (tmp_path / "short" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 30}))
    short = serve(tmp_path / "short")
    try:
        results, _ = run_speculative(servers["target"].address, short.address, PROMPTS[:2], TOKENS,
                                     num_draft_tokens=3)
        assert [r.token_ids for r in results] == reference[:2]
        assert_clean(servers["target"].address, short.address)
    finally:
        short.stop()


@pytest.mark.parametrize("side", ["target", "draft"])
def test_a_first_prefill_whose_answer_is_lost_leaves_no_cache(tiny, side):
    """The server made the cache, the answer never came: the ids are the client's own, so the
    clean-up still releases it (with server-chosen ids it stayed until its lease ran out)."""
    from client import DeadlineExceededError

    _, servers, _ = tiny

    async def go():
        t = AsyncExecutorClient(servers["target"].address, timeout=120)
        d = AsyncExecutorClient(servers["perturbed"].address, timeout=120)
        lossy = t if side == "target" else d
        real = lossy.prefill

        async def answer_lost(item, **kwargs):
            await real(item, **kwargs)
            raise DeadlineExceededError("the answer did not arrive in time (injected)")

        lossy.prefill = answer_lost
        try:
            with pytest.raises(DeadlineExceededError):
                await SpeculativeDecoder(t, d, num_draft_tokens=3).generate(PROMPTS[2], max_tokens=8)
        finally:
            await t.close()
            await d.close()

    asyncio.run(go())
    assert_clean(servers["target"].address, servers["perturbed"].address)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_and_end_of_sequence_cut_rounds_short(tiny, max_tokens):
    _, servers, reference = tiny
    results, _ = run_speculative(servers["target"].address, servers["perturbed"].address, PROMPTS[:3],
                                 max_tokens, num_draft_tokens=4)
    assert [r.token_ids for r in results] == [ref[:max_tokens] for ref in reference[:3]]
    # A stop id ends the output before it, even in the middle of an accepted run.
    ref = reference[3]
    stop = next(t for t in ref[3:] if t not in ref[:3]) if any(t not in ref[:3] for t in ref[3:]) else ref[0]
    async def go():
        async with AsyncExecutorClient(servers["target"].address) as t, \
                AsyncExecutorClient(servers["perturbed"].address) as d:
            return await SpeculativeDecoder(t, d).generate(PROMPTS[3], max_tokens=TOKENS, stop_token_ids=[stop])
    res = asyncio.run(go())
    assert res.finish_reason == "stop" and res.token_ids == ref[:ref.index(stop)]
    assert_clean(servers["target"].address, servers["perturbed"].address)


def test_sampled_verification_over_grpc(tiny):
    _, servers, _ = tiny
    kw = {"num_draft_tokens": 3, "temperature": 0.8}
    same, s_same = run_speculative(servers["target"].address, servers["same"].address, PROMPTS[:3], 20, seed=1, **kw)
    again, _ = run_speculative(servers["target"].address, servers["same"].address, PROMPTS[:3], 20, seed=1, **kw)
    other, s_other = run_speculative(servers["target"].address, servers["other"].address, PROMPTS[:3], 20, seed=2,
                                     **kw)
    assert [r.token_ids for r in same] == [r.token_ids for r in again]  # seeded: reproducible
    assert all(len(r.token_ids) == 20 and all(0 <= t < VOCAB for t in r.token_ids) for r in same + other)
    # Same weights, same distribution: p_T/p_D is 1 up to float rounding, so nearly all are kept.
    assert s_same.acceptance_rate > 0.9 and s_other.acceptance_rate < s_same.acceptance_rate
    assert_clean(*(s.address for s in servers.values()))


def test_speculative_sampling_leaves_the_target_distribution_unchanged():
    """Monte Carlo over accept_sampled: each emitted token is distributed as the target's row."""
    gen = np.random.default_rng(0)
    vocab, n = 5, 2
    p_t = gen.dirichlet(np.ones(vocab), size=n + 1)
    p_d = gen.dirichlet(np.ones(vocab), size=n)
    firsts, seconds = np.zeros(vocab), np.zeros(vocab)
    trials = 40000
    for _ in range(trials):
        drafts = [int(gen.choice(vocab, p=p_d[i])) for i in range(n)]
        k, nxt = accept_sampled(drafts, p_d, p_t, gen)
        emitted = drafts[:k] + [nxt]
        firsts[emitted[0]] += 1
        if len(emitted) > 1:
            seconds[emitted[1]] += 1
    np.testing.assert_allclose(firsts / trials, p_t[0], atol=0.012)
    np.testing.assert_allclose(seconds / seconds.sum(), p_t[1], atol=0.02)
    assert accept_greedy([3, 4, 5], [3, 4, 9, 1]) == (2, 9)
    assert accept_greedy([3, 4], [3, 4, 7]) == (2, 7)
    assert accept_greedy([], [6]) == (0, 6)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_dir):
    target = serve(smollm2_dir, block_size=16, num_blocks=128)
    draft = serve(smollm2_dir, block_size=16, num_blocks=128, dtype="bfloat16")
    yield target, draft
    target.stop()
    draft.stop()


def test_smollm2_target_with_a_bfloat16_draft_equals_plain_greedy(smollm2_pair, smollm2_dir):
    from client.tokenizer import TextTokenizer

    target, draft = smollm2_pair
    tok = TextTokenizer(smollm2_dir)
    prompts = [tok.encode("The capital of France is"),
               tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]))]
    reference = [plain_greedy(target.address, p, 32) for p in prompts]
    results, stats = run_speculative(target.address, draft.address, prompts, 32, num_draft_tokens=4)
    assert [r.token_ids for r in results] == reference, [tok.decode(r.token_ids) for r in results]
    print(f"\nSmolLM2 fp32 target, bf16 draft, N=4: acceptance {stats.acceptance_rate:.2f}, "
          f"{stats.tokens_per_round:.2f} tokens per target call")
    assert stats.acceptance_rate > 0.5
    assert_clean(target.address, draft.address)


def test_the_benchmark_runs(tmp_path, capsys):
    """A tiny smoke run of bench.speculative (`python -m bench.speculative`) on a tiny model, a 1-layer draft."""
    import json

    from bench.speculative import main

    build("qwen3", tmp_path / "m")
    out = tmp_path / "result.json"
    # In-process servers: the child processes of a real run would each spend their start-up importing torch.
    assert main(["--model", str(tmp_path / "m"), "--draft", "layers:1", "--num-draft-tokens", "2",
                 "--max-tokens", "6", "--random-prompts", "2", "--repeats", "1", "--in-process",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "acceptance" in text and "speed-up" in text
    rows = json.loads(out.read_text())["results"]
    assert [r["draft"] for r in rows] == ["layers:1"] and rows[0]["identical"] and rows[0]["tokens"] == 12
