"""The Python-C boundary of the skinny kernels (kernels.py <-> skinny.c): the weight-type codes come from one table in
skinny.c, bad arguments are refused with an error naming the argument, its value and what it must be (and skinny.c
refuses bad shapes again on its own), failed allocations become MemoryError, hot calls reuse their scratch buffers,
plain C arithmetic is not contracted into fused multiply-adds, and argmax_prob treats NaN as torch.argmax does."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.runtime import kernels, quant

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler or no AVX2/FMA")
BUILDS = [b for b in ("avx512", "avx2") if b in kernels.supported_isas()]
SK_OK, SK_EARG, SK_ENOMEM = 0, kernels.SK_EARG, kernels.SK_ENOMEM


@pytest.fixture
def build(request):
    prev = kernels.set_path(request.param)
    yield request.param
    kernels.set_path(prev)


def _layer(kind: str, n: int = 40, k: int = 256, gs: int = 32):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    if kind == "f32":
        return w
    if kind == "bf16":
        return w.bfloat16()
    if kind == "bf16t":
        return quant.QLinear(quant.tile(w.bfloat16()), None)
    if kind == "gguf":  # one Q4_K part of random blocks (tests/test_gguf_weights.py)
        import numpy as np

        from pipeline.runtime import gguf_weights as gw
        from tests.test_gguf_weights import layer, random_blocks

        return layer([(gw.Q4_K, random_blocks(gw.Q4_K, 16, k, np.random.default_rng(3)))], k)
    q, s = quant.quantize(w, "int8" if kind.startswith("i8") else "int4", gs)
    if kind == "i8t" or kind == "i4t":
        q = quant.tile(q)
    if kind == "i4a8":
        return quant.QLinear(*quant.tile_a8(q, s), out_features=n)
    return quant.QLinear(q, s)


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_weight_type_codes_are_skinny_cs_table_in_both_builds(build):
    """kernels.py passes the codes skinny.c's WEIGHT_TYPES table names (no number is written in Python): every layout
    the Python side uses has a distinct code, both builds have the same table, and each layout's arguments carry its
    table code."""
    codes = kernels.weight_types()
    assert set(kernels.WEIGHT_TYPE_NAMES) <= set(codes)
    assert len(set(codes.values())) == len(codes)
    other = kernels._compile("avx2" if build == "avx512" else "avx512") if len(BUILDS) == 2 else None
    if other is not None:
        assert other.weight_types == codes
    for name in kernels.WEIGHT_TYPE_NAMES:
        assert kernels._weight_args(_layer(name))[2] == codes[name], name


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_skinny_c_refuses_shapes_and_types_it_cannot_read_on_its_own(build):
    """The C side's guard (weights_ok and friends), called past the Python checks: an unknown weight type, an int4
    group that does not divide K, a fused_linear mode that does not exist, kv_len past the cache and a layer plan whose
    shapes do not chain are refused with SK_EARG and nothing is written; good arguments return SK_OK."""
    lib = kernels._load()
    codes = kernels.weight_types()
    x = torch.randn(2, 64)
    w = torch.randn(8, 64)
    y = torch.full((2, 8), 7.0)
    args = (x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 2, 64, 8, 1)
    assert lib.skinny_matmul(*args, max(codes.values()) + 1, 0) == SK_EARG
    assert lib.skinny_matmul(*args, -1, 0) == SK_EARG
    assert torch.equal(y, torch.full((2, 8), 7.0))
    q, s = quant.quantize(torch.randn(8, 64), "int4", 32)
    assert lib.skinny_matmul(x.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr(), 2, 64, 8, 1, codes["i4"],
                             48) == SK_EARG
    assert lib.skinny_matmul(x.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr(), 2, 64, 8, 1, codes["i4"],
                             32) == SK_OK
    assert lib.fused_linear(x.data_ptr(), None, 0.0, w.data_ptr(), None, y.data_ptr(), 2, 64, 8, 1, codes["f32"], 0, 3,
                            0) == SK_EARG
    q4, kc = torch.randn(1, 1, 2, 8), torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    slots = torch.zeros(1, 1, dtype=torch.int64)
    out = torch.empty_like(q4)
    assert lib.attention(q4.data_ptr(), kc.data_ptr(), kc.data_ptr(), None, slots.data_ptr(), out.data_ptr(), 1, 1, 2,
                         1, 8, 4, 5, 1.0, 1) == SK_EARG
    plan = kernels.layer_plan(torch.randn(32, 16), torch.randn(16, 16), torch.randn(64, 16), torch.randn(16, 32), None,
                              torch.ones(16), torch.ones(16), 1e-6, 2, 1, 8)
    plan.down.K = 16  # gate/up [64, 16] no longer twice the down projection's input
    xs = torch.randn(1, 1, 16)
    before = xs.clone()
    pos = torch.zeros(1, 1, dtype=torch.int64)
    cos = torch.ones(4, 8)
    assert lib.decoder_layer(ctypes.byref(plan), xs.data_ptr(), 1, 1, pos.data_ptr(), pos.data_ptr(), cos.data_ptr(),
                             cos.data_ptr(), kc.data_ptr(), kc.data_ptr(), 4, None, 1, 1) == SK_EARG
    assert torch.equal(xs, before)


def _raises(fn, *words):
    with pytest.raises(ValueError) as e:
        fn()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_the_python_boundary_names_the_argument_its_value_and_the_requirement():
    """Each entry point refuses what the C code would read out of bounds or misread, before calling it: a row width
    that is not the weight's, a misaligned weight, an int4 group the kernel cannot read, a norm of the wrong size, an
    output of the wrong shape, a slot past the cache, a position past the RoPE tables, kv_len past the cache, layer
    plans whose shapes do not chain, a non-contiguous cache."""
    w = torch.randn(8, 64)
    _raises(lambda: kernels.linear(torch.randn(2, 63), w), "kernels.linear", "x.shape", "[2, 63]", "64")
    raw = bytearray(4 * 8 * 64 + 4)
    odd = torch.frombuffer(raw, dtype=torch.float32, count=8 * 64, offset=1).view(8, 64)
    _raises(lambda: kernels.linear(torch.randn(2, 64), odd), "w.data_ptr()", "multiple of its element size 4")
    q, s = quant.quantize(torch.randn(8, 96), "int4", 32)
    bad = quant.QLinear(q, s[:, :2])  # 96 columns in 2 groups of 48
    _raises(lambda: kernels.linear(torch.randn(1, 96), bad), "w.group_size", "48", "multiple of 32")
    x = torch.randn(3, 64)
    _raises(lambda: kernels.fused_linear(x, w, norm=torch.ones(63), eps=1e-6), "kernels.fused_linear", "norm.shape",
            "[63]", "[64]")
    _raises(lambda: kernels.fused_linear(x, w, out=torch.zeros(3, 9)), "out.shape", "[3, 9]", "[3, 8]")
    _raises(lambda: kernels.fused_linear(torch.randn(3, 64), w, swiglu=True), "x.shape", "128")
    _raises(lambda: kernels.rmsnorm(x, torch.ones(32), 1e-6), "kernels.rmsnorm", "weight.shape", "[32]")
    hq, hkv, d, length = 2, 1, 8, 4
    qkv = torch.randn(1, 2, hq + 2 * hkv, d)
    pos = torch.tensor([[0, 1]])
    cos = sin = torch.ones(8, d)
    kc, vc = (torch.zeros(1, hkv, length, d, dtype=torch.bfloat16) for _ in range(2))
    _raises(lambda: kernels.rope_write(qkv, pos, torch.tensor([[3, 4]]), cos, sin, kc, vc, hq, hkv),
            "kernels.rope_write", "slots (min, max)", "(3, 4)", "[0, 4)")
    _raises(lambda: kernels.rope_write(qkv, torch.tensor([[0, 8]]), pos, cos, sin, kc, vc, hq, hkv), "pos (min, max)",
            "[0, 8)")
    _raises(lambda: kernels.rope_write(qkv, pos.int(), pos, cos, sin, kc, vc, hq, hkv), "pos.dtype", "torch.int64")
    q = torch.randn(1, 2, hq, d)
    _raises(lambda: kernels.attention(q, kc, vc, None, length + 1, pos), "kernels.attention", "kv_len", "5", "[0, 4]")
    _raises(lambda: kernels.layer_plan(torch.randn(32, 16), torch.randn(16, 16), torch.randn(64, 16),
                                       torch.randn(16, 24), None, torch.ones(16), torch.ones(16), 1e-6, hq, hkv, d),
            "kernels.layer_plan", "w2 (out_features, in_features)", "(16, 24)", "(16, 32)")
    plan = kernels.layer_plan(torch.randn(32, 16), torch.randn(16, 16), torch.randn(64, 16), torch.randn(16, 32), None,
                              torch.ones(16), torch.ones(16), 1e-6, hq, hkv, d)
    xs = torch.randn(1, 2, 16)
    _raises(lambda: kernels.decoder_layer(plan, xs, pos, torch.tensor([[0, 4]]), cos, sin, kc, vc, None, 4),
            "kernels.decoder_layer", "slots (min, max)", "(0, 4)")
    wide = torch.zeros(1, hkv, length, 2 * d, dtype=torch.bfloat16)[..., :d]  # every other 8 columns: a strided view
    _raises(lambda: kernels.decoder_layer(plan, xs, pos, pos, cos, sin, wide, wide, None, 2), "kc.stride()")
    f32 = torch.zeros(1, hkv, length, d)  # the cache before bf16: refused, not read as if it were
    _raises(lambda: kernels.decoder_layer(plan, xs, pos, pos, cos, sin, f32, f32, None, 2), "kernels.decoder_layer",
            "kc is torch.float32", "bfloat16")
    _raises(lambda: kernels.attention(q, f32, f32, None, 2, pos), "kernels.attention", "kc.dtype", "torch.bfloat16")
    layers = kernels.plan_array([plan])
    k5 = torch.zeros(1, 1, hkv, length, d, dtype=torch.bfloat16)
    _raises(lambda: kernels.decoder_layers(layers, 1, xs, pos, pos, cos, sin, k5, k5, None, length + 1),
            "kernels.decoder_layers", "kv_len", "5")
    _raises(lambda: kernels.decoder_layers(layers, 2, xs, pos, pos, cos, sin, k5, k5, None, 2), "n", "2", "[0, 1]")


def test_a_valid_layer_call_passes_the_checks_and_writes_only_its_slots():
    """The checks refuse nothing valid: a decoder layer whose plan was built from temporaries (the plan keeps them
    alive) runs, gives finite values and writes cache slots 0..2 only (the runtime's own model runs through the same
    checks in test_runtime_model; the bitwise equalities are test_kernels')."""
    plan = kernels.layer_plan(*(torch.randn(*s) * 0.2 for s in ((32, 16), (16, 16), (64, 16), (16, 32))), None,
                              torch.ones(16), torch.ones(16), 1e-6, 2, 1, 8)
    xs = torch.randn(1, 3, 16)
    pos = torch.arange(3)[None]
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    ang = torch.outer(torch.arange(8).float(), inv)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    kc, vc = (torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16) for _ in range(2))
    x0 = xs.clone()
    kernels.decoder_layer(plan, xs, pos, pos, cos, sin, kc, vc, None, 3)
    assert torch.isfinite(xs).all() and not torch.equal(xs, x0)
    assert kc[0, 0, :3].abs().sum() > 0 and kc[0, 0, 3].abs().sum() == 0  # slots 0..2 written, slot 3 untouched


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_hot_calls_reuse_their_scratch_buffers(build):
    """Scratch is allocated once per thread and reused: after a first call of each kind, repeated matmuls, fused
    linears and decoder layers of the same (or smaller) size allocate nothing."""
    allocs = ctypes.c_longlong.in_dll(kernels._load(), "skinny_scratch_allocs")
    bf, a8 = _layer("bf16t", 64, 256), _layer("i4a8", 40, 256)
    x = torch.randn(4, 256)
    plan = kernels.layer_plan(torch.randn(32, 16), torch.randn(16, 16), torch.randn(64, 16), torch.randn(16, 32), None,
                              torch.ones(16), torch.ones(16), 1e-6, 2, 1, 8)
    pos = torch.arange(3)[None]
    cos = torch.ones(8, 8)
    kc = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)

    def step(rows: int) -> None:
        kernels.linear(x[:rows], bf)
        kernels.linear(x[:rows], a8)
        kernels.fused_linear(x[:rows], bf, norm=torch.ones(256), eps=1e-6, out=torch.zeros(rows, 64))
        kernels.decoder_layer(plan, torch.randn(1, 3, 16), pos, pos, cos, cos, kc, kc, None, 3)

    for threads in (1, 2):
        kernels.set_threads(threads)
        step(4)
        before = allocs.value
        for _ in range(20):
            step(4)
            step(1)
        assert allocs.value == before, threads
    kernels.configure_threads(0)


def test_a_long_prefill_takes_its_large_buffers_once_a_call_not_once_a_layer():
    """A prefill chunk's buffers past the kept slot size (8 MB; the 1.5B's gate/up output at 2,048 tokens is 147 MB)
    are taken once per decoder_layers call and shared by its layers, then given back: mapping and zeroing them layer
    by layer had been an eighth of a cold prefill. Four layers allocate what one does; the next call allocates again
    (the slots were trimmed), and the output is the same as four decoder_layer calls."""
    allocs = ctypes.c_longlong.in_dll(kernels._load(), "skinny_scratch_allocs")
    H, F, hq, hkv, D, T = 16, 1024, 2, 1, 8, 1100  # the gate/up output: 1100 x 2048 floats, 9 MB
    g = torch.Generator().manual_seed(0)
    ws = [[torch.randn(n, k, generator=g) * 0.1 for n, k in (((hq + 2 * hkv) * D, H), (H, hq * D), (2 * F, H), (H, F))]
          for _ in range(4)]
    plans = [kernels.layer_plan(*w, None, torch.ones(H), torch.ones(H), 1e-6, hq, hkv, D) for w in ws]
    arr = kernels.plan_array(plans)
    pos = torch.arange(T)[None]
    ang = torch.outer(torch.arange(T).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x0 = torch.randn(1, T, H, generator=g)

    def run(n: int) -> tuple[int, torch.Tensor]:
        k, v = (torch.zeros(4, 1, hkv, T, D, dtype=torch.bfloat16) for _ in range(2))
        x = x0.clone()
        before = allocs.value
        kernels.decoder_layers(arr, n, x, pos, pos, cos, sin, k, v, None, T)
        return allocs.value - before, x

    run(1)  # the slots under 8 MB grow once per thread
    one, _ = run(1)
    four, x4 = run(4)
    again, _ = run(4)
    assert one > 0 and four == one and again == one, (one, four, again)
    k, v = (torch.zeros(4, 1, hkv, T, D, dtype=torch.bfloat16) for _ in range(2))
    x = x0.clone()
    for i, plan in enumerate(plans):
        kernels.decoder_layer(plan, x, pos, pos, cos, sin, k[i], v[i], None, T)
    assert torch.equal(x, x4)


def test_a_failed_scratch_allocation_raises_memory_error_and_the_process_goes_on():
    """Under an address-space limit too small for the scratch of a large prefill, fused_linear raises MemoryError
    (skinny.c checks its allocations) instead of writing through NULL, and the next small call works."""
    code = textwrap.dedent("""
        import resource, torch
        from pipeline.runtime import kernels
        assert kernels.available()
        kernels.configure_threads(1)
        x = torch.randn(4096, 4096)  # its RMSNorm scratch needs 64 MB
        w = torch.randn(16, 4096)
        g = torch.ones(4096)
        small = kernels.fused_linear(x[:2], w, norm=g, eps=1e-6)
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))
        try:
            kernels.fused_linear(x, w, norm=g, eps=1e-6)
        except MemoryError as e:
            print("MemoryError", e)
        assert torch.equal(kernels.fused_linear(x[:2], w, norm=g, eps=1e-6), small)
        print("still running")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "MemoryError kernels.fused_linear: skinny.c could not allocate" in res.stdout
    assert "still running" in res.stdout


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_plain_c_arithmetic_is_not_contracted_into_fma(build):
    """-ffp-contract=off: a * b + c written in skinny.c rounds the product first (here to 1 + 2^-11, so the sum is 0),
    where a fused multiply-add would give 2^-24; only the FMAs written out fuse, the same in both builds."""
    a = b = float(np.float32(1 + 2.0 ** -12))
    c = float(np.float32(-(1 + 2.0 ** -11)))
    unfused = float(np.float32(np.float32(a) * np.float32(b)) + np.float32(c))
    assert unfused == 0.0
    assert kernels._load().skinny_contract_probe(a, b, c) == unfused


def test_the_plain_c_parts_agree_bit_for_bit_between_builds():
    """RMSNorm, RoPE with the bias, SwiGLU and the accumulating output projection are plain C (no intrinsics): with
    contraction off both builds compute them alike, bit for bit."""
    if len(BUILDS) < 2:
        pytest.skip("this CPU runs only the AVX2 build")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 96, generator=g)
    w = torch.randn(24, 48, generator=g)
    hq, hkv, d = 2, 1, 16
    qkv = torch.randn(2, 3, hq + 2 * hkv, d, generator=g)
    bias = torch.randn((hq + 2 * hkv) * d, generator=g)
    pos = torch.tensor([[0, 1, 2], [3, 4, 5]])
    cos, sin = torch.randn(8, d, generator=g), torch.randn(8, d, generator=g)
    outs = {}
    for b in BUILDS:
        prev = kernels.set_path(b)
        try:
            kc, vc = (torch.zeros(2, hkv, 8, d, dtype=torch.bfloat16) for _ in range(2))
            q = kernels.rope_write(qkv, pos, pos, cos, sin, kc, vc, hq, hkv, bias)
            acc = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
            kernels.fused_linear(x, w, swiglu=True, out=acc)
            outs[b] = (kernels.rmsnorm(x, torch.randn(96, generator=torch.Generator().manual_seed(2)), 1e-6), q, kc,
                       vc, acc)
        finally:
            kernels.set_path(prev)
    for one, two in zip(*outs.values()):
        assert torch.equal(one, two)


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_argmax_prob_takes_nan_as_the_largest_value_like_torch(build):
    """torch.argmax counts NaN as the largest value (the first NaN wins) and softmax makes such a row all NaN:
    argmax_prob gives the same index, in the vector part and in the N % 8 tail, next to +inf and in an all-NaN row,
    and probability NaN; rows without NaN keep their answers."""
    nan, inf = float("nan"), float("inf")
    for n in (5, 8, 13, 1000):
        lg = torch.randn(7, n, generator=torch.Generator().manual_seed(n))
        lg[0, 0] = nan
        lg[1, n // 2] = nan
        lg[2, n - 1] = nan  # the tail when n % 8 != 0
        lg[3, 1] = inf
        lg[3, n - 1] = nan  # NaN beats +inf
        lg[4] = nan
        lg[5, 2] = nan
        lg[5, 3] = nan  # the first of two
        idx, prob = kernels.argmax_prob(lg)
        assert torch.equal(idx, lg.argmax(-1)), (n, idx, lg.argmax(-1))
        want = torch.softmax(lg, -1).amax(-1)
        assert torch.equal(prob[:6].isnan(), want[:6].isnan()) and prob[:6].isnan().all(), n
        assert (prob[6] - want[6]).abs() <= 1e-6
        alone, _ = kernels.argmax_prob(lg, with_prob=False)
        assert torch.equal(alone, idx)


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_swiglu_is_within_two_ulps_of_float64_and_keeps_expfs_limits(build):
    """SwiGLU's vectorised exp: a / (1 + exp(-a)) * b within 2 units in the last place of the float64 value on
    [-87, 87], in the 8-column body and the padded K % 8 tail alike; beyond, what glibc's expf gave: silu(-100) is 0
    (exp overflows to infinity), silu(100) is 100, and NaN or -inf give NaN. Read through an identity matmul, so each
    output column is one SwiGLU element."""
    k = 13  # one 8-column block and a 5-column tail
    a = torch.linspace(-87, 87, 13 * 401).reshape(401, k)
    b = torch.rand(401, k, generator=torch.Generator().manual_seed(4)) + 0.5
    out = kernels.fused_linear(torch.cat([a, b], 1).contiguous(), torch.eye(k), swiglu=True).double()
    ref = a.double() / (1 + torch.exp(-a.double())) * b.double()
    # the float64 value of the fp32 ops around exp: a / (1 + e) and * b each round once more
    assert ((out - ref).abs() <= 4 * 2.0 ** -24 * ref.abs() + 1e-44).all()
    special = torch.tensor([[-100.0, 100.0, 0.0, -88.8, 88.8, 1e-30, -1e-30, 0.0]])
    out = kernels.fused_linear(torch.cat([special, torch.ones_like(special)], 1), torch.eye(8), swiglu=True)
    half = torch.tensor(1e-30) / 2  # silu(x) = x / 2 near 0
    assert torch.equal(out[0], torch.tensor([-0.0, 100.0, 0.0, -0.0, 88.8, half, -half, 0.0])), out
    for bad in (float("nan"), float("-inf")):
        row = torch.tensor([[bad] + [1.0] * 7 + [1.0] * 8])
        assert kernels.fused_linear(row, torch.eye(8), swiglu=True).isnan().all()


SAMPLE_PATHS = [*BUILDS, "torch"]


@pytest.mark.parametrize("build", SAMPLE_PATHS, indirect=True)
def test_sample_rows_takes_the_first_entry_whose_running_total_passes_u(build):
    """Inverse-CDF sampling: index i for u in [total before i, total through i) / total, across the 32-entry blocks
    and the N % 32 tail, with zero entries never chosen (u at a zero entry's place takes the next positive one),
    and u just under 1 taking the last positive entry; random rows give the same indices in every build."""
    n = 70  # two full blocks and a 6-entry tail
    p = torch.zeros(1, n)
    p[0, [3, 31, 32, 40, 65]] = torch.tensor([1.0, 2.0, 1.0, 4.0, 2.0])  # running totals 1, 3, 4, 8, 10
    edges = {0.0: 3, 0.0999: 3, 0.1: 31, 0.2999: 31, 0.3: 32, 0.3999: 32, 0.4: 40, 0.7999: 40, 0.8: 65,
             1 - 2 ** -53: 65}
    for u, want in edges.items():
        got = int(kernels.sample_rows(p, torch.tensor([u], dtype=torch.float64))[0])
        assert got == want, (build, u, got, want)
    g = torch.Generator().manual_seed(5)
    for cols in (1, 31, 32, 33, 1000):
        rows = torch.rand(64, cols, generator=g) ** 3
        rows[rows < 0.05] = 0
        rows[:, -1] += 0.01  # every row has a positive entry
        u = torch.rand(64, generator=g, dtype=torch.float64)
        got = kernels.sample_rows(rows, u)
        run = rows.double().cumsum(-1)
        want = torch.searchsorted(run, (u * run[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        assert torch.equal(got, want), (build, cols)
        assert (rows.gather(1, got[:, None]) > 0).all()


@pytest.mark.parametrize("build", SAMPLE_PATHS, indirect=True)
def test_sample_rows_refuses_a_row_without_a_distribution_and_names_it(build):
    """A negative, NaN or infinite weight, or a row of zeros, is refused (torch.multinomial refuses them too) with
    the row's number; the block holding it may be a full one or the tail."""
    u = torch.full((3,), 0.5, dtype=torch.float64)
    for at, bad in ((5, float("nan")), (40, -1.0), (68, float("inf")), (None, 0.0)):
        p = torch.rand(3, 70, generator=torch.Generator().manual_seed(1))
        if at is None:
            p[2] = 0.0
        else:
            p[2, at] = bad
        with pytest.raises(ValueError, match="row 2 has a negative, NaN or infinite weight or none positive"):
            kernels.sample_rows(p, u)
    with pytest.raises(ValueError, match=r"want \[B, N\] and \[B\]"):
        kernels.sample_rows(torch.rand(3, 70), u[:2])


@pytest.mark.parametrize("build", SAMPLE_PATHS, indirect=True)
def test_softmax_rows_is_torchs_softmax_of_logits_over_the_temperature(build):
    """Every sampled token's distribution (sampling.warp): within 1e-5 of float64's softmax(x / t) per entry above
    1e-30, in the 8-column body and the N % 8 tail, -inf entries (top-k's mask) exactly 0; and where torch's float
    softmax is NaN (a NaN or +inf logit, a row of -inf, a NaN temperature, a temperature so small that x / t
    overflows) the row is NaN too, other rows unchanged."""
    g = torch.Generator().manual_seed(2)
    for n in (5, 8, 13, 1000):
        x = torch.randn(4, n, generator=g) * 4
        x[1, n - 1] = float("-inf")
        for t in (1.0, 0.7, 1e-3, 50.0):
            got, want = kernels.softmax_rows(x, t), torch.softmax(x.double() / t, -1)
            big = want > 1e-30
            assert ((got.double() - want).abs() <= 1e-5 * want)[big].all(), (build, n, t)
            assert got[1, n - 1] == 0 and (got >= 0).all()
    nan, inf = float("nan"), float("inf")
    x = torch.randn(5, 13, generator=g)
    x[0, 2], x[1, 12], x[2] = nan, inf, -inf
    for t in (1.0, nan, 1e-39):
        got, want = kernels.softmax_rows(x, t), torch.softmax(x / t, -1)
        assert torch.equal(got.isnan().all(-1), want.isnan().any(-1)), (build, t)
        if t == 1.0:
            assert not got[3:].isnan().any()


def test_torch_on_caller_runs_torch_on_one_thread_and_restores_the_count():
    """Sampling's vocabulary-wide ops run with torch on the calling thread alone (kernels.torch_on_caller, around
    sampling.warp and speculative.residual); the thread count comes back after it, after an exception too, and
    nested uses keep the outer setting."""
    from pipeline.runtime import sampling

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        with kernels.torch_on_caller():
            seen.append(torch.get_num_threads())
            with kernels.torch_on_caller():
                seen.append(torch.get_num_threads())
            seen.append(torch.get_num_threads())
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), kernels.torch_on_caller():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
        inside = []
        real = kernels.softmax_rows
        kernels.softmax_rows = lambda x, t: (inside.append(torch.get_num_threads()), real(x, t))[1]
        try:
            sampling.warp(torch.randn(3, 40), sampling.SamplingParams(temperature=0.8, top_p=0.9))
        finally:
            kernels.softmax_rows = real
        assert inside == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
