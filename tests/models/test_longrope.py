"""Phi-4-mini's rope over gRPC against transformers (fp32, 1e-4): partial rotary embeddings
(3/4 of each head) and LongRoPE, past the original context.

transformers picks LongRoPE's short or long frequencies by the longest position of each
forward: generate()'s prompt within the original context (24 tokens here) gets the short
ones, and each token decoded after it the long ones once its position reaches 24. That is
the oracle here, a transformers forward token by token over its KV cache. The executor picks
them by each position alone, so a prompt that crosses 24 gets what that token-by-token
reading gives, whatever its chunks or batch mates (transformers' one forward over such a
prompt would rotate all of it with the long ones: the one reading where the two differ).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client import DecodeInput, PrefillInput
from tests.models.test_llm_executor import TOL, Served, close, prompt
from tests.models.tiny_models import LONGROPE_ORIGINAL

PROMPT = 16  # within the original context
TOTAL = 60  # well past it


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served("phi4_mini", tmp_path_factory.mktemp("longrope"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def tokens():
    return prompt(TOTAL)


@pytest.fixture(scope="module")
def stepwise(served, tokens) -> np.ndarray:
    """transformers' logits at each position: the prompt in one forward, then one token a forward."""
    from transformers import DynamicCache

    cache, rows = DynamicCache(), []
    with torch.no_grad():
        out = served.oracle(torch.tensor([tokens[:PROMPT]]), past_key_values=cache, use_cache=True)
        rows.extend(out.logits[0].float().numpy())
        for t in tokens[PROMPT:]:
            out = served.oracle(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1].float().numpy())
    return np.stack(rows)


def test_the_config_is_phi4_minis(served):
    config = served.executor.model_config
    assert config.rotary_dim == 12 and config.head_dim == 16
    assert config.rope_scaling.kind == "longrope"
    assert config.rope_scaling.original_max_position_embeddings == LONGROPE_ORIGINAL
    assert config.rope_scaling.attention_factor > 1.3


def test_decoding_past_the_original_context_matches_transformers(served, tokens, stepwise):
    c = served.client
    out = c.prefill(PrefillInput(tokens[:PROMPT]))
    close(out.logits.logits, stepwise[PROMPT - 1])
    handle = out.kv_cache
    for i in range(PROMPT, TOTAL):
        step = c.decode(DecodeInput(tokens[i], handle))
        handle = step.kv_cache
        close(step.logits.logits, stepwise[i])
    c.release_cache(handle)


def test_a_prompt_across_the_boundary_is_rotated_position_by_position(served, tokens, stepwise):
    """One prefill of 40 tokens, the same in chunks that start and end on either side of 24,
    and beside other prompts in one batch: each position rotated by its own frequencies."""
    c = served.client
    n = 40
    whole = c.prefill(PrefillInput(tokens[:n]))
    close(whole.logits.logits, stepwise[n - 1])
    handle = None
    for a, b in [(0, 7), (7, 26), (26, 31), (31, n)]:
        out = c.prefill(PrefillInput(tokens[a:b], kv_cache=handle))
        handle = out.kv_cache
        close(out.logits.logits, stepwise[b - 1])
    short, crossing, again = c.batch_prefill([PrefillInput(tokens[:10]), PrefillInput(tokens[:n]),
                                              PrefillInput(tokens[:30])])
    close(short.logits.logits, stepwise[9])
    close(crossing.logits.logits, stepwise[n - 1])
    close(again.logits.logits, stepwise[29])
    # What transformers' single forward over the whole prompt gives differs past the boundary
    # (its long frequencies for every position): the choice above is a real one.
    assert np.abs(served.logits(tokens[:n])[n - 1] - stepwise[n - 1]).max() > 10 * TOL
    for h in (whole.kv_cache, handle, short.kv_cache, crossing.kv_cache, again.kv_cache):
        c.release_cache(h)
    assert c.status().kv_pool.used_blocks == 0
