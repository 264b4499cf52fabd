"""TextTokenizer: a model directory's tokenizer and chat template, without transformers or torch.

Reads tokenizer.json (the `tokenizers` library), tokenizer_config.json (chat template,
special tokens) and generation_config.json (end-of-sequence ids) as Hugging Face writes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The embedded model, as `make model` converts it, relative to the repository root.
DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json holds special tokens as strings or as {"content": ...} objects.
    return value.get("content") if isinstance(value, dict) else value


class TextTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: pass --tokenizer with the served model's directory")
        self.tokenizer = Tokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        eos: set[int] = set()
        gen = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        eos.update(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        if self.eos_token is not None and (eos_id := self.tokenizer.token_to_id(self.eos_token)) is not None:
            eos.add(eos_id)
        self.eos_ids = eos

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token is not None:
            ids = [self.tokenizer.token_to_id(self.bos_token), *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the model's chat template the way transformers does (sandboxed Jinja)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
