"""Weight-only quantization for the torch runtime (TensorRT-LLM's W8A16 and W4A16).

Decoding reads every weight once per token, so bytes per weight set the speed. `int8` keeps one fp32
scale per output row (symmetric, q in [-127, 127]); `int4` keeps one bf16 scale per `group_size`
input columns of each row (q in [-8, 7] against the bf16-rounded scale, which may be negative, stored as q + 8 in a
nibble; each scale searched for the least error, `quantize_int4`). bf16, as TensorRT-LLM keeps W4A16 scales in the
activation dtype: an fp32 scale per 64 weights was 11% of an int4 g64 layer's bytes, and decoding reads every byte
once per step. Activations stay fp32 between layers: the skinny kernel decodes the weights in registers (`kernels.py`,
`skinny.c`); for int4 (as for bf16 weights) it rounds each activation row to bf16 at the matmul, for vdpbf16ps.

int4 packing, per row: the first K - K % 128 columns in superblocks of 128 columns (64 bytes), read as 32
little-endian 16-bit words: word i (0..31) holds column 32m + i in nibble m (bits 4m..4m + 3, m in 0..3).
The K % 128 columns left (a multiple of 32) come in blocks of 32 columns (16 bytes = 8 words): word i
holds column 8m + i in nibble m. The AVX-512 kernel shifts a superblock's words right by 4m and looks the
low nibble up in a table of bf16(u - 8) (vpermw): 32 bf16 weights of columns 32m.. in order, as vdpbf16ps
takes them; a 32-column block is broadcast to the four 128-bit lanes, lane m shifted by 4m.

In a state dict a quantized linear `P` is `P.qweight` (int8 [N, K], or uint8 [N, K / 2] for int4)
plus `P.scales` (fp32 [N], or bf16 [N, K / group_size]) instead of `P.weight`; the format is read back from
the shapes, so loading needs no extra configuration.

bf16 weights are not quantized, but on CPU they are tiled at load (`tile_model`, never stored so): 4 rows by 32
columns at a time, [N / 4, K / 32, 4, 32], so the kernel's tiles of rows stream by as one sequential read instead of
interleaved rows. The 1.5B target's one-token matmuls ran 1.13x as fast so when memory was fast and 1.02x when it
was slow; verification and prefill about the same (skinny.c, PF_TILED1). A tiled layer is a QLinear of algo "bf16".
int4 layers are tiled the same way, 8 rows of 64-byte superblocks side by side ([N / 8, K / 128, 8, 64], K % 128 == 0;
`tile`): the 0.5B draft's one-token matmuls ran 1.06x as fast; int8 in 8 rows of 16 columns ([N / 8, K / 16, 8,
16]): the 1.5B's 1.08-1.12x when memory was fast, 1.05x when slow. Engines keep row-major weights, and
`model.float_state` gives plain ones back.

`int4_a8` (W4A8) stores the same int4 weights and scales; the kernel multiplies them by activations quantized to int8
per group at each matmul (skinny.c's WT_I4A8), by integer dot products: a fraction of W4A16's instructions, for a
draft whose numerics never change the output (the target verifies every token). On CPU its layers are laid out in
blocks of 16 rows ([ceil(N / 16), K / 8, 64] bytes, bf16 scales [ceil(N / 16), K / group_size, 16]; `tile_a8`), the
only layout the kernel reads them in, whatever `kernels.tiles()` says.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re

import torch
from torch import Tensor, nn

from pipeline.runtime import kernels

# How int4 weights are rounded (quantize_int4): /2 searches each group's scale; joins the hash with FORMAT, so engines
# rounded to nearest are rebuilt once (their layout would still load).
ROUNDING = "int4-rounding/2"
# Version of the stored int4 layout (4: bf16 scales; 3: the word-nibble orders above with fp32 scales; 2 was
# a byte order for fp32 lanes; int8 never changed). Engines record it and int4 engines join it to their
# input hash, so one in an older layout is rebuilt, never misread.
FORMAT = "qlinear/4"


def layout_tag(algo: str) -> tuple[str, ...]:
    """What joins an engine's input hash for `algo`: the int4 layout version (int8 engines keep their hash)."""
    return (FORMAT, ROUNDING) if algo in ("int4", "int4_a8") else (GGUF_FORMAT,) if algo == "gguf" else ()
ALGOS = ("int8", "int4", "int4_a8")
# TensorRT-LLM's QuantAlgo names for weight-only int8 / int4; W4A8 here is the torch runtime's int4 weights with int8
# activations (TensorRT-LLM's own W4A8_AWQ takes fp8 activations).
QUANT_ALGO = {"none": None, "int8": "W8A16", "int4": "W4A16", "int4_a8": "W4A8", "gguf": "GGUF"}
# The GGUF's own Q4_K / Q6_K weights in the kernels' panels (gguf_weights.py; torch backend on CPU only).
GGUF_FORMAT = "gguf-panels/3"  # /2: norms, biases and the embedding kept fp32; /3: Q4_K d / dmin kept fp16
GROUP_SIZES = (32, 64, 128)
# The runtime's linear layers: every matmul a decode step reads. Embeddings stay in the engine dtype
# (a row lookup reads almost nothing); a tied head is quantized as its own copy.
LINEAR = re.compile(r"^(layers\.\d+\.(wqkv|wo|w13|w2)|lm_head)\.weight$")


_NIBBLES: dict[int, tuple[Tensor, Tensor]] = {}


def nibble_columns(K: int) -> tuple[Tensor, Tensor]:
    """(column of each packed byte's low nibble, of its high nibble) for rows of K columns (module docstring)."""
    if K not in _NIBBLES:
        lo = []
        K128 = K - K % 128
        for base in range(0, K128, 128):  # byte 2i + h holds nibbles 2h, 2h + 1 of word i
            lo += [base + 64 * (j % 2) + j // 2 for j in range(64)]
        for base in range(K128, K, 32):
            lo += [base + 16 * (j % 2) + j // 2 for j in range(16)]
        lo_t = torch.tensor(lo)
        _NIBBLES[K] = (lo_t, lo_t + torch.where(lo_t < K128, 32, 8))
    return _NIBBLES[K]


def unpack_int4(qweight: Tensor) -> Tensor:
    """uint8 [N, K / 2] packed int4 -> u = q + 8, uint8 [N, K]."""
    N, half = qweight.shape
    lo, hi = nibble_columns(2 * half)
    u = torch.empty(N, 2 * half, dtype=torch.uint8, device=qweight.device)
    u[:, lo.to(qweight.device)], u[:, hi.to(qweight.device)] = qweight & 15, qweight >> 4
    return u


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (q int8 [N, K], scale fp32 [N]) with w ~= q * scale[:, None]."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4(w: Tensor, group_size: int, importance: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (packed uint8 [N, K / 2], scale bf16 [N, K / group_size]) with w ~= (u - 8) * scale, u in 0..15.

    Each group's scale is the one of least squared error, weighted by `importance` [K] where given (the mean square of
    the layer's inputs by column, `model.linear_input_power`), among SCALE_STEPS times the largest weight over 7 or
    over -8 (_search_scales); each weight then rounds to its nearest level. The largest weight over 7 is plain nearest
    rounding (q in [-7, 7]), so no group is rounded worse than that. On the 0.5B draft (experiments/draft_quant.py,
    2026-12-06) top-1 agreement with the target went from 0.891 (nearest) to 0.894 unweighted and 0.902 weighted by
    its inputs (fp32: 0.911)."""
    N, K = w.shape
    if group_size not in GROUP_SIZES or K % group_size:
        raise ValueError(f"group_size {group_size}: int4 needs one of {GROUP_SIZES} dividing the input width {K} "
                         "of every linear layer; pick a group_size that divides it or use quantization: int8")
    if importance is not None and importance.shape != (K,):
        raise ValueError(f"importance: got shape {tuple(importance.shape)}, expected ({K},): one value per input "
                         "column")
    wg = w.detach().float().view(N, K // group_size, group_size)
    imp = None if importance is None else importance.detach().float().view(1, K // group_size, group_size)
    rows = max(1, SEARCH_ELEMENTS // K)  # the search's temporaries stay bounded on a 65,536-row head
    scale = torch.cat([_search_scales(wg[i:i + rows], imp) for i in range(0, N, rows)])
    u = (torch.round(wg / scale[..., None]).clamp_(-8, 7).to(torch.int16).view(N, K) + 8).to(torch.uint8)
    return _pack4(u), scale.bfloat16().contiguous()


def _pack4(u: Tensor) -> Tensor:
    """u = q + 8, uint8 [N, K] -> the packed int4 rows (module docstring)."""
    lo, hi = nibble_columns(u.shape[1])
    return (u[:, lo.to(u.device)] | (u[:, hi.to(u.device)] << 4)).contiguous()


SCALE_STEPS = (1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.825, 0.8, 0.775, 0.75, 0.725, 0.7)
SEARCH_ELEMENTS = 1 << 23  # weights a scale search holds at once (a few temporaries of 32 MB)


def _search_scales(wg: Tensor, imp: Tensor | None, lo: int = -8, hi: int = 7) -> Tensor:
    """Per group of wg [N, G, gs], the bf16-representable scale s (q = round(w / s) in [lo, hi]: int4's [-8, 7]) of
    least sum imp * (w - q s)^2. Candidates: the group's signed largest weight m times each of SCALE_STEPS, over hi (m
    takes level hi) or over lo (m takes level lo, the extra negative level: a finer step); a step below 1 clips the few
    largest weights to resolve the rest finer. The first candidate (m / hi) is nearest rounding; ties keep the earlier
    candidate. An all-zero group gets scale 1 (every q 0)."""
    m = wg.gather(2, wg.abs().argmax(dim=2, keepdim=True))[..., 0]
    best = err_best = None
    for f in SCALE_STEPS:
        for base in (m / hi, m / lo):
            s = (base * f).bfloat16().float()
            s = torch.where(s == 0, torch.ones_like(s), s)  # a zero group (or a scale below bf16's range)
            e = (wg - torch.round(wg / s[..., None]).clamp_(lo, hi) * s[..., None]).square_()
            e = (e * imp).sum(2) if imp is not None else e.sum(2)
            if best is None:
                best, err_best = s, e
            else:
                take = e < err_best
                best, err_best = torch.where(take, s, best), torch.where(take, e, err_best)
    return best


def dequantize(qweight: Tensor, scales: Tensor) -> Tensor:
    """The fp32 weight [N, K] a quantized pair stands for (each element rounded once, as the kernel does); a tiled
    bf16 weight's row-major bf16 matrix. A W4A8 block layout gives its padded rows too (QLinear.weight drops them)."""
    if qweight.dim() == 3:
        qweight, scales = untile_a8(qweight, scales)
    if qweight.dim() == 4:
        qweight = untile(qweight)
    if qweight.dtype == torch.int8:
        return qweight.float() * scales[:, None]
    if qweight.dtype == torch.bfloat16:
        return qweight
    K = qweight.shape[1] * 2
    return (unpack_int4(qweight).float() - 8.0) * scales.float().repeat_interleave(K // scales.shape[1], dim=1)


# Tile shape per storage dtype: (rows, stored elements of a row per block), as skinny.c reads them: bf16 4 x 32 (TROWS),
# int8 8 x 16, packed int4 8 x 64 bytes (one 128-column superblock).
TILES = {torch.bfloat16: (4, 32), torch.int8: (8, 16), torch.uint8: (8, 64)}


def tileable(q: Tensor) -> bool:
    """A 2-D bf16 / int8 / packed int4 matrix that fills whole tiles."""
    if q.dim() != 2 or q.dtype not in TILES:
        return False
    rows, cols = TILES[q.dtype]
    return q.shape[0] % rows == 0 and q.shape[1] % cols == 0


def tile(q: Tensor) -> Tensor:
    """[N, C] -> [N / rows, C / cols, rows, cols] (TILES): each tile's rows side by side, block after block, as the
    kernel reads them."""
    rows, cols = TILES[q.dtype]
    N, C = q.shape
    return q.detach().reshape(N // rows, rows, C // cols, cols).transpose(1, 2).contiguous()


def untile(t: Tensor) -> Tensor:
    """The row-major [N, C] matrix of a tiled one."""
    nt, nb, rows, cols = t.shape
    return t.transpose(1, 2).reshape(nt * rows, nb * cols)


A8_ROWS = 16  # rows per W4A8 block: one int32 lane each in the AVX-512 kernel


def tile_a8(qweight: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """Row-major int4 (packed [N, K / 2], bf16 scales [N, K / gs]) -> the W4A8 kernel's blocks of 16 rows (module
    docstring), zero rows padding the last block: byte 4 l + j of chunk c of a block holds row l's columns 8c + j (low
    nibble) and 8c + 4 + j (high nibble)."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    Np = -(-N // A8_ROWS) * A8_ROWS
    u = unpack_int4(qweight)
    sc = scales.bfloat16()
    if Np != N:
        u = torch.cat([u, torch.full((Np - N, K), 8, dtype=torch.uint8, device=u.device)])
        sc = torch.cat([sc, torch.zeros(Np - N, sc.shape[1], dtype=sc.dtype, device=sc.device)])
    u = u.view(Np // A8_ROWS, A8_ROWS, K // 8, 2, 4)
    packed = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).transpose(1, 2)  # [blocks, K / 8, 16 rows, 4 bytes]
    blocks = packed.reshape(Np // A8_ROWS, K // 8, 4 * A8_ROWS).contiguous()
    return blocks, sc.view(Np // A8_ROWS, A8_ROWS, -1).transpose(1, 2).contiguous()


def untile_a8(blocks: Tensor, scales: Tensor, rows: int | None = None) -> tuple[Tensor, Tensor]:
    """The row-major int4 pair of a W4A8 block layout (its first `rows` rows; default all, padding included)."""
    nb, chunks, _ = blocks.shape
    b = blocks.view(nb, chunks, A8_ROWS, 4).transpose(1, 2)  # [blocks, 16 rows, K / 8, 4]
    u = torch.stack([b & 15, b >> 4], dim=3).reshape(nb * A8_ROWS, chunks * 8)
    sc = scales.transpose(1, 2).reshape(nb * A8_ROWS, -1)
    rows = nb * A8_ROWS if rows is None else rows
    K = chunks * 8
    lo, hi = nibble_columns(K)
    u = u[:rows]
    packed = u[:, lo.to(u.device)] | (u[:, hi.to(u.device)] << 4)
    return packed.contiguous(), sc[:rows].contiguous()


def a8_reference(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    """x [..., K] @ W.T as the W4A8 kernel computes it (skinny.c, tile_a8), for row-major int4 weights: activations
    quantized per group, exact integer group sums, then acc = s_w * s_x * sum + acc group after group. The kernel fuses
    that multiply-add (one rounding); here it is rounded twice via float64, so the two agree within an ulp or so (the
    torch fallback and the tests' reference)."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    ng = scales.shape[1]
    gs = K // ng
    xs = x.reshape(-1, K).float()
    xs = torch.where(xs.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(xs), xs)  # denormals read as zero
    g = xs.view(-1, ng, gs)
    m = g.abs().amax(dim=-1)
    bad = ~torch.isfinite(g).all(dim=-1)
    zero = (m < 1e-30) & ~bad
    safe = torch.where(zero | bad, torch.ones_like(m), m)
    q = torch.round(g * (torch.tensor(127.0) / safe)[..., None])
    q = torch.where((zero | bad)[..., None], torch.zeros_like(q), q)
    sx = torch.where(zero, torch.zeros_like(m), torch.where(bad, torch.full_like(m, float("nan")), m / 127.0))
    w = (unpack_int4(qweight).float() - 8.0).view(N, ng, gs).to(xs.device)
    out = torch.empty(xs.shape[0], N, dtype=torch.float32, device=xs.device)
    step = max(1, (1 << 24) // (N * ng))  # rows at a time: the group sums of a prefill would not fit at once
    for r0 in range(0, xs.shape[0], step):
        ints = torch.einsum("rgk,ngk->rng", q[r0:r0 + step], w)  # exact: every partial sum is an integer below 2^24
        s = scales.float().to(xs.device)[None] * sx[r0:r0 + step, None, :]
        acc = torch.zeros(ints.shape[0], N, dtype=torch.float64, device=xs.device)
        for j in range(ng):
            acc = (ints[..., j].double() * s[..., j].double() + acc).float().double()
        out[r0:r0 + step] = acc.float()
    return out.view(*x.shape[:-1], N)


def algo_of(qweight: Tensor) -> str:
    return {torch.int8: "int8", torch.uint8: "int4", torch.bfloat16: "bf16"}[qweight.dtype]


class QLinear(nn.Module):
    """A linear layer holding quantized (or tiled bf16) weights and an optional fp32 bias; the kernels decode them in
    registers. `act8`: int4 weights whose matmuls quantize the activations to int8 (W4A8); on CPU such a layer is held
    in the kernel's 16-row blocks (3-D `qweight`, see tile_a8), `out_features` giving the rows without the padding."""

    def __init__(self, qweight: Tensor, scales: Tensor | None, bias: Tensor | None = None, act8: bool = False,
                 out_features: int | None = None):
        super().__init__()
        if qweight.dtype not in (torch.int8, torch.uint8, torch.bfloat16):
            raise ValueError(f"qweight dtype {qweight.dtype}: expected int8 (int8), uint8 (packed int4) or bfloat16 "
                             "(tiled, see tile)")
        if qweight.dtype == torch.bfloat16 and qweight.dim() != 4:
            raise ValueError(f"a bf16 qweight is tiled [N / 4, K / 32, 4, 32] (quant.tile), not {list(qweight.shape)}")
        if act8 and qweight.dtype != torch.uint8:
            raise ValueError(f"int8 activations (W4A8) need int4 weights, not {algo_of(qweight)}")
        self.register_buffer("qweight", qweight.contiguous())
        # int4 scales are bf16 (the kernel reads them so), int8 ones fp32; tiled bf16 has none (an empty buffer).
        if qweight.dtype == torch.bfloat16:
            scales = torch.empty(0, device=qweight.device)
        self.register_buffer("scales", (scales.float() if qweight.dtype != torch.uint8 else
                                        scales.bfloat16()).contiguous())
        # Qwen2's q/k/v bias stays fp32 and is added outside the matmul (by rope_write on the fast path).
        if bias is not None:
            self.register_buffer("bias", bias.float().contiguous())
        else:
            self.bias = None
        self.algo = algo_of(qweight)
        self.blocks_a8 = qweight.dim() == 3  # W4A8's 16-row blocks (tile_a8)
        self.act8 = act8 or self.blocks_a8
        self.tiled = qweight.dim() in (3, 4)  # bf16 always; int8 / int4 once tile_model ran
        s = qweight.shape
        if self.blocks_a8:
            self.out_features, self.in_features = out_features or s[0] * A8_ROWS, s[1] * 8
        else:
            self.out_features, stored = (s[0] * s[2], s[1] * s[3]) if self.tiled else (s[0], s[1])
            self.in_features = stored * (2 if self.algo == "int4" else 1)
        self.group_size = self.in_features // scales.shape[1] if self.algo == "int4" else 0

    @property
    def weight(self) -> Tensor:
        """Dequantized fp32 (tiled: row-major bf16) weight, for code that needs the matrix itself (training, the torch
        fallback)."""
        return dequantize(self.qweight, self.scales)[: self.out_features]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def rowmajor(self) -> tuple[Tensor, Tensor]:
        """(qweight, scales) row-major, as an engine stores them (int8 / int4; tiled bf16: the bf16 weight and None)."""
        if self.blocks_a8:
            return untile_a8(self.qweight, self.scales, self.out_features)
        return (untile(self.qweight) if self.tiled else self.qweight), self.scales

    def rows(self, idx: Tensor) -> QLinear | Tensor:
        """The layer restricted to output rows `idx` (a reduced-vocabulary head), still quantized and in the same
        layout (tiled bf16: tiled again when the rows fill whole tiles, else a row-major bf16 weight)."""
        q, sc = self.rowmajor()
        if self.algo == "bf16":
            w = q[idx].contiguous()
            return QLinear(tile(w), None) if tileable(w) and self.bias is None else w
        sub = QLinear(q[idx], sc[idx], None if self.bias is None else self.bias[idx], act8=self.act8)
        if self.blocks_a8:
            return QLinear(*tile_a8(sub.qweight, sub.scales), sub.bias, out_features=sub.out_features)
        return QLinear(tile(sub.qweight), sub.scales, sub.bias) if self.tiled and tileable(sub.qweight) else sub

    def linear_a8(self, x: Tensor) -> Tensor:
        """x @ W.T as the W4A8 kernel computes it, in torch (a8_reference): for devices or machines without the
        kernel."""
        q, sc = self.rowmajor()
        return a8_reference(x, q, sc)

    def forward(self, x: Tensor) -> Tensor:
        y = kernels.linear(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"{self.in_features}, {self.out_features}, {self.algo}{', int8 activations' if self.act8 else ''}{g}"


def head_rows(layer: nn.Module, idx: Tensor):
    """Output rows `idx` of a linear layer as the kernels take them (a reduced-vocabulary head)."""
    return layer.rows(idx) if isinstance(layer, QLinear) else layer.weight[idx].contiguous()


def quantize_head(weight: Tensor, algo: str, group_size: int = 128,
                  importance: Tensor | None = None) -> dict[str, Tensor]:
    """A reduced-vocabulary draft head's tensors for draft_head.safetensors: `weight`, or `qweight` + `scales`."""
    if algo == "none":
        return {"weight": weight.contiguous()}
    q, s = quantize(weight, algo, group_size, importance)
    return {"qweight": q, "scales": s}


def quantize(w: Tensor, algo: str, group_size: int = 128,
             importance: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(qweight, scales) as an engine stores them; int4_a8 stores int4 weights (the activations are quantized at run
    time). `importance`: int4's scale search weights (quantize_int4); int8 keeps its row scale."""
    if algo == "int8":
        return quantize_int8(w)
    if algo in ("int4", "int4_a8"):
        return quantize_int4(w, group_size, importance)
    raise ValueError(f"quantization {algo!r}: the torch runtime quantizes int8, int4 or int4_a8 (or none)")


def quantize_state(state: dict[str, Tensor], algo: str, group_size: int = 128,
                   tie_embeddings: bool | None = None,
                   importance: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """A runtime-layout state dict with every linear weight (and the LM head) quantized.

    `algo` 'none' returns the state unchanged. With tied embeddings (`tie_embeddings`, or no
    `lm_head.weight` in the state) the head is quantized from the embedding, which stays for lookup. `importance`: per
    layer name ("layers.3.w13", "lm_head"), its inputs' mean square by column (model.linear_input_power), for int4's
    scale search.
    """
    importance = importance or {}
    if algo == "none":
        return dict(state)
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        if LINEAR.match(k):
            q, s = quantize(v, algo, group_size, importance.get(k[: -len(".weight")]))
            out[k[: -len(".weight")] + ".qweight"], out[k[: -len(".weight")] + ".scales"] = q, s
        else:
            out[k] = v
    tied = tie_embeddings if tie_embeddings is not None else "lm_head.weight" not in state
    if tied and "lm_head.qweight" not in out and "embed.weight" in state:
        out["lm_head.qweight"], out["lm_head.scales"] = quantize(state["embed.weight"], algo, group_size,
                                                                 importance.get("lm_head"))
    return out


def cast_state(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Cast the unquantized tensors of a state dict to `dtype`; quantized pairs keep their storage dtypes."""
    keep = (".qweight", ".scales", ".gguf_w", ".gguf_parts")
    return {k: (v if k.endswith(keep) else v.to(dtype)).contiguous() for k, v in state.items()}


def quantize_model(model: nn.Module, algo: str, group_size: int = 128,
                   importance: dict[str, Tensor] | None = None) -> nn.Module:
    """Replace every runtime linear layer of a built Transformer (and its LM head) by a QLinear, in place; bf16 layers
    tiled at load are quantized from their weights too, and the new layers are laid out as `build_model` would.
    `importance`: as quantize_state's."""
    if algo == "none":
        return model
    importance = importance or {}
    for name, mod in list(model.named_modules()):
        plain = isinstance(mod, nn.Linear) or isinstance(mod, QLinear) and mod.algo == "bf16"
        if plain and LINEAR.match(name + ".weight"):
            parent, _, leaf = name.rpartition(".")
            q, s = quantize(mod.weight, algo, group_size, importance.get(name))
            layer = QLinear(q, s, mod.bias, act8=algo == "int4_a8")
            setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    if model.embed.weight.device.type == "cpu" and kernels.available():
        tile_model(model)
    return model


def tile_model(model: nn.Module, tiles: bool | None = None) -> int:
    """Lay out every runtime linear layer (and the LM head; a tied one gets its own copy, the embedding stays for
    lookup) in place for the CPU kernels; returns the number changed. W4A8 layers always go to their 16-row blocks
    (tile_a8: the one layout the kernel reads them in); bf16, int8 and int4 layers are tiled when `tiles` (default
    `kernels.tiles()`), and widths that do not fill whole tiles stay row-major."""
    tiles = kernels.tiles() if tiles is None else tiles
    n = 0
    for name, mod in list(model.named_modules()):
        if not LINEAR.match(name + ".weight"):
            continue
        if isinstance(mod, QLinear) and mod.act8 and not mod.blocks_a8:
            layer = QLinear(*tile_a8(mod.qweight, mod.scales), mod.bias, out_features=mod.out_features)
        elif not tiles or isinstance(mod, QLinear) and mod.act8:
            continue
        elif isinstance(mod, nn.Linear) and tileable(mod.weight):
            layer = QLinear(tile(mod.weight), None, mod.bias)
        elif isinstance(mod, QLinear) and tileable(mod.qweight):
            layer = QLinear(tile(mod.qweight), mod.scales, mod.bias)
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
        n += 1
    if n:
        kernels.weights_moved()
    return n


def untile_model(model: nn.Module, tie_embeddings: bool = False) -> int:
    """Turn every tiled bf16 layer back into a row-major nn.Linear (with `tie_embeddings`, the head shares the
    embedding again) and every tiled int8 / int4 one (W4A8 blocks too) into a row-major QLinear, in place; returns the
    number untiled."""
    n = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QLinear) and mod.algo in ("int4", "int8") and mod.tiled:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf,
                    QLinear(*mod.rowmajor(), mod.bias, act8=mod.act8))
            n += 1
        elif isinstance(mod, QLinear) and mod.algo == "bf16":
            parent, _, leaf = name.rpartition(".")
            with torch.device("meta"):
                lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            if tie_embeddings and name == "lm_head":
                lin.weight = model.embed.weight
            else:
                lin.weight = nn.Parameter(mod.weight.contiguous(), requires_grad=False)
            if mod.bias is not None:
                lin.bias = nn.Parameter(mod.bias, requires_grad=False)
            setattr(model.get_submodule(parent) if parent else model, leaf, lin)
            n += 1
    if n:
        kernels.weights_moved()
    return n


def fit_group_size(widths: list[int], group_size: int) -> int | None:
    """`group_size` if it divides every input width, else the largest of GROUP_SIZES that does (None: none)."""
    for g in [group_size, *sorted(GROUP_SIZES, reverse=True)]:
        if g in GROUP_SIZES and all(w % g == 0 for w in widths):
            return g
    return None


def quant_config(algo: str, group_size: int) -> dict:
    """`pretrained_config.quantization` as TensorRT-LLM writes it."""
    return {"quant_algo": QUANT_ALGO[algo], "group_size": group_size, "kv_cache_quant_algo": None}


def int8_activations(config: dict) -> bool:
    """Whether an engine config.json asks for int8 activations (`quant_algo` W4A8)."""
    q = (config.get("pretrained_config") or {}).get("quantization") or {}
    return q.get("quant_algo") == QUANT_ALGO["int4_a8"]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight a decode step reads (parameters and quantized buffers, shared ones once)."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


HUGE_PAGE = 2 << 20


def to_hugepages(model: nn.Module, min_bytes: int = 64 << 10) -> int:
    """Move a CPU model's weights (each of `min_bytes` or more) into one anonymous mapping advised for 2 MB pages;
    returns the bytes moved.

    Decoding streams every weight once per step, and with 4 KB pages part of it goes to TLB misses: the bf16
    Qwen2.5-Coder-1.5B target's one-token step took 79 ms on 4 KB pages and 75 ms on huge pages (2 threads,
    same run). The weights are packed (4 KB apart) into one mapping whose start is 2 MB aligned: a mapping per
    tensor left every weight smaller than a few MB (all of the int4 draft's layers) on 4 KB pages, since a
    huge page needs an aligned 2 MB range inside one mapping. `hugepage_bytes()` says how much of the process
    really is on them. Shared (tied) tensors stay shared, and each moved tensor has its own storage (so
    safetensors can still save them). `PIPELINE_HUGEPAGES=0` turns it off; where madvise is not available
    the weights stay where they are.
    """
    if os.environ.get("PIPELINE_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    slots: dict[int, list[tuple[dict, str]]] = {}
    tensors: dict[int, Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or t.numel() * t.element_size() < min_bytes:
                    continue
                key = t.data_ptr()
                tensors.setdefault(key, t)
                slots.setdefault(key, []).append((table, name))
    if not tensors:
        return 0
    sizes = {key: t.numel() * t.element_size() for key, t in tensors.items()}
    span = sum((n + 4095) & ~4095 for n in sizes.values())
    try:
        region, at = _hugepage_region(span)
    except (OSError, ValueError) as e:  # pragma: no cover - platform dependent
        logging.getLogger("pipeline.kernels").info("huge pages not available for the weights: %s", e)
        return 0
    for key, t in tensors.items():
        n = sizes[key]
        view = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=at).view(t.dtype).view(t.shape)
        view.copy_(t)
        at += (n + 4095) & ~4095
        for table, name in slots[key]:
            old = table[name]
            if isinstance(old, nn.Parameter):
                old.data = view  # every module holding this Parameter (a tied head) sees the move
            else:
                table[name] = view
    kernels.weights_moved()
    return sum(sizes.values())


def _hugepage_region(nbytes: int) -> tuple[mmap.mmap, int]:
    """A mapping advised for 2 MB pages with room for `nbytes`, and the offset in it of its first 2 MB boundary."""
    # Private: a shared anonymous mapping is shmem, which follows shmem_enabled (often "never") and so
    # silently got 4 KB pages on this machine; private anonymous memory follows THP's "madvise".
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    region.madvise(mmap.MADV_HUGEPAGE)
    return region, -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE


def hugepage_tensor(nbytes: int) -> Tensor:
    """A uint8 tensor of `nbytes` on 2 MB pages where Linux gives them (plain memory where madvise fails)."""
    try:
        region, at = _hugepage_region(nbytes)
    except (OSError, ValueError, AttributeError):  # pragma: no cover - platform dependent
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=at)


def proc_bytes(path: str, field: str) -> int:
    """A `field: N kB` line of a /proc file, in bytes (0 where the file or the field is absent)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def hugepage_bytes() -> int:
    """Bytes of this process's anonymous memory on transparent huge pages (0 where Linux does not say)."""
    return proc_bytes("/proc/self/smaps_rollup", "AnonHugePages")


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode for anonymous memory ("always", "madvise", "never" or "")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""
