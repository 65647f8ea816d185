"""The skinny C matmul: every tile shape gives the same bits as a one-row call, and matches torch."""

import pytest
import torch

from pipeline.runtime import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler or no AVX2/FMA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_skinny_matmul_rows_are_bitwise_independent_of_how_many_share_a_call(dtype, threads):
    g = torch.Generator().manual_seed(0)
    K, N = 203, 77  # tails in both K (not a multiple of 8) and N (not a multiple of any tile height)
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(kernels.MAX_ROWS, K, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([kernels.linear(x[i:i + 1], w) for i in range(len(x))])
        for s in range(1, kernels.MAX_ROWS + 1):
            assert torch.equal(kernels.linear(x[:s], w), alone[:s]), f"{s} rows"
    finally:
        torch.set_num_threads(old)
    ref = x @ w.float().T
    assert (alone - ref).abs().max() <= 1e-3
