"""The few-row matmul kernel (executors/models/triton_gemv.py) against torch's, in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import triton_kernels_unrunnable

pytestmark = pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))
pytest.importorskip("triton")

from executors.models.triton_gemv import MAX_ROWS, gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k,block_n,block_k", [(40, 96, 16, 32), (33, 200, 8, 64), (64, 64, 32, 64)])
@pytest.mark.parametrize("extras", ["none", "bias", "residual", "both"])
def test_rows_times_a_row_major_weight(m, n, k, block_n, block_k, extras):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE) if extras in ("bias", "both") else None
    res = torch.randn(m, n, generator=g).to(DEVICE) if extras in ("residual", "both") else None
    got = gemv(x, w, bias, res, block_n=block_n, block_k=block_k)
    want = torch.nn.functional.linear(x, w, bias) + (res if res is not None else 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_it_refuses_what_it_cannot_compute():
    x, w = torch.randn(MAX_ROWS + 1, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="1..8 rows"):
        gemv(x, w)
    column_major = torch.randn(32, 16, device=DEVICE).t()  # [16, 32], unit stride along N
    with pytest.raises(ValueError, match="row-major"):
        gemv(x[:2], column_major)


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("extras", ["none", "both"])
def test_split_k_adds_the_partial_sums(m, split, extras):
    """K divided among `split` programs per column block (200 inputs in tiles of 32: the last
    split short or empty), their partial sums added by the second kernel."""
    g = torch.Generator().manual_seed(m * 100 + split)
    x = torch.randn(m, 200, generator=g).to(DEVICE)
    w = torch.randn(40, 200, generator=g).to(DEVICE)
    bias = torch.randn(40, generator=g).to(DEVICE) if extras == "both" else None
    res = torch.randn(m, 40, generator=g).to(DEVICE) if extras == "both" else None
    got = gemv(x, w, bias, res, block_n=8, block_k=32, split=split)
    want = torch.nn.functional.linear(x, w, bias) + (res if res is not None else 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="split"):
        gemv(x, w, split=0)
