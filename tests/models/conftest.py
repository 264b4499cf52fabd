"""Fixtures shared by the real-weights tests: transformers' reading of the embedded GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest



@pytest.fixture(scope="session")
def gguf_model(gguf_path: Path):
    """transformers' own reading of the GGUF (it dequantizes and un-permutes Q/K itself); ~30 s."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
