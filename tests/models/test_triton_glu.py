"""The gated MLP's activation-and-multiply as one Triton kernel, against torch.

Triton's interpreter runs the kernel here (the compiled one on a GPU); the whole-model paths
through it are in test_triton_paths.py (the triton executors against the reference, 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import triton_kernels_unrunnable

pytestmark = pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))
pytest.importorskip("triton")

from executors.models import layers, triton_glu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,inter", [(1, 96), (5, 1100), (3, 2048)])
def test_the_kernel_computes_the_models_activation(activation, rows, inter):
    g = torch.Generator().manual_seed(rows * inter)
    gu = (4 * torch.randn(rows, 2 * inter, generator=g)).to(DEVICE)
    gu[0, :8] = torch.tensor([-80.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 80.0, 5.0])  # both tails of the activation
    got = triton_glu.glu(gu, activation)
    want = layers.activation(activation)(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (rows, inter) and torch.isfinite(got).all()


def test_a_strided_input_and_no_rows():
    gu = torch.randn(4, 64, device=DEVICE)
    wide = torch.randn(4, 100, device=DEVICE)
    wide[:, :64] = gu
    torch.testing.assert_close(triton_glu.glu(wide[:, :64], "silu"), triton_glu.torch_glu(gu, "silu"))
    assert triton_glu.glu(gu[:0], "silu").shape == (0, 32)


def test_the_start_up_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    assert triton_glu.self_check(DEVICE, torch.float32, "silu") is None
    assert triton_glu.self_check(DEVICE, torch.float32, "gelu_tanh") is None
    assert "no GLU kernel" in triton_glu.self_check(DEVICE, torch.float32, "relu")
    real = triton_glu.glu
    monkeypatch.setattr(triton_glu, "glu", lambda gu, act: real(gu, act) * 1.001)
    assert "differs from the torch ops" in triton_glu.self_check(DEVICE, torch.float32, "silu")
