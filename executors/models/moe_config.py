"""MoeConfig: how a mixture-of-experts checkpoint routes, read from its config.json.

The layouts, all top-k routing over the scores of one linear router:

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
- MiniMax-M2 (`MiniMaxM2ForCausalLM`): Mixtral's names, every layer sparse, GLM-4.5's
  sigmoid scores and correction (`block_sparse_moe.e_score_correction_bias`) without groups,
  scaling or shared experts, the chosen weights renormalised.
- GPT-OSS (`GptOssForCausalLM`): `mlp.router` (a weight and a bias), its top k logits'
  softmax (the weights renormalised, as a softmax over all and then the k); the experts as
  stacked tensors with biases (`mlp.experts.gate_up_proj`, its gate and up columns
  interleaved, `down_proj`; stacked_experts.py) and a clamped SwiGLU (`swiglu_limit`,
  `swiglu_alpha`), as wide as `intermediate_size`, in every layer.
- Granite MoE (`GraniteMoeForCausalLM`, Granite 3.x's MoE models): `block_sparse_moe.router.layer`
  (no bias; the softmax of its top k logits), the experts stacked without biases
  (`block_sparse_moe.input_linear` [E, 2I, hidden], gate then up, and `output_linear`; read
  as GPT-OSS's stacked experts, stacked_experts.py), every layer sparse; `GraniteMoeShared`
  adds a gated `shared_mlp` beside them (`shared_intermediate_size` wide, no gate on its sum).
- GLM-4.5 (`Glm4MoeForCausalLM`) and DeepSeek V3 (`DeepseekV3ForCausalLM`, Kimi K2's too):
  sigmoid scores, the experts chosen by score plus `mlp.gate.e_score_correction_bias` among
  the `topk_group` best of `n_group` groups (a group scored by its two best), their scores
  renormalised and times `routed_scaling_factor`; `mlp.shared_experts` (`n_shared_experts`
  experts wide, no gate) beside them; the first `first_k_dense_replace` layers dense.
- DeepSeek V2 (`DeepseekV2ForCausalLM`): GLM-4.5's layout with a softmax router, its
  top k over every expert (`topk_method: greedy`) or within the `topk_group` best groups, a
  group scored by its best (`group_limited_greedy`), the weights times
  `routed_scaling_factor` and never renormalised (as transformers reads it).

Router options a family's transformers model does not read (grouped top-k, sigmoid scoring,
scaling factors on the softmax families) are refused by name rather than served wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from executors.models.errors import UnsupportedModel

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "minimax_m2", "gpt_oss", "granitemoe",
                "granitemoeshared", "deepseek_v2", "deepseek_v3")
# Router options of the grouped families (DeepSeek's, GLM-4.5's): a config of a softmax family
# that sets one to something other than its plain-softmax value is refused.
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
    # "qwen" (mlp.experts.N.gate_proj), "mixtral" (block_sparse_moe.experts.N.w1), "gpt_oss"
    # (mlp.experts.gate_up_proj: every expert in one tensor, with biases; mlp.router with a bias)
    # or "granite" (block_sparse_moe.experts.gate_up_proj, stacked, no biases: its files'
    # input_linear, renamed as transformers renames it)
    style: str
    # GLM-4.5: sigmoid scores (else a softmax), the groups top-k picks from, the chosen
    # weights' factor; its shared experts have no gate (Qwen2-MoE's one is behind a sigmoid).
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_gated: bool = True
    # Where e_score_correction_bias sits: on the router (GLM-4.5's mlp.gate) or on the sparse
    # block itself (MiniMax-M2's block_sparse_moe).
    correction_on_block: bool = False
    # GPT-OSS's experts' activation: gate clamped above at swiglu_limit, up to +-swiglu_limit,
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: act(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    @property
    def grouped(self) -> bool:
        """Routed as DeepSeek's routers are (moe_routing.GroupedRouting), not as a plain softmax top k."""
        return self.scoring == "sigmoid" or self.n_group > 1 or self.routed_scaling_factor != 1.0

    @property
    def stacked(self) -> bool:
        """The experts held as stacked tensors (GPT-OSS's, Granite's), not a module each."""
        return self.style in ("gpt_oss", "granite")

    @property
    def clamp(self) -> tuple[float, float] | None:
        """GPT-OSS's clamped SwiGLU's (limit, alpha); None: act(gate) * up."""
        return None if self.swiglu_limit is None else (self.swiglu_limit, self.swiglu_alpha)

    @property
    def biased(self) -> bool:
        """Biases on the router and on each expert's projections (GPT-OSS)."""
        return self.style == "gpt_oss"

    @property
    def router_name(self) -> str:
        """The sparse layer's attribute holding the router, as the checkpoint names it."""
        return "router" if self.stacked else "gate"

    @property
    def module_name(self) -> str:
        """The decoder layer's attribute holding the experts, as the checkpoint names it."""
        return "block_sparse_moe" if self.style in ("mixtral", "granite") else "mlp"

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """An expert's gate, up and down projections, as the checkpoint names them."""
        return ("w1", "w3", "w2") if self.style == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    @property
    def shared_name(self) -> str:
        """The sparse layer's attribute holding the shared expert(s), as the checkpoint names it."""
        if self.style == "granite":
            return "shared_mlp"
        return "shared_expert" if self.shared_gated else "shared_experts"

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


def moe_from_dict(cfg: dict[str, Any], family: str, layers: int) -> MoeConfig | None:
    if family not in MOE_FAMILIES:
        return None
    if family in _SIGMOID_DEFAULTS:
        return _sigmoid_groups(cfg, layers, _SIGMOID_DEFAULTS[family])
    if family == "deepseek_v2":
        return _deepseek_v2(cfg, layers)
    if family == "gpt_oss":
        return _gpt_oss(cfg, layers)
    if family in ("granitemoe", "granitemoeshared"):
        return _granite_moe(cfg, layers, family == "granitemoeshared")
    arch = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
            "minimax_m2": "MiniMaxM2ForCausalLM"}.get(family, "MixtralForCausalLM")
    for key, allowed in _PLAIN_ROUTER.items():  # (MiniMax-M2's files say scoring_func: sigmoid, which it is)
        if family != "minimax_m2" and cfg.get(key) not in allowed:
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
    if family == "minimax_m2":  # its router always renormalises
        return MoeConfig(experts, top_k, int(cfg["intermediate_size"]), True, 0, (True,) * layers, "mixtral",
                         scoring="sigmoid", correction_on_block=True)
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


# The config classes' defaults (Glm4MoeConfig, DeepseekV3Config) where the file omits a key.
_SIGMOID_DEFAULTS = {
    "glm4_moe": {"n_routed_experts": 128, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "norm_topk_prob": True, "moe_intermediate_size": 1408,
                 "first_k_dense_replace": 1, "n_shared_experts": 1},
    "deepseek_v3": {"n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "moe_intermediate_size": 2048,
                    "first_k_dense_replace": 3, "n_shared_experts": 1},
}


def _count(cfg: dict[str, Any], key: str, default: int | None, least: int = 1) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise UnsupportedModel(f"{key} must be an integer >= {least}, got {value!r}")
    return value


def _groups(cfg: dict[str, Any], defaults: dict[str, Any]) -> tuple[int, int, int, int, float]:
    """(experts, top_k, n_group, topk_group, routed_scaling_factor), checked: the groups split
    the experts evenly, and the best ones hold k experts to choose from."""
    experts, top_k = _count(cfg, "n_routed_experts", defaults["n_routed_experts"]), _count(
        cfg, "num_experts_per_tok", defaults["num_experts_per_tok"])
    groups, chosen = _count(cfg, "n_group", defaults["n_group"]), _count(cfg, "topk_group", defaults["topk_group"])
    if experts % groups or (groups > 1 and experts // groups < 2):
        raise UnsupportedModel(f"n_group {groups} must divide n_routed_experts {experts} into groups of 2 or more")
    if chosen > groups or top_k > chosen * (experts // groups):
        raise UnsupportedModel(f"num_experts_per_tok {top_k} from topk_group {chosen} of n_group {groups} groups of "
                               f"{experts // groups} experts cannot be chosen")
    scale = cfg.get("routed_scaling_factor", defaults["routed_scaling_factor"])
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise UnsupportedModel(f"routed_scaling_factor must be a positive number, got {scale!r}")
    return experts, top_k, groups, chosen, float(scale)


def _sigmoid_groups(cfg: dict[str, Any], layers: int, defaults: dict[str, Any]) -> MoeConfig:
    """Glm4MoeConfig's and DeepseekV3Config's reading (their defaults where the file omits a key;
    as transformers, a file's scoring_func and topk_method are not read: the router is theirs)."""
    experts, top_k, groups, chosen, scale = _groups(cfg, defaults)
    norm = cfg.get("norm_topk_prob", defaults["norm_topk_prob"])
    if not isinstance(norm, bool):
        raise UnsupportedModel(f"norm_topk_prob must be true or false, got {norm!r}")
    inter = _count(cfg, "moe_intermediate_size", defaults["moe_intermediate_size"])
    dense = _count(cfg, "first_k_dense_replace", defaults["first_k_dense_replace"], least=0)
    # (0 would make transformers' shared experts zero-width matrices, which its files then hold)
    shared = _count(cfg, "n_shared_experts", defaults["n_shared_experts"]) * inter
    return MoeConfig(experts, top_k, inter, norm, shared, tuple(i >= dense for i in range(layers)), "qwen",
                     scoring="sigmoid", n_group=groups, topk_group=chosen, routed_scaling_factor=scale,
                     shared_gated=False)


_V2_DEFAULTS = {"n_routed_experts": 64, "num_experts_per_tok": None, "n_group": None, "topk_group": None,
                "routed_scaling_factor": 1.0}


def _deepseek_v2(cfg: dict[str, Any], layers: int) -> MoeConfig:
    """DeepseekV2Config's reading (its defaults where the file omits a key)."""
    method = cfg.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModel(f"topk_method {method!r} is not supported for DeepseekV2ForCausalLM "
                               "(greedy, group_limited_greedy)")
    if cfg.get("norm_topk_prob"):  # DeepseekV2TopkRouter never renormalises; DeepSeek's own code would
        raise UnsupportedModel("norm_topk_prob: true is not supported for DeepseekV2ForCausalLM "
                               "(its transformers router does not renormalise)")
    if cfg.get("moe_layer_freq", 1) != 1:  # transformers makes every layer from first_k_dense_replace sparse
        raise UnsupportedModel(f"moe_layer_freq {cfg['moe_layer_freq']!r} is not supported; 1 is")
    # greedy: every expert a candidate (the file's n_group and topk_group not read)
    reading = cfg if method == "group_limited_greedy" else {**cfg, "n_group": 1, "topk_group": 1}
    experts, top_k, groups, chosen, scale = _groups(reading, _V2_DEFAULTS)
    inter = _count(cfg, "moe_intermediate_size", 1407)
    dense = _count(cfg, "first_k_dense_replace", 0, least=0)
    shared = _count(cfg, "n_shared_experts", 2) * inter
    return MoeConfig(experts, top_k, inter, False, shared, tuple(i >= dense for i in range(layers)), "qwen",
                     n_group=groups, topk_group=chosen, routed_scaling_factor=scale, shared_gated=False)


def _local_experts(cfg: dict[str, Any], experts: int, top_k: int) -> tuple[int, int]:
    """num_local_experts and num_experts_per_tok, checked, the class's defaults where the file omits them."""
    experts, top_k = cfg.get("num_local_experts", experts), cfg.get("num_experts_per_tok", top_k)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise UnsupportedModel(f"num_local_experts must be an integer >= 1, got {experts!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        raise UnsupportedModel(f"num_experts_per_tok must be between 1 and num_local_experts ({experts}), got {top_k!r}")
    return experts, top_k


def _gpt_oss(cfg: dict[str, Any], layers: int) -> MoeConfig:
    """GptOssConfig's reading (its defaults where the file omits a key)."""
    experts, top_k = _local_experts(cfg, 128, 4)
    limit, alpha = cfg.get("swiglu_limit", 7.0), cfg.get("swiglu_alpha", 1.702)
    for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise UnsupportedModel(f"{key} must be a positive number, got {value!r}")
    return MoeConfig(experts, top_k, int(cfg.get("intermediate_size", 2880)), True, 0, (True,) * layers, "gpt_oss",
                     swiglu_limit=float(limit), swiglu_alpha=float(alpha))


def _granite_moe(cfg: dict[str, Any], layers: int, shared: bool) -> MoeConfig:
    """GraniteMoeConfig's (GraniteMoeSharedConfig's) reading, their defaults where the file omits a key."""
    experts, top_k = _local_experts(cfg, 8, 2)
    width = cfg.get("shared_intermediate_size", 0) if shared else 0
    if not isinstance(width, int) or isinstance(width, bool) or width < 0:
        raise UnsupportedModel(f"shared_intermediate_size must be an integer >= 0, got {width!r}")
    return MoeConfig(experts, top_k, int(cfg.get("intermediate_size", 11008)), True, width, (True,) * layers,
                     "granite", shared_gated=False)
