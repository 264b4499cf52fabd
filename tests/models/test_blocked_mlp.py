"""The MLP of a many-row step in row blocks (fast_forward.MLP_ROWS): with the CPU kernels a
large prefill's gate/up output would otherwise be a fresh 50 MB mapping faulted in page by
page. Each row is computed alone by the kernels, so blocks change no bit; here with blocks of
5 rows against the reference, and against the same steps unblocked."""

from __future__ import annotations

import numpy as np
import pytest

import executors.cpu_kernels as cpu_kernels_module
from executors.models import fast_forward
from executors.types import DecodeInput, PrefillInput
from tests.models.test_cpu_paths import Pair, same, tokens

pytestmark = pytest.mark.skipif(cpu_kernels_module.cpu_kernels() is None, reason="the CPU kernels do not build here")


def _run(family: str, prompts: list[list[int]], monkeypatch, rows: int):
    monkeypatch.setattr(fast_forward, "MLP_ROWS", rows)
    pair = Pair(family)
    try:
        outs, refs = pair.both("batch_prefill", [PrefillInput(input_ids=p) for p in prompts])
        for x, y in zip(outs, refs, strict=True):
            same(x, y)
        steps, _ = pair.both("batch_decode", [DecodeInput(token_id=7, kv_cache=o.kv_cache) for o in outs])
        return [o.logits.logits.array for o in outs + steps]
    finally:
        pair.close()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_prefill_in_mlp_blocks_is_the_unblocked_one_bit_for_bit(family, monkeypatch):
    calls: list[int] = []  # the rows of each down projection (its activation computed as it packs them)
    original = cpu_kernels_module.CpuKernels.linear

    def counted(self, x, *args, **kwargs):
        if kwargs.get("glu") is not None:
            calls.append(x.shape[0])
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(cpu_kernels_module.CpuKernels, "linear", counted)
    prompts = [tokens(n) for n in (9, 3, 14, 6)]  # 32 rows: blocks of 5, the last of 2
    blocked = _run(family, prompts, monkeypatch, 5)
    assert 5 in calls and 2 in calls and 32 not in calls  # the prefill's MLPs ran in blocks
    calls.clear()
    whole = _run(family, prompts, monkeypatch, 1 << 20)
    assert 32 in calls and 5 not in calls
    for a, b in zip(blocked, whole, strict=True):
        assert np.array_equal(a, b)
