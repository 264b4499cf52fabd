"""MoeConfig: how a mixture-of-experts checkpoint routes, read from its config.json.

Four layouts, all top-k routing over a softmax of one linear router:

- Qwen3-MoE (`Qwen3MoeForCausalLM`): `mlp.gate` and `mlp.experts.N.{gate,up,down}_proj`;
  `norm_topk_prob` renormalises the k weights to sum to 1; layers listed in
  `mlp_only_layers`, and those off the `decoder_sparse_step` grid, keep a dense MLP.
- Qwen2-MoE (`Qwen2MoeForCausalLM`): the same, plus `mlp.shared_expert` that every token
  runs, scaled by sigmoid(`mlp.shared_expert_gate`).
- Mixtral (`MixtralForCausalLM`): `block_sparse_moe.gate` and
  `block_sparse_moe.experts.N.{w1,w3,w2}` (gate, up, down), weights always renormalised,
  every layer sparse, experts as wide as `intermediate_size`.
- OLMoE (`OlmoeForCausalLM`): Qwen3-MoE's names, every layer sparse, experts as wide as
  `intermediate_size`, `norm_topk_prob` off by default.

Router options this decoder does not implement (grouped top-k, sigmoid scoring, scaling
factors) are refused by name rather than served wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from executors.models.errors import UnsupportedModel

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
# Router options of other MoE families (DeepSeek, GLM, ...): a config that sets one to
# something other than its plain-softmax value is refused.
_PLAIN_ROUTER = {"scoring_func": (None, "softmax"), "topk_method": (None, "greedy"), "n_group": (None, 1), "topk_group": (None, 1),
                 "routed_scaling_factor": (None, 1, 1.0), "moe_router_topk_scaling": (None,),
                 "n_shared_experts": (None, 0)}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    norm_topk_prob: bool  # renormalise the k chosen weights to sum to 1
    shared_intermediate_size: int  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP
    style: str  # "qwen" (mlp.experts.N.gate_proj) or "mixtral" (block_sparse_moe.experts.N.w1)

    @property
    def module_name(self) -> str:
        """The decoder layer's attribute holding the experts, as the checkpoint names it."""
        return "block_sparse_moe" if self.style == "mixtral" else "mlp"

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """An expert's gate, up and down projections, as the checkpoint names them."""
        return ("w1", "w3", "w2") if self.style == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


def moe_from_dict(cfg: dict[str, Any], family: str, layers: int) -> MoeConfig | None:
    if family not in MOE_FAMILIES:
        return None
    arch = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "olmoe": "OlmoeForCausalLM"}.get(family, "MixtralForCausalLM")
    for key, allowed in _PLAIN_ROUTER.items():
        if cfg.get(key) not in allowed:
            raise UnsupportedModel(f"router option {key}={cfg[key]!r} is not supported for {arch} "
                                   f"(only plain softmax top-k routing)")
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 saves the latter for Qwen
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts < 1:
        raise UnsupportedModel(f"{arch} needs num_experts (or num_local_experts) >= 1, got {experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise UnsupportedModel(f"num_experts_per_tok must be between 1 and num_experts ({experts}), got {top_k!r}")
    norm = cfg.get("norm_topk_prob", family == "mixtral")
    if not isinstance(norm, bool):
        raise UnsupportedModel(f"norm_topk_prob must be true or false, got {norm!r}")
    if family == "mixtral":
        return MoeConfig(experts, top_k, int(cfg["intermediate_size"]), True, 0, (True,) * layers, "mixtral")
    if family == "olmoe":
        return MoeConfig(experts, top_k, int(cfg["intermediate_size"]), norm, 0, (True,) * layers, "qwen")
    if "moe_intermediate_size" not in cfg:
        raise UnsupportedModel(f"config.json lacks 'moe_intermediate_size', which {arch} needs")
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedModel(f"decoder_sparse_step must be >= 1, got {step}")
    dense = set(cfg.get("mlp_only_layers") or ())
    if not dense <= set(range(layers)):
        raise UnsupportedModel(f"mlp_only_layers names layers outside 0..{layers - 1}: {sorted(dense - set(range(layers)))}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return MoeConfig(experts, top_k, int(cfg["moe_intermediate_size"]), norm, shared, sparse, "qwen")
