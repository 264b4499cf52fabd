"""The LoRA side of a KvCacheExecutor: its adapter calls and a request's adapter lookup.

What LoadLoraAdapter, UnloadLoraAdapter, ListLoraAdapters and the LoRA metrics do over the
executor's LoraRegistry (adapters.py: reading, validating, keeping adapters) and its
CacheRegistry (cache_state.py: which caches were computed under which adapter). An
executor without LoRA support has no registry (None): its calls are refused and a request
naming an adapter is told none is loaded. The `_now` functions run on the executor's worker.
"""

from __future__ import annotations

from executors.adapters import LoraRegistry
from executors.cache_state import CacheRegistry
from executors.descriptions import LoraAdapterInfo, LoraMetrics
from executors.errors import NotFound, Unsupported
from executors.lora import LoraAdapter


def require_loras(loras: LoraRegistry | None, executor: str) -> LoraRegistry:
    if loras is None:
        raise Unsupported(f"the {executor} executor has no LoRA support")
    return loras


def add_adapter_now(loras: LoraRegistry, adapter: LoraAdapter) -> LoraAdapterInfo:
    loras.add(adapter)
    return loras.info(adapter.name, 0)


def remove_adapter_now(loras: LoraRegistry, caches: CacheRegistry, name: str) -> LoraAdapterInfo:
    loras.get(name, "name")
    bound = caches.adapter_bindings().get(name, 0)
    info = loras.info(name, bound)
    loras.remove(name, bound)
    return info


def lora_metrics(loras: LoraRegistry | None, caches: CacheRegistry) -> LoraMetrics | None:
    if loras is None:
        return None
    return LoraMetrics(
        enabled=True,
        adapter_count=len(loras),
        active_cache_bindings=sum(caches.adapter_bindings().values()),
        projection_applications=loras.projection_applications,
        position="real-inference",
        source="modelexec-multi-lora",
    )


def named_adapter(loras: LoraRegistry | None, name: str | None, where: str, executor: str) -> LoraAdapter | None:
    """The loaded adapter a request names (None: it names none), for a cache it creates."""
    if name is None:
        return None
    if loras is None:
        raise NotFound(f"{where}: no LoRA adapter named {name!r} is loaded: the {executor} executor has no "
                       "LoRA support", field=where, reason="LORA_ADAPTER_NOT_FOUND", adapter=name)
    return loras.get(name, where)
