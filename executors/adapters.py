"""LoraRegistry: the LoRA adapters an executor holds, by name.

Adapters come from PEFT directories (at start-up, every subdirectory of the adapter
directory that holds an adapter_config.json, named after it; at run time, a directory
under that root or the two files sent inline). Reading and validating runs on the
caller's thread; only the insertion into the registry runs on the executor's worker, so
a step never sees half an adapter. Each load gets a fresh key, which namespaces the prefix
cache: K and V computed under one load of "a" are never reused under another.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from executors.descriptions import LoraAdapterInfo, LoraSource
from executors.errors import AlreadyExists, FailedPrecondition, InvalidParameter, NotFound, ResourceExhausted
from executors.lora import LoraAdapter, LoraAdapterError, LoraTargets, build_adapter, read_peft_bytes, read_peft_dir

# The names a request carries in metadata and an operator types: no paths, no spaces.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True, slots=True)
class LoraLimits:
    max_adapters: int = 8
    max_rank: int = 64
    root: str | None = None  # run-time path loads resolve under it; None refuses them


@dataclass(slots=True)
class _Loaded:
    adapter: LoraAdapter
    loaded_at_unix_s: float


class LoraRegistry:
    def __init__(self, targets: LoraTargets, limits: LoraLimits, dtype: torch.dtype, device: str,
                 placed: Callable[[LoraAdapter], LoraAdapter] | None = None,
                 dropped: Callable[[LoraAdapter], None] | None = None) -> None:
        """`placed`: what an adapter becomes once registered, on the worker thread (tensor
        parallelism: sent to the other ranks, this rank's shard kept); `dropped`: told of
        each removal."""
        self.placed, self.dropped = placed, dropped
        self.targets = targets
        self.limits = limits
        self.dtype = dtype
        self.device = device
        self._adapters: dict[str, _Loaded] = {}
        self._serial = 0
        self.projection_applications = 0

    def __len__(self) -> int:
        return len(self._adapters)

    @property
    def nbytes(self) -> int:
        """Device memory held by the loaded adapters' weights."""
        return sum(x.adapter.nbytes for x in list(self._adapters.values()))

    def get(self, name: str, where: str) -> LoraAdapter:
        loaded = self._adapters.get(name)
        if loaded is None:
            known = ", ".join(sorted(self._adapters)) or "none"
            raise NotFound(f"{where}: no LoRA adapter named {name!r} is loaded (loaded: {known})",
                           field=where, reason="LORA_ADAPTER_NOT_FOUND", adapter=name)
        return loaded.adapter

    def holds(self, adapter: LoraAdapter) -> bool:
        """This very load of the adapter is still registered (not unloaded, nor replaced under its name)."""
        loaded = self._adapters.get(adapter.name)
        return loaded is not None and loaded.adapter.key == adapter.key

    # -- loading (caller's thread) ----------------------------------------------------------
    def read(self, name: str, source: LoraSource) -> LoraAdapter:
        """Read and validate an adapter; nothing is registered yet."""
        if not ADAPTER_NAME.fullmatch(name):
            raise InvalidParameter("name must have 1 to 128 characters from [A-Za-z0-9._:-]", field="name")
        if source.path is not None:
            directory = self._resolve(source.path)  # a bad path is the caller's mistake, whatever else holds
            origin = str(directory)
        else:
            origin = "inline"
        self._check_free(name)
        try:
            if source.path is not None:
                config, tensors = read_peft_dir(directory)
            else:
                config, tensors = read_peft_bytes(source.config_json or b"", source.safetensors or b"")
            self._serial += 1
            return build_adapter(name, f"{name}@{self._serial}", config, tensors, self.targets,
                                 dtype=self.dtype, device=self.device, max_rank=self.limits.max_rank, source=origin)
        except LoraAdapterError as e:
            problem = str(e) if str(e).startswith(f"adapter {name!r}") else f"adapter {name!r}: {e}"
            raise InvalidParameter(f"LoRA {problem}", field="source", reason="LORA_ADAPTER_INVALID",
                                   adapter=name) from None

    def _resolve(self, path: str) -> Path:
        if self.limits.root is None:
            raise FailedPrecondition("loading adapters by path needs the server's --lora-dir; send the files inline",
                                     field="path", reason="LORA_DIR_NOT_CONFIGURED")
        root = Path(self.limits.root).resolve()
        directory = (root / path).resolve()
        if directory != root and root not in directory.parents:
            raise InvalidParameter(f"path {path!r} leaves the adapter directory", field="path")
        if not (directory / ADAPTER_CONFIG).is_file():
            raise NotFound(f"path {path!r}: no {ADAPTER_CONFIG} in that directory of the adapter directory",
                           field="path", reason="LORA_PATH_NOT_FOUND")
        return directory

    def _check_free(self, name: str) -> None:
        if name in self._adapters:
            raise AlreadyExists(f"a LoRA adapter named {name!r} is already loaded; unload it first",
                                field="name", reason="LORA_ADAPTER_EXISTS", adapter=name)
        if len(self._adapters) >= self.limits.max_adapters:
            raise ResourceExhausted(
                f"{len(self._adapters)} LoRA adapters are loaded, the most this server holds (--max-loras); "
                "unload one first", field="name", reason="TOO_MANY_LORA_ADAPTERS")

    # -- registry changes (worker thread) ---------------------------------------------------
    def add(self, adapter: LoraAdapter) -> None:
        self._check_free(adapter.name)  # again: another load may have won the race
        if self.placed is not None:
            adapter = self.placed(adapter)
        self._adapters[adapter.name] = _Loaded(adapter, time.time())

    def remove(self, name: str, bound_caches: int) -> _Loaded:
        self.get(name, "name")
        if bound_caches:
            raise FailedPrecondition(
                f"LoRA adapter {name!r} is bound to {bound_caches} live cache(s); release them first",
                field="name", reason="LORA_ADAPTER_IN_USE", adapter=name, bound_caches=bound_caches)
        loaded = self._adapters.pop(name)
        if self.dropped is not None:
            self.dropped(loaded.adapter)
        return loaded

    # -- description ------------------------------------------------------------------------
    def info(self, name: str, bound_caches: int) -> LoraAdapterInfo:
        return _info(self._adapters[name], bound_caches)

    def infos(self, bindings: dict[str, int]) -> list[LoraAdapterInfo]:
        # A snapshot: this runs on the event loop while the worker may add or remove one.
        loaded = sorted(list(self._adapters.values()), key=lambda x: x.adapter.name)
        return [_info(x, bindings.get(x.adapter.name, 0)) for x in loaded]

    def load_directory(self, root: str) -> list[str]:
        """Load every adapter directory directly under root (start-up); returns their names."""
        names = []
        for sub in sorted(Path(root).iterdir()):
            if (sub / ADAPTER_CONFIG).is_file():
                self.add(self.read(sub.name, LoraSource(path=str(sub.relative_to(root)))))
                names.append(sub.name)
        return names


def _info(loaded: _Loaded, bound_caches: int) -> LoraAdapterInfo:
    a = loaded.adapter
    return LoraAdapterInfo(
        name=a.name,
        rank=a.rank,
        alpha=a.alpha,
        scaling=a.scaling,
        target_modules=tuple(a.target_modules),
        source=a.source,
        num_parameters=a.num_parameters,
        bytes=a.nbytes,
        bound_caches=bound_caches,
        loaded_at_unix_s=loaded.loaded_at_unix_s,
    )
