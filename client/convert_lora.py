"""LoRA adapter requests: load from the server's --lora-dir, upload a local PEFT directory, unload.

Apart because uploading reads files on this machine, which no other conversion does;
client.convert re-exports these.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._proto import executor_pb2 as pb


def load_lora_adapter_request(name: str, path: str) -> pb.LoadLoraAdapterRequest:
    """Load from a directory on the server, relative to its --lora-dir."""
    return pb.LoadLoraAdapterRequest(name=name, path=path)


# The two files of a PEFT adapter directory that LoadLoraAdapter takes inline.
LORA_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def upload_lora_adapter_request(name: str, local_dir: str | os.PathLike[str]) -> pb.LoadLoraAdapterRequest:
    """Load from a PEFT adapter directory on this machine: its two files travel inline."""
    directory = Path(local_dir)
    missing = [f for f in LORA_ADAPTER_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} is not a PEFT adapter directory: {', '.join(missing)} missing")
    config, weights = (directory / f for f in LORA_ADAPTER_FILES)
    return pb.LoadLoraAdapterRequest(name=name, inline=pb.InlineLoraAdapter(
        adapter_config_json=config.read_bytes(), adapter_model_safetensors=weights.read_bytes()))


def unload_lora_adapter_request(name: str) -> pb.UnloadLoraAdapterRequest:
    return pb.UnloadLoraAdapterRequest(name=name)
