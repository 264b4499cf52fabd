"""The GGUF -> Hugging Face converter, checked against transformers' own GGUF loader.

The real SmolLM2 GGUF is converted once per module; transformers' GGUF model and tokenizer are
loaded once too, since each takes seconds. transformers and torch are used here only: the
converter itself must not import them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from executors import gguf_import
from executors.gguf_import import convert, permute_rope, unpermute_rope

REPO_ROOT = Path(__file__).resolve().parents[2]

# Strings where SmolLM2's Digits pre-tokenizer and a plain ByteLevel one agree: every string the
# brief lists, which transformers' GGUF tokenizer must encode exactly as we do.
PLAIN_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "12345",
    "There are 12 345 people, 3.14159 pies and 1,000,000 dollars.",
    "def f(x):\n    if x:\n\treturn [x, 'y']\n\t\tpass  # comment\n",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "中文测试，日本語のテキスト、한국어",
    "<|im_start|>user\nHi<|im_end|>",
    "don't I'm we'll THEY'RE",
    "  leading and trailing spaces  \n\n\n",
    "x<|endoftext|>y",
]
# Where the two differ: a digit after two spaces, or a numeric symbol like ½. HF's SmolLM2
# tokenizer.json (and llama.cpp's "smollm" pre-type) isolate every \p{N} first; transformers 5
# has no entry for "smollm" and uses GPT-2's ByteLevel split alone.
DIGIT_TEXTS = ["and  2024-11-22", "½ cup, ²³ and Ⅻ", "١٢٣ in Arabic digits"]


@pytest.fixture(scope="module")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    start = time.monotonic()
    out = convert(gguf_path, tmp_path_factory.mktemp("gguf") / "smollm2")
    print(f"conversion took {time.monotonic() - start:.1f}s")
    return out


@pytest.fixture(scope="module")
def hf_model(converted: Path):
    import transformers

    model, info = transformers.LlamaForCausalLM.from_pretrained(str(converted), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_path: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.mark.parametrize(("n_head", "rows"), [(9, 576), (3, 192)])
def test_unpermute_inverts_llama_cpp_rope_permutation(n_head: int, rows: int) -> None:
    rng = np.random.default_rng(n_head)
    w = rng.standard_normal((rows, 576)).astype(np.float32)
    permuted = permute_rope(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope(permuted, n_head), w)
    np.testing.assert_array_equal(permute_rope(unpermute_rope(w, n_head), n_head), w)
    # Also on 1-D (a bias) arrays.
    b = rng.standard_normal(rows)
    np.testing.assert_array_equal(unpermute_rope(permute_rope(b, n_head), n_head), b)


def test_config_matches_the_gguf_metadata(converted: Path, gguf_model) -> None:
    ours = json.loads((converted / "config.json").read_text())
    theirs = gguf_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == ours["rope_parameters"]["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert ours["rms_norm_eps"] == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["tie_word_embeddings"] is True


def test_weights_equal_transformers_gguf_loading(converted: Path, gguf_model) -> None:
    from safetensors.numpy import load_file

    ours = load_file(str(converted / "model.safetensors"))
    theirs = {name: t.detach().numpy() for name, t in gguf_model.state_dict().items()}
    assert "lm_head.weight" not in ours  # tied: the GGUF has no output.weight
    assert set(theirs) - set(ours) == {"lm_head.weight"} and set(ours) <= set(theirs)
    for name, array in ours.items():
        assert array.dtype == np.float32, name
        np.testing.assert_allclose(array, theirs[name], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_logits_equal_transformers_gguf_model(hf_model, gguf_model) -> None:
    import torch

    ids = torch.tensor([[504, 3575, 282, 4649, 314, 2, 216, 33, 34, 35]])
    with torch.no_grad():
        ours, theirs = hf_model(ids).logits, gguf_model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)


def test_tokenizer_matches_transformers_gguf_tokenizer(converted: Path, gguf_tokenizer) -> None:
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert ours.get_vocab_size() == gguf_tokenizer.backend_tokenizer.get_vocab_size() == 49152
    for text in PLAIN_TEXTS + DIGIT_TEXTS:
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == text
        if text in PLAIN_TEXTS:
            assert ids == gguf_tokenizer.encode(text), text
    assert ours.encode("<|im_start|>user\nHi<|im_end|>").ids[0] == 1
    assert ours.encode("<|im_start|>user\nHi<|im_end|>").ids[-1] == 2


def test_tokenizer_differs_from_transformers_only_by_the_digit_split(converted: Path, gguf_tokenizer) -> None:
    """Vocabulary, merges and special tokens are the same; only SmolLM2's Digits step differs."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    theirs = Tokenizer.from_str(gguf_tokenizer.backend_tokenizer.to_str())
    assert [ours.encode(t).ids for t in DIGIT_TEXTS] != [theirs.encode(t).ids for t in DIGIT_TEXTS]
    theirs.pre_tokenizer = ours.pre_tokenizer
    for text in PLAIN_TEXTS + DIGIT_TEXTS:
        assert ours.encode(text).ids == theirs.encode(text).ids, text


def test_auto_tokenizer_from_the_directory_uses_tokenizer_json(converted: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(converted))
    for text in PLAIN_TEXTS + DIGIT_TEXTS:
        assert auto.encode(text) == ours.encode(text).ids, text
    assert (auto.bos_token, auto.eos_token, auto.pad_token, auto.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    prompt = auto.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["model_max_length"] == 8192
    assert json.loads((converted / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_converted_model_generates_text(converted: Path, hf_model) -> None:
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(converted / "tokenizer.json"))
    prompt = "The capital of France is"
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
    text = tokenizer.decode(out[0, ids.shape[1]:].tolist())
    print(f"greedy: {prompt!r} -> {text!r}")
    assert text.strip()


def test_second_convert_is_a_no_op(converted: Path, gguf_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    assert set(mtimes) == set(gguf_import.OUTPUT_FILES)
    assert convert(gguf_path, converted) == converted
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == mtimes
    assert "nothing to do" in capsys.readouterr().out
    marker = json.loads((converted / "conversion.json").read_text())
    assert marker["source"] == gguf_path.name and marker["size"] == gguf_path.stat().st_size
    assert len(marker["sha256"]) == 64


def test_stale_or_incomplete_conversions_are_not_reused(converted: Path, gguf_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in gguf_import.OUTPUT_FILES:
        if name == "model.safetensors":
            os.link(converted / name, copy / name)  # no 540 MB copy
        else:
            shutil.copy2(converted / name, copy / name)
    assert gguf_import.is_converted(gguf_path, copy)
    marker = json.loads((copy / "conversion.json").read_text())
    (copy / "conversion.json").write_text(json.dumps({**marker, "mtime_ns": 1}))
    assert gguf_import.is_converted(gguf_path, copy)  # touched but identical: the sha256 decides
    (copy / "conversion.json").write_text(json.dumps({**marker, "converter_version": 0}))
    assert not gguf_import.is_converted(gguf_path, copy)
    (copy / "conversion.json").write_text(json.dumps(marker))
    (copy / "tokenizer.json").unlink()
    assert not gguf_import.is_converted(gguf_path, copy)


def test_interrupted_conversion_leaves_nothing(gguf_path: Path, tmp_path: Path, monkeypatch) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # after config.json is written to the temporary directory

    monkeypatch.setattr(gguf_import, "convert_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(gguf_path, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_converter_does_not_import_torch_or_transformers() -> None:
    code = ("import sys, executors.gguf_import as g; g.default_gguf_path(); "
            "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_cli_help_and_defaults() -> None:
    assert gguf_import.DEFAULT_MODEL_DIR == REPO_ROOT / "models" / "smollm2-135m-instruct"
    result = subprocess.run([sys.executable, "-m", "executors.gguf_import", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True)
    assert "--gguf" in result.stdout and "--force" in result.stdout
