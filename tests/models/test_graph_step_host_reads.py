"""The decode step that CUDA graphs capture reads no device tensor's values on the host.

A CUDA graph cannot capture a synchronization: a host read of a device tensor inside the
captured step (int(t), t.item(), t.tolist(), bool(t), t.numpy(), a nonzero or masked select
whose size depends on values) fails the capture, and the executor falls back to eager decode
steps. The first H100 run of `make gpu-check` found one (a min/max of the positions in
step_ops.for_step): every capture failed and batch-1 steps took 21 ms instead of 3.4.

On a CPU nothing synchronizes, so here the graphs' static-buffer step runs (eagerly, as
DecodeGraphs does on a CPU) under a torch function mode that refuses those reads, with the
CPU kernels off as on a GPU and the Triton launches (the attention prologue's, the decode
kernel's and the GLU's) stubbed out: Triton's interpreter itself copies tensors to the host, and the
launches' host arguments are shapes and numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from executors.llm import LlmExecutor, LlmExecutorConfig
from tests.conftest import triton_kernels_unrunnable
from tests.models.test_cpu_paths import BLOCK, tiny_model

pytestmark = [
    pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable())),
    # The CPU's stand-in for a capture: on a GPU the capture itself runs (test_triton_paths.py, tests/gpu).
    pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check; on a GPU the decode graphs are captured"),
]
pytest.importorskip("triton")

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__, torch.nonzero,
              torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique}


class RefuseHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS or (func is torch.Tensor.__getitem__ and len(args) > 1
                                  and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool):
            raise AssertionError(f"the graph step reads a tensor on the host: {getattr(func, '__name__', func)}")
        return func(*args, **(kwargs or {}))


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_captured_step_reads_nothing_on_the_host(family, monkeypatch):
    cfg = LlmExecutorConfig(model_dir=f"/nonexistent/{family}", block_size=BLOCK, num_blocks=24, device="cpu",
                            dtype="float32", max_batch_size=4, attention_backend="triton", cpu_kernels=False,
                            max_sequence_length=96)
    model = tiny_model(family)
    model.use_cpu_kernels = False  # as on a GPU: torch ops, no CPU kernels' checks
    ex = LlmExecutor(cfg, model, decode_graphs=True)
    try:
        graphs = ex.graphs
        assert graphs is not None and ex.model.cpu_kernels is None
        from executors.models import triton_attention_launch, triton_glu, triton_prologue

        # The fused kernels' launches are in the step too.
        assert graphs.prologue is ex.qkv_prologue is not None and graphs.glu is ex.fused_glu is not None
        monkeypatch.setattr(triton_attention_launch, "_decode_kernel", _NoLaunch())
        monkeypatch.setattr(triton_prologue, "_prologue_kernel", _NoLaunch())
        monkeypatch.setattr(triton_glu, "_glu_kernel", _NoLaunch())
        for b in graphs.buckets:
            with RefuseHostReads():
                logits, pairs = graphs._step(b)  # the argmax pairs are computed in the graph too
            assert logits.shape[0] == b and pairs.shape == (2, b)
        # The mode does catch a read: the check above can fail.
        with pytest.raises(AssertionError, match="__int__"), RefuseHostReads():
            int(graphs._long[1, :2].min())
    finally:
        ex.worker.close()


def test_a_failed_capture_is_explained_by_its_first_error():
    """What a capture failure looks like: the op that synchronized raises inside the capture, then
    capture_end raises that an earlier error happened; the warning names the first, and where."""
    from executors.decode_graphs import describe_failure
    from executors.models import step_ops

    def captured_step():
        step_ops.for_step
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nSearch for ...")

    try:
        try:
            captured_step()
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as e:
        text = describe_failure(e)
    assert text.startswith("RuntimeError at tests/models/test_graph_step_host_reads.py:"), text
    assert "(captured_step): CUDA error: operation not permitted when stream is capturing (an operation" in text
    assert "Search for" not in text and "previous error" not in text
