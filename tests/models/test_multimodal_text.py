"""The text model of a multimodal checkpoint (Gemma 3 4B-27B, Mistral Small 3.1): read under
both transformers layouts' names, its other towers skipped, what it cannot be refused by name.

test_families.py serves both tiny multimodal models against transformers over gRPC; here the
loader's reading of their files."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models.config import DecoderConfig, UnsupportedModel
from executors.types import PrefillInput
from tests.models.tiny_models import build

TOKENS = [3, 17, 5, 99, 12, 7, 250, 31, 8, 64, 2, 45]


def last_logits(model_dir) -> np.ndarray:
    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(model_dir), block_size=4, num_blocks=32))
    try:
        return asyncio.run(ex.prefill(PrefillInput(input_ids=TOKENS))).logits.logits.array
    finally:
        ex.worker.close()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm")
    oracle = build("gemma3_multimodal", root / "saved")
    with torch.no_grad():
        want = oracle(torch.tensor([TOKENS])).logits[0, -1].float().numpy()
    return root, want


def test_transformers_5_names_load_as_transformers_4_names_do(gemma3):
    """model.language_model.* (transformers 5's module names) reads as language_model.model.*."""
    root, want = gemma3
    np.testing.assert_allclose(last_logits(root / "saved"), want, atol=1e-4, rtol=0)
    renamed = root / "renamed"
    renamed.mkdir()
    weights = load_file(root / "saved" / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in weights)
    save_file({name.replace("language_model.model.", "model.language_model.").replace(
        "vision_tower.", "model.vision_tower."): t for name, t in weights.items()},
        renamed / "model.safetensors", metadata={"format": "pt"})
    (renamed / "config.json").write_text((root / "saved" / "config.json").read_text())
    np.testing.assert_allclose(last_logits(renamed), want, atol=1e-4, rtol=0)


def test_a_tensor_the_text_model_does_not_have_is_refused_by_its_stored_name(gemma3):
    root, _ = gemma3
    extra = root / "extra"
    extra.mkdir()
    weights = load_file(root / "saved" / "model.safetensors")
    weights["language_model.model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(weights, extra / "model.safetensors", metadata={"format": "pt"})
    (extra / "config.json").write_text((root / "saved" / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match=r"does not expect: language_model\.model\.layers\.0\.mlp\.extra"):
        LlmExecutor(LlmExecutorConfig(model_dir=str(extra), num_blocks=16))


def test_a_multimodal_config_without_its_text_config_is_refused(gemma3):
    root, _ = gemma3
    cfg = json.loads((root / "saved" / "config.json").read_text())
    del cfg["text_config"]
    with pytest.raises(UnsupportedModel, match="Gemma3ForConditionalGeneration's config.json has no text_config"):
        DecoderConfig.from_dict(cfg)
    with pytest.raises(UnsupportedModel, match="supported: .*Mistral3ForConditionalGeneration"):
        DecoderConfig.from_dict({**cfg, "architectures": ["LlavaForConditionalGeneration"]})


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_a_peft_adapter_on_the_text_model_matches_peft(reference, tmp_path):
    """PEFT on the whole multimodal model, targeting the text model's projections by a regex
    (a plain list would take the vision tower's q_proj too): its tensors are named by
    transformers 5's module paths (model.language_model.layers...), read as the decoder's."""
    from peft import LoraConfig, get_peft_model

    from executors.lora import LoraTargets, build_adapter, read_peft_dir
    from executors.models.loader import load_model
    from tests.models.test_lora import forward

    torch.manual_seed(29)
    base = build("gemma3_multimodal", tmp_path / "base")
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                           target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
    peft.eval().save_pretrained(tmp_path / "adapter")
    config, tensors = read_peft_dir(tmp_path / "adapter")
    assert any(".language_model.layers." in name for name in tensors), sorted(tensors)[:3]
    model = load_model(tmp_path / "base", torch.float32, "cpu")
    adapter = build_adapter("mm", "mm@1", config, tensors, LoraTargets.from_config(model.config),
                            dtype=torch.float32, device="cpu", max_rank=8, source="test")
    assert {m for _, m in adapter.weights} == {"q_proj", "v_proj", "down_proj"}
    tokens = torch.tensor(TOKENS)
    (_, logits), = forward(model, [(adapter, tokens)], reference)[0]
    with torch.no_grad():
        want = peft(tokens[None]).logits[0]
    assert (logits - want).abs().max().item() <= 1e-4
    with torch.no_grad(), peft.disable_adapter():
        assert (logits - peft(tokens[None]).logits[0]).abs().max().item() > 1e-2  # the adapter matters


def test_qwen2_5_vls_flat_config_reads_as_transformers_reads_it(tmp_path):
    """Qwen2.5-VL's published files hold the text model's keys at the top level, its rotation as
    {"type": "mrope", "mrope_section": ...}: transformers reads such a file as its nested one,
    and so does the decoder (token ids alone: every mrope section turns by the same position)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    build("qwen2_5_vl", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**cfg, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    oracle = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = oracle(torch.tensor([TOKENS])).logits[0, -1].float().numpy()
    np.testing.assert_allclose(last_logits(tmp_path), want, atol=1e-4, rtol=0)
