"""The GGUF's 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in the CPU kernels (gguf_blocks32.c).

Tiny random and adversarial blocks made here, no model files: every weight decoded from the panels equals the `gguf`
package's dequantization bit for bit, through the torch unpacking and each C build this CPU runs; a matmul equals the
documented arithmetic (int8 activations per 32 columns, exact integer sums, a fixed fp32 order) bit for bit on every
build, thread count and number of token rows, beside k-quant parts and with the AMX tiles on; a type without a kernel
is refused naming the tensor and the type.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.runtime import gguf_weights as gw
from pipeline.runtime import kernels
from tests.test_gguf_weights import AMX, BUILDS, F16_MAX, F16_MIN_DENORMAL, F16_MIN_NORMAL, _f16
from tests.test_gguf_weights import random_blocks as random_kquant_blocks

TYPES = [gw.Q4_0, gw.Q4_1, gw.Q5_0, gw.Q5_1, gw.Q8_0]
HAS_MIN = (gw.Q4_1, gw.Q5_1)


@pytest.fixture
def path():
    """Run a test on one kernel build and put the previous one back."""
    prev = kernels.path()
    yield kernels.set_path
    kernels.set_path(prev)


def random_blocks(qtype: int, N: int, K: int, rng, scale: float = 1e-2) -> np.ndarray:
    """N rows of random GGUF blocks of 32 (random integers, fp16 d and m around `scale`, of either sign)."""
    nb = K // 32
    raw = rng.integers(0, 256, size=(N, nb, gw.GGUF_BLOCK32[qtype]), dtype=np.uint8)
    raw[..., 0:2] = _f16(rng.normal(0, scale, (N, nb)))
    if qtype in HAS_MIN:
        raw[..., 2:4] = _f16(rng.normal(0, scale, (N, nb)))
    return raw.reshape(N, -1)


def adversarial_blocks(qtype: int, rng) -> np.ndarray:
    """16 rows x 64 columns of extreme blocks: fp16 max / min normal / min denormal / zero / negative d and m, every
    integer at its largest or smallest (Q8_0: -128 and 127), and all-zero blocks."""
    ds = [F16_MAX, -F16_MAX, F16_MIN_NORMAL, F16_MIN_DENORMAL, 0.0, 1.0, -F16_MIN_DENORMAL, 3.0e-5]
    size = gw.GGUF_BLOCK32[qtype]
    o = 4 if qtype in HAS_MIN else 2  # where the integers start
    rows = []
    for i in range(16):
        raw = rng.integers(0, 256, size=(2, size), dtype=np.uint8)
        d, m = ds[i % len(ds)], ds[(i * 3 + 1) % len(ds)]
        if i == 13:
            d, m = F16_MAX, F16_MIN_DENORMAL  # 2^40 apart: D q + M rounds
        raw[:, 0:2] = _f16(d)
        if qtype in HAS_MIN:
            raw[:, 2:4] = _f16(m)
        if i % 4 == 1:
            raw[:, o:] = 0xFF  # every integer at its top (Q8_0: -1)
        if i % 4 == 2:
            raw[:, o:] = 0  # every integer 0 (the most negative weight for Q4_0 / Q5_0)
        if i % 4 == 3 and qtype == gw.Q8_0:
            raw[0, 2:] = 0x80  # -128
            raw[1, 2:] = 0x7F  # 127
        if i == 15:
            raw[:] = 0  # all-zero blocks
        rows.append(raw.reshape(-1))
    return np.stack(rows)


def layer(tensors, K: int) -> gw.GGUFLinear:
    return gw.GGUFLinear(*gw.pack_parts(tensors, K))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_every_weight_decoded_from_the_panels_equals_the_gguf_reference_dequantization(qtype, kind, path):
    rng = np.random.default_rng(100 + qtype)
    raw = random_blocks(qtype, 37, 576, rng) if kind == "random" else adversarial_blocks(qtype, rng)
    K = raw.shape[1] // gw.GGUF_BLOCK32[qtype] * 32
    ref = torch.from_numpy(gw.reference_dequantize(qtype, raw, K))
    lin = layer([(qtype, raw)], K)
    assert torch.equal(lin.weight, ref)  # the torch unpacking of the panels
    for build in BUILDS:
        path(build)
        assert torch.equal(lin.dequant_kernel(0), ref), build  # the C build's decoding of the same panels


def _x(S: int, K: int, seed: int = 0) -> torch.Tensor:
    """Activations with an outlier column, an all-zero block, a block of denormals and one of huge values."""
    x = torch.randn(S, K, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 40
    x[:, 32:64] = 0
    x[:, 64:96] *= 1e-39
    x[:, 96:128] *= 1e30
    return x


@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_equals_the_documented_arithmetic_bit_for_bit_on_every_build(threads, path):
    """Four parts of different types in one layer (a fused q/k/v as the draft's GGUF mixes them), K = 896 (the 0.5B's
    width, not whole super-blocks), 53 token rows (past the 48-row chunk, quantized on the pool), one NaN row."""
    rng = np.random.default_rng(7)
    K = 896
    parts = [(gw.Q5_0, random_blocks(gw.Q5_0, 40, K, rng)), (gw.Q8_0, random_blocks(gw.Q8_0, 24, K, rng)),
             (gw.Q4_1, random_blocks(gw.Q4_1, 19, K, rng)), (gw.Q5_1, random_blocks(gw.Q5_1, 16, K, rng))]
    lin = layer(parts, K)
    x = _x(53, K)
    x[9, 300] = float("nan")
    ref = gw.reference_matmul(x, lin.fields(), lin.out_features)
    assert torch.isnan(ref[9]).all() and torch.isfinite(ref[:9]).all() and torch.isfinite(ref[10:]).all()
    prev = kernels.threads()
    kernels.set_threads(threads)
    try:
        for build in BUILDS:
            path(build)
            for S in (1, 2, 3, 4, 5, 8, 9, 53):
                got = kernels.linear(x[:S], lin)
                assert ((got == ref[:S]) | (got.isnan() & ref[:S].isnan())).all(), (build, S)
        path("torch")
        got = kernels.linear(x, lin)
        assert ((got == ref) | (got.isnan() & ref.isnan())).all()
    finally:
        kernels.set_threads(prev)


@pytest.mark.parametrize("qtype", TYPES)
def test_adversarial_blocks_multiply_as_documented_on_every_build(qtype, path):
    rng = np.random.default_rng(qtype)
    raw = adversarial_blocks(qtype, rng)
    lin = layer([(qtype, np.concatenate([raw, raw[:5]]))], 64)  # 21 rows: a partial second panel
    x = _x(3, 64, seed=qtype)[:, :64] * torch.tensor([1.0, 1e-3, 1e3])[:, None]
    ref = gw.reference_matmul(x, lin.fields(), lin.out_features)
    for build in BUILDS:
        path(build)
        got = kernels.linear(x, lin)
        assert ((got == ref) | (got.isnan() & ref.isnan())).all(), build


def test_blocks_of_32_beside_k_quants_in_one_layer_and_on_the_amx_tiles(path):
    """A layer mixing Q4_K / Q6_K parts (activations per 256 columns) with Q8_0 / Q4_1 parts (per 32): each part keeps
    its own contract; the AMX mode (the software model of the tiles) runs the k-quants on tiles and leaves the blocks of
    32 on their own code, same bits."""
    rng = np.random.default_rng(13)
    K = 512
    lin = layer([(gw.Q4_K, random_kquant_blocks(gw.Q4_K, 20, K, rng)), (gw.Q8_0, random_blocks(gw.Q8_0, 17, K, rng)),
                 (gw.Q6_K, random_kquant_blocks(gw.Q6_K, 16, K, rng)), (gw.Q4_1, random_blocks(gw.Q4_1, 9, K, rng))], K)
    x = _x(11, K, seed=2)
    ref = gw.reference_matmul(x, lin.fields(), lin.out_features)
    assert torch.isfinite(ref).all()
    for build in BUILDS:
        path(build)
        assert torch.equal(kernels.linear(x, lin), ref), build
    if AMX:
        path("avx512")
        prev = kernels.set_amx("emulated")
        try:
            assert torch.equal(kernels.linear(x, lin), ref)
        finally:
            kernels.set_amx(prev)


def test_matmul_is_the_dequantized_matmul_within_the_activation_rounding(path):
    """Against fp64 on the GGUF's fp32 weights the result is off by the activation rounding only: each 32 columns'
    activations move by at most half a step of max|x| / 127, and a block 1000x larger leaves its neighbours' alone."""
    rng = np.random.default_rng(9)
    K = 576
    lin = layer([(t, random_blocks(t, 16, K, rng)) for t in (gw.Q4_0, gw.Q5_1)], K)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    x[:, 32:64] *= 1000
    q8, dx, _ = gw.quantize_activations32(x)
    assert dx.shape == (3, 18) and (dx[:, 1] > 500 * dx[:, 0]).all()
    xq = (q8.double().view(3, -1, 32) * dx.double()[..., None]).view(3, K)  # the activations the kernel multiplies
    assert ((x.double() - xq).abs() <= dx.double().repeat_interleave(32, 1) / 2 * (1 + 1e-6)).all()
    exact = xq @ lin.weight.double().T
    for build in BUILDS:
        path(build)
        got = kernels.linear(x, lin).double()
        assert (got - exact).abs().max() <= 1e-5 * exact.abs().max(), build


def test_a_tensor_type_without_a_kernel_is_refused_naming_the_tensor_and_the_type(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    f = tmp_path / "q2k.gguf"
    w = GGUFWriter(str(f), "llama")
    w.add_tensor("output.weight", np.zeros((16, 84), np.uint8), raw_dtype=GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"tensor output\.weight is Q2_K, which quantization gguf has no kernel for"):
        gw.gguf_layers(f, 0, log=lambda *_: None)
    with pytest.raises(ValueError, match="GGUF tensor type 10: quantization gguf runs Q4_K, Q6_K, Q4_0"):
        gw.pack(10, np.zeros((16, 84), np.uint8), 256)
    with pytest.raises(ValueError, match="input width 576: a Q4_K part needs whole super-blocks of 256 columns"):
        gw.pack_parts([(gw.Q4_K, np.zeros((16, 288), np.uint8))], 576)


def test_llama_q_and_k_rows_come_back_in_the_checkpoints_order():
    """llama.cpp's llama converter interleaves each head's RoPE halves in attn_q / attn_k (its permute); the rows are
    put back whole, so the blocks are not touched: SmolLM2's GGUF builds only with this (gguf_state's check)."""
    heads, rows = 3, 3 * 64
    hf = np.arange(rows * 2).reshape(rows, 2)
    gguf_rows = hf.reshape(heads, 2, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows, 2)  # llama.cpp's permute
    assert not np.array_equal(gguf_rows, hf)
    assert np.array_equal(gguf_rows[gw.unpermute_rows(rows, heads)], hf)


@pytest.mark.parametrize("qtype", [*TYPES, gw.Q4_K, gw.Q6_K])
def test_a_reduced_head_of_gguf_rows_is_those_rows_bit_for_bit(qtype, path):
    """A reduced-vocabulary head (the draft's, Medusa's proposal vocabulary) on GGUF weights: the chosen rows gathered
    from the panels decode to the same weights and multiply to the same bits as the full head's columns."""
    rng = np.random.default_rng(21 + qtype)
    K = 512
    raw = random_blocks(qtype, 75, K, rng) if qtype in gw.RECORD32 else random_kquant_blocks(qtype, 75, K, rng)
    full = layer([(qtype, raw)], K)
    idx = torch.tensor([74, 0, 17, 16, 3, 40, 41, 15, 60, 2, 33, 70, 9, 31, 50, 49, 48, 1, 5])
    sub = full.rows(idx)
    assert sub.out_features == 19 and torch.equal(sub.weight, full.weight[idx])
    x = _x(3, K, seed=1)
    for build in BUILDS:
        path(build)
        assert torch.equal(kernels.linear(x, sub), kernels.linear(x, full)[:, idx]), build
    with pytest.raises(ValueError, match="indices must lie in 0..74"):
        full.rows(torch.tensor([75]))
