"""A GGUF's own k-quant weights (Q4_K, Q6_K) for the CPU kernels, never rounded twice (`quantization: gguf`).

The GGUF's integers and scales are kept; at build time each tensor is repacked (`pack`) into the panels of 16 output
rows gguf_kernels.c reads (its header gives the byte layout and the arithmetic contract): the same integers q, the
same 6-bit / 8-bit sub-block scales, Q4_K's d / dmin as the GGUF's own fp16 (the kernels widen them; Q6_K's d is
widened to fp32 here, exactly). Nothing is re-rounded: a weight enters every matmul as its exact value
d sc q - dmin m (Q4_K) or d sc (q - 32) (Q6_K), which is the GGUF's dequantized value (gguf.quants) whenever that
is representable in fp32; always for Q6_K, and for Q4_K wherever `q4k_exact` says so (the engine build counts the
sub-blocks where it is not and reports them).

Activations are quantized per 256 columns (a super-block) to int8 at each matmul (gguf_kernels.c); `reference_matmul`
is that arithmetic in torch, bit for bit (the torch fallback and the tests' reference).

A layer is up to four parts of one input width (the runtime fuses q/k/v and gate/up, and a Q4_K_M GGUF mixes Q4_K and
Q6_K among them): `GGUFLinear` holds every part's packed bytes in one buffer (`qweight`) and a table `parts` [n, 5]
(ggml type, rows, first output row, byte offset, input width). In an engine's safetensors a layer `P` is `P.gguf_w` +
`P.gguf_parts`. The 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: the draft's GGUF, SmolLM2's Q4_1) are packed
by `pack32` into gguf_blocks32.c's records, with activations per 32 columns (`quantize_activations32`); a layer may
mix them with k-quant parts, each part keeping its own contract.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.runtime import kernels
from pipeline.runtime.quant import GGUF_FORMAT, LINEAR, QLinear

Q4_K, Q6_K = 12, 14  # ggml type ids (gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8  # the blocks of 32 (gguf_blocks32.c)
TYPE_NAMES = {Q4_K: "Q4_K", Q6_K: "Q6_K", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0"}
GGUF_BLOCK = {Q4_K: 144, Q6_K: 210}   # bytes per 256 weights in the GGUF
RECORD = {Q4_K: 2368, Q6_K: 3392}     # bytes per 16 rows x 256 columns in the kernel's panels
GGUF_BLOCK32 = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}  # bytes per 32 weights in the GGUF
RECORD32 = {Q4_0: 320, Q4_1: 384, Q5_0: 384, Q5_1: 448, Q8_0: 576}  # bytes per 16 rows x 32 columns in the panels
ZERO32 = {Q4_0: 8, Q5_0: 16}          # w = d (q - z); Q4_1 / Q5_1: w = d q + m; Q8_0: d q (q int8)
SUPPORTED = (*RECORD, *RECORD32)
# A record's sections as (bytes, bytes of one panel row per group of 16): every section keeps each of the 16 rows'
# bytes at a fixed place in each group (gguf_kernels.c / gguf_blocks32.c), so rows can be gathered (GGUFLinear.rows).
LANE_SECTIONS = {Q4_K: ((2048, 4), (32, 2), (32, 2), (128, 1), (128, 1)),
                 Q6_K: ((2048, 4), (1024, 4), (64, 4), (256, 1)),
                 **{t: ((rec, 4),) for t, rec in RECORD32.items()}}
FORMAT = GGUF_FORMAT  # joins an engine's input hash (quant.layout_tag): a changed layout rebuilds, never misreads
MAX_PARTS = 4


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def q4k_fields(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """GGUF Q4_K rows [N, K / 256 * 144] -> d, dmin fp32 [N, nsb], sc, m uint8 [N, nsb, 8], q uint8 [N, K]."""
    N = raw.shape[0]
    b = raw.reshape(N, -1, 144)
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
    s = b[..., 4:16].reshape(N, -1, 3, 4)
    sd, sm, smd = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=-1)
    m = np.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1)
    qs = b[..., 16:].reshape(N, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    return d, dmin, sc, m, (qs & 0x0F).reshape(N, -1)


def q6k_fields(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """GGUF Q6_K rows [N, K / 256 * 210] -> d fp32 [N, nsb], sc int8 [N, nsb, 16], q uint8 [N, K] (0..63)."""
    N = raw.shape[0]
    b = raw.reshape(N, -1, 210)
    nsb = b.shape[1]
    ql = b[..., :128].reshape(N, nsb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[..., 128:192].reshape(N, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = (ql & 0x0F).reshape(N, nsb, 8, 32) | ((qh & 0x03).reshape(N, nsb, 8, 32) << 4)
    return _fp16(b[..., 208:210]), np.ascontiguousarray(b[..., 192:208]).view(np.int8), q.reshape(N, -1)


def fields32(qtype: int, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """GGUF rows of a 32-weight block type [N, K / 32 * block bytes] -> d fp32 [N, nb], m fp32 [N, nb] (Q4_1 / Q5_1;
    else None), q int64 [N, K] as stored (0..15, 0..31, or Q8_0's int8)."""
    N = raw.shape[0]
    b = raw.reshape(N, -1, GGUF_BLOCK32[qtype])
    d = _fp16(b[..., 0:2])
    if qtype == Q8_0:
        return d, None, np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int64).reshape(N, -1)
    m = _fp16(b[..., 2:4]) if qtype in (Q4_1, Q5_1) else None
    o = 2 if m is None else 4
    qh = None
    if qtype in (Q5_0, Q5_1):
        qh = np.ascontiguousarray(b[..., o:o + 4]).view("<u4")[..., 0].astype(np.int64)
        o += 4
    qs = b[..., o:o + 16].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if qh is not None:
        q = q | (((qh[..., None] >> np.arange(32)) & 1) << 4)
    return d, m, q.reshape(N, -1)


def panel_bytes(qtype: int, K: int) -> int:
    """Bytes of one 16-row panel of a part of this type over K columns."""
    return K // 32 * RECORD32[qtype] if qtype in RECORD32 else K // 256 * RECORD[qtype]


def pack32(qtype: int, raw: np.ndarray, K: int) -> np.ndarray:
    """One GGUF tensor of a 32-weight block type -> the kernel's panels (gguf_blocks32.c): per panel and block of 32
    columns the integers (nibble lines as the k-quants', a line of fifth bits, or Q8_0's q + 128), then D[16] (and
    M[16]) fp32; rows past N are zero."""
    N, nb = raw.shape[0], K // 32
    Np = -(-N // 16) * 16
    d, m, q = fields32(qtype, raw)
    P = Np // 16
    q = _pad_rows(q, Np)
    if qtype == Q8_0:  # line c, byte 4 l + j: row l's column 4c + j, as q + 128
        u = (q + 128).astype(np.uint8).reshape(P, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4)
        parts = [u.reshape(P, nb, 512)]
    else:
        parts = [_nibble_lines(q.astype(np.uint8)).reshape(P, nb, 256)]
        if qtype in (Q5_0, Q5_1):  # byte 4 l + j, bit 2c + h: the fifth bit of row l's column 8c + 4h + j
            h = ((q >> 4) & 1).astype(np.uint8).reshape(P, 16, nb, 4, 2, 4)  # [P, l, nb, c, h, j]
            h = h << (2 * np.arange(4, dtype=np.uint8)[:, None, None] + np.arange(2, dtype=np.uint8)[:, None])
            parts.append(h.sum((3, 4), dtype=np.uint8).transpose(0, 2, 1, 3).reshape(P, nb, 64))
    parts.append(_lanes(_pad_rows(d, Np)))
    if m is not None:
        parts.append(_lanes(_pad_rows(m, Np)))
    out = np.concatenate(parts, axis=-1)
    assert out.shape[-1] == RECORD32[qtype]
    return np.ascontiguousarray(out).reshape(-1)


def _pad_rows(a: np.ndarray, Np: int) -> np.ndarray:
    return a if a.shape[0] == Np else np.concatenate([a, np.zeros((Np - a.shape[0], *a.shape[1:]), a.dtype)])


def _nibble_lines(u: np.ndarray) -> np.ndarray:
    """[Np, K] values (low 4 bits used) -> [P, K / 8, 64]: byte 4 l + j of line c holds row l's columns 8c + j (low
    nibble) and 8c + 4 + j (high), as W4A8's tile_a8."""
    Np, K = u.shape
    v = (u & 15).reshape(Np // 16, 16, K // 8, 2, 4)
    return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).transpose(0, 2, 1, 3).reshape(Np // 16, K // 8, 64)


def _lanes(a: np.ndarray) -> np.ndarray:
    """Per-row values [Np, nsb, *rest] -> [P, nsb, *rest, 16] (row l of a panel in lane l), as bytes."""
    Np, nsb = a.shape[:2]
    a = a.reshape(Np // 16, 16, nsb, *a.shape[2:])
    a = np.moveaxis(a, 1, -1)
    return np.ascontiguousarray(a).view(np.uint8).reshape(Np // 16, nsb, -1)


def pack(qtype: int, raw: np.ndarray, K: int) -> np.ndarray:
    """One GGUF tensor's rows (uint8 [N, K / 256 * block bytes]) -> the kernel's panels, uint8 [ceil(N / 16) * K / 256
    * RECORD] (gguf_kernels.c); rows past N are zero (d = dmin = 0). The 32-weight block types: `pack32`."""
    if qtype in RECORD32:
        if K % 32:
            raise ValueError(f"input width {K}: GGUF {TYPE_NAMES[qtype]} comes in blocks of 32 columns")
        return pack32(qtype, raw, K)
    if qtype not in RECORD:
        raise ValueError(f"GGUF tensor type {qtype}: quantization gguf runs {', '.join(TYPE_NAMES.values())} "
                         "tensors; use quantization: int4_a8 for this model")
    if K % 256:
        raise ValueError(f"input width {K}: GGUF k-quants come in super-blocks of 256 columns")
    N = raw.shape[0]
    Np, nsb = -(-N // 16) * 16, K // 256
    if qtype == Q4_K:
        d, dmin, sc, m, q = q4k_fields(raw)
        nib = _nibble_lines(_pad_rows(q, Np)).reshape(Np // 16, nsb, 2048)
        # d and dmin as the GGUF's fp16 (widened by the kernel, exactly): 64 bytes a record fewer than fp32
        parts = [nib, _lanes(_pad_rows(d.astype(np.float16), Np)), _lanes(_pad_rows(dmin.astype(np.float16), Np)),
                 _lanes(_pad_rows(sc, Np)), _lanes(_pad_rows(m, Np))]
    else:
        d, sc, q = q6k_fields(raw)
        q = _pad_rows(q, Np)
        nib = _nibble_lines(q).reshape(Np // 16, nsb, 2048)
        h2 = (q >> 4).reshape(Np // 16, 16, K // 16, 4, 4).astype(np.uint8)
        hb = (h2[:, :, :, 0] | (h2[:, :, :, 1] << 2) | (h2[:, :, :, 2] << 4) | (h2[:, :, :, 3] << 6))
        hb = hb.transpose(0, 2, 1, 3).reshape(Np // 16, nsb, 1024)
        parts = [nib, hb, _lanes(_pad_rows(d, Np)), _lanes(_pad_rows(sc, Np))]
    out = np.concatenate(parts, axis=-1)
    assert out.shape[-1] == RECORD[qtype]
    return np.ascontiguousarray(out).reshape(-1)


def q4k_exact(raw: np.ndarray) -> tuple[int, int]:
    """(sub-blocks whose 16 values d sc q - dmin m are all representable in fp32, sub-blocks) of GGUF Q4_K rows: where
    they are, the kernel's exact weight is the GGUF's rounded one. Exact integer arithmetic (fp16 = mantissa * 2^e)."""
    d, dmin, sc, m, _ = q4k_fields(raw)

    def split(v):  # fp32 holding an fp16 value -> integer mantissa, exponent
        mant, ex = np.frexp(v.astype(np.float64))
        return (mant * 2048).astype(np.int64), ex.astype(np.int64) - 11

    md, ed = split(d)
    mm, em = split(dmin)
    # d sc q is a multiple of 2^ed below 2^(ed + 21), dmin m of 2^em below 2^(em + 17), so their difference a multiple
    # of 2^min below 2^(max + 1): where that span fits 24 bits every value does (every sub-block of the Qwen2.5-Coder
    # GGUFs); only the rest is checked value by value.
    span = np.maximum(ed + 21, em + 17) + 1 - np.minimum(ed, em)
    easy = ((span <= 24) | (md == 0) | (mm == 0))[..., None] | (m == 0)
    hard = ~easy
    if not hard.any():
        return int(easy.size), int(easy.size)
    rows = hard.any(axis=(1, 2))
    e = _q4k_exact_values(md[rows], ed[rows], mm[rows], em[rows], sc[rows], m[rows])
    return int(easy.sum()) + int((e & hard[rows]).sum()), int(easy.size)


def _q4k_exact_values(md, ed, mm, em, sc, m) -> np.ndarray:
    """Per sub-block: are all 16 values md sc q 2^ed - mm m 2^em representable in fp32 (exact integers)."""
    e0 = np.minimum(ed, em)[..., None, None]
    q = np.arange(16, dtype=np.int64)
    V = ((md[..., None] * sc.astype(np.int64))[..., None] * q << (ed[..., None, None] - e0)) \
        - ((mm[..., None] * m.astype(np.int64))[..., None] << (em[..., None, None] - e0))
    a = np.abs(V)
    low = a & -a
    bits = np.frexp(a.astype(np.float64))[1] - np.frexp(np.maximum(low, 1).astype(np.float64))[1]
    return ((a == 0) | (bits < 24)).all(axis=-1)


def reference_dequantize(qtype: int, raw: np.ndarray, K: int) -> np.ndarray:
    """The GGUF's own dequantized weights (gguf.quants), fp32 [N, K]."""
    from gguf import GGMLQuantizationType, quants  # lazy: the gguf package (~0.1 s) only when a GGUF file is read

    return quants.dequantize(raw, GGMLQuantizationType(qtype)).reshape(raw.shape[0], K)


# ---- the kernel's arithmetic in torch -----------------------------------------------------------------------------

def _fma32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """fp32 fma(a, b, c) with one rounding: exact product and sum rounded to odd in float64, then to fp32."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bp = s - p
    t = (p - (s - bp)) + (cd - bp)  # the sum's rounding error (TwoSum)
    odd = (s.view(torch.int64) & 1) == 1
    fix = (t != 0) & ~odd & torch.isfinite(s) & torch.isfinite(t)
    toward = torch.where(t > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(fix, torch.nextafter(s, toward), s).float()


def _quantize_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Rows x [R, K] fp32 -> (x8 int64 [R, K / group, group], dx [R, K / group]): one int8 scale per `group` columns,
    as gg_quant_row (256) and gg_quant32_row (32) do; a group with a non-finite value gets dx NaN, an all-zero one 0."""
    R, K = x.shape
    xb = x.float().reshape(R, K // group, group)
    bad = ~torch.isfinite(xb).all(-1)
    mx = torch.where(bad, torch.zeros(()), xb.abs().nan_to_num(0.0).amax(-1))
    zero = (mx < 1e-30) & ~bad
    skip = zero | bad
    inv = torch.tensor(127.0) / torch.where(skip, torch.ones(()), mx)
    q = torch.round(torch.where(skip[..., None], torch.zeros(()), xb.nan_to_num(0.0) * inv[..., None])).long()
    dx = torch.where(bad, torch.full_like(mx, float("nan")), torch.where(zero, torch.zeros(()), mx / 127.0))
    return q, dx


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows x [R, K] fp32 -> (x8 int64 [R, K], dx [R, K / 256], xs [R, K / 32], o [R, K / 16]) as gg_quant_row: one
    scale per 256 columns; xs the sum of each 32 columns' x8 (an exact integer, as fp32), o -32 times each 16's."""
    R, K = x.shape
    q, dx = _quantize_groups(x, 256)
    xs = q.reshape(R, K // 32, 32).sum(-1).float()
    o = -32 * q.reshape(R, K // 16, 16).sum(-1)
    return q.reshape(R, K), dx, xs, o


def quantize_activations32(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows x [R, K] fp32 -> (x8 int64 [R, K], dx [R, K / 32], xs [R, K / 32]) as gg_quant32_row: one scale per 32
    columns, xs the sum of each block's x8 (an exact integer, as fp32)."""
    R, K = x.shape
    q, dx = _quantize_groups(x, 32)
    return q.reshape(R, K), dx, q.sum(-1).float()


def _unpack32(qtype: int, packed: Tensor, N: int, K: int) -> dict[str, Tensor]:
    P, nb = -(-N // 16), K // 32
    r = packed.reshape(P, nb, RECORD32[qtype])
    if qtype == Q8_0:
        q = r[..., :512].long().reshape(P, nb, 8, 16, 4) - 128  # [P, nb, c, l, j]
        doff = 512
    else:
        lines = r[..., :256].long().reshape(P, nb, 4, 1, 16, 4)  # [P, nb, c, 1, l, j]
        q = torch.cat([lines & 15, lines >> 4], dim=3)  # [P, nb, c, h, l, j]
        doff = 256
        if qtype in (Q5_0, Q5_1):
            hb = r[..., 256:320].long().reshape(P, nb, 1, 1, 16, 4)
            shift = (2 * torch.arange(4).reshape(4, 1) + torch.arange(2)).reshape(1, 1, 4, 2, 1, 1)
            q = q | (((hb >> shift) & 1) << 4)
            doff = 320
        q = (q - ZERO32.get(qtype, 0)).permute(0, 1, 2, 3, 5, 4)  # [P, nb, c, h, j, l]
    q = q.reshape(P, nb, 32, 16) if qtype != Q8_0 else q.permute(0, 1, 2, 4, 3).reshape(P, nb, 32, 16)
    q = q.permute(0, 3, 1, 2).reshape(P * 16, K)[:N]

    def lanes(t: Tensor) -> Tensor:  # [P, nb, 64] bytes -> [N, nb] fp32
        return t.contiguous().view(torch.float32).reshape(P, nb, 16).permute(0, 2, 1).reshape(P * 16, nb)[:N]

    out = {"q": q, "D": lanes(r[..., doff:doff + 64])}
    if qtype in (Q4_1, Q5_1):
        out["M"] = lanes(r[..., doff + 64:doff + 128])
    return out


def unpack(qtype: int, packed: Tensor, N: int, K: int) -> dict[str, Tensor]:
    """The integers and scales of a part from its panels: q [N, K]; Q4_K: D, M fp32 [N, K / 32] (d sc, dmin m);
    Q6_K: D fp32 [N, K / 16]; the 32-weight block types: q - z, D (and M for Q4_1 / Q5_1) fp32 [N, K / 32]."""
    if qtype in RECORD32:
        return _unpack32(qtype, packed, N, K)
    P, nsb = -(-N // 16), K // 256
    r = packed.reshape(P, nsb, RECORD[qtype])
    lines = r[..., :2048].reshape(P, nsb * 32, 16, 4)  # [panel, line, row, j]
    u = torch.stack([lines & 15, lines >> 4], dim=3)  # [panel, line, row, nibble, j]
    q = u.permute(0, 2, 1, 3, 4).reshape(P * 16, K).long()

    def lanes(t: Tensor, dtype, per: int) -> Tensor:  # [P, nsb, per * 16 * size] -> [N, nsb, per]
        v = t.contiguous().view(dtype).reshape(P, nsb, per, 16)
        return v.permute(0, 3, 1, 2).reshape(P * 16, nsb, per)[:N]

    if qtype == Q4_K:
        d, dmin = lanes(r[..., 2048:2080], torch.float16, 1).float(), lanes(r[..., 2080:2112], torch.float16, 1).float()
        sc, m = lanes(r[..., 2112:2240], torch.uint8, 8), lanes(r[..., 2240:2368], torch.uint8, 8)
        return {"q": q[:N], "D": (d * sc.float()).reshape(N, -1), "M": (dmin * m.float()).reshape(N, -1)}
    hb = r[..., 2048:3072].reshape(P, nsb * 16, 16, 4)
    h = torch.stack([(hb >> (2 * f)) & 3 for f in range(4)], dim=3)  # [panel, sub-block, row, field, jj]
    q = q | (h.permute(0, 2, 1, 3, 4).reshape(P * 16, K).long() << 4)
    d, sc = lanes(r[..., 3072:3136], torch.float32, 1), lanes(r[..., 3136:3392], torch.int8, 16)
    return {"q": q[:N], "D": (d * sc.float()).reshape(N, -1)}


def dequantize_part(qtype: int, f: dict[str, Tensor]) -> Tensor:
    """A part's weights fp32 [N, K] as gguf.quants rounds them (Q4_K: RN(RN(D q) - M))."""
    q = f["q"].float()
    N, K = q.shape
    if qtype in RECORD32:  # D (q - z) is exact in fp32; the _1 types round RN(D q + M) as gguf.quants
        v = f["D"].repeat_interleave(32, 1) * q
        return v + f["M"].repeat_interleave(32, 1) if "M" in f else v
    if qtype == Q4_K:
        return ((f["D"].repeat_interleave(32, 1) * q) - f["M"].repeat_interleave(32, 1)).reshape(N, K)
    return f["D"].repeat_interleave(16, 1) * (q - 32)


def reference_matmul(x: Tensor, parts: list[tuple[int, dict[str, Tensor], int]], N: int) -> Tensor:
    """x [..., K] @ W.T by the kernel's arithmetic (gguf_kernels.c header), bit for bit: parts (ggml type, `unpack`
    fields, first output row)."""
    K = x.shape[-1]
    xs2 = x.reshape(-1, K).float()
    if any(t in RECORD for t, _, _ in parts):
        q8, dx, xs, o = quantize_activations(xs2)
    if any(t in RECORD32 for t, _, _ in parts):
        q32, dx32, xs32 = quantize_activations32(xs2)
    R = xs2.shape[0]
    y = torch.empty(R, N, dtype=torch.float32)
    for qtype, f, n0 in parts:
        q = f["q"]
        n = q.shape[0]
        acc = torch.zeros(R, n)
        if qtype in RECORD32:
            ints = torch.einsum("rbk,nbk->rnb", q32.reshape(R, -1, 32).double(), q.reshape(n, -1, 32).double()).float()
            for j in range(K // 32):
                t = f["D"][None, :, j] * dx32[:, None, j]  # RN(D_j dx_j)
                acc = _fma32(ints[..., j], t, acc)
                if "M" in f:
                    acc = _fma32(f["M"][None, :, j] * dx32[:, None, j], xs32[:, None, j].expand(R, n), acc)
        elif qtype == Q4_K:
            ints = torch.einsum("rbk,nbk->rnb", q8.reshape(R, -1, 32).double(), q.reshape(n, -1, 32).double()).float()
            for s in range(K // 256):
                a = torch.zeros(R, n)
                for j in range(8 * s, 8 * s + 8):
                    a = _fma32(ints[..., j], f["D"][None, :, j].expand(R, n), a)
                    a = _fma32(-f["M"][None, :, j].expand(R, n), xs[:, None, j].expand(R, n), a)
                acc = _fma32(a, dx[:, None, s].expand(R, n), acc)
        else:
            ints = torch.einsum("rbk,nbk->rnb", q8.reshape(R, -1, 16).double(), q.reshape(n, -1, 16).double())
            ints = (ints + o[:, None, :].double()).float()
            for s in range(K // 256):
                a = torch.zeros(R, n)
                for j in range(16 * s, 16 * s + 16):
                    a = _fma32(ints[..., j], f["D"][None, :, j].expand(R, n), a)
                acc = _fma32(a, dx[:, None, s].expand(R, n), acc)
        y[:, n0:n0 + n] = acc
    return y.reshape(*x.shape[:-1], N)


# ---- the layer ----------------------------------------------------------------------------------------------------

class _Part(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("N", ctypes.c_int), ("n0", ctypes.c_int), ("pad", ctypes.c_int),
                ("w", ctypes.c_void_p)]


class _Desc(ctypes.Structure):
    """gguf_kernels.c's gg_desc_t."""

    _fields_ = [("nparts", ctypes.c_int), ("K", ctypes.c_int), ("part", _Part * MAX_PARTS)]


def pack_parts(tensors: list[tuple[int, np.ndarray]], K: int) -> tuple[Tensor, Tensor]:
    """GGUF tensors (ggml type, uint8 rows) stacked along the output rows -> (qweight uint8 [bytes], parts int64
    [n, 5]: type, rows, first output row, byte offset, input width)."""
    if not 1 <= len(tensors) <= MAX_PARTS:
        raise ValueError(f"{len(tensors)} parts: a GGUF layer has 1 to {MAX_PARTS}")
    blobs, table, n0, off = [], [], 0, 0
    for qtype, raw in tensors:
        if qtype in RECORD and K % 256:
            raise ValueError(f"input width {K}: a {TYPE_NAMES[qtype]} part needs whole super-blocks of 256 columns")
        b = pack(qtype, raw, K)
        blobs.append(b)
        table.append([qtype, raw.shape[0], n0, off, K])
        n0 += raw.shape[0]
        off += b.size
    return torch.from_numpy(np.concatenate(blobs)), torch.tensor(table, dtype=torch.int64)


class GGUFLinear(QLinear):
    """A linear layer on a GGUF's own Q4_K / Q6_K weights (module docstring), with an optional fp32 bias.

    A QLinear for the code that lays out and plans layers (`algo` "gguf", never tiled or re-quantized): `qweight` is
    the packed parts, `scales` empty (the scales live in the panels)."""

    def __init__(self, qweight: Tensor, parts: Tensor, bias: Tensor | None = None):
        nn.Module.__init__(self)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", torch.empty(0))
        self.register_buffer("parts", parts.to(torch.int64).contiguous())
        if bias is not None:
            self.register_buffer("bias", bias.float().contiguous())
        else:
            self.bias = None
        self.algo, self.act8, self.blocks_a8, self.tiled, self.group_size = "gguf", False, False, True, 0
        self.in_features = int(parts[0, 4])
        self.out_features = int(parts[:, 1].sum())
        self._desc: tuple[int, _Desc] | None = None

    def _table(self) -> list[tuple[int, int, int, int]]:
        return [tuple(int(v) for v in row[:4]) for row in self.parts.tolist()]

    def desc_ptr(self) -> int:
        """The address of this layer's gg_desc_t, rebuilt when `qweight` moved (quant.to_hugepages)."""
        base = self.qweight.data_ptr()
        if self._desc is None or self._desc[0] != base:
            d = _Desc(len(self.parts), self.in_features)
            for i, (qtype, n, n0, off) in enumerate(self._table()):
                d.part[i] = _Part(qtype, n, n0, 0, base + off)
            self._desc = (base, d)
        return ctypes.addressof(self._desc[1])

    def fields(self) -> list[tuple[int, dict[str, Tensor], int]]:
        out = []
        for qtype, n, n0, off in self._table():
            size = -(-n // 16) * panel_bytes(qtype, self.in_features)
            out.append((qtype, unpack(qtype, self.qweight[off:off + size], n, self.in_features), n0))
        return out

    @property
    def weight(self) -> Tensor:
        """The fp32 weight [N, K] as gguf.quants dequantizes it."""
        return torch.cat([dequantize_part(t, f) for t, f, _ in self.fields()])

    def reference(self, x: Tensor) -> Tensor:
        """x @ W.T as the kernel computes it, in torch (`reference_matmul`)."""
        return reference_matmul(x, self.fields(), self.out_features).to(x.device)

    def dequant_kernel(self, part: int) -> Tensor:
        """Part `part`'s weights decoded by the C kernel library (gguf_dequant), for the tests."""
        lib = kernels._load()
        if lib is None:
            raise RuntimeError("no kernel library on this path")
        _, n, _, _ = self._table()[part]
        out = torch.empty(n, self.in_features, dtype=torch.float32)
        lib.gguf_dequant(self.desc_ptr(), part, out.data_ptr())
        return out

    def rows(self, idx: Tensor) -> GGUFLinear:
        """Output rows `idx` as a GGUF layer of their own (a reduced-vocabulary head: the draft's, Medusa's proposal
        vocabulary): each row's bytes gathered from its panel lanes into new panels, nothing decoded or rounded."""
        table = self._table()
        if len(table) != 1:
            raise ValueError(f"rows of a GGUF layer of {len(table)} parts: a reduced head is one tensor's rows")
        qtype, n, _, _ = table[0]
        idx = idx.to(torch.int64).reshape(-1)
        if idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= n:
            raise ValueError(f"rows: indices must lie in 0..{n - 1} and not be empty")
        K, P, m = self.in_features, -(-n // 16), idx.numel()
        nrec = K // 32 if qtype in RECORD32 else K // 256
        r = self.qweight.reshape(P, nrec, -1)
        Pm = -(-m // 16)
        out, off = [], 0
        for size, w in LANE_SECTIONS[qtype]:  # (bytes, bytes per lane per group of 16 lanes)
            g = size // (16 * w)
            sec = r[..., off:off + size].reshape(P, nrec, g, 16, w).permute(0, 3, 1, 2, 4).reshape(P * 16, nrec, g, w)
            sel = torch.zeros(Pm * 16, nrec, g, w, dtype=torch.uint8)
            sel[:m] = sec[idx]
            out.append(sel.reshape(Pm, 16, nrec, g, w).permute(0, 2, 3, 1, 4).reshape(Pm, nrec, g * 16 * w))
            off += size
        packed = torch.cat(out, -1).reshape(-1).contiguous()
        parts = torch.tensor([[qtype, m, 0, 0, K]], dtype=torch.int64)
        return GGUFLinear(packed, parts, None if self.bias is None else self.bias[idx])

    def rowmajor(self):
        raise ValueError("GGUF weights have no row-major int4 / int8 form")

    def extra_repr(self) -> str:
        kinds = "+".join(f"{TYPE_NAMES.get(t, t)}x{n}" for t, n, _, _ in self._table())
        return f"{self.in_features}, {self.out_features}, gguf {kinds}"


# ---- from a GGUF file to the runtime's layers ---------------------------------------------------------------------

def gguf_layers(path, num_layers: int, log=print) -> dict[str, Tensor]:
    """The runtime's linear layers (and LM head) from a GGUF file, as `P.gguf_w` + `P.gguf_parts` entries of an
    engine state dict, with a report of Q4_K sub-blocks whose exact weights the GGUF rounds (`q4k_exact`)."""
    from gguf import GGUFReader  # lazy: the gguf package (~0.1 s) only when a GGUF file is read

    reader = GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    heads = rope_heads(reader)

    def tensor(name: str) -> tuple[int, np.ndarray]:
        if name not in by_name:
            raise ValueError(f"{path}: no tensor {name!r} in the GGUF")
        t = by_name[name]
        raw = np.asarray(t.data)
        kind = name.rsplit(".", 2)[-2]
        if heads and kind in ("attn_q", "attn_k"):  # whole rows of blocks: reordering them requantizes nothing
            raw = raw[unpermute_rows(raw.shape[0], heads[0] if kind == "attn_q" else heads[1])]
        return int(t.tensor_type), raw

    groups = {"lm_head": ["output.weight"]}
    for i in range(num_layers):
        b = f"blk.{i}."
        groups.update({f"layers.{i}.wqkv": [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
                       f"layers.{i}.wo": [b + "attn_output.weight"],
                       f"layers.{i}.w13": [b + "ffn_gate.weight", b + "ffn_up.weight"],
                       f"layers.{i}.w2": [b + "ffn_down.weight"]})
    if "output.weight" not in by_name:  # a tied head: the embedding's matrix, multiplied as its own copy
        groups["lm_head"] = ["token_embd.weight"]
    out: dict[str, Tensor] = {}
    exact = total = 0
    for prefix, names in groups.items():
        ts = [tensor(n) for n in names]
        bad = [n for n, (t, _) in zip(names, ts) if t not in SUPPORTED]
        if bad:
            raise ValueError(f"{path}: tensor {bad[0]} is {by_name[bad[0]].tensor_type.name}, which quantization gguf "
                             f"has no kernel for (it runs {', '.join(TYPE_NAMES.values())}); use quantization: "
                             "int4_a8 or none for this model")
        K = int(by_name[names[0]].shape[0])
        for (t, raw) in ts:
            if t == Q4_K:
                e, n = q4k_exact(raw)
                exact, total = exact + e, total + n
        out[prefix + ".gguf_w"], out[prefix + ".gguf_parts"] = pack_parts(ts, K)
    log(f"GGUF weights: {exact}/{total} Q4_K sub-blocks exact in fp32 as the GGUF rounds them"
        + ("" if exact == total else f" ({total - exact} hold values the GGUF rounds, by under half an ulp: "
                                      "the kernel multiplies by the exact ones)"))
    return out


def rope_heads(reader) -> tuple[int, int] | None:
    """(heads, kv heads) where the GGUF's attn_q / attn_k rows are in llama.cpp's interleaved RoPE order (its llama
    converter permutes them; Qwen2's does not), else None."""
    arch, heads = reader.fields.get("general.architecture"), reader.fields.get("llama.attention.head_count")
    if arch is None or arch.contents() != "llama" or heads is None:
        return None  # (a llama file without head counts fails gguf_state's check against the checkpoint)
    h = int(heads.contents())
    kv = reader.fields.get("llama.attention.head_count_kv")
    return h, int(kv.contents()) if kv is not None else h


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's permute(w, heads): gguf[i] = hf[perm[i]], so hf = gguf[argsort(perm)]."""
    perm = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    return np.argsort(perm)


def gguf_bytes(path) -> tuple[int, int]:
    """(bytes of the GGUF's tensors, of them the token embedding's): what `bytes per token` is held against."""
    from gguf import GGUFReader  # lazy: the gguf package (~0.1 s) only when a GGUF file is read

    reader = GGUFReader(str(path))
    total = sum(int(t.n_bytes) for t in reader.tensors)
    embd = sum(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    return total, embd


def gguf_state(runtime: dict[str, Tensor], path, num_layers: int, log=print) -> dict[str, Tensor]:
    """An engine state dict on the GGUF's own weights: `runtime` (hf_to_runtime of the dequantized checkpoint, for the
    norms and biases) with every linear layer and the head replaced by `gguf_layers`, and the embedding the GGUF's own
    dequantized rows in fp32 (a lookup: its bytes are not read per token). The parts' row order is checked against the
    dequantized checkpoint's matrices (layer 0 and the head, at that checkpoint's precision)."""
    from gguf import GGUFReader  # lazy: the gguf package (~0.1 s) only when a GGUF file is read

    out = {k: v for k, v in runtime.items() if not LINEAR.match(k)}
    layers = gguf_layers(path, num_layers, log)
    for prefix in ("layers.0.wqkv", "layers.0.w13", "layers.0.w2", "lm_head"):
        want = runtime.get(prefix + ".weight", runtime["embed.weight"] if prefix == "lm_head" else None)
        got = GGUFLinear(layers[prefix + ".gguf_w"], layers[prefix + ".gguf_parts"]).weight
        if want is None or not torch.equal(got[:256].to(want.dtype), want[:256]):
            raise ValueError(f"{path}: {prefix} from the GGUF's blocks differs from the dequantized checkpoint "
                             "(tensor order or layout): refusing to build on it")
    out.update(layers)
    t = {x.name: x for x in GGUFReader(str(path)).tensors}["token_embd.weight"]
    raw = np.asarray(t.data)
    out["embed.weight"] = torch.from_numpy(reference_dequantize(int(t.tensor_type), raw, int(t.shape[0])).copy()) \
        if int(t.tensor_type) in SUPPORTED else runtime["embed.weight"].float()
    return out
