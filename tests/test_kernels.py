"""The skinny C matmul for fp32, bf16, int8 and int4 weights: each output element has one value whatever
the number of rows in the call (bitwise, past 32 rows and across row chunks), the AVX-512 and AVX2
builds agree bit for bit, results stay within a float64 error bound computed here from the
arithmetic (not from the code's constants), and the torch fallback agrees within 1e-4."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.runtime import kernels, quant
from tests.conftest import np_unpack_int4

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler or no AVX2/FMA")
KINDS = ["float32", "bfloat16", "int8", "int4"]
ROWS = [1, 2, 5, 7, 33, 65]
U = 2.0 ** -24  # fp32 unit roundoff


def weights(kind: str, n: int, k: int, seed: int = 0, group_size: int = 32):
    """(kernel weight, float64 matrix it stands for, rebuilt in numpy from the stored bits)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind == "float32":
        return w, w.double().numpy()
    if kind == "bfloat16":
        wb = w.bfloat16()
        return wb, wb.float().double().numpy()
    layer = quant.QLinear(*quant.quantize(w, kind, group_size))
    s = layer.scales.double().numpy()
    if kind == "int8":
        return layer, layer.qweight.numpy().astype(np.float64) * s[:, None]
    u = np_unpack_int4(layer.qweight.numpy())
    return layer, u * np.repeat(s, group_size, axis=1)


def _shape(kind: str) -> tuple[int, int]:
    # K: not a multiple of 16 (scalar tail) except for int4, which needs whole groups; N: not a multiple of
    # any tile height or the per-thread chunk.
    return (77, 256) if kind == "int4" else (77, 203)


@pytest.fixture
def threads():
    n, kn = torch.get_num_threads(), kernels.threads()
    yield
    torch.set_num_threads(n)
    kernels.set_threads(kn)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_matches_float64_reference_within_the_fp32_error_bound(kind, rows):
    n, k = _shape(kind)
    w, ref_w = weights(kind, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = kernels.linear(x, w).double().numpy()
    xd = x.double().numpy()
    ref = xd @ ref_w.T
    # Sum of k products in fp32 (plus one rounding of each dequantized weight and of the int8 scale):
    # |error| <= (k + 2) u sum |x||w| to first order.
    bound = (k + 2) * U * (np.abs(xd) @ np.abs(ref_w).T) * 1.01
    assert (np.abs(got - ref) <= bound).all(), float((np.abs(got - ref) / bound).max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nthreads", [1, 2])
def test_a_rows_output_is_bitwise_the_same_whatever_the_row_count(kind, nthreads, threads):
    n, k = _shape(kind)
    w, _ = weights(kind, n, k, seed=1)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(2))
    kernels.configure_threads(nthreads)
    alone = torch.cat([kernels.linear(x[i:i + 1], w) for i in range(len(x))])
    # Every tile shape (1..6-row groups), across 32 and across the 48-row chunks the kernel works in.
    for s in [*range(2, 14), 17, 31, 32, 33, 47, 48, 49, 65, 96, 97, 100]:
        assert torch.equal(kernels.linear(x[:s], w), alone[:s]), f"{kind}: {s} rows"
        assert torch.equal(kernels.linear(x[100 - s:], w), alone[100 - s:]), f"{kind}: last {s} rows"


@pytest.mark.parametrize("kind", KINDS)
def test_thread_count_does_not_change_the_bits(kind, threads):
    n, k = _shape(kind)
    w, _ = weights(kind, n, k, seed=3)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    kernels.configure_threads(1)
    one = kernels.linear(x, w)
    kernels.configure_threads(2)
    assert torch.equal(kernels.linear(x, w), one)


@pytest.mark.skipif("avx512" not in kernels.supported_isas(), reason="CPU without AVX-512")
@pytest.mark.parametrize("kind", KINDS)
def test_avx512_and_avx2_builds_agree_bit_for_bit(kind):
    n, k = _shape(kind)
    w, _ = weights(kind, n, k, seed=5)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    prev = kernels.set_path("avx512")
    try:
        a = kernels.linear(x, w)
        kernels.set_path("avx2")
        b = kernels.linear(x, w)
    finally:
        kernels.set_path(prev)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_fallback_agrees_with_the_kernel(kind):
    n, k = _shape(kind)
    w, _ = weights(kind, n, k, seed=7)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(8))
    fast = kernels.linear(x, w)
    prev = kernels.set_path("torch")
    try:
        assert kernels.path() == "torch"
        slow = kernels.linear(x, w)
    finally:
        kernels.set_path(prev)
    assert (fast - slow).abs().max() <= 1e-4 * max(1.0, float(slow.abs().max()))


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
def test_fused_linear_modes_are_row_count_independent_and_correct(kind):
    n, k = 64, 128
    w, ref_w = weights(kind, n, k, seed=9)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(40, k, generator=g)
    norm = torch.rand(k, generator=g) + 0.5
    eps = 1e-5
    xd = x.double()
    normed = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * norm.double()).numpy()
    y = kernels.fused_linear(x, w, norm=norm, eps=eps)
    assert np.abs(y.double().numpy() - normed @ ref_w.T).max() <= 1e-4 * np.abs(normed @ ref_w.T).max()
    for s in (1, 7, 33):
        assert torch.equal(kernels.fused_linear(x[:s].contiguous(), w, norm=norm, eps=eps), y[:s])
    gu = torch.randn(40, 2 * k, generator=g)
    a, b = gu[:, :k].double(), gu[:, k:].double()
    act = (a * torch.sigmoid(a) * b).numpy()
    base = torch.randn(40, n, generator=g)
    out = base.clone()
    kernels.fused_linear(gu, w, swiglu=True, out=out)
    want = base.double().numpy() + act @ ref_w.T
    assert np.abs(out.double().numpy() - want).max() <= 1e-4 * np.abs(want).max()
    for s in (1, 6, 35):
        part = base[:s].clone()
        kernels.fused_linear(gu[:s].contiguous(), w, swiglu=True, out=part)
        assert torch.equal(part, out[:s])


def test_configure_threads_sets_torch_and_the_kernels(threads):
    kernels.configure_threads(1)
    assert torch.get_num_threads() == 1 and kernels.threads() == 1
    kernels.configure_threads(2)
    assert torch.get_num_threads() == 2 and kernels.threads() == 2


def test_fp16_weights_are_refused_by_name():
    with pytest.raises(ValueError, match="float16"):
        kernels.fused_linear(torch.randn(2, 16), torch.randn(8, 16).half())


def _kernel_path_in_subprocess(env: dict) -> subprocess.CompletedProcess:
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from pipeline.runtime import kernels; print('PATH=' + kernels.path())")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_a_failed_compile_is_logged_and_reported_as_the_torch_path(tmp_path):
    res = _kernel_path_in_subprocess({"CC": "false", "PIPELINE_CACHE": str(tmp_path)})
    assert "PATH=torch" in res.stdout
    assert "skinny kernel failed" in res.stderr


def test_forced_path_is_reported():
    res = _kernel_path_in_subprocess({"PIPELINE_KERNEL": "avx2"})
    assert "PATH=avx2" in res.stdout, res.stderr
    res = _kernel_path_in_subprocess({"PIPELINE_KERNEL": "torch"})
    assert "PATH=torch" in res.stdout
