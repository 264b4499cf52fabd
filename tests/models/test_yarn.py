"""YaRN's frequencies and attention factor against transformers' own computation, bit for bit.

The tiny models of test_config_fidelity.py check whole forwards with YaRN configs, but 40
positions of a random model barely feel the ramp's ends or the rounding of them. Here the
inverse frequencies and the cos/sin gain executors/models/layers.py computes from a
DecoderConfig are compared exactly with transformers' `_compute_yarn_parameters` (through
ROPE_INIT_FUNCTIONS) for configs that move each of them: factor, betas, truncate, mscale,
an explicit attention factor, a null factor. (Phi-3 reads "yarn" as LongRoPE: that is
test_config_fidelity.py's.)
"""

from __future__ import annotations

import pytest
import torch

from executors.models.config import DecoderConfig
from executors.models.layers import inverse_frequencies, rope_tables

tf = pytest.importorskip("transformers")

BASE = {"vocab_size": 64, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32768}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 1e6}

CASES = {
    "qwen3_128k": YARN,
    "betas": {**YARN, "beta_fast": 24, "beta_slow": 2},
    "untruncated": {**YARN, "truncate": False},
    "mscale_ratio": {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707},
    "attention_factor": {**YARN, "attention_factor": 1.25},
    "null_factor": {**YARN, "factor": None, "original_max_position_embeddings": 4096},
    "factor_one": {**YARN, "factor": 1.0},
    "low_base": {**YARN, "rope_theta": 1e4, "original_max_position_embeddings": 2048},
    "factor_below_one": {**YARN, "factor": 0.5},  # no attention gain then
    "equal_betas": {**YARN, "beta_fast": 2, "beta_slow": 2, "truncate": False},  # a ramp of width 0.001
    # Head dim 16 with base 20: the ramp starts at dimension 6 and its slow end (20) lies past
    # the last one, where it is clamped (15).
    "clamped": {**YARN, "rope_theta": 20.0, "beta_fast": 128, "head_dim": 16},
}


@pytest.mark.parametrize("name", list(CASES))
def test_yarn_matches_transformers_bit_for_bit(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(CASES[name])
    base = {**BASE, "head_dim": rope.pop("head_dim", 128)}
    theirs_config = tf.Qwen3Config(**base, rope_parameters=dict(rope))
    inv_theirs, gain_theirs = ROPE_INIT_FUNCTIONS["yarn"](theirs_config, "cpu")
    ours = DecoderConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "rope_parameters": rope})
    scaling = ours.rope_scaling
    assert scaling.kind == "yarn"
    inv = inverse_frequencies(ours.head_dim, ours.rope_theta, scaling)
    assert torch.equal(inv, inv_theirs.float()), (inv - inv_theirs).abs().max()
    assert scaling.attention_factor == pytest.approx(gain_theirs, rel=1e-12)
    cos, sin = rope_tables(ours)
    # The positions YaRN is set for: its factor times the original context, at least.
    assert cos.shape[0] == max(32768, int(scaling.original_max_position_embeddings * scaling.factor))
    phases = torch.outer(torch.arange(cos.shape[0], dtype=torch.float32), inv_theirs.float())
    assert torch.equal(cos[:, :ours.head_dim // 2], phases.cos() * gain_theirs)
    assert torch.equal(sin[:, ours.head_dim // 2:], phases.sin() * gain_theirs)


def test_yarn_settings_transformers_fails_on_are_refused():
    from executors.models.errors import UnsupportedModel

    config = {**BASE, "architectures": ["Qwen3ForCausalLM"]}
    for rope, words in [({k: v for k, v in YARN.items() if k != "factor"}, "lacks 'factor'"),
                        ({**YARN, "beta_fast": -1}, "beta_fast must be a positive number"),
                        ({**YARN, "original_max_position_embeddings": 0}, "original_max_position_embeddings must be")]:
        with pytest.raises(UnsupportedModel, match=words):
            DecoderConfig.from_dict({**config, "rope_parameters": rope})
