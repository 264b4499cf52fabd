"""A gated MLP's down projection over its gate/up output (CpuKernels.linear's `glu`): the
activation computed as the kernels pack the rows (pack_x.h) is the same bits as glu() then
the matmul, on either instruction set, at every row count and width."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executors.cpu_kernels import cpu_kernels
from executors.cpu_kernels.panels import pack
from executors.cpu_kernels.qpanels import quantize


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels()
    if k is None:
        pytest.skip("the CPU kernels cannot be built here")
    return k


# Rows: the dot products (1-6), one and two 8-row halves, 16-row panels and past them, and a
# 160-row chunk and more. Widths: whole chunks of eight, a tail of 4 or 6 past them, more
# than one 64-column block.
@pytest.mark.parametrize("inter", [8, 20, 30, 136])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_fused_activation_gives_the_unfused_bits(kernels, isa, inter, activation):
    gen = torch.Generator().manual_seed(inter)
    n = 14  # two full 6-column panels and a part of one
    w = pack(torch.randn(n, inter, generator=gen))
    bias = torch.randn(n, generator=gen)
    for m in (1, 5, 6, 7, 8, 13, 16, 17, 33, 170):
        gate_up = torch.randn(m, 2 * inter, generator=gen) * 3  # SiLU's and GELU's curved part and tails
        residual = torch.randn(m, n, generator=gen)
        act = kernels.glu(gate_up, activation)
        assert torch.equal(kernels.linear(gate_up, w, bias, residual=residual, glu=activation),
                           kernels.linear(act, w, bias, residual=residual)), (m, inter)
        assert torch.equal(kernels.linear(gate_up, w, glu=activation), kernels.linear(act, w)), (m, inter)


def test_rows_laid_out_with_a_stride_and_int8_weights(kernels):
    gen = torch.Generator().manual_seed(1)
    inter, n, m = 24, 12, 40
    wide = torch.randn(m, 2 * inter + 5, generator=gen)
    gate_up = wide[:, :2 * inter]  # rows 2 I + 5 apart
    dense = torch.randn(n, inter, generator=gen)
    act = kernels.glu(gate_up.contiguous(), "silu")
    assert torch.equal(kernels.linear(gate_up, pack(dense), glu="silu"), kernels.linear(act, pack(dense)))
    # int8 panels take the activation first, then their own matmul: the same as doing it by hand.
    q = quantize(dense)
    assert torch.equal(kernels.linear(gate_up, q, glu="silu"), kernels.linear(act, q))
    reference = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ dense.T
    np.testing.assert_allclose(kernels.linear(gate_up, pack(dense), glu="silu"), reference, rtol=1e-5, atol=1e-5)


def test_an_odd_width_or_an_unknown_activation_is_refused(kernels):
    w = pack(torch.randn(6, 4))
    with pytest.raises(ValueError, match="gate/up output"):
        kernels.linear(torch.randn(9, 7), w, glu="silu")
    with pytest.raises(ValueError, match="relu"):
        kernels.linear(torch.randn(9, 8), w, glu="relu")
    with pytest.raises(ValueError, match="columns"):  # the halves must match the weight's k
        kernels.linear(torch.randn(9, 10), w, glu="silu")
