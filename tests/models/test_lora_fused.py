"""LoRA on Phi-3's fused projections (qkv_proj, gate_up_proj), GLM-4's (gate_up_proj) and
StarCoder2's and Phi's renamed ones (c_fc, c_proj; dense, fc1, fc2: the decoder's o_proj, up_proj
and down_proj) against
transformers + PEFT.

Phi-4-mini's partial rotary embeddings and GLM-4's interleaved ones reorder q's and k's rows as
they load (partial_rotary.py); an adapter's B rows for them are reordered the same way.

PEFT adapts the modules the transformers model has, so a Phi-3 adapter carries one A and B
for qkv_proj and one for gate_up_proj. The decoder keeps q/k/v and gate/up as parameters of
their own; build_adapter cuts each fused pair into its parts' (the same A, B's rows), which
must give PEFT's output exactly (fp32, 1e-4), on the fast path and on the reference, in a
batch that mixes both adapters and none.
"""

from __future__ import annotations

import pytest
import torch

from executors.lora import LoraAdapterError, LoraTargets, build_adapter, read_peft_dir
from executors.models.loader import load_model
from tests.models.test_lora import TOL, forward, max_diff, prompt
from tests.models.tiny_models import build

ADAPTERS = {
    "all": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    "narrow": {"r": 4, "lora_alpha": 12, "use_rslora": True, "layers_to_transform": [0, 2]},
}
# Per family: the narrow adapter's targets; the modules PEFT resolves all-linear to.
NARROW = {"phi3": ["qkv_proj", "down_proj"], "phi4_mini": ["qkv_proj", "down_proj"], "glm4": ["k_proj", "gate_up_proj"],
          "starcoder2": ["v_proj", "c_fc"], "phi": ["v_proj", "fc1"]}
ALL_LINEAR = {"phi3": {"down_proj", "gate_up_proj", "o_proj", "qkv_proj"},
              "glm4": {"down_proj", "gate_up_proj", "o_proj", "q_proj", "k_proj", "v_proj"}}
MIXED = [("all", 9), (None, 6), ("narrow", 14), ("all", 12), ("narrow", 1)]


class Phi3:
    def __init__(self, family: str, root) -> None:
        from peft import LoraConfig, get_peft_model

        base = build(family, root / "base")
        self.model = load_model(root / "base", torch.float32, "cpu")
        self.targets = LoraTargets.from_config(self.model.config)
        torch.manual_seed(23)
        first, second = ADAPTERS
        self.family = family
        self.peft = get_peft_model(base, LoraConfig(**ADAPTERS[first], init_lora_weights=False), adapter_name=first)
        self.peft.add_adapter(second, LoraConfig(**ADAPTERS[second], target_modules=NARROW[family],
                                                 init_lora_weights=False))
        self.peft.eval()
        self.peft.save_pretrained(root / "adapters")
        self.saved = {name: read_peft_dir(root / "adapters" / name) for name in ADAPTERS}
        self.adapters = {name: build_adapter(name, f"{name}@1", *self.saved[name], self.targets, dtype=torch.float32,
                                             device="cpu", max_rank=16, source="test") for name in ADAPTERS}
        self.prompts = [prompt(n) for _, n in MIXED]

    @torch.no_grad()
    def oracle(self, adapter: str | None, tokens: torch.Tensor) -> torch.Tensor:
        causal_lm = self.peft.get_base_model()
        if adapter is None:
            with self.peft.disable_adapter():
                return causal_lm(tokens[None]).logits[0]
        self.peft.set_adapter(adapter)
        return causal_lm(tokens[None]).logits[0]


# phi4_mini: partial rotary embeddings, so B's rows of q and k follow the order the loader
# gave the weights' (the prompts stay within its LongRoPE's original context); glm4: q/k/v on
# their own, gate/up fused, half of each head rotating in neighbouring pairs.
@pytest.fixture(scope="module", params=["phi3", "phi4_mini", "glm4"])
def phi3(request, tmp_path_factory) -> Phi3:
    return Phi3(request.param, tmp_path_factory.mktemp(request.param))


def test_peft_names_the_fused_modules_and_the_adapter_reports_them(phi3):
    config, tensors = phi3.saved["all"]
    # PEFT saves all-linear resolved, as the modules' paths.
    modules = ALL_LINEAR["glm4" if phi3.family == "glm4" else "phi3"]
    assert {t.rsplit(".", 1)[-1] for t in config["target_modules"]} == modules
    assert any(".gate_up_proj.lora_B" in name for name in tensors)
    adapter = phi3.adapters["all"]
    assert adapter.target_modules == tuple(sorted(modules))
    # Counted as PEFT stores it (one A per fused projection), though q, k and v each use it.
    assert adapter.num_parameters == sum(t.numel() for t in tensors.values())
    assert adapter.nbytes == 4 * adapter.num_parameters
    assert {m for _, m in adapter.weights} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"}
    a_q, b_q = adapter.weights[(0, "q_proj")]
    a_v, b_v = adapter.weights[(0, "v_proj")]
    assert (a_q is a_v) == (phi3.family != "glm4")  # the parts share a fused pair's A
    assert adapter.weights[(0, "gate_proj")][0] is adapter.weights[(0, "up_proj")][0]
    q = phi3.model.config.num_heads * phi3.model.config.head_dim
    assert b_q.shape == (q, 8) and b_v.shape == (phi3.model.config.num_kv_heads * phi3.model.config.head_dim, 8)
    narrow = phi3.adapters["narrow"]
    parts = ("gate_proj", "k_proj", "up_proj") if phi3.family == "glm4" else ("down_proj", "k_proj", "q_proj", "v_proj")
    assert sorted(narrow.weights) == [(layer, m) for layer in (0, 2) for m in parts]


def mixed_batch_matches_peft(phi3: Phi3, reference: bool) -> None:
    batch = [(phi3.adapters.get(name), p) for (name, _), p in zip(MIXED, phi3.prompts, strict=True)]
    outs, lora = forward(phi3.model, batch, reference)
    for (name, _), p, (_, logits) in zip(MIXED, phi3.prompts, outs, strict=True):
        want = phi3.oracle(name, p)
        assert max_diff(logits, want) <= TOL, name
        if name is not None:  # the adapter matters
            assert max_diff(logits, phi3.oracle(None, p)) > 100 * TOL, name
    assert lora.applications == len(phi3.adapters["all"].weights) + len(phi3.adapters["narrow"].weights)


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_a_mixed_batch_matches_peft(phi3, reference):
    mixed_batch_matches_peft(phi3, reference)


# Per family: PEFT's names of o_proj, up_proj and down_proj.
RENAMED = {"starcoder2": ("o_proj", "c_fc", "c_proj"), "phi": ("dense", "fc1", "fc2")}


@pytest.fixture(scope="module", params=list(RENAMED))
def renamed(request, tmp_path_factory) -> Phi3:
    return Phi3(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_ungated_mlps_take_peft_adapters_by_their_own_names(renamed, reference):
    """PEFT adapts StarCoder2's c_fc and c_proj, Phi's dense, fc1 and fc2 (all-linear resolves
    to them); the decoder's o_proj, up_proj and down_proj take their pairs whole, on an MLP
    without a gate (Phi's beside attention, on the same norm's output)."""
    o, up, down = RENAMED[renamed.family]
    config, tensors = renamed.saved["all"]
    theirs = {"q_proj", "k_proj", "v_proj", o, up, down}
    assert {t.rsplit(".", 1)[-1] for t in config["target_modules"]} == theirs
    adapter = renamed.adapters["all"]
    assert adapter.target_modules == tuple(sorted(theirs))
    assert {m for _, m in adapter.weights} == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}
    assert sorted(renamed.adapters["narrow"].weights) == [(layer, m) for layer in (0, 2) for m in ("up_proj", "v_proj")]
    mixed_batch_matches_peft(renamed, reference)
    ours = {name.replace(f".{up}.", ".up_proj."): t for name, t in tensors.items()}
    with pytest.raises(LoraAdapterError, match=f"target module 'up_proj' is not one this executor can adapt; "
                                               f"supported: q_proj, k_proj, v_proj, {o}, {up}, {down}"):
        build_adapter("renamed", "renamed@1", {**config, "target_modules": ["up_proj"]}, ours,
                      renamed.targets, dtype=torch.float32, device="cpu", max_rank=16, source="test")


def test_the_split_projections_are_refused_by_their_own_names(phi3):
    """A part of a fused projection is not a module of the family's transformers model."""
    config, tensors = phi3.saved["narrow"]
    glm = phi3.family == "glm4"
    fused, part = ("gate_up_proj", "gate_proj") if glm else ("qkv_proj", "q_proj")
    supported = ("q_proj, k_proj, v_proj, o_proj, gate_up_proj, down_proj" if glm
                 else "qkv_proj, o_proj, gate_up_proj, down_proj")
    renamed = {name.replace(fused, part): t for name, t in tensors.items()}
    targets = [part if t == fused else t for t in NARROW[phi3.family]]
    with pytest.raises(LoraAdapterError, match=rf"target module '{part}' is not one this executor can adapt; "
                                               rf"supported: {supported}"):
        build_adapter("renamed", "renamed@1", {**config, "target_modules": targets}, renamed,
                      phi3.targets, dtype=torch.float32, device="cpu", max_rank=16, source="test")
    short = dict(tensors)
    name = next(n for n in short if f".{fused}.lora_B" in n)
    short[name] = short[name][:-1]  # one output row short of the parts'
    with pytest.raises(LoraAdapterError, match=rf"{fused} maps 64 -> {256 if glm else 128} features"):
        build_adapter("short", "short@1", config, short, phi3.targets, dtype=torch.float32, device="cpu",
                      max_rank=16, source="test")
