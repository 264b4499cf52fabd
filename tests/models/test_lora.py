"""Multi-LoRA in DecoderLM against transformers + PEFT (fp32, max abs diff <= 1e-4), and the refusals at load.

The oracle is PEFT itself: adapters are made and saved by peft (random A and B, so every
delta counts), read back by executors.lora and served by our decoder; each sequence's
hidden states and logits must match the PeftModel with that sequence's adapter active, or
disabled for base rows. That pins down what users' adapters mean: PEFT's tensor layout,
its scaling (alpha / r, rsLoRA's alpha / sqrt(r)), target_modules and layers_to_transform.
One flat batch mixes sequences of two adapters and of none, as a serving step does, and
each must get exactly its own adapter's output, on the fast path and on the reference.
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from safetensors.torch import save as save_safetensors

from executors.lora import (
    LoraAdapter,
    LoraAdapterError,
    LoraTargets,
    build_adapter,
    read_peft_bytes,
    read_peft_dir,
)
from executors.lora_batch import LoraBatch
from executors.models.attention import Segment, StepContext
from executors.models.config import DecoderConfig
from executors.models.loader import load_model
from tests.models.tiny_models import VOCAB, build

TOL = 1e-4
# bfloat16 rounding through three layers moves these logits by up to ~0.04, while each
# adapter moves them by 0.6-1.1: a lost or misplaced delta still fails.
TOL_BF16 = 0.08
# Granite: B of o_proj and down_proj scaled; Gemma 2: sandwich norms, soft-capped scores;
# SmolLM3: NoPE layers; OLMo 2: deltas on q/k before its norms across heads; Cohere: parallel
# layers (the MLP's deltas on the input norm's output), q/k rows reordered; StableLM: partial rotation.
FAMILIES = ["qwen3", "llama", "qwen2", "granite", "gemma2", "smollm3", "olmo2", "cohere", "stablelm"]
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Two adapters that differ in everything PEFT lets them differ in: rank, alpha, scaling
# rule, targets, and a layer restriction (tiny_models has 3 or 4 layers; "narrow" skips layer 1).
ADAPTER_CONFIGS = {
    "wide": {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES},
    "narrow": {"r": 4, "lora_alpha": 12, "use_rslora": True, "layers_to_transform": [0, 2],
               "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]},
}
# Prompt lengths of a batch under one adapter: one group covering every row (no gather),
# 17 rows (the packed float32 weights on the fast path).
ALONE = [11, 6]
# (adapter, prompt length) per sequence of the mixed batch: the same adapter in
# non-adjacent sequences (an index gather), base rows in between, a one-token prompt, and
# more than 48 rows (plain F.linear rather than the packed float32 weights).
MIXED = [("wide", 9), (None, 6), ("narrow", 14), ("wide", 12), ("narrow", 1), (None, 8)]
rng = torch.Generator().manual_seed(5)


class Family:
    """A tiny model of one family: our DecoderLM, the PeftModel oracle and both adapters, loaded by us."""

    def __init__(self, family: str, root) -> None:
        from peft import LoraConfig, get_peft_model

        self.base_dir = root / "base"
        base = build(family, self.base_dir)
        self.model = load_model(self.base_dir, torch.float32, "cpu")
        torch.manual_seed(17)
        first, *others = ADAPTER_CONFIGS
        # init_lora_weights=False: B random rather than zero, so each adapter changes the output.
        self.peft = get_peft_model(base, LoraConfig(**ADAPTER_CONFIGS[first], init_lora_weights=False),
                                   adapter_name=first)
        for name in others:
            self.peft.add_adapter(name, LoraConfig(**ADAPTER_CONFIGS[name], init_lora_weights=False))
        self.peft.eval()
        self.peft.save_pretrained(root / "adapters")  # one subdirectory per adapter name
        self.dirs = {name: root / "adapters" / name for name in ADAPTER_CONFIGS}
        self.targets = LoraTargets.from_config(self.model.config)
        self.adapters = {name: self.load(name, torch.float32) for name in ADAPTER_CONFIGS}
        self.prompts = [prompt(n) for n in (*ALONE, *(n for _, n in MIXED))]
        # PEFT's outputs for every prompt under each adapter and under none, computed once:
        # transformers takes ~40 ms a forward even for this tiny model.
        self.expected = {name: self.oracle(name, self.prompts) for name in (*ADAPTER_CONFIGS, None)}

    def load(self, name: str, dtype: torch.dtype) -> LoraAdapter:
        config, tensors = read_peft_dir(self.dirs[name])
        return build_adapter(name, f"{name}@1", config, tensors, self.targets, dtype=dtype, device="cpu",
                             max_rank=16, source=str(self.dirs[name]))

    @torch.no_grad()
    def oracle(self, adapter: str | None, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """PEFT's (hidden states, logits) per prompt under one adapter, or with adapters disabled.

        One right-padded forward, with no attention mask: causal attention never lets a
        prompt's tokens see the padding after them."""
        longest = max(len(p) for p in prompts)
        ids = torch.stack([torch.cat([p, p.new_zeros(longest - len(p))]) for p in prompts])
        causal_lm = self.peft.get_base_model()  # the LoRA layers are injected into it, in place
        if adapter is not None:
            self.peft.set_adapter(adapter)
        with self.peft.disable_adapter() if adapter is None else contextlib.nullcontext():
            hidden = causal_lm.model(ids).last_hidden_state
            logits = causal_lm.lm_head(hidden) / getattr(causal_lm.config, "logits_scaling", 1.0)  # Granite's
            logits = logits * getattr(causal_lm.config, "logit_scale", 1.0)  # Cohere's
            cap = getattr(causal_lm.config, "final_logit_softcapping", None)  # Gemma's
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
        return [(hidden[i, :len(p)], logits[i, :len(p)]) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def forward(model, sequences: list[tuple[LoraAdapter | None, torch.Tensor]], reference: bool):
    """One flat fresh-prompt step of all sequences (no KV pool: each segment attends within itself).

    Returns per sequence (hidden, logits), and the step's LoraBatch."""
    ids = torch.cat([tokens for _, tokens in sequences])
    positions = torch.cat([torch.arange(len(tokens)) for _, tokens in sequences])
    segments, row_ranges, row = [], [], 0
    for adapter, tokens in sequences:
        segments.append(Segment(q_start=row, q_len=len(tokens), start=0))
        row_ranges.append((row, len(tokens), adapter))
        row += len(tokens)
    lora = LoraBatch.build(row_ranges, row, "cpu")
    ctx = StepContext(segments, reference=reference, lora=lora)
    hidden = model.hidden_states(ids, positions, ctx)
    logits = model.logits(hidden, reference=reference)
    outs = [(hidden[s.q_start:s.q_start + s.q_len], logits[s.q_start:s.q_start + s.q_len]) for s in segments]
    return outs, lora


def adapter_against_peft(family: str, target_modules: list[str], reference: bool, root,
                         tokens: list[int]) -> LoraTargets:
    """A tiny `family` model under a random PEFT adapter on `target_modules`: a row under the
    adapter and a row without it in one step, against the PeftModel with it on and off (and the
    adapter must change the answer). Returns what the served model offers to adapters."""
    from peft import LoraConfig, get_peft_model

    base = build(family, root / "base")
    model = load_model(root / "base", torch.float32, "cpu")
    torch.manual_seed(3)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules,
                                           init_lora_weights=False)).eval()
    peft.save_pretrained(root / "adapter")
    config, tensors = read_peft_dir(root / "adapter")
    targets = LoraTargets.from_config(model.config)
    adapter = build_adapter("a", "a@1", config, tensors, targets, dtype=torch.float32, device="cpu", max_rank=8,
                            source=str(root / "adapter"))
    ids = torch.tensor(tokens)
    with torch.no_grad():
        want = peft(ids[None]).logits[0]
        with peft.disable_adapter():
            plain = peft(ids[None]).logits[0]
    (_, adapted), (_, unadapted) = forward(model, [(adapter, ids), (None, ids)], reference)[0]
    assert (want - plain).abs().max() > 1e-2  # the adapter changes the answer
    torch.testing.assert_close(adapted, want, atol=TOL, rtol=0)
    torch.testing.assert_close(unadapted, plain, atol=TOL, rtol=0)
    return targets


def mixed_batch(family: Family, adapters: dict[str, LoraAdapter]) -> list[tuple[LoraAdapter | None, torch.Tensor]]:
    return [(adapters.get(name), p) for (name, _), p in zip(MIXED, family.prompts[len(ALONE):], strict=True)]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def prompt(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=rng)


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
@pytest.mark.parametrize("adapter", [*ADAPTER_CONFIGS, None])
def test_one_adapter_for_the_whole_batch_matches_peft(family, adapter, reference):
    prompts = family.prompts[:len(ALONE)]
    outs, lora = forward(family.model, [(family.adapters.get(adapter), p) for p in prompts], reference)
    assert (lora is None) == (adapter is None)
    for i, (hidden, logits) in enumerate(outs):
        want_hidden, want_logits = family.expected[adapter][i]
        assert max_diff(hidden, want_hidden) <= TOL
        assert max_diff(logits, want_logits) <= TOL
        if adapter is not None:  # the adapter matters: the checks above would catch a missing delta
            assert max_diff(logits, family.expected[None][i][1]) > 100 * TOL


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_a_mixed_batch_gives_each_sequence_its_own_adapter(family, reference):
    outs, lora = forward(family.model, mixed_batch(family, family.adapters), reference)
    for i, ((name, _), (hidden, logits)) in enumerate(zip(MIXED, outs, strict=True), start=len(ALONE)):
        want_hidden, want_logits = family.expected[name][i]
        assert max_diff(hidden, want_hidden) <= TOL, name
        assert max_diff(logits, want_logits) <= TOL, name
    # One delta per (adapter, layer, module) it targets, however many sequences use it.
    assert lora.applications == sum(len(family.adapters[name].weights) for name in ADAPTER_CONFIGS)
    layers = family.model.config.num_layers  # 3 (SmolLM3's: 4); "narrow" adapts layers 0 and 2 only
    assert lora.applications == layers * 7 + 2 * 5


@pytest.mark.parametrize("family", ["qwen3"], indirect=True)  # one family is enough for a smoke test
def test_bfloat16_fast_path_stays_near_float32(family):
    model = load_model(family.base_dir, torch.bfloat16, "cpu")
    adapters = {name: family.load(name, torch.bfloat16) for name in ADAPTER_CONFIGS}
    assert adapters["wide"].weights[(0, "q_proj")][0].dtype == torch.bfloat16
    half, _ = forward(model, mixed_batch(family, adapters), reference=False)
    full, _ = forward(family.model, mixed_batch(family, family.adapters), reference=False)
    for (_, half_logits), (_, full_logits) in zip(half, full, strict=True):
        assert half_logits.dtype == torch.float32
        assert max_diff(half_logits, full_logits) <= TOL_BF16


def test_uploaded_bytes_give_the_same_adapter_as_the_directory(family):
    directory = family.dirs["narrow"]
    from_dir = read_peft_dir(directory)
    from_bytes = read_peft_bytes((directory / "adapter_config.json").read_bytes(),
                                 (directory / "adapter_model.safetensors").read_bytes())
    assert from_bytes[0] == from_dir[0]
    assert from_bytes[1].keys() == from_dir[1].keys()
    inline = build_adapter("narrow", "narrow@2", *from_bytes, family.targets, dtype=torch.float32, device="cpu",
                           max_rank=16, source="inline")
    loaded = family.adapters["narrow"]
    assert inline.weights.keys() == loaded.weights.keys()
    for key, (a, b) in loaded.weights.items():
        assert torch.equal(inline.weights[key][0], a) and torch.equal(inline.weights[key][1], b)
    assert (inline.rank, inline.alpha, inline.scaling) == (4, 12.0, 12 / math.sqrt(4))
    assert inline.target_modules == ("down_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    assert sorted({layer for layer, _ in inline.weights}) == [0, 2]  # layers_to_transform
    assert inline.num_parameters == sum(a.numel() + b.numel() for a, b in inline.weights.values())
    assert inline.nbytes == 4 * inline.num_parameters
    assert inline.source == "inline"


# -- rows and groups ----------------------------------------------------------------------
def test_sequences_of_one_adapter_form_one_group():
    adapter = handmade_adapter()
    assert LoraBatch.build([(0, 3, None), (3, 2, None)], 5, "cpu") is None
    adjacent = LoraBatch.build([(0, 3, adapter), (3, 2, adapter), (5, 4, None)], 9, "cpu")
    assert [g.rows for g in adjacent.groups] == [slice(0, 5)]
    apart = LoraBatch.build([(0, 3, adapter), (3, 2, None), (5, 1, adapter)], 6, "cpu")
    assert len(apart.groups) == 1 and apart.groups[0].rows.tolist() == [0, 1, 2, 5]
    # Into a column slice of a wider output, rows 3-4 (no adapter) and other columns untouched.
    x, fused = torch.randn(6, 64), torch.zeros(6, 200)
    apart.apply(0, "q_proj", x, fused[:, 8:136])
    apart.apply(0, "k_proj", x, fused[:, 136:])  # not a target: nothing
    a, b_scaled = adapter.weights[(0, "q_proj")]
    rows = [0, 1, 2, 5]
    torch.testing.assert_close(fused[rows, 8:136], x[rows] @ a.t() @ b_scaled.t())
    assert fused[[3, 4]].abs().sum() == 0 and fused[:, :8].abs().sum() == 0 and fused[:, 136:].abs().sum() == 0
    assert apart.applications == 1


# -- refusals -----------------------------------------------------------------------------
TARGETS = LoraTargets.from_config(DecoderConfig.from_dict({
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
    "head_dim": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
PREFIX = "base_model.model.model.layers"


def handmade(r: int = 4, modules=("q_proj", "down_proj"), layers=(0, 1)) -> tuple[dict, dict[str, torch.Tensor]]:
    """A valid adapter_config.json and tensors for TARGETS, as PEFT would save them."""
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": list(modules), "bias": "none",
              "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {},
              "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None}
    tensors = {}
    for layer in layers:
        for module in modules:
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            in_features, out_features = TARGETS.shapes[module]
            tensors[f"{PREFIX}.{layer}.{parent}.{module}.lora_A.weight"] = torch.randn(r, in_features)
            tensors[f"{PREFIX}.{layer}.{parent}.{module}.lora_B.weight"] = torch.randn(out_features, r)
    return config, tensors


def build_handmade(config, tensors, max_rank: int = 16) -> LoraAdapter:
    return build_adapter("mine", "mine@1", config, tensors, TARGETS, dtype=torch.float32, device="cpu",
                         max_rank=max_rank, source="inline")


def handmade_adapter() -> LoraAdapter:
    return build_handmade(*handmade())


def test_targets_follow_the_config():
    assert TARGETS.num_layers == 2
    assert TARGETS.shapes == {"q_proj": (64, 128), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (128, 64),
                              "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}


def test_b_carries_the_scaling():
    config, tensors = handmade(r=4)  # lora_alpha 8
    name_a, name_b = tensor(0, "q_proj", "A"), tensor(0, "q_proj", "B")
    plain = build_handmade(config, tensors)
    assert plain.scaling == 8 / 4
    assert torch.equal(plain.weights[(0, "q_proj")][0], tensors[name_a])
    assert torch.equal(plain.weights[(0, "q_proj")][1], tensors[name_b] * 2)
    config["use_rslora"] = True
    assert build_handmade(config, tensors).scaling == 8 / math.sqrt(4)


def test_regex_target_modules_and_layers_to_transform():
    config, tensors = handmade()
    config["target_modules"] = r"model\.layers\.\d+\.(self_attn\.q_proj|mlp\.down_proj)"
    assert build_handmade(config, tensors).target_modules == ("down_proj", "q_proj")
    config, tensors = handmade(layers=(1,))
    config["layers_to_transform"] = [1]
    assert sorted(build_handmade(config, tensors).weights) == [(1, "down_proj"), (1, "q_proj")]


def tensor(layer: int, module: str, half: str) -> str:
    parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"{PREFIX}.{layer}.{parent}.{module}.lora_{half}.weight"


def set_config(**changes):
    return lambda config, tensors: config.update(changes)


def add_tensor(name: str, shape: tuple[int, ...]):
    return lambda config, tensors: tensors.update({name: torch.randn(shape)})


BACKTRACKING = r"(?:\w|\.|\w\.|\.\w|\w\w)+\d\d\d"
REFUSALS = {
    "not LoRA": (set_config(peft_type="IA3"), ["peft_type", "'IA3'", "LORA"]),
    "rank above max_rank": (set_config(r=32), ["r=32", "max_rank 16"]),
    "rank zero": (set_config(r=0), ["r=0", "positive"]),
    "lm_head target": (set_config(target_modules=["q_proj", "down_proj", "lm_head"]),
                       ["'lm_head'", "supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"]),
    "embed_tokens tensor": (add_tensor("base_model.model.model.embed_tokens.lora_embedding_A", (4, VOCAB)),
                            ["'embed_tokens'", "cannot adapt", "supported: q_proj"]),
    "unknown module": (set_config(target_modules=["q_proj", "down_proj", "fc1"]), ["'fc1'", "supported"]),
    "wrong shape": (add_tensor(tensor(0, "q_proj", "A"), (4, 63)),
                    [tensor(0, "q_proj", "A"), "shape (4, 63)", "expected (4, 64)"]),
    "tensors of another rank": (set_config(r=8), [tensor(0, "down_proj", "A"), "(4, 96)", "expected (8, 96)"]),
    "layer out of range": (add_tensor(tensor(2, "q_proj", "A"), (4, 64)), ["layer 2 is out of range", "2 layers"]),
    "declared target without tensors": (set_config(target_modules=["q_proj", "down_proj", "v_proj"]),
                                        ["v_proj", "no tensors at all"]),
    "all-linear without all tensors": (set_config(target_modules="all-linear"), ["gate_proj", "no tensors at all"]),
    "undeclared tensors": (set_config(target_modules=["q_proj"]), ["layer 0 down_proj", "do not target"]),
    "layer left out by layers_to_transform": (set_config(layers_to_transform=[1]),
                                              ["layer 0 down_proj", "do not target"]),
    "missing lora_B": (lambda config, tensors: tensors.pop(tensor(1, "q_proj", "B")),
                       [tensor(1, "q_proj", "B"), "missing"]),
    "DoRA": (set_config(use_dora=True), ["DoRA", "not supported"]),
    "activated LoRA": (set_config(alora_invocation_tokens=[5, 6]), ["alora_invocation_tokens", "not supported"]),
    "bias": (set_config(bias="all"), ["bias='all'", "not supported"]),
    "lora_bias": (set_config(lora_bias=True), ["lora_bias", "not supported"]),
    "lora_B bias tensor": (add_tensor(tensor(0, "q_proj", "B").replace(".weight", ".bias"), (128,)),
                           ["lora_B.bias", "lora_bias"]),
    "fan_in_fan_out": (set_config(fan_in_fan_out=True), ["fan_in_fan_out", "not supported"]),
    "modules_to_save": (set_config(modules_to_save=["lm_head"]), ["modules_to_save", "not supported"]),
    "base tensor": (add_tensor(f"{PREFIX}.0.self_attn.q_proj.weight", (128, 64)), ["not a LoRA weight"]),
    "rank_pattern": (set_config(rank_pattern={"q_proj": 2}), ["rank_pattern", "not supported"]),
    "alpha_pattern": (set_config(alpha_pattern={"q_proj": 2}), ["alpha_pattern", "not supported"]),
    "layers_pattern": (set_config(layers_to_transform=[0], layers_pattern="blocks"), ["layers_pattern", "'blocks'"]),
    "regex matching nothing": (set_config(target_modules=r".*\.fc\d"), ["regex", "matches none", "supported"]),
    "invalid regex": (set_config(target_modules="(q_proj"), ["not a valid regular expression"]),
    # Seconds per path (minutes under Python's re, with the GIL held): refused within the budget.
    "backtracking regex": (set_config(target_modules=BACKTRACKING), ["target_modules", "took more than 0.5 s"]),
    "backtracking exclude regex": (set_config(exclude_modules=BACKTRACKING), ["exclude_modules", "took more than"]),
    "regex too long": (set_config(target_modules="|".join(["q_proj"] * 1000)), ["6999 characters long"]),
    # Values JSON (and Python's reader) allows that PEFT's config would never hold.
    "alpha past a float": (set_config(lora_alpha=10**400), ["lora_alpha", "401 digits", "too large"]),
    "alpha past a float, rslora": (set_config(lora_alpha=10**400, use_rslora=True), ["too large"]),
    "alpha NaN": (set_config(lora_alpha=float("nan")), ["lora_alpha=nan", "not a finite number"]),
    "alpha infinite": (set_config(lora_alpha=float("inf")), ["lora_alpha=inf", "not a finite number"]),
    "exclude_modules a number": (set_config(exclude_modules=5), ["exclude_modules", "not 5"]),
    "exclude_modules invalid regex": (set_config(exclude_modules="("), ["exclude_modules", "not a valid regular"]),
    "layers_to_transform a float": (set_config(layers_to_transform=1.5), ["layers_to_transform 1.5", "layer index"]),
    "layers_to_transform a dict": (set_config(layers_to_transform={"a": 1}), ["layers_to_transform", "layer index"]),
    "layers_pattern a number": (set_config(layers_to_transform=[0], layers_pattern=5), ["layers_pattern", "not 5"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_problem(case):
    change, fragments = REFUSALS[case]
    config, tensors = handmade()
    change(config, tensors)
    with pytest.raises(LoraAdapterError) as refused:
        build_handmade(config, tensors)
    message = str(refused.value)
    assert message.startswith("adapter 'mine': ")
    for fragment in fragments:
        assert fragment in message


def test_unreadable_uploads_and_directories_are_refused(tmp_path):
    config, tensors = handmade()
    config_json, weights = json.dumps(config).encode(), save_safetensors(tensors)
    with pytest.raises(LoraAdapterError, match="adapter_config.json is not valid JSON"):
        read_peft_bytes(b'{"peft_type": "LORA",', weights)
    with pytest.raises(LoraAdapterError, match="not a JSON object"):
        read_peft_bytes(b"[1, 2]", weights)
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors is not a valid safetensors file"):
        read_peft_bytes(config_json, b"not safetensors at all")
    (tmp_path / "adapter_config.json").write_bytes(config_json)
    (tmp_path / "adapter_model.bin").write_bytes(b"a pickle")
    with pytest.raises(LoraAdapterError, match="only adapter_model.bin.*safe_serialization=True"):
        read_peft_dir(tmp_path)
    with pytest.raises(LoraAdapterError, match="not a directory"):
        read_peft_dir(tmp_path / "absent")
