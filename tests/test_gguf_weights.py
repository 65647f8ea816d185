"""The GGUF's own Q4_K / Q6_K weights in the CPU kernels (gguf_kernels.c, pipeline/runtime/gguf_weights.py).

Tiny random and adversarial blocks made here, no model files: every weight decoded from the kernels' panels equals the
`gguf` package's reference dequantization bit for bit, on every kernel build this CPU runs; a matmul equals the
documented arithmetic (int8 activations per 256 columns, exact integer sums, a fixed fp32 order) bit for bit, on any
number of token rows and threads; and a model on such layers decodes the same bits by prefill and token by token.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from pipeline import spec as specmod
from pipeline.runtime import gguf_weights as gw
from pipeline.runtime import kernels, quant
from pipeline.runtime.model import ModelConfig, build_model

BUILDS = kernels.supported_isas()  # the C builds this CPU runs ("avx512", "avx2"); torch is the reference itself
F16_MAX, F16_MIN_NORMAL, F16_MIN_DENORMAL = 65504.0, 2.0 ** -14, 2.0 ** -24


@pytest.fixture
def path():
    """Run a test on one kernel build and put the previous one back."""
    prev = kernels.path()

    def use(name: str) -> None:
        kernels.set_path(name)

    yield use
    kernels.set_path(prev)


def _f16(v) -> np.ndarray:
    return np.frombuffer(np.asarray(v, dtype=np.float16).tobytes(), np.uint8).reshape(*np.shape(v), 2)


def random_blocks(qtype: int, N: int, K: int, rng, scale: float = 1e-3) -> np.ndarray:
    """N rows of random GGUF blocks (random integers and scale bytes, fp16 d / dmin around `scale`)."""
    nsb = K // 256
    raw = rng.integers(0, 256, size=(N, nsb, gw.GGUF_BLOCK[qtype]), dtype=np.uint8)
    if qtype == gw.Q4_K:
        raw[..., 0:2] = _f16(np.abs(rng.normal(0, scale, (N, nsb))))
        raw[..., 2:4] = _f16(np.abs(rng.normal(0, scale, (N, nsb))))
    else:
        raw[..., 208:210] = _f16(rng.normal(0, scale, (N, nsb)))
    return raw.reshape(N, -1)


def adversarial_blocks(qtype: int, rng) -> np.ndarray:
    """16 rows x 256 columns of extreme blocks: fp16 max / min normal / min denormal / zero / negative d and dmin,
    largest and zero sub-block scales and integers, and all-zero blocks."""
    ds = [F16_MAX, -F16_MAX, F16_MIN_NORMAL, F16_MIN_DENORMAL, 0.0, 1.0, -F16_MIN_DENORMAL, 3.0e-5]
    rows = []
    for i in range(16):
        raw = rng.integers(0, 256, size=gw.GGUF_BLOCK[qtype], dtype=np.uint8)
        d, dmin = ds[i % len(ds)], ds[(i * 3 + 1) % len(ds)]
        if i in (13, 14):
            d, dmin = (F16_MAX, F16_MIN_DENORMAL) if i == 13 else (F16_MIN_DENORMAL, -F16_MAX)  # 2^40 apart
        if i == 15:
            raw[:] = 0  # an all-zero block
        elif qtype == gw.Q4_K:
            raw[0:2], raw[2:4] = _f16(d), _f16(dmin)
            if i % 4 == 1:
                raw[4:16] = 0xFF  # every 6-bit scale and min 63
            if i % 4 == 2:
                raw[16:] = 0xFF  # every q 15
            if i % 4 == 3:
                raw[16:] = 0
        else:
            raw[208:210] = _f16(d)
            if i % 4 == 1:
                raw[192:208] = 0x80  # scales -128
            if i % 4 == 2:
                raw[:192] = 0xFF  # q 63
            if i % 4 == 3:
                raw[:192] = 0  # q 0 (weight -32 d sc)
        rows.append(raw)
    return np.stack(rows)


def layer(tensors: list[tuple[int, np.ndarray]], K: int) -> gw.GGUFLinear:
    return gw.GGUFLinear(*gw.pack_parts(tensors, K))


@pytest.mark.parametrize("qtype", [gw.Q4_K, gw.Q6_K])
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_every_weight_decoded_from_the_panels_equals_the_gguf_reference_dequantization(qtype, kind, path):
    rng = np.random.default_rng(qtype)
    raw = random_blocks(qtype, 37, 512, rng) if kind == "random" else adversarial_blocks(qtype, rng)
    K = raw.shape[1] // gw.GGUF_BLOCK[qtype] * 256
    ref = torch.from_numpy(gw.reference_dequantize(qtype, raw, K))
    lin = layer([(qtype, raw)], K)
    assert torch.equal(lin.weight, ref)  # the torch path's decoding of the panels
    for build in BUILDS:
        path(build)
        assert torch.equal(lin.dequant_kernel(0), ref), build  # the C build's decoding of the same panels


def test_q4k_panels_keep_the_ggufs_fp16_scales_and_read_no_more_than_148_bytes_per_144():
    """A Q4_K record holds each row's d and dmin as the file's own fp16 bytes (the kernels widen them), so the panels
    read 2368 bytes per 16 rows x 256 columns: 148 per 144 GGUF bytes, where fp32 copies had read 152."""
    rng = np.random.default_rng(7)
    N, K = 40, 512
    raw = random_blocks(gw.Q4_K, N, K, rng)
    packed = gw.pack(gw.Q4_K, raw, K)
    P, nsb = -(-N // 16), K // 256
    assert packed.nbytes == P * nsb * 2368 == P * 16 * nsb * 148
    rec = packed.reshape(P, nsb, 2368)
    blocks = raw.reshape(N, nsb, 144)
    for n in (0, 17, 39):
        p, lane = divmod(n, 16)
        for s in range(nsb):
            assert bytes(rec[p, s, 2048 + 2 * lane:2050 + 2 * lane]) == bytes(blocks[n, s, 0:2])  # d
            assert bytes(rec[p, s, 2080 + 2 * lane:2082 + 2 * lane]) == bytes(blocks[n, s, 2:4])  # dmin


def test_q6k_weights_are_always_exact_and_q4k_exactness_is_counted_per_sub_block():
    rng = np.random.default_rng(3)
    raw = adversarial_blocks(gw.Q4_K, rng)
    exact, total = gw.q4k_exact(raw)
    assert total == 16 * 8 and 0 < exact < total  # fp16 max d beside a denormal dmin cannot be exact in fp32
    f = gw.q4k_fields(raw)
    d, dmin, sc, m = (x.astype(np.float64) for x in f[:4])
    vals = d[..., None, None] * sc[..., None] * np.arange(16) - (dmin[..., None] * m)[..., None]
    ok = (vals.astype(np.float32).astype(np.float64) == vals).all(-1)  # float64 is exact for these
    assert exact == int(ok.sum())
    typical = random_blocks(gw.Q4_K, 16, 256, rng)
    typical[:, 2:4] = typical[:, 0:2]  # dmin == d: d (sc q - m), 21 bits at most, always representable
    assert gw.q4k_exact(typical) == (128, 128)


def _x(S: int, K: int, seed: int = 0) -> torch.Tensor:
    """Activations with outlier columns, an all-zero block, a block of denormals and one of huge values."""
    x = torch.randn(S, K, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 40
    x[:, 32:64] = 0
    x[:, 64:96] *= 1e-39
    if K > 128:
        x[:, 96:128] *= 1e30
    return x


@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_equals_the_documented_arithmetic_bit_for_bit_on_every_build(threads, path):
    rng = np.random.default_rng(7)
    K = 512
    parts = [(gw.Q4_K, random_blocks(gw.Q4_K, 40, K, rng)), (gw.Q6_K, random_blocks(gw.Q6_K, 24, K, rng)),
             (gw.Q4_K, random_blocks(gw.Q4_K, 16, K, rng, scale=F16_MAX / 64))]
    lin = layer(parts, K)
    x = _x(33, K)  # past 16 384 columns: the rows are quantized on the pool's threads
    ref = gw.reference_matmul(x, lin.fields(), lin.out_features)
    assert torch.isfinite(ref).all()
    prev = kernels.threads()
    kernels.set_threads(threads)
    try:
        for build in BUILDS:
            path(build)
            assert torch.equal(kernels.linear(x, lin), ref), build
        path("torch")
        assert torch.equal(kernels.linear(x, lin), ref)
    finally:
        kernels.set_threads(prev)


@pytest.mark.parametrize("qtype", [gw.Q4_K, gw.Q6_K])
def test_the_integer_sums_stay_exact_at_their_largest(qtype, path):
    """Each sub-block's integer sum i_j is exact before its float steps (the AVX2 build adds vpmaddubsw pair sums in
    int16, 8 of them for Q4_K and 2 for Q6_K, before vpmaddwd widens them): every scale at its largest (Q4_K 63,
    Q6_K -128), every q at 15 / 63 or 0, and activations of one sign with |x8| = 127 in every column reach the bounds
    the header gives. Bit for bit against the reference (float64 integers, which cannot wrap), and against fp64 on the
    exact weights: a sum that wrapped would be off by 2^16 of its unit."""
    K, rng = 512, np.random.default_rng(3)
    rows = []
    for i in range(16):
        raw = rng.integers(0, 256, size=(K // 256, gw.GGUF_BLOCK[qtype]), dtype=np.uint8)
        if qtype == gw.Q4_K:
            raw[:, 0:2], raw[:, 2:4] = _f16(1.0), _f16(0.5 if i % 2 else 0.0)
            raw[:, 4:16] = 0xFF  # every 6-bit scale and min 63
            raw[:, 16:] = 0xFF if i < 8 else 0  # every q 15, or 0
        else:
            raw[:, 208:210] = _f16(1.0)
            raw[:, 192:208] = 0x80  # every scale -128
            raw[:, :192] = 0xFF if i < 8 else 0  # every q 63, or 0 (weights 31 and -32 times d sc)
        rows.append(raw.reshape(-1))
    lin = layer([(qtype, np.stack(rows))], K)
    x = torch.cat([torch.ones(1, K), -torch.ones(1, K), torch.ones(1, K).index_fill_(1, torch.arange(0, K, 2), -1)])
    exact = x.double() @ lin.weight.double().T  # |x| = 1 quantizes exactly: x8 = 127, dx = 1 / 127
    ref = gw.reference_matmul(x, lin.fields(), lin.out_features)
    assert (ref.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    for build in BUILDS:
        path(build)
        assert torch.equal(kernels.linear(x, lin), ref), build
        assert torch.equal(kernels.linear(x.repeat(3, 1), lin), ref.repeat(3, 1)), build  # the many-row passes too


def test_matmul_is_the_dequantized_matmul_within_the_activation_rounding(path):
    """The kernels multiply the weights the GGUF stands for by int8 activations with one scale per 256 columns:
    against fp64 on the fp32 weights the result is off by the activation rounding only (half a step of max|x| / 127
    of each super-block), and a super-block 1000x larger leaves its neighbour's steps alone."""
    rng = np.random.default_rng(9)
    K = 512
    lin = layer([(gw.Q4_K, random_blocks(gw.Q4_K, 16, K, rng)), (gw.Q6_K, random_blocks(gw.Q6_K, 16, K, rng))], K)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    x[:, 256:] *= 1000
    q8, dx, _, _ = gw.quantize_activations(x)
    assert dx.shape == (3, 2) and (dx[:, 1] > 500 * dx[:, 0]).all()
    xq = (q8.double().view(3, -1, 256) * dx.double()[..., None]).view(3, K)  # the activations the kernel multiplies
    step = dx.double().repeat_interleave(256, 1)
    assert ((x.double() - xq).abs() <= step / 2 * (1 + 1e-6)).all()
    exact = xq @ lin.weight.double().T
    for build in BUILDS:
        path(build)
        got = kernels.linear(x, lin).double()
        assert (got - exact).abs().max() <= 1e-5 * exact.abs().max(), build


def test_nan_and_infinite_activations_give_nan_outputs_as_a_float_matmul_would(path):
    rng = np.random.default_rng(11)
    lin = layer([(gw.Q4_K, random_blocks(gw.Q4_K, 16, 256, rng)), (gw.Q6_K, random_blocks(gw.Q6_K, 16, 256, rng))], 256)
    x = torch.randn(3, 256)
    x[1, 7] = float("nan")
    x[2, 200] = float("inf")
    for build in BUILDS:
        path(build)
        y = kernels.linear(x, lin)
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all() and torch.isnan(y[2]).all()


@pytest.mark.parametrize("build", BUILDS)
def test_each_token_row_gets_the_same_bits_whatever_the_number_of_rows(build, path):
    path(build)
    rng = np.random.default_rng(5)
    K = 768
    lin = layer([(gw.Q6_K, random_blocks(gw.Q6_K, 48, K, rng)), (gw.Q4_K, random_blocks(gw.Q4_K, 35, K, rng))], K)
    x = _x(8, K, seed=3)
    solo = torch.cat([kernels.linear(x[i:i + 1], lin) for i in range(8)])
    for S in range(1, 9):
        assert torch.equal(kernels.linear(x[:S], lin), solo[:S]), S
    many = torch.cat([x] * 7)  # 56 rows: past the 48-row chunk
    assert torch.equal(kernels.linear(many, lin), torch.cat([solo] * 7))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_sized_calls_give_each_row_its_one_row_bits_at_every_row_count_and_chunking(build, threads, path):
    """1..600 distinct token rows (a long prompt's chunks, many 48-row kernel chunks and 8-row groups, ragged ends)
    and prompts split into uneven chunks: every row's output is the bits it gets alone, so prefill in chunks, prefill
    whole and decoding step by step agree (the prompt cache and chunked prefill rely on it)."""
    path(build)
    prev = kernels.threads()
    kernels.set_threads(threads)
    try:
        rng = np.random.default_rng(11)
        K, R = 512, 600
        lin = layer([(gw.Q4_K, random_blocks(gw.Q4_K, 40, K, rng)), (gw.Q6_K, random_blocks(gw.Q6_K, 24, K, rng)),
                     (gw.Q4_K, random_blocks(gw.Q4_K, 9, K, rng))], K)
        x = torch.cat([_x(R - 3, K, seed=7), torch.zeros(1, K), _x(2, K, seed=8) * 1e-33])  # tiny and zero rows too
        solo = torch.cat([kernels.linear(x[i:i + 1], lin) for i in range(R)])
        for S in range(1, R + 1):
            assert torch.equal(kernels.linear(x[:S], lin), solo[:S]), S
        for cuts in ([1, 7, 48, 49, 95, 96, 97, 300], [8, 9, 16, 17, 511, 512, 513], list(range(0, R, 64))):
            bounds = sorted(set([0, *cuts, R]))
            parts = [kernels.linear(x[a:b], lin) for a, b in zip(bounds, bounds[1:])]
            assert torch.equal(torch.cat(parts), solo), cuts
    finally:
        kernels.set_threads(prev)


def test_the_kernel_path_is_named_with_amx_exactly_where_the_cpu_and_os_allow_it():
    assert kernels.path() in ("avx512+amx", "avx512", "avx2", "torch")
    flags = kernels._cpu_flags()
    if kernels.path().startswith("avx512"):
        can = kernels.amx_unavailable() is None
        assert (kernels.path() == "avx512+amx") == (can and os.environ.get("PIPELINE_AMX") != "0")
        if not {"amx_tile", "amx_int8"} <= flags:  # /proc/cpuinfo agrees with the library's CPUID probe
            assert not can and "no AMX" in kernels.amx_unavailable()
            with pytest.raises(ValueError, match="no AMX"):
                kernels.set_path("avx512+amx")
            with pytest.raises(ValueError, match="no AMX"):
                kernels.set_amx("hardware")
    with pytest.raises(ValueError, match=r"set_amx: mode is 'on'; it must be one of \['emulated', 'hardware', 'off'\]"):
        kernels.set_amx("on")


AMX = "avx512" in BUILDS  # the AMX code runs on the software model of the tiles wherever the AVX-512 build does


@pytest.fixture(params=["emulated", "hardware"])
def amx_tiles(request, path):
    """The AVX-512 build with its GGUF tiles on AMX: on the software model of the tiles everywhere that build runs,
    and on the tiles themselves where this CPU and OS have them; the previous mode back afterwards."""
    if not AMX:
        pytest.skip("the AMX code is part of the AVX-512 build, which this CPU cannot run")
    path("avx512")
    if request.param == "hardware" and kernels.amx_unavailable():
        pytest.skip(f"AMX tiles: {kernels.amx_unavailable()}")
    faults = kernels.amx_faults()
    prev = kernels.set_amx(request.param)
    prev_rows = kernels.amx_min_rows(1)  # the AMX code at every row count, not only where it is the faster
    yield request.param
    kernels.amx_min_rows(prev_rows)
    kernels.set_amx(prev)
    assert kernels.amx_faults() == faults  # no tile operation the hardware would have refused


@pytest.mark.parametrize("threads", [1, 2])
def test_the_amx_tiles_give_the_documented_bits(threads, amx_tiles):
    """TDPBSSD on the decoded weights gives the same integers as vpdpbusd; the float steps are the same, so the AMX
    path keeps the contract bit for bit: every token-row count of one pass (1-16), a second pass (17-32) and the
    48-row chunk, outputs that end mid-panel, Q4_K and Q6_K parts, adversarial and all-zero blocks, NaN inputs."""
    rng = np.random.default_rng(17)
    K = 512
    odd = np.concatenate([random_blocks(gw.Q4_K, 16, K, rng, scale=F16_MAX / 64),
                          np.concatenate([adversarial_blocks(gw.Q4_K, rng)] * 2, 1)[:13]])
    parts = [(gw.Q4_K, random_blocks(gw.Q4_K, 40, K, rng)), (gw.Q6_K, random_blocks(gw.Q6_K, 24, K, rng)),
             (gw.Q6_K, np.concatenate([adversarial_blocks(gw.Q6_K, rng)] * 2, 1)), (gw.Q4_K, odd)]
    lin = layer(parts, K)
    x = _x(53, K, seed=4)
    x[9, 300] = float("nan")
    ref = gw.reference_matmul(x, lin.fields(), lin.out_features)
    prev = kernels.threads()
    kernels.set_threads(threads)
    try:
        assert kernels.amx() == amx_tiles
        for S in (1, 2, 5, 8, 11, 16, 17, 30, 53):
            got = kernels.linear(x[:S], lin)
            assert ((got == ref[:S]) | (got.isnan() & ref[:S].isnan())).all(), S
        assert torch.isnan(ref[9]).all() and torch.isfinite(ref[:9, :64]).all()  # the random parts stay finite
    finally:
        kernels.set_threads(prev)


def test_the_amx_path_decodes_a_model_as_the_avx512_tiles_do(amx_tiles):
    cfg = _tiny_cfg()
    st = quant.cast_state(_tiny_state(cfg, np.random.default_rng(2)), torch.bfloat16)
    model = build_model(cfg, st, torch.bfloat16, "cpu")
    tokens = torch.tensor([[3, 9, 27, 17, 51, 25, 11, 33, 2, 6, 18, 54, 34, 38, 50, 22, 5, 15, 45, 7]])
    with torch.inference_mode():
        on_tiles = model(tokens, torch.arange(tokens.shape[1])[None], model.new_cache(1, 32))
        kernels.set_amx("off")
        on_avx512 = model(tokens, torch.arange(tokens.shape[1])[None], model.new_cache(1, 32))
        kernels.set_amx(amx_tiles)
    assert torch.equal(on_tiles, on_avx512)


def test_bench_times_verification_on_the_amx_and_the_avx512_tiles_side_by_side(amx_tiles):
    """Where the GGUF weights run on AMX tiles, bench's verify_cost_amx times both tiles in alternating rounds and
    checks an 8-token forward gives the same bits on both; it leaves the tiles as it found them, and is None where the
    AVX-512 tiles are all there is. (On the tile model here the times mean nothing; on an AMX machine they are issue
    28's figure.)"""
    from pipeline import bench

    cfg = _tiny_cfg()
    st = quant.cast_state(_tiny_state(cfg, np.random.default_rng(2)), torch.bfloat16)
    model = build_model(cfg, st, torch.bfloat16, "cpu")
    kernels.amx_min_rows(11)  # the tiles timed at every S whatever the threshold, which is put back
    v = bench.verify_cost_amx(model, max_s=4, reps=2)
    assert kernels.amx_min_rows(1) == 11 and v["min_rows"] == 11
    assert kernels.amx() == amx_tiles and v["mode"] == amx_tiles and v["same_bits"] is True and v["rounds"] == 2
    for tiles in ("amx", "avx512"):
        assert [c["tokens"] for c in v[tiles]] == [1, 2, 3, 4] and v[tiles][0]["relative"] == 1.0
        assert all(c["ms"] > 0 for c in v[tiles])
    assert len(v["amx_over_avx512"]) == 4 and all(r > 0 for r in v["amx_over_avx512"])
    line = " ".join(bench.verify_cost_amx_lines(v))
    assert f"same bits: yes): 4 tokens {v['amx'][-1]['ms']:.1f} against {v['avx512'][-1]['ms']:.1f} ms" in line
    assert "chunks of 11 token rows or more" in line and f"1: {v['amx_over_avx512'][0]:.2f}, 2: " in line
    kernels.set_amx("off")
    try:
        assert bench.verify_cost_amx(model) is None and bench.verify_cost_amx_lines(None) == []
    finally:
        kernels.set_amx(amx_tiles)


@pytest.mark.skipif(not AMX, reason="the AMX code is part of the AVX-512 build, which this CPU cannot run")
def test_the_amx_tiles_take_only_chunks_of_at_least_their_min_rows(path, monkeypatch):
    """At a few token rows the tiles cost more than the AVX-512 tiles (they decode every weight whatever the rows), so
    a chunk below kernels.amx_min_rows stays on the AVX-512 tiles: with the tile model's first sum off by one, only
    the chunks the tiles take come out changed. The spec of PIPELINE_AMX_MIN_ROWS is checked where it is read."""
    rng = np.random.default_rng(29)
    K = 512
    lin = layer([(gw.Q4_K, random_blocks(gw.Q4_K, 32, K, rng))], K)
    x = _x(12, K, seed=6)
    path("avx512")
    lib = kernels._lib
    ref = {S: kernels.linear(x[:S], lin) for S in (1, 7, 8, 12)}
    flip = ctypes.c_int.in_dll(lib, "gg_amx_model_flip")
    prev, prev_rows = kernels.set_amx("emulated"), kernels.amx_min_rows(8)
    flip.value = 1
    try:
        assert kernels.amx_min_rows() == 8
        for S, on_tiles in ((1, False), (7, False), (8, True), (12, True)):
            assert torch.equal(kernels.linear(x[:S], lin), ref[S]) is not on_tiles, S
        kernels.amx_min_rows(1)
        assert not torch.equal(kernels.linear(x[:1], lin), ref[1])
        with pytest.raises(ValueError, match="rows is 0; it must be 1 to 1024"):
            kernels.amx_min_rows(0)
    finally:
        flip.value = 0
        kernels.amx_min_rows(prev_rows)
        kernels.set_amx(prev)
    monkeypatch.setenv("PIPELINE_AMX_MIN_ROWS", "eight")
    if kernels.amx_unavailable() is None:
        with pytest.raises(ValueError, match="PIPELINE_AMX_MIN_ROWS is 'eight'; it must be a whole number"):
            kernels._amx_default("avx512", lib)


def _model_dp(a: np.ndarray, b: np.ndarray, b_rows: int | None = None) -> tuple[np.ndarray, int]:
    """One TDPBSSD on the tile model: A [M, Kb] int8, B [Kb / 4, 4 N] int8 (VNNI layout) into a zeroed C [M, N]; the
    faults it counted."""
    lib = kernels._compile("avx512")
    M, Kb = a.shape
    N = b.shape[1] // 4
    c = np.full((M, N), 7, np.int32)
    before = ctypes.c_longlong.in_dll(lib, "gg_amx_faults").value
    rows = b.shape[0] if b_rows is None else b_rows
    lib.gguf_amx_model_dp(a.ctypes.data, b.ctypes.data, c.ctypes.data, M, Kb, N, rows)
    return c, ctypes.c_longlong.in_dll(lib, "gg_amx_faults").value - before


@pytest.mark.skipif(not AMX, reason="the AMX code is part of the AVX-512 build, which this CPU cannot run")
def test_the_tile_model_multiplies_as_the_instruction_reference_says_and_refuses_what_the_hardware_refuses():
    """The model is worth its word only if its TDPBSSD is the reference's: C[m, n] = sum over k, i of A[m, 4k + i]
    B[k, 4n + i] on signed bytes, here against numpy on the unpacked layout; and if it refuses (#UD) what the hardware
    refuses: B's rows not A's columns / 4, or a tile used with no configuration loaded."""
    rng = np.random.default_rng(23)
    for M, Kb, N in ((16, 64, 16), (8, 32, 16), (3, 16, 16), (1, 4, 5)):
        a = rng.integers(-128, 128, (M, Kb), dtype=np.int8)
        b = rng.integers(-128, 128, (Kb // 4, 4 * N), dtype=np.int8)
        want = a.astype(np.int64) @ b.reshape(Kb // 4, N, 4).transpose(0, 2, 1).reshape(Kb, N).astype(np.int64)
        c, faults = _model_dp(a, b)
        assert faults == 0 and np.array_equal(c, want.astype(np.int32)), (M, Kb, N)
    extreme = np.full((16, 64), -128, np.int8)
    c, _ = _model_dp(extreme, np.full((16, 64), -128, np.int8))
    assert (c == 64 * 128 * 128).all()  # 2^20: no saturation anywhere
    a, b = np.ascontiguousarray(extreme[:8, :32]), np.zeros((8, 64), np.int8)
    assert _model_dp(a, b)[1] == 0
    _, faults = _model_dp(a, b, b_rows=7)  # B has 7 rows where A's 32 columns need 8
    assert faults == 1
    lib = kernels._compile("avx512")
    before = ctypes.c_longlong.in_dll(lib, "gg_amx_faults").value
    lib.gguf_amx_model_unconfigured()
    assert ctypes.c_longlong.in_dll(lib, "gg_amx_faults").value == before + 1


@pytest.mark.skipif(not AMX, reason="the AMX code is part of the AVX-512 build, which this CPU cannot run")
def test_the_amx_self_test_passes_on_the_tile_model_and_fails_on_a_wrong_sum():
    """The self-test a machine with AMX runs before using the tiles (gguf_amx_selftest, in a child process): on the
    software model it finds the AVX-512 tiles' bits; with the model's first sum off by one it names where."""
    lib = kernels._compile("avx512")
    assert kernels.amx_self_test(lib.so_path, mode=2) is None
    assert lib.gguf_amx_selftest(2) == 0
    flip = ctypes.c_int.in_dll(lib, "gg_amx_model_flip")
    flip.value = 1
    try:
        assert lib.gguf_amx_selftest(2) == 1000  # one token row, one thread, output column 0
    finally:
        flip.value = 0
    if kernels.amx_unavailable() and "no AMX" in kernels.amx_unavailable():
        assert lib.gguf_amx_selftest(1) == -1  # the instructions are not there: refused, not run


def _fake_library(tmp_path, body: str):
    """A shared library on a CPU that has AMX (gguf_amx_probe 1) whose gguf_amx_selftest does `body`: what a broken
    tile path looks like from the parent."""
    src = tmp_path / "fake.c"
    src.write_text("static int mode;\n"
                   "int gguf_amx_probe(void) { return 1; }\n"
                   "int gguf_amx(int want) { if (want >= 0) mode = want; return mode; }\n"
                   "int gguf_amx_min_rows(int rows) { (void)rows; return 8; }\n"
                   f"int gguf_amx_selftest(int want) {{ (void)want; {body} }}\n")
    so = tmp_path / "skinny-fake.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    return so


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
@pytest.mark.parametrize("body, why", [("__builtin_trap();", "killed by SIGILL"),
                                       ("return 17000 + 100 + 42;", "at 17 token rows, 2 thread(s), output column 42"),
                                       ("return -1;", "could not run")])
def test_a_failed_amx_self_test_is_named_and_kept_beside_the_library(tmp_path, body, why):
    """A tile fault kills the child, not the caller; a verdict other than 0 is a reason, which amx_unavailable() then
    gives; the hardware verdict is written once beside the library and read back, not rerun."""
    so = _fake_library(tmp_path, body)
    got = kernels.amx_self_test(so)
    assert got is not None and why in got
    mark = so.with_name(so.name + ".amx")
    assert mark.read_text().strip() == got
    mark.write_text("ok\n")  # a later process reads the verdict, it does not run the child again
    assert kernels.amx_self_test(so) is None
    assert kernels.amx_self_test(so, mode=2) is not None  # the model's run is never cached


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
def test_an_amx_self_test_that_hangs_is_refused_but_not_kept(tmp_path):
    """A self-test past its time limit may only have met a busy minute: refused now, tried again by the next process."""
    so = _fake_library(tmp_path, "for (;;) {}")
    assert kernels.amx_self_test(so, timeout=1) == "the AMX self-test did not finish in 1 s"
    assert not so.with_name(so.name + ".amx").exists()


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
def test_a_cpu_with_amx_takes_the_tiles_only_after_their_self_test_passes(tmp_path, caplog):
    """Where the probe allows AMX, the library's self-test decides: a tile that traps leaves the AVX-512 tiles on,
    with a warning naming why; a passing one turns the AMX tiles on."""
    for body, on in (("__builtin_trap();", 0), ("return 0;", 1)):
        (tmp_path / body[:6]).mkdir()
        lib = ctypes.CDLL(str(_fake_library(tmp_path / body[:6], body)))
        lib.so_path = tmp_path / body[:6] / "skinny-fake.so"
        caplog.clear()
        with caplog.at_level("INFO", logger="pipeline.kernels"):
            kernels._amx_default("avx512", lib)
        assert lib.gguf_amx(-1) == on
        if not on:
            assert "AMX unused: the AMX self-test was killed by SIGILL" in caplog.text
            assert kernels._amx_why(lib) == "the AMX self-test was killed by SIGILL"


def _tiny_cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64, tie_embeddings=False, max_position_embeddings=512,
                       eos_token_id=[1], qkv_bias=True, model_type="qwen2")


def _tiny_state(cfg: ModelConfig, rng) -> dict[str, torch.Tensor]:
    H, F = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_dim
    g = torch.Generator().manual_seed(0)
    st = {"embed.weight": torch.randn(cfg.vocab_size, H, generator=g), "norm.weight": torch.ones(H)}

    def put(prefix, tensors, K):
        st[prefix + ".gguf_w"], st[prefix + ".gguf_parts"] = gw.pack_parts(tensors, K)

    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        st[p + "attn_norm.weight"], st[p + "ffn_norm.weight"] = torch.ones(H), torch.ones(H)
        st[p + "wqkv.bias"] = torch.randn(H + 2 * kv, generator=g) * 0.1
        put(p + "wqkv", [(gw.Q4_K, random_blocks(gw.Q4_K, H, H, rng, 2e-3)),
                         (gw.Q4_K, random_blocks(gw.Q4_K, kv, H, rng, 2e-3)),
                         (gw.Q6_K, random_blocks(gw.Q6_K, kv, H, rng, 1e-3))], H)
        put(p + "wo", [(gw.Q4_K, random_blocks(gw.Q4_K, H, H, rng, 2e-3))], H)
        put(p + "w13", [(gw.Q4_K, random_blocks(gw.Q4_K, F, H, rng, 2e-3)),
                        (gw.Q4_K, random_blocks(gw.Q4_K, F, H, rng, 2e-3))], H)
        put(p + "w2", [(gw.Q6_K, random_blocks(gw.Q6_K, H, F, rng, 1e-3))], F)
    put("lm_head", [(gw.Q6_K, random_blocks(gw.Q6_K, cfg.vocab_size, H, rng, 1e-2))], H)
    return st


def test_a_model_on_gguf_layers_decodes_the_same_bits_by_prefill_and_token_by_token():
    cfg = _tiny_cfg()
    st = quant.cast_state(_tiny_state(cfg, np.random.default_rng(0)), torch.bfloat16)
    assert st["layers.0.wqkv.gguf_w"].dtype == torch.uint8 and st["layers.0.wqkv.gguf_parts"].dtype == torch.int64
    model = build_model(cfg, st, torch.bfloat16, "cpu")
    assert isinstance(model.lm_head, gw.GGUFLinear) and model.embed.weight.dtype == torch.float32
    toks = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.inference_mode():
        cache = model.new_cache(1, 8)
        prefill = model.logits(model(toks, torch.arange(6)[None], cache))
        cache = model.new_cache(1, 8)
        steps = torch.cat([model.logits(model(toks[:, i:i + 1], torch.tensor([[i]]), cache)) for i in range(6)], 1)
        assert torch.equal(prefill, steps)
        prev = kernels.set_path("torch")
        try:
            slow = model.logits(model(toks, torch.arange(6)[None], model.new_cache(1, 8)))
        finally:
            kernels.set_path(prev)
    assert torch.isfinite(prefill).all()
    # The same matmuls; attention and norms in torch differ by ulps, which move an int8 activation a step now and then.
    assert (prefill - slow).abs().max() <= 2e-2 * prefill.abs().max()


@pytest.mark.parametrize("section,path", [
    ({"draft": {"source": "train", "quantization": "gguf"}}, "draft.quantization"),
    ({"device": "cuda", "target": {"source": "x", "quantization": "gguf"}}, "target.quantization"),
])
def test_spec_refuses_gguf_weights_where_no_kernel_runs_them(tmp_path, section, path):
    from tests.conftest import write_spec

    with pytest.raises(specmod.SpecError) as e:
        specmod.load(write_spec(tmp_path, name="bad", **section))
    assert str(e.value).startswith(f"{path}:")


def test_spec_accepts_gguf_weights_for_the_target_on_cpu(tmp_path):
    from tests.conftest import write_spec

    s = specmod.load(write_spec(tmp_path, name="ok", target={"source": "x", "quantization": "gguf"}))
    assert s.target.quantization == "gguf"


def test_a_tensor_type_without_a_kernel_is_refused_naming_it():
    with pytest.raises(ValueError, match="GGUF tensor type 10: quantization gguf runs Q4_K, Q6_K"):
        gw.pack(10, np.zeros((16, 84), np.uint8), 256)  # Q2_K
