"""MlaConfig: DeepSeek V2's and V3's multi-head latent attention, read from config.json.

MLA projects each token's keys and values through one low-rank latent: kv_a_proj_with_mqa
gives a [kv_lora_rank] latent (then RMSNormed) and a [qk_rope_head_dim] rotary key shared by
every head; kv_b_proj expands the latent into each head's non-rotary key
([qk_nope_head_dim]) and value ([v_head_dim]). Queries come from q_proj, or through a
low-rank q_a_proj, its RMSNorm and q_b_proj where q_lora_rank is set.

The executor caches the latent and the rotary key (kv_lora_rank + qk_rope_head_dim numbers a
token a layer, as one KV head) rather than the expanded keys and values, and attends in the
latent space (mla.py). To every attention path that is grouped-query attention with one KV
head of that width: DecoderConfig.head_dim is the latent row's width, num_kv_heads 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from executors.models.errors import UnsupportedModel
from executors.models.rope_config import RopeScaling, yarn_mscale

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
# DeepseekV2Config's and DeepseekV3Config's defaults (the same) where the file omits a key.
_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128}


@dataclass(frozen=True, slots=True)
class MlaConfig:
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int  # the latent every head's key and value are expanded from
    qk_nope_head_dim: int  # a head's key dimensions that do not rotate (from the latent)
    qk_rope_head_dim: int  # its rotated ones (one rotary key shared by every head)
    v_head_dim: int
    # DeepSeek lays each rotary pair out as neighbours (2i, 2i + 1) (V2 always; V3 where
    # rope_interleave, its default): the loader reorders those rows into NeoX halves (mla.py).
    interleaved: bool

    @property
    def latent_dim(self) -> int:
        """A cached row: the normed latent, then the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def score_scale(self, scaling: RopeScaling | None) -> float:
        """The scale of q.k: qk_head_dim ** -0.5, times YaRN's mscale of mscale_all_dim squared
        (transformers' yarn_apply_mscale)."""
        if scaling is None or scaling.kind != "yarn" or not scaling.mscale_all_dim:
            return self.qk_head_dim ** -0.5
        return self.qk_head_dim ** -0.5 * yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def mla_from_dict(cfg: dict[str, Any], family: str) -> MlaConfig | None:
    if family not in MLA_FAMILIES:
        return None

    def size(key: str) -> int:
        value = cfg.get(key, _DEFAULTS[key])
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnsupportedModel(f"{key} must be an integer >= 1, got {value!r}")
        return value

    q_rank = cfg.get("q_lora_rank", _DEFAULTS["q_lora_rank"])
    q_rank = None if q_rank is None else size("q_lora_rank")
    rope = size("qk_rope_head_dim")
    if rope % 2:
        raise UnsupportedModel(f"qk_rope_head_dim must be even (rotary pairs), got {rope}")
    latent, nope, v = size("kv_lora_rank"), size("qk_nope_head_dim"), size("v_head_dim")
    if (latent + rope) % 8:  # the CPU kernels' rows and the Triton kernels' tiles
        raise UnsupportedModel(f"kv_lora_rank + qk_rope_head_dim ({latent + rope}) must be a multiple of 8")
    interleaved = family == "deepseek_v2" or bool(cfg.get("rope_interleave", True))
    return MlaConfig(q_rank, latent, nope, rope, v, interleaved)
