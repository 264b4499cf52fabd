"""How executors/models/few_row_matmuls.py chooses, per shape, between torch's matmul and the
Triton block shapes (the kernel itself in Triton's interpreter; the timer a stand-in)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import triton_kernels_unrunnable

pytestmark = pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))
pytest.importorskip("triton")

from executors.models import few_row_matmuls  # noqa: E402
from executors.models.few_row_matmuls import FewRowMatmuls  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CANDIDATES = ((4, 64, 4), (8, 32, 4), (16, 32, 4))


def weights(n: int = 40, k: int = 96, count: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    return [torch.randn(n, k, generator=g).to(DEVICE) for _ in range(count)]


class Timer:
    """Runs what it times (so the calls happen) and answers the next of `times`."""

    def __init__(self, *times: float) -> None:
        self.times, self.calls = list(times), 0

    def __call__(self, fn) -> float:
        fn()
        self.calls += 1
        return self.times.pop(0)


def test_the_fastest_contender_serves_each_shape():
    ws = weights()
    x = torch.randn(2, 96, device=DEVICE)
    timer = Timer(5.0, 7.0, 3.0, 4.0)  # torch, then each block shape
    m = FewRowMatmuls(ws, CANDIDATES, timer=timer)
    got = m.linear(x, ws[1], None)
    torch.testing.assert_close(got, F.linear(x, ws[1]), atol=1e-4, rtol=1e-5)
    assert m.chosen() == {"2x40x96": "triton 8x32/4"}
    assert list(m.timings.values())[0] == {"torch": 5.0, "triton 4x64/4": 7.0, "triton 8x32/4": 3.0,
                                           "triton 16x32/4": 4.0}
    m.linear(x, ws[2], None)  # the same shape: chosen once
    assert timer.calls == 4
    res = torch.randn(2, 40, device=DEVICE)
    timer.times = [1.0, 2.0, 2.0, 2.0]  # torch wins this one
    want = res + F.linear(x, ws[0])
    got = m.residual_linear(res, x, ws[0], None)  # torch's adds into the residual stream in place
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert m.chosen()["2x40x96+residual"] == "torch"


def test_a_block_shape_that_computes_wrongly_is_not_a_contender(monkeypatch):
    real = few_row_matmuls.gemv

    def off_by_one(x, w, bias, residual, block_n, block_k, warps, split=1):
        out = real(x, w, bias, residual, block_n, block_k, warps, split)
        return out + 1 if block_n == 8 else out

    monkeypatch.setattr(few_row_matmuls, "gemv", off_by_one)
    ws = weights()
    timer = Timer(5.0, 4.0, 1.0)  # torch, 4x64, 16x32: the wrong one is never timed
    m = FewRowMatmuls(ws, CANDIDATES, timer=timer)
    bias = torch.randn(40, device=DEVICE)
    m.linear(torch.randn(1, 96, device=DEVICE), ws[0], bias)
    assert m.chosen() == {"1x40x96+bias": "triton 16x32/4"}
    assert "triton 8x32/4" not in list(m.timings.values())[0]


def test_untimed_the_first_right_block_shape_serves_and_large_steps_keep_torch():
    ws = weights()
    m = FewRowMatmuls(ws, CANDIDATES, timer=None)
    m.linear(torch.randn(3, 96, device=DEVICE), ws[0], None)
    assert m.chosen() == {"3x40x96": "triton 4x64/4"} and m.timings == {}
    x = torch.randn(9, 96, device=DEVICE)  # past the kernel's 8 rows
    torch.testing.assert_close(m.linear(x, ws[0], None), F.linear(x, ws[0]))
    assert len(m.chosen()) == 1


def test_few_rows_also_try_long_and_split_tiles_which_compute_right():
    fr = few_row_matmuls
    assert fr.default_candidates(2) == fr.CANDIDATES + fr.LONG_TILES + fr.SPLIT_TILES
    assert fr.default_candidates(3) == fr.default_candidates(4) == fr.CANDIDATES + fr.SPLIT_TILES
    assert fr.default_candidates(8) == fr.CANDIDATES
    (w,) = weights(n=40, k=300, count=1)
    x, res = torch.randn(2, 300, device=DEVICE), torch.randn(2, 40, device=DEVICE)
    for cfg in fr.LONG_TILES + fr.SPLIT_TILES:  # K shorter than the tile, or than the splits: masked
        got = fr.gemv(x, w, None, res, *cfg)
        torch.testing.assert_close(got, res + F.linear(x, w), atol=1e-4, rtol=1e-5)
    shapes = len(fr.default_candidates(1))
    m = FewRowMatmuls([w], timer=Timer(*[9.0] * shapes, 1.0))  # torch, then every block shape: the last wins
    m.linear(x[:1], w, None)
    assert m.chosen() == {"1x40x300": "triton 16x256/4 split 8"}
