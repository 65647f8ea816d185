"""The skinny C matmul for fp32, bf16 (row-major and tiled), int8 and int4 weights: each output element has one
value whatever the number of rows in the call (bitwise, past 32 rows and across row chunks), the AVX-512 and AVX2
builds agree bit for bit, results stay within a float64 error bound computed here from the
arithmetic (not from the code's constants), and the torch fallback agrees within 1e-4.

bf16 and int4 weights multiply activations rounded to bf16 (round to nearest even, denormals to zero),
by pairs of fused products as vdpbf16ps: the reference rounds x the same way, in numpy, and the
unrounded product is checked too, within the bf16 rounding of x."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.runtime import kernels, quant
from tests.conftest import np_unpack_int4

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler or no AVX2/FMA")
KINDS = ["float32", "bfloat16", "bf16_tiled", "int8", "int8_tiled", "int4", "int4_tiled"]
# Kinds whose outputs are layout, row-count, thread-count and build independent; int4_a8 (W4A8) quantizes the
# activations to int8, so its own reference (np_a8) replaces the float64 product of the tests over KINDS.
ALL_KINDS = [*KINDS, "int4_a8"]
ROWS = [1, 2, 5, 7, 33, 65]
U = 2.0 ** -24  # fp32 unit roundoff
UB = 2.0 ** -9  # bf16 unit roundoff
DOT_BF16 = ("bfloat16", "bf16_tiled", "int4", "int4_tiled")  # weight kinds whose kernel rounds x to bf16


def np_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 -> float64 in numpy: round to nearest even on the bits, denormals to signed zero."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = np.where((u & 0x7F800000) == 0, (u >> 16) & 0x8000, r)
    return (r.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def weights(kind: str, n: int, k: int, seed: int = 0, group_size: int = 32):
    """(kernel weight, float64 matrix it stands for, rebuilt in numpy from the stored bits)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind == "float32":
        return w, w.double().numpy()
    if kind == "bfloat16":
        wb = w.bfloat16()
        return wb, wb.float().double().numpy()
    if kind == "bf16_tiled":
        wb = w.bfloat16()
        return quant.QLinear(quant.tile(wb), None), wb.float().double().numpy()
    layer = quant.QLinear(*quant.quantize(w, kind.removesuffix("_tiled").removesuffix("_a8"), group_size))
    s = layer.scales.double().numpy()
    if kind.startswith("int8"):
        ref = layer.qweight.numpy().astype(np.float64) * s[:, None]
        return (quant.QLinear(quant.tile(layer.qweight), layer.scales) if kind == "int8_tiled" else layer), ref
    u = np_unpack_int4(layer.qweight.numpy())
    if kind == "int4_tiled":
        layer = quant.QLinear(quant.tile(layer.qweight), layer.scales)
    if kind == "int4_a8":
        layer = quant.QLinear(*quant.tile_a8(layer.qweight, layer.scales), out_features=n)
    return layer, u * np.repeat(s, group_size, axis=1)


def _shape(kind: str) -> tuple[int, int]:
    # K: not a multiple of 16 (scalar tail) except for int4, which needs whole groups; N: not a multiple of
    # any tile height or the per-thread chunk. Tiled bf16 is whole 4 x 32 tiles (not of 8 or of 24-row thread chunks).
    # W4A8 pads its last block of 16 rows.
    return {"int4": (77, 256), "int4_tiled": (40, 384), "int8_tiled": (56, 208), "bf16_tiled": (76, 224),
            "int4_a8": (77, 256)}.get(kind, (77, 203))


def _both_builds(x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.linear(x, w) by the AVX-512 build and by the AVX2 build."""
    prev = kernels.set_path("avx512")
    try:
        a = kernels.linear(x, w)
        kernels.set_path("avx2")
        return a, kernels.linear(x, w)
    finally:
        kernels.set_path(prev)


def _bf16_reference(x: torch.Tensor, ref_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 product of bf16-rounded x with the weights, and the fp32 error bound (k + 2) u sum |x||w|."""
    k = x.shape[-1]
    return np_bf16(x.numpy()) @ ref_w.T, (k + 2) * U * (np.abs(x.double().numpy()) @ np.abs(ref_w).T) * 1.01


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
    xr = np_bf16(x.numpy()) if kind in DOT_BF16 else xd
    ref = xr @ ref_w.T
    # Sum of k products in fp32 (plus one rounding of each dequantized weight and of the int8 scale):
    # |error| <= (k + 2) u sum |x||w| to first order.
    mass = np.abs(xd) @ np.abs(ref_w).T
    bound = (k + 2) * U * mass * 1.01
    assert (np.abs(got - ref) <= bound).all(), float((np.abs(got - ref) / bound).max())
    if kind in DOT_BF16:
        # Against the unrounded x: each x moved by at most UB |x|.
        loose = (UB + (k + 2) * U) * mass * 1.01
        assert (np.abs(got - xd @ ref_w.T) <= loose).all()


@pytest.mark.parametrize("kind", ALL_KINDS)
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


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_thread_count_does_not_change_the_bits(kind, threads):
    n, k = _shape(kind)
    w, _ = weights(kind, n, k, seed=3)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    kernels.configure_threads(1)
    one = kernels.linear(x, w)
    kernels.configure_threads(2)
    assert torch.equal(kernels.linear(x, w), one)


@pytest.mark.parametrize("kind", ["float32", "bf16_tiled", "int8_tiled", "int4", "int4_tiled", "int4_a8"])
def test_rows_a_thread_takes_from_another_threads_share_have_the_same_bits(kind, threads):
    """With more threads than cores some are descheduled mid-call and the others take the rest of their shares."""
    import ctypes

    w, _ = weights(kind, 4096, 256, seed=7)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    kernels.configure_threads(1)
    one = kernels.linear(x, w)
    stolen = ctypes.c_longlong.in_dll(kernels._load(), "skinny_stolen_rows")
    before = stolen.value
    kernels.configure_threads(6)
    for _ in range(200):
        assert torch.equal(kernels.linear(x, w), one)
        if stolen.value > before:
            break
    assert stolen.value > before, "no rows were taken from another thread's share in 200 calls"


def test_the_swiglu_before_a_down_projection_does_not_depend_on_the_thread_count(threads):
    w, _ = weights("int4", 48, 2048, seed=5)
    gu = torch.randn(3, 4096, generator=torch.Generator().manual_seed(6)) * 4  # 3 x 2048 elements: split over threads
    kernels.configure_threads(1)
    one = kernels.fused_linear(gu, w, swiglu=True)
    kernels.configure_threads(2)
    assert torch.equal(kernels.fused_linear(gu, w, swiglu=True), one)
    assert torch.equal(kernels.fused_linear(gu[:1].contiguous(), w, swiglu=True), one[:1])  # 2048: split too


@pytest.mark.parametrize("shape", [(1, 1, 14, 2, 64, 65), (2, 5, 4, 2, 36, 37), (1, 3, 6, 3, 128, 300)])
def test_attention_matches_sdpa_and_ignores_threads_padding_and_build(threads, shape):
    """The C attention (bf16 K/V and dot products, vectorised exp, split over threads) is torch's attention of the
    same bf16 q, K and V within the rounding of its softmax weights to bf16 (2^-9 of a weight: at most 2^-9 max |V|
    on an output); a query's result is the same on 1 and 2 threads, with masked slots padded past kv_len, and from the
    AVX2 build; without a mask it attends to the slots up to its own."""
    B, S, Hq, Hkv, D, kv = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(B, S, Hq, D, generator=g) * 2
    kc, vc = (torch.randn(B, Hkv, kv + 12, D, generator=g).bfloat16() for _ in range(2))
    pos = kv - S + torch.arange(S)
    mask = (torch.arange(kv)[None, None, :] <= pos[None, :, None]).repeat(B, 1, 1)
    mask[-1, 0, 3] = False  # a hole before the query's own slot (a tree branch)
    ref = F.scaled_dot_product_attention(q.bfloat16().double().transpose(1, 2), kc[:, :, :kv].double(),
                                         vc[:, :, :kv].double(), attn_mask=mask[:, None],
                                         enable_gqa=True).transpose(1, 2)
    m8 = mask.to(torch.uint8).contiguous()
    kernels.configure_threads(1)
    one = kernels.attention(q, kc, vc, m8, kv)
    assert (one - ref).abs().max() < 2 ** -9 * float(vc.abs().max()) + 1e-5
    kernels.configure_threads(2)
    assert torch.equal(kernels.attention(q, kc, vc, m8, kv), one)
    padded = torch.cat([m8, torch.zeros(B, S, 9, dtype=torch.uint8)], -1).contiguous()
    assert torch.equal(kernels.attention(q, kc, vc, padded, kv + 9), one)
    if "avx2" in kernels.supported_isas():
        prev = kernels.set_path("avx2")
        try:
            assert torch.equal(kernels.attention(q, kc, vc, m8, kv), one)
        finally:
            kernels.set_path(prev)
    causal = (torch.arange(kv)[None, None, :] <= pos[None, :, None]).repeat(B, 1, 1).to(torch.uint8).contiguous()
    slots = pos[None].repeat(B, 1).contiguous()
    assert torch.equal(kernels.attention(q, kc, vc, None, kv, slots=slots), kernels.attention(q, kc, vc, causal, kv))


@pytest.mark.parametrize("shape", [(6, 12, 2, 128, 206), (5, 14, 2, 64, 70), (3, 6, 3, 36, 41), (2, 4, 4, 20, 9)])
def test_a_query_attends_alike_alone_and_grouped_with_the_heads_that_share_its_kv_head(threads, shape):
    """Attention works in units of up to ATT_UNIT (query, head) pairs that read one kv head (8 in the AVX-512 build,
    4 in AVX2; each K and V row loaded once for all of them): a query's result is the bits it gets computed alone,
    for every unit size the shapes give (AVX-512: 36 pairs 8 + 7 x 4, 35: 7 x 5, 6: one unit; AVX2: 6 heads a kv
    head at 1 query 3 + 3, 7: 4 + 3), on 1 and 2 threads."""
    S, Hq, Hkv, D, kv = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(1, S, Hq, D, generator=g) * 2
    kc, vc = (torch.randn(1, Hkv, kv + 5, D, generator=g).bfloat16() for _ in range(2))
    slots = (kv - S + torch.arange(S))[None].contiguous()
    for n in (1, 2):
        kernels.configure_threads(n)
        together = kernels.attention(q, kc, vc, None, kv, slots=slots)
        for s in range(S):
            at = slots[:, s:s + 1].contiguous()
            alone = kernels.attention(q[:, s:s + 1].contiguous(), kc, vc, None, kv, slots=at)
            assert torch.equal(alone[0, 0], together[0, s]), (n, s)
            for h in range(Hq):  # and one head alone (a unit of one pair), its kv head's K and V as the cache
                kvh = h // (Hq // Hkv)
                one = kernels.attention(q[:, s:s + 1, h:h + 1].contiguous(), kc[:, kvh:kvh + 1].contiguous(),
                                        vc[:, kvh:kvh + 1].contiguous(), None, kv, slots=at)
                assert torch.equal(one[0, 0, 0], together[0, s, h]), (n, s, h)


@pytest.mark.parametrize("shape", [(40, 0, 60, 12, 2, 128), (21, 5, 40, 6, 3, 36), (24, 1030, 1100, 12, 2, 128),
                                   (24, 8200, 8300, 12, 2, 128)])
def test_a_causal_chunk_scores_no_slot_past_its_queries_and_keeps_their_bits(threads, shape):
    """A unit computes nothing past the last slot its pairs see (a prefill chunk from slot 0 had scored every query
    against the whole chunk and masked half of it): each query of a chunk of S at slots [start, start + S) under
    kv_len past them equals that query alone with kv_len its own slot + 1, where there is nothing to skip; and so
    does the mask path with the causal mask padded by zeros (its last nonzero bounds the unit). Units mixing two
    queries (8 pairs of 6 heads), the D % 8 tail (D 36), past 1,024 slots (the thread's scratch) and past 8,192
    (units in tiles over blocks of slots), on 1 and 2 threads."""
    S, start, kv, Hq, Hkv, D = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(1, S, Hq, D, generator=g) * 2
    kc, vc = (torch.randn(1, Hkv, kv + 3, D, generator=g).bfloat16() for _ in range(2))
    slots = (start + torch.arange(S))[None].contiguous()
    causal = (torch.arange(kv)[None, None, :] <= slots[:, :, None]).to(torch.uint8).contiguous()
    for n in (1, 2):
        kernels.configure_threads(n)
        together = kernels.attention(q, kc, vc, None, kv, slots=slots)
        assert torch.equal(kernels.attention(q, kc, vc, causal, kv), together), n
        for s in range(S):
            own = start + s
            alone = kernels.attention(q[:, s:s + 1].contiguous(), kc, vc, None, own + 1, slots=slots[:, s:s + 1])
            assert torch.equal(alone[0, 0], together[0, s]), (n, s)


# A tree of 10 nodes after the prefix (node i at slot n + i, parents first): siblings at depths 1 to 3, so most
# nodes sit at a slot past their position, and one path 0-1-4-7-9 five deep.
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]


@pytest.mark.parametrize("shape", [(6, 2, 64), (12, 2, 128), (9, 3, 128), (6, 1, 64), (6, 2, 36)])
def test_a_tree_node_attends_as_the_chain_of_its_ancestors_wherever_its_slot_lies(threads, shape):
    """Under a tree mask node i sits at slot n + i and sees the prefix [0, n) and its ancestors' slots (a sibling's
    slot between them hidden); the same query decoded as the chain of its ancestors sits at slot n + depth and sees
    [0, n + depth]. Same scores, same K/V rows in the same order, so the bits must be the same: the exponentials are
    summed by rank among the slots a pair sees, not by slot index (issue 53: by slot index the last exponential fell
    in another lane, a rounding a Q4_1 target amplified to flipped tokens). GQA groups 3 and 6, D 64, 128 and 36
    (tail), prefixes putting the nodes at every lane, every build this CPU runs, 1 and 2 threads."""
    Hq, Hkv, D = shape
    T = len(TREE_PARENTS)
    chains = []
    for i in range(T):
        path, u = [], i
        while u >= 0:
            path.append(u)
            u = TREE_PARENTS[u]
        chains.append(path[::-1])
    for n in (5, 38, 300):
        g = torch.Generator().manual_seed(n + sum(shape))
        q = torch.randn(1, T, Hq, D, generator=g) * 2
        kc, vc = (torch.randn(1, Hkv, n + T + 4, D, generator=g).bfloat16() for _ in range(2))
        mask = torch.zeros(1, T, n + T, dtype=torch.uint8)
        mask[:, :, :n] = 1
        for i, c in enumerate(chains):
            mask[0, i, [n + a for a in c]] = 1
        for isa in kernels.supported_isas():
            prev = kernels.set_path(isa)
            try:
                for th in (1, 2):
                    kernels.configure_threads(th)
                    tree = kernels.attention(q, kc, vc, mask, n + T)
                    for i, c in enumerate(chains):
                        rows = list(range(n)) + [n + a for a in c]
                        ck, cv = kc[:, :, rows].contiguous(), vc[:, :, rows].contiguous()
                        at = torch.tensor([[len(rows) - 1]])
                        chain = kernels.attention(q[:, i:i + 1].contiguous(), ck, cv, None, len(rows), slots=at)
                        assert torch.equal(chain[0, 0], tree[0, i]), (isa, th, n, i)
            finally:
                kernels.set_path(prev)


@pytest.mark.skipif("avx512" not in kernels.supported_isas(), reason="CPU without AVX-512")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_avx512_and_avx2_builds_agree_bit_for_bit(kind):
    n, k = _shape(kind)
    w, _ = weights(kind, n, k, seed=5)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    a, b = _both_builds(x, w)
    assert torch.equal(a, b)


@pytest.mark.skipif("avx512" not in kernels.supported_isas(), reason="CPU without AVX-512 + AVX512_BF16")
@pytest.mark.parametrize("kind", DOT_BF16)
@pytest.mark.parametrize("seed", range(6))
def test_bf16_dot_products_agree_between_builds_on_random_shapes_rows_and_threads(kind, seed, threads):
    # vdpbf16ps (AVX-512) against its two-FMA emulation (AVX2): random shapes incl. K tails (bf16), every
    # row count 1..40, both thread counts, and each row equal to that row computed alone.
    rng = np.random.default_rng(seed)
    gs = int(rng.choice([32, 64, 128]))
    k = gs * int(rng.integers(1, 5)) if kind.startswith("int4") else int(rng.integers(1, 300))
    n = int(rng.integers(1, 90))
    if kind == "bf16_tiled":
        k, n = 32 * (k // 32 + 1), 4 * (n // 4 + 1)
    if kind == "int4_tiled":
        k, n = 128 * (k // 128 + 1), 8 * (n // 8 + 1)
    w, ref_w = weights(kind, n, k, seed=seed, group_size=gs)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32) * np.float32(rng.choice([1e-3, 1, 50])))
    out = {}
    prev = kernels.set_path("avx512")
    try:
        for isa in ("avx512", "avx2"):
            kernels.set_path(isa)
            for nt in (1, 2):
                kernels.configure_threads(nt)
                out[isa, nt] = [kernels.linear(x[:s], w) for s in range(1, 41)]
    finally:
        kernels.set_path(prev)
    base = out["avx512", 1][-1]
    for key, ys in out.items():
        for s, y in enumerate(ys, start=1):
            assert torch.equal(y, base[:s]), (kind, k, n, key, s)
    ref, bound = _bf16_reference(x, ref_w)
    assert (np.abs(base.double().numpy() - ref) <= bound).all()


@pytest.mark.skipif("avx512" not in kernels.supported_isas(), reason="CPU without AVX-512 + AVX512_BF16")
@pytest.mark.parametrize("k,gs", [(32, 32), (96, 32), (128, 128), (160, 32), (192, 64), (448, 64), (416, 32)])
def test_int4_superblocks_and_block_tails_agree_and_match_the_reference(k, gs):
    # Columns below K - K % 128 are stored in 128-column superblocks, the rest in 32-column blocks.
    w, ref_w = weights("int4", 37, k, seed=k, group_size=gs)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k))
    a, b = _both_builds(x, w)
    assert torch.equal(a, b)
    ref, bound = _bf16_reference(x, ref_w)
    assert (np.abs(a.double().numpy() - ref) <= bound).all()


def np_a8(x: np.ndarray, u: np.ndarray, scales: np.ndarray, gs: int) -> tuple[np.ndarray, np.ndarray]:
    """W4A8 in numpy, read off skinny.c's header: per group of gs columns m = max |x|, q = RN(x * RN(127 / m)),
    s_x = RN(m / 127) (fp32); the group's sum of (u - 8) q exactly; acc = s_w s_x sum + acc group after group. The
    kernel fuses that multiply-add, so the float64 one here may differ by an ulp of acc per group: returns (reference,
    bound)."""
    x32 = x.astype(np.float32)
    ng = x.shape[1] // gs
    g = x32.reshape(len(x), ng, gs)
    m = np.abs(g).max(axis=2)
    safe = np.where(m > 0, m, np.float32(1))
    inv = (np.float32(127) / safe).astype(np.float32)
    q = np.rint((g * inv[..., None]).astype(np.float32)).astype(np.float64)
    sx = (m / np.float32(127)).astype(np.float32)
    ints = np.einsum("rgk,ngk->rng", q, (u.astype(np.float64) - 8).reshape(len(u), ng, gs))
    s = (scales.astype(np.float32)[None] * sx[:, None, :]).astype(np.float32)
    acc = np.zeros((len(x), len(u)), dtype=np.float32)
    mass = np.zeros((len(x), len(u)))
    for j in range(ng):
        term = ints[..., j] * s[..., j].astype(np.float64)
        acc = (term + acc.astype(np.float64)).astype(np.float32)
        mass += np.abs(term)
    return acc.astype(np.float64), (ng + 1) * U * mass * 1.01


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 33])
@pytest.mark.parametrize("n,k,gs", [(77, 256, 32), (64, 896, 128), (16, 4864, 128), (40, 192, 64)])
def test_w4a8_is_its_integer_arithmetic_and_within_the_activation_rounding_of_the_float_product(n, k, gs, rows):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n))
    qw, sw = quant.quantize(w, "int4_a8", gs)
    layer = quant.QLinear(*quant.tile_a8(qw, sw), out_features=n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.linspace(0.1, 3, k)
    got = kernels.linear(x, layer).double().numpy()
    u = np_unpack_int4(qw.numpy()) + 8
    ref, bound = np_a8(x.numpy(), u, sw.float().numpy(), gs)
    assert (np.abs(got - ref) <= bound).all(), float((np.abs(got - ref) / bound).max())
    # Against the float product: each activation moved by at most half a step s_x / 2 (plus its fp32 roundings).
    wd = (u - 8) * np.repeat(sw.float().numpy(), gs, axis=1)
    xd = x.double().numpy()
    step = np.repeat(np.abs(xd).reshape(rows, k // gs, gs).max(axis=2) / 127, gs, axis=1)
    loose = (step / 2 * (1 + 1e-5)) @ np.abs(wd).T + (k + 2) * U * (np.abs(xd) @ np.abs(wd).T) * 2
    assert (np.abs(got - xd @ wd.T) <= loose).all()


def test_w4a8_zero_tiny_denormal_and_non_finite_groups(threads):
    """A group of zeros, of values below 1e-30 or of fp32 denormals counts as zero; a NaN or an infinity makes the
    row's outputs NaN and leaves the other rows alone; both builds agree."""
    k, gs = 256, 64
    w = torch.randn(48, k, generator=torch.Generator().manual_seed(3))
    qw, sw = quant.quantize(w, "int4_a8", gs)
    layer = quant.QLinear(*quant.tile_a8(qw, sw), out_features=48)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(4))
    x[0] = 0
    x[1, :gs] = 1e-31
    x[2, :gs] = 1e-39
    x[3, gs + 5] = float("nan")
    x[4, 7] = float("inf")
    got = kernels.linear(x, layer)
    zeroed = x.clone()
    zeroed[1, :gs] = 0
    zeroed[2, :gs] = 0
    assert (got[0] == 0).all()
    assert torch.equal(got[1:3], kernels.linear(zeroed[1:3], layer))
    assert got[3:5].isnan().all() and not got[5].isnan().any()
    assert torch.equal(got[5], kernels.linear(x[5:], layer)[0])
    if "avx512" in kernels.supported_isas():
        a, b = _both_builds(x, layer)
        assert torch.equal(a[:3], b[:3]) and torch.equal(a[5], b[5]) and b[3:5].isnan().all()


def test_w4a8_blocks_of_16_rows_round_trip_pad_and_keep_their_layout_in_row_subsets():
    n, k, gs = 37, 192, 64  # three blocks, the last padded with 11 rows
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    qw, sw = quant.quantize(w, "int4_a8", gs)
    blocks, bs = quant.tile_a8(qw, sw)
    assert blocks.shape == (3, k // 8, 64) and bs.shape == (3, k // gs, 16) and blocks.dtype == torch.uint8
    assert torch.equal(quant.untile_a8(blocks, bs, n)[0], qw) and torch.equal(quant.untile_a8(blocks, bs, n)[1], sw)
    # Byte 4 l + j of chunk c: row l's columns 8c + j (low nibble) and 8c + 4 + j (high nibble), as u = q + 8.
    u = np_unpack_int4(qw.numpy()) + 8
    b = blocks.numpy()
    assert b[1, 5, 4 * 3 + 2] == u[16 + 3, 8 * 5 + 2] | (u[16 + 3, 8 * 5 + 6] << 4)
    assert (b[2, :, 4 * 5:] == 0x88).all()  # padding rows hold u = 8, q = 0
    layer = quant.QLinear(blocks, bs, out_features=n)
    ref = quant.QLinear(qw, sw)
    assert layer.shape == (n, k) and layer.act8 and torch.equal(layer.weight, ref.weight)
    idx = torch.tensor([36, 0, 17, 5, 20])
    sub = layer.rows(idx)
    assert sub.blocks_a8 and sub.shape == (5, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    assert torch.equal(kernels.linear(x, sub), kernels.linear(x, layer)[:, idx])


@pytest.mark.skipif("avx512" not in kernels.supported_isas(), reason="CPU without AVX-512 + AVX512_BF16")
def test_builds_agree_on_adversarial_bf16_inputs(threads):
    # Cancellation, wide exponent spread, tiny (denormal once rounded or multiplied) and huge values: the
    # flush-to-zero and double rounding of vdpbf16ps must be emulated exactly by the AVX2 build.
    g = torch.Generator().manual_seed(11)
    k, n = 96, 50
    scale = torch.pow(2.0, torch.randint(-140, 60, (n, k), generator=g).float())
    w = (torch.randn(n, k, generator=g) * scale).bfloat16()
    w[:, 0::2] = -w[:, 1::2]  # pairs that cancel
    x = torch.randn(12, k, generator=g) * torch.pow(2.0, torch.randint(-140, 40, (12, k), generator=g).float())
    x[3] = 1e-39  # denormal fp32 activations: rounded to zero
    a, b = _both_builds(x, w)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert (a[3] == 0).all()


@pytest.mark.parametrize("nthreads", [1, 2, 5])
@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
def test_tiled_weights_give_the_row_major_bits_for_every_row_count_thread_count_and_build(kind, nthreads, threads):
    """Tiling is a layout, never a different sum: tiles for every group of token rows (int4 tiles of 8 rows read by
    tiles of 5, 3 or 2: rows straddle tiles), shares and claims."""
    if kind == "bfloat16":
        w, _ = weights("bfloat16", 4 * 37, 32 * 11, seed=12)
        tiled = quant.QLinear(quant.tile(w), None)
    elif kind == "int8":
        w, _ = weights("int8", 8 * 37, 16 * 13, seed=12)
        tiled = quant.QLinear(quant.tile(w.qweight), w.scales)
    else:
        w, _ = weights("int4", 8 * 37, 128 * 3, seed=12, group_size=64)
        tiled = quant.QLinear(quant.tile(w.qweight), w.scales)
    assert torch.equal(tiled.weight, w if kind == "bfloat16" else w.weight) and tiled.shape == tuple(w.shape)
    x = torch.randn(50, w.shape[1], generator=torch.Generator().manual_seed(13))
    kernels.configure_threads(nthreads)
    for s in (1, 2, 3, 4, 6, 7, 12, 13, 49, 50):
        assert torch.equal(kernels.linear(x[:s], tiled), kernels.linear(x[:s], w)), s
    if "avx512" in kernels.supported_isas():
        a, b = _both_builds(x, tiled)
        assert torch.equal(a, b) and torch.equal(a, kernels.linear(x, w))


@pytest.mark.parametrize("kind", ALL_KINDS)
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


@pytest.mark.parametrize("kind", ["bfloat16", "bf16_tiled", "int8", "int8_tiled", "int4", "int4_tiled"])
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
    if kind in DOT_BF16:  # x rounded to bf16 after the norm: within UB |x| per element (plus fp32 sums)
        bound = (UB + (k + 8) * U) * (np.abs(normed) @ np.abs(ref_w).T) * 1.01
        assert (np.abs(y.double().numpy() - normed @ ref_w.T) <= bound).all()
    else:
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
    if kind in DOT_BF16:
        bound = (UB + (k + 8) * U) * (np.abs(act) @ np.abs(ref_w).T + np.abs(want)) * 1.01
        assert (np.abs(out.double().numpy() - want) <= bound).all()
    else:
        assert np.abs(out.double().numpy() - want).max() <= 1e-4 * np.abs(want).max()
    for s in (1, 6, 35):
        part = base[:s].clone()
        kernels.fused_linear(gu[:s].contiguous(), w, swiglu=True, out=part)
        assert torch.equal(part, out[:s])


def test_the_avx512_build_needs_avx512_bf16_and_vnni(monkeypatch, caplog):
    base = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: base | {"avx512_bf16", "avx512_vnni"})
    assert kernels.supported_isas() == ["avx512", "avx2"]
    for missing in ("avx512_bf16", "avx512_vnni"):
        monkeypatch.setattr(kernels, "_cpu_flags", lambda m=missing: base | {"avx512_bf16", "avx512_vnni"} - {m})
        monkeypatch.setattr(kernels, "_warned_bf16", [])
        with caplog.at_level("INFO", logger="pipeline.kernels"):
            assert kernels.supported_isas() == ["avx2"]
        assert "AVX512_BF16" in caplog.text and "AVX512_VNNI" in caplog.text


def test_both_builds_need_f16c_for_the_q4k_scales(monkeypatch):
    """The Q4_K panels keep the GGUF's fp16 d / dmin and both builds widen them with F16C (vcvtph2ps)."""
    every = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: every)
    assert kernels.supported_isas() == ["avx512", "avx2"]
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: every - {"f16c"})
    assert kernels.supported_isas() == []
    assert all("-mf16c" in flags for flags in kernels.ISA_FLAGS.values())


def test_configure_threads_sets_torch_and_the_kernels(threads):
    kernels.configure_threads(1)
    assert torch.get_num_threads() == 1 and kernels.threads() == 1
    kernels.configure_threads(2)
    assert torch.get_num_threads() == 2 and kernels.threads() == 2


def test_fp16_weights_are_refused_by_name():
    with pytest.raises(ValueError, match="float16"):
        kernels.fused_linear(torch.randn(2, 16), torch.randn(8, 16).half())


def _kernel_paths_in_subprocesses(*envs: dict) -> list[subprocess.CompletedProcess]:
    """kernels.path() in a fresh interpreter per environment (the path is chosen at import), run side by side: each
    is mostly torch's import."""
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from pipeline.runtime import kernels; print('PATH=' + kernels.path())")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, **env}) for env in envs]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _kernel_path_in_subprocess(env: dict) -> subprocess.CompletedProcess:
    return _kernel_paths_in_subprocesses(env)[0]


@pytest.mark.slow
def test_a_failed_compile_is_logged_and_reported_as_the_torch_path(tmp_path):
    res = _kernel_path_in_subprocess({"CC": "false", "PIPELINE_CACHE": str(tmp_path)})
    assert "PATH=torch" in res.stdout
    assert "skinny kernel failed" in res.stderr


@pytest.mark.slow
@pytest.mark.skipif("avx512" not in kernels.supported_isas(), reason="needs a CPU that runs the AVX-512 build")
def test_an_assembler_without_amx_still_gets_the_avx512_build(tmp_path):
    """A compiler whose assembler refuses the AMX instructions (binutils before 2.36) gets the AVX-512 build without
    them, logged, instead of falling back to torch."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\ncase "$*" in *SKINNY_NO_AMX*) exec gcc "$@";; *mavx512f*) echo "Error: no such '
                  'instruction: tileloadd" >&2; exit 1;; *) exec gcc "$@";; esac\n')
    cc.chmod(0o755)
    code = ("from pipeline.runtime import kernels; print('PATH=' + kernels.path()); "
            "print('WHY=' + str(kernels.amx_unavailable()))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CC": str(cc), "PIPELINE_CACHE": str(tmp_path / "cache")})
    assert "PATH=avx512" in res.stdout, res.stderr
    assert "WHY=this avx512 library was compiled without the AMX instructions" in res.stdout
    assert "compiled only without its AMX instructions" in res.stderr


@pytest.mark.slow
def test_forced_path_is_reported():
    avx2, torch_path = _kernel_paths_in_subprocesses({"PIPELINE_KERNEL": "avx2"}, {"PIPELINE_KERNEL": "torch"})
    assert "PATH=avx2" in avx2.stdout, avx2.stderr
    assert "PATH=torch" in torch_path.stdout


def _qwen2_layers(layers: int, seed: int):
    """A small Qwen2-shaped config (q/k/v bias, GQA), random weights for it and the generator that made them."""
    from pipeline.runtime.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=32, qkv_bias=True, model_type="qwen2", rope_theta=1e6)
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    st = {k: torch.rand(s, generator=g) + 0.5 if "norm" in k else torch.randn(s, generator=g) * 0.2
          for k, s in shapes.items()}
    return cfg, st, g


@pytest.mark.parametrize("tiles", ["0", "1"])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int4", "int4_a8"])
def test_the_one_call_decoder_layer_equals_its_five_kernel_calls_bitwise(kind, tiles, monkeypatch):
    """Block.fast runs a layer as one C call (decoder_layer); the five calls it replaced give the same bits, in x
    and in the K/V written, for a decode step and a multi-token (verification) step; a weight moved and reported
    (kernels.weights_moved) rebuilds the cached plan. Row-major and tiled weights alike."""
    from pipeline.runtime.model import build_model, wt

    monkeypatch.setenv("PIPELINE_TILES", tiles)

    cfg, st, g = _qwen2_layers(1, seed=4)
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    model = build_model(cfg, st, dtype, "cpu")
    if kind.startswith("int4"):
        model = quant.quantize_model(model, kind, 32)
        assert model.layers[0].w13.act8 == (kind == "int4_a8")
    layer = model.layers[0]
    cos, sin = model._rope(64, "cpu")
    for S, start in ((1, 9), (5, 10)):
        x = torch.randn(2, S, 128, generator=g)
        pos = (start + torch.arange(S))[None].repeat(2, 1).contiguous()
        kv = start + S
        mask = (torch.arange(kv)[None, None, :] <= pos[:, :, None]).to(torch.uint8).contiguous()
        cache = [torch.randn(2, 2, 32, 32, generator=g).bfloat16() for _ in range(2)]
        kc, vc = (c.clone() for c in cache)
        got = layer.fast(x.clone(), pos, pos, (cos, sin), kc, vc, mask, kv)
        xr, kr, vr = x.clone(), cache[0].clone(), cache[1].clone()
        qkv = kernels.fused_linear(xr, wt(layer.wqkv), norm=layer.attn_norm.weight, eps=cfg.rms_norm_eps)
        q = kernels.rope_write(qkv.view(2, S, -1, 32), pos, pos, cos, sin, kr, vr, 4, 2, bias=layer.wqkv.bias)
        o = kernels.attention(q, kr, vr, mask, kv)
        kernels.fused_linear(o.view(2, S, -1), wt(layer.wo), out=xr)
        h = kernels.fused_linear(xr, wt(layer.w13), norm=layer.ffn_norm.weight, eps=cfg.rms_norm_eps)
        kernels.fused_linear(h, wt(layer.w2), swiglu=True, out=xr)
        assert torch.equal(got, xr) and torch.equal(kc, kr) and torch.equal(vc, vr)
    key = layer.__dict__["_plan"][1]
    layer.ffn_norm.weight.data = layer.ffn_norm.weight.data * 2
    kernels.weights_moved()
    layer.fast(torch.randn(1, 1, 128), torch.tensor([[0]]), torch.tensor([[0]]), (cos, sin),
               torch.zeros(1, 2, 4, 32, dtype=torch.bfloat16), torch.zeros(1, 2, 4, 32, dtype=torch.bfloat16),
               torch.ones(1, 1, 1, dtype=torch.uint8), 1)
    assert layer.__dict__["_plan"][1] != key


@pytest.mark.parametrize("kind", ["bfloat16", "int4_a8"])
def test_all_layers_in_one_call_equal_the_layer_by_layer_calls_on_cache_row_views(kind):
    """Transformer.forward runs every layer in one C call (decoder_layers) on the cache's [layers, B, ...] buffers; it
    equals Block.fast layer by layer, also on a view of some batch rows (KVCache.rows), and a layer whose submodule
    is replaced is read through its new plan."""
    from pipeline.runtime.model import build_model

    cfg, st, g = _qwen2_layers(3, seed=6)
    model = build_model(cfg, st, torch.bfloat16, "cpu")
    if kind == "int4_a8":
        model = quant.quantize_model(model, "int4_a8", 32)
    cache = model.new_cache(4, 24)
    view = cache.rows(1, 3)
    toks = torch.randint(0, 64, (2, 7), generator=g)
    pos = torch.arange(7).expand(2, 7).contiguous()
    with torch.inference_mode():
        model(toks[:, :6], pos[:, :6], view)
        got = model(toks[:, 6:], pos[:, 6:], view)
        ref_k, ref_v = cache.k.clone(), cache.v.clone()
        again = model.new_cache(4, 24)
        x = model.embed(toks).float().contiguous()
        cos, sin = model._rope(7, "cpu")
        rows = again.rows(1, 3)
        for i, layer in enumerate(model.layers):
            layer.fast(x, pos, pos, (cos, sin), rows.k[i], rows.v[i], None, 7)
        want = kernels.rmsnorm(x, model.norm.weight, model.norm.eps)[:, 6:]
        assert torch.equal(got, want)
        assert torch.equal(ref_k, again.k) and torch.equal(ref_v, again.v) and (cache.k[:, 0] == 0).all()
        other = build_model(cfg, {k: v * 1.5 if "layers.1.w13" in k else v for k, v in st.items()}, torch.bfloat16,
                            "cpu")
        if kind == "int4_a8":
            other = quant.quantize_model(other, "int4_a8", 32)
        model.layers[1].w13 = other.layers[1].w13
        fresh = model.new_cache(1, 8)
        changed = model(toks[:1, :6], pos[:1, :6], fresh)
        assert torch.equal(changed, other(toks[:1, :6], pos[:1, :6], other.new_cache(1, 8)))


def test_layer_plans_follow_the_weights_through_quantization_huge_pages_and_dtype_moves():
    """Plans are cached per layer and checked only when weights are said to have moved: every way the pipeline
    moves weights says so, and a step afterwards equals a step of a model built that way from the start."""
    from pipeline.runtime.model import build_model

    cfg, st, _ = _qwen2_layers(2, seed=5)
    tokens, pos = torch.tensor([[3, 9, 27, 5]]), torch.arange(4)[None]

    def step(m):
        with torch.inference_mode():
            out = m(tokens, pos, m.new_cache(1, 8))
        assert all(layer.__dict__["_plan"][1] == layer._weight_key() for layer in m.layers)  # points at the weights
        return out

    model = build_model(cfg, dict(st), torch.float32, "cpu")
    step(model)
    quant.quantize_model(model, "int4", 32)
    fresh = quant.quantize_model(build_model(cfg, dict(st), torch.float32, "cpu"), "int4", 32)
    assert torch.equal(step(model), step(fresh))
    assert quant.to_hugepages(model, min_bytes=0) > 0
    assert torch.equal(step(model), step(fresh))
    rounded = {k: v.bfloat16().float() for k, v in st.items()}
    widened = build_model(cfg, dict(rounded), torch.bfloat16, "cpu")
    step(widened)
    widened.float()
    assert torch.equal(step(widened), step(build_model(cfg, dict(rounded), torch.float32, "cpu")))


def test_argmax_prob_is_torchs_argmax_and_softmax_maximum():
    """The draft's token and confidence per row in one C pass: the first largest logit (ties included) and its softmax
    probability within 1e-6 of torch's, for peaked, flat and -inf-masked rows of any width."""
    g = torch.Generator().manual_seed(14)
    for n in (1, 7, 8, 65536, 151936 + 3):
        lg = torch.randn(5, n, generator=g) * torch.tensor([0.01, 1.0, 8.0, 30.0, 1.0])[:, None]
        if n > 8:
            lg[4, 3] = lg[4, n - 2] = lg[4].max() + 1  # a tie: the first one wins, as torch.argmax picks
            lg[1, : n // 2] = -float("inf")
        idx, prob = kernels.argmax_prob(lg)
        assert torch.equal(idx, lg.argmax(-1)), n
        alone, none = kernels.argmax_prob(lg, with_prob=False)
        assert torch.equal(alone, idx) and none is None
        assert (prob - torch.softmax(lg, -1).amax(-1)).abs().max() <= 1e-6, n
    bad = torch.zeros(2, 16)
    bad[1] = -float("inf")
    _, prob = kernels.argmax_prob(bad)
    assert prob[0] == pytest.approx(1 / 16) and prob[1].isnan()


def test_greedy_picks_are_torchs_argmax_for_any_leading_shape():
    """sampling.greedy (every greedy pick: next_token, the verification of drafts) returns torch's argmax over the
    last dimension, ties to the first, a NaN winning as in torch, for one row, a [B, S, V] block and bf16 logits
    (torch's own pass there)."""
    from pipeline.runtime.sampling import SamplingParams, greedy, next_token

    g = torch.Generator().manual_seed(3)
    lg = torch.randn(2, 7, 151936, generator=g)
    lg[0, 2, 10] = lg[0, 2, 90000] = lg[0, 2].max() + 1
    lg[1, 4, 500] = float("nan")
    assert torch.equal(greedy(lg), lg.argmax(-1)) and greedy(lg)[1, 4] == 500 and greedy(lg)[0, 2] == 10
    assert torch.equal(greedy(lg[:, ::2]), lg[:, ::2].argmax(-1))  # not contiguous
    assert torch.equal(greedy(lg.bfloat16()), lg.bfloat16().argmax(-1))
    row = lg[0, 2]
    assert greedy(row).shape == () and next_token(row, SamplingParams(), torch.Generator()) == 10


def test_the_bandwidth_probe_reads_every_byte(threads):
    """stream_read (the bench's bandwidth probe) xors every word on every thread: flipping any byte changes it."""
    x = torch.zeros(3 * 64 * 1001, dtype=torch.uint8)
    for n in (1, 2, 3):
        kernels.configure_threads(n)
        assert kernels.stream_read(x) == 0
        for i in [*range(64), x.numel() // 2 + 5, x.numel() - 1]:
            x[i] = 1
            assert kernels.stream_read(x) != 0, (n, i)
            x[i] = 0


def _pool_counter(name: str):
    import ctypes

    return ctypes.c_longlong.in_dll(kernels._load(), name)


@pytest.fixture
def pool_wait():
    """The pool's two spin budgets (ns), restored after the test."""
    quiet, busy = _pool_counter("pool_spin_quiet_ns"), _pool_counter("pool_spin_busy_ns")
    saved = quiet.value, busy.value
    yield quiet, busy
    quiet.value, busy.value = saved


def test_kernel_calls_from_several_threads_at_once_keep_single_thread_bits(threads):
    """One caller at a time gets the pool; a call made while it is taken runs its shares on its own thread. Both give
    the bits of a one-thread call (the served stub's batcher and a second Python thread may call at once)."""
    import threading

    ws = [weights(kind, 640, 256, seed=11)[0] for kind in ("int4_a8", "bf16_tiled", "float32")]
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(12))
    kernels.configure_threads(1)
    want = [kernels.linear(x, w) for w in ws]
    kernels.configure_threads(2)
    bad: list[str] = []

    def caller(i: int) -> None:
        for r in range(40):
            w = (i + r) % len(ws)
            if not torch.equal(kernels.linear(x, ws[w]), want[w]):
                bad.append(f"thread {i} call {r}")

    ts = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts), "a kernel call hung with several callers"
    assert not bad, bad[:5]


def test_a_forked_child_starts_its_own_pool_workers():
    """The parent's workers do not exist in a forked child: its first parallel call starts new ones (a child that
    waited on the parent's would hang) and gets the same bits."""
    code = (
        "import os, signal, torch\n"
        "from pipeline.runtime import kernels\n"
        "from tests.test_kernels import weights\n"
        "w = weights('int4_a8', 640, 256, seed=3)[0]\n"
        "x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))\n"
        "kernels.configure_threads(2)\n"
        "want = kernels.linear(x, w)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(60)\n"
        "    ok = all(torch.equal(kernels.linear(x, w), want) for _ in range(20))\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "child 0" in res.stdout, (res.stdout, res.stderr[-1000:])


def test_pool_workers_spin_through_short_gaps_within_the_budget_and_sleep_past_it(threads, pool_wait):
    """The wait between calls (a decode step's Python): a budget longer than the gap keeps the worker awake (no
    futex sleeps), a zero budget puts it to sleep in every gap. The calls' bits do not depend on either."""
    import time

    quiet, busy = pool_wait
    w = weights("int4_a8", 640, 256, seed=5)[0]
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    kernels.configure_threads(2)
    want = kernels.linear(x, w)
    sleeps = _pool_counter("pool_sleeps")

    def gaps(n: int, gap_s: float) -> int:
        kernels.linear(x, w)
        before = sleeps.value
        for _ in range(n):
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
            assert torch.equal(kernels.linear(x, w), want)
        return sleeps.value - before

    quiet.value = busy.value = 200_000_000  # 200 ms: far past a 1 ms gap
    assert gaps(20, 0.001) == 0
    quiet.value = busy.value = 0
    assert gaps(20, 0.001) >= 20


def test_the_pool_sees_another_runnable_process_and_takes_the_short_wait(threads):
    """Beside CPU-bound processes the probe of /proc/loadavg finds runnable threads that are not ours, so waits use
    pool_spin_busy_ns (a spinning thread would take the core from the one holding the work)."""
    import time

    from pipeline.contention import busy_process

    w = weights("int4_a8", 640, 256, seed=5)[0]
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    kernels.configure_threads(2)
    seen = _pool_counter("pool_busy_seen")
    with busy_process(), busy_process():
        before = seen.value
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end and seen.value == before:
            kernels.linear(x, w)
            time.sleep(0.005)
        assert seen.value > before, "no probe saw the busy processes in 1 s of calls"


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_the_int8_peak_probe_counts_its_multiply_adds_and_names_the_instruction(isa):
    """int8_peak runs the build's own dot-product instruction on the kernel threads: the C call returns exactly
    rounds x threads x 12 accumulators x the instruction's multiply-adds (64 for vpdpbusd zmm, 32 for vpmaddubsw ymm),
    and the rate is that count over a positive time, under the build's instruction name."""
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} build")
    prev_path, prev_threads = kernels.path(), kernels.threads()
    kernels.set_path(isa)
    try:
        per = {"avx512": 64, "avx2": 32}[isa]
        for n in (1, 3):
            assert kernels._lib.int8_peak(1000, n) == 1000 * n * 12 * per
        assert kernels._lib.int8_peak(-5, 2) == 0  # a negative count runs nothing
        kernels.set_threads(2)
        r = kernels.int8_peak(0.03)
        assert r["threads"] == 2 and r["instruction"] == kernels.PEAK_INSTRUCTION[isa]
        assert r["instruction"].startswith({"avx512": "vpdpbusd zmm", "avx2": "vpmaddubsw ymm"}[isa])
        assert 1e8 < r["macs_per_s"] < 1e14  # 0.1 G to 100 T multiply-adds a second: a count over a real time
    finally:
        kernels.set_path(prev_path)
        kernels.set_threads(prev_threads)


def test_the_kv_cache_holds_k_and_v_rounded_to_bf16_as_rope_write_writes_them():
    """rope_write rotates k (half-rotation RoPE, the bias added first) and writes k and v into the bf16 cache rounded
    to nearest even, as torch rounds fp32 to bf16 (normal values); q comes back in fp32, unrounded; the slots not
    written keep what they held."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, D, L = 4, 2, 36, 9
    qkv = torch.randn(1, 3, hq + 2 * hkv, D, generator=g) * 3
    bias = torch.randn((hq + 2 * hkv) * D, generator=g)
    pos = torch.tensor([[2, 5, 7]])
    slots = torch.tensor([[0, 4, 8]])
    half = D // 2
    inv = 1.0 / (1e4 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.outer(torch.arange(16).float(), inv)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    kc, vc = (torch.full((1, hkv, L, D), 7.0, dtype=torch.bfloat16) for _ in range(2))
    q = kernels.rope_write(qkv, pos, slots, cos, sin, kc, vc, hq, hkv, bias)
    x = qkv + bias.view(hq + 2 * hkv, D)
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]
    rot = x[:, :, :hq + hkv] * c + torch.cat([-x[..., half:], x[..., :half]], -1)[:, :, :hq + hkv] * s
    assert (q - rot[:, :, :hq]).abs().max() < 1e-5 and q.dtype == torch.float32
    for t, slot in enumerate(slots[0].tolist()):
        assert torch.equal(kc[0, :, slot], rot[0, t, hq:].to(torch.bfloat16)), t
        assert torch.equal(vc[0, :, slot], x[0, t, hq + hkv:].to(torch.bfloat16)), t
    untouched = [s for s in range(L) if s not in slots[0].tolist()]
    assert bool((kc[0, :, untouched] == 7).all() and (vc[0, :, untouched] == 7).all())


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_the_gguf_tiles_prefetch_their_records_ahead_in_the_built_library(isa):
    """The GGUF tiles' software prefetch is most of a one-token step's speed (none: 1.06-1.13x the time, 2-core Zen 4,
    kernel_log.md 2026-12-05) and no output shows it: an address formed as an integer made GCC 12 drop every one of
    them. So the built library is read: the functions that run the panels hold the prefetches."""
    import shutil

    if isa not in kernels.supported_isas() or shutil.which("objdump") is None:
        pytest.skip(f"needs the {isa} build and objdump")
    lib = kernels._compile(isa)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib.so_path)], capture_output=True, text=True,
                         check=True).stdout
    count: dict[str, int] = {}
    fn = ""
    for line in asm.splitlines():
        if line.endswith(">:"):
            fn = line.split("<", 1)[1].rstrip(">:").split(".", 1)[0]
        elif "prefetcht1" in line:
            count[fn] = count.get(fn, 0) + 1
    # a Q4_K and a Q6_K record's lines (38 and 53) are prefetched in loops the compiler may unroll or not; each tile
    # body that gg_panels inlines keeps at least its two record loops, beside the 32-weight blocks' one
    assert count.get("gg_panels", 0) >= 3, count
