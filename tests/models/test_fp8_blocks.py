"""Block-wise FP8 checkpoints (DeepSeek V3's, Kimi K2's, Qwen3's FP8 releases) dequantized at
load: the arithmetic against its definition, a checkpoint served against transformers holding
the same dequantized weights, a tensor-parallel rank's slices, the weights digest, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import fp8_blocks
from executors.models.config import DecoderConfig, UnsupportedModel
from executors.models.loader import checkpoint_parameters, load_model
from executors.parallel.shard import ShardPlan
from tests.models.tiny_models import VOCAB, build

BLOCK = (16, 16)  # small blocks: the tiny matrices hold several, and partial ones at their edges


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """W as float8_e4m3fn and a float32 scale per block (its largest |w| over e4m3's 448)."""
    (n, k), (r, c) = w.shape, block
    rb, cb = -(-n // r), -(-k // c)
    padded = torch.zeros(rb * r, cb * c)
    padded[:n, :k] = w.float()
    blocks = padded.view(rb, r, cb, c)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rb * r, cb * c)[:n, :k].contiguous()
    return q, scale


def explicit(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The definition, element by element of the scales: weight * scale_inv of its block."""
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j]
    return out


@pytest.mark.parametrize("shape, block", [((300, 260), (128, 128)), ((40, 33), (16, 16)), ((7, 5), (16, 8))])
def test_dequantize_is_the_weight_times_its_blocks_scale(shape, block, monkeypatch):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    q, scale = quantize(w, block)
    want = explicit(q, scale, block)
    assert torch.equal(fp8_blocks.dequantize(q, scale, block), want)
    monkeypatch.setattr(fp8_blocks, "CHUNK_ROWS", 1)  # a row block at a time
    assert torch.equal(fp8_blocks.dequantize(q, scale, block), want)
    assert (want - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def fp8_checkpoint(family: str, root):
    """A tiny random `family` model saved, then its projections' weights as FP8 blocks (the
    router, norms, embedding and lm_head left as they are, as DeepSeek's files leave them);
    returns transformers' model holding the dequantized weights."""
    model = build(family, root)
    weights = load_file(root / "model.safetensors")
    dequantized = {}
    for name in list(weights):
        if name.endswith("proj.weight") and weights[name].dim() == 2:
            q, scale = quantize(weights[name], BLOCK)
            weights[name], weights[name + fp8_blocks.SCALE_SUFFIX] = q, scale
            dequantized[name] = explicit(q, scale, BLOCK)
    save_file(weights, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (root / "config.json").write_text(json.dumps(config))
    state = model.state_dict()
    for name, tensor in dequantized.items():
        if name in state:
            state[name] = tensor
        else:  # transformers 5 stacks the routed experts: NAME = STEM.E.gate_proj.weight
            stem, expert, proj, _ = name.rsplit(".", 3)
            if proj == "down_proj":
                state[f"{stem}.down_proj"][int(expert)] = tensor
            else:
                inter = tensor.shape[0]
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                state[f"{stem}.gate_up_proj"][int(expert), rows] = tensor
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
def test_an_fp8_checkpoint_is_served_as_its_dequantized_weights(family, tmp_path):
    oracle = fp8_checkpoint(family, tmp_path)
    tokens = np.random.default_rng(3).integers(0, VOCAB, size=29).tolist()
    with torch.no_grad():
        want = oracle(torch.tensor([tokens])).logits[0].numpy()
    executor = LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path), block_size=4, num_blocks=64))
    try:
        got = executor._forward_sequence(tokens, hidden=False).float().numpy()
    finally:
        executor.close()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # the digest reads the files as the loader does
    model = load_model(tmp_path, torch.float32, "cpu", cpu_kernels=False)
    theirs = dict(checkpoint_parameters(tmp_path, torch.float32))
    mine = dict(model.logical_parameters())
    assert list(theirs) == list(mine)
    for name, tensor in mine.items():
        assert torch.equal(theirs[name], tensor), name


def test_a_ranks_slices_of_fp8_weights_are_the_dequantized_ones(tmp_path):
    """A tensor-parallel rank dequantizes each FP8 matrix, then takes its rows or columns: the
    slices a rank of the same checkpoint saved unquantized holds."""
    fp8_checkpoint("deepseek_v3", tmp_path / "fp8")
    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "fp8" / "model.safetensors")
    block = fp8_blocks.SCALE_SUFFIX
    save_file({name: (fp8_blocks.dequantize(t, weights[name + block], BLOCK) if name + block in weights else t)
               for name, t in weights.items() if not name.endswith(block)}, plain / "model.safetensors")
    for rank in (0, 1):
        def plan(c, rank=rank):
            return ShardPlan(c, rank, 2)

        a = dict(load_model(tmp_path / "fp8", torch.float32, "cpu", shard=plan, cpu_kernels=False).named_parameters())
        b = dict(load_model(plain, torch.float32, "cpu", shard=plan, cpu_kernels=False).named_parameters())
        assert list(a) == list(b)
        for name in a:
            assert torch.equal(a[name], b[name]), (rank, name)


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100}


@pytest.mark.parametrize("quant, refusal", [
    ({"quant_method": "fp8"}, "needs weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "needs weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt 'e5m2'"),
])
def test_fp8_settings_it_cannot_read_are_refused(quant, refusal):
    with pytest.raises(UnsupportedModel, match=refusal):
        DecoderConfig.from_dict({**LLAMA, "quantization_config": quant})
    assert DecoderConfig.from_dict({**LLAMA, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}).fp8_block == (128, 128)


def test_fp8_weights_without_their_scales_or_with_wrong_ones_are_refused(tmp_path):
    fp8_checkpoint("qwen3", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    scale = weights.pop(name + fp8_blocks.SCALE_SUFFIX)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=f"FP8 tensor {name} has no {name}_scale_inv"):
        load_model(tmp_path, torch.float32, "cpu")
    weights[name + fp8_blocks.SCALE_SUFFIX] = scale[:, :1].contiguous()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=r"needs scales \[8, 4\], got \[8, 1\]"):
        load_model(tmp_path, torch.float32, "cpu")


def test_scales_in_another_shard_than_their_weights(tmp_path):
    """The loader finds each scale by name wherever the index puts it."""
    fp8_checkpoint("qwen3", tmp_path)
    whole = dict(load_model(tmp_path, torch.float32, "cpu", cpu_kernels=False).named_parameters())
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in weights.items() if n.endswith("_scale_inv")},
              "model-00002-of-00002.safetensors": {n: t for n, t in weights.items() if not n.endswith("_scale_inv")}}
    for shard, tensors in shards.items():
        save_file(tensors, tmp_path / shard, metadata={"format": "pt"})
    index = {"weight_map": {n: shard for shard, tensors in shards.items() for n in tensors}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = dict(load_model(tmp_path, torch.float32, "cpu", cpu_kernels=False).named_parameters())
    assert list(sharded) == list(whole) and all(torch.equal(sharded[n], whole[n]) for n in whole)
