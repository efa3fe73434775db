"""gpu/sampling/reductions.py's C kernels against torch: argmax the same indices as
torch.argmax(dim=-1) on random rows, ties (the first), NaNs (the first NaN), -inf rows, odd
widths and row strides; log_softmax_parts the log_softmax within float rounding, NaN where
torch's is."""

import numpy as np
import pytest
import torch

from gpu import kernels
from gpu.sampling.reductions import _library, argmax_rows, log_softmax_parts

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="needs an AVX2 CPU and a C compiler")


def test_the_c_kernel_is_what_runs():
    assert _library() is not None


@pytest.mark.parametrize("S, V", [(1, 262144), (8, 49152), (3, 1), (5, 7), (2, 9), (17, 100)])
def test_random_rows(S, V):
    x = torch.from_numpy(np.random.default_rng(V).standard_normal((S, V)).astype(np.float32))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_take_the_first_and_nans_win():
    x = torch.zeros(6, 40)
    x[0, [3, 17, 30]] = 2.0  # a tie in the vector part
    x[1, [37, 38]] = 5.0  # a tie in the scalar tail
    x[2, 25] = float("nan")
    x[2, 5] = float("inf")
    x[3, [9, 39]] = float("nan")
    x[4] = float("-inf")
    x[5, 39] = 1.0  # the maximum in the tail alone
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x).tolist() == [3, 37, 25, 9, 0, 39]


def test_rows_of_a_wider_tensor_and_other_tensors():
    wide = torch.randn(4, 300)
    view = wide[:, 10:250]  # rows 300 floats apart
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    for x in (torch.randn(3, 50, dtype=torch.float64), torch.randn(50, 3).t()):  # torch's own path
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("S, V", [(1, 262144), (8, 49152), (3, 1), (5, 7), (17, 100)])
def test_log_softmax_from_its_parts(S, V):
    x = torch.from_numpy(np.random.default_rng(V).standard_normal((S, V)).astype(np.float32)) * 8
    x[0, : V // 2] = float("-inf")  # tokens masked away
    argmax, top, log_sum = log_softmax_parts(x)
    want = torch.log_softmax(x, dim=-1)
    assert torch.equal(argmax, x.argmax(dim=-1)) and torch.equal(top, x.max(dim=-1).values)
    torch.testing.assert_close((x - top[:, None]) - log_sum[:, None], want, rtol=1e-6, atol=2e-6)
    assert ((top - top) - log_sum <= 0).all()  # the top token's logprob is never above 0


def test_log_softmax_parts_of_rows_without_a_finite_top_are_nan():
    x = torch.zeros(4, 30)
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")
    x[2] = float("-inf")
    x[3, 5] = 1.0
    for parts in (log_softmax_parts(x), log_softmax_parts(x.double())):  # the C kernel, torch's
        argmax, top, log_sum = parts
        assert torch.isnan(log_sum[:3]).all() and torch.isnan(torch.log_softmax(x[:3], dim=-1)).all()
        assert argmax.tolist() == [3, 7, 0, 5]
        torch.testing.assert_close(log_sum[3:].float(), torch.logsumexp(x[3:] - 1.0, dim=-1))
