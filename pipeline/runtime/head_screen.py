"""The exact greedy head on fewer bytes: a Q4_K screen of a GGUF head's rows, then the rows it cannot rule out.

Greedy decoding needs only each token row's argmax over the vocabulary, and the head is the largest single read of a
step (the 1.5B flagship's Q6_K head: 193 MB of its 1,000 MB). The screen is the same head rounded to Q4_K (135 MB
in the kernels' panels), multiplied by the same Q4_K / Q6_K kernel, and for every vocabulary row j a bound on how far
its screened score s_j can lie from the logit r_j the head's own kernel computes:

    |r_j - s_j| <= |W_j| (|a - a'| + 2 tol m) + |W_j - Q_j| (|a'| + tol m)

W_j the GGUF row as the head's kernel multiplies it, Q_j the screen's row as its kernel does, a and a' the token's
hidden state as each kernel quantizes it to int8 (the same for a k-quant head: both quantize per 256 columns), m
the larger of their norms, and tol (SUM_TOL) both kernels' fp32 rounding with room to spare. skinny.c's
screen_bounds repeats the kernels' quantization (RN(x RN(127 / max)) steps of RN(max / 127) a group); `build`
raises |W_j| and |W_j - Q_j| past their own rounding. So a row whose s_j plus its bound falls below an exact logit
L of that token cannot be its argmax.

`logits` is one C call (skinny.c's screen_head): the screen's matmul; each 16-row panel's largest score; the panel
of each token's best score computed exactly (L: the token's largest logit there); the panels whose largest score
plus their largest bound coefficients (`pwn`, `pdn`) could reach L, and of those the ones holding a row whose own
bound could; those computed with the head's own kernel (the same bits the full head gives those rows: its rows are
independent), -inf everywhere else. Its argmax, the first largest value, is the full head's: every row that could
equal or beat the best is among those computed. On the flagship's answers a token leaves about 5 panels to compute.

It only serves greedy picks: sampling and the training's recorded logits read the full head
(`Transformer.logits(..., greedy=False)`), and so do more than `max_rows()` token rows (the screen's arithmetic then
costs more than its bytes save: 6 on the AVX-512 tiles, 3 on the AVX2 passes), hidden states that are not
finite, and tokens that leave more than MAX_PANEL_SHARE of the panels. Built at load
(`Transformer.attach_head_screen`, 6.6 s for the flagship's head on 2 cores) and kept beside the engine for the
next process and load (`build`'s cache_dir).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from pipeline.runtime import kernels
from pipeline.runtime.gguf_weights import (
    Q4_K,
    Q5_0,
    Q5_1,
    Q6_K,
    Q8_0,
    RECORD32,
    TYPE_NAMES,
    GGUFLinear,
    pack,
)

log = logging.getLogger(__name__)

SCREENED = (Q6_K, Q8_0, Q5_0, Q5_1)  # head types of 5.5 bits a weight or more in their panels: the screen's 4.6 pay
MAX_PANEL_SHARE = 1 / 8  # past this share of the panels, the full head is the cheaper read
MAX_ROWS = 6  # token rows the screen serves: at 8 the two reads' arithmetic costs more than the bytes saved
# The AVX2 passes, compute-bound from 3 token rows: on Zen 3 (2 cores) the screen took 0.65-0.72x the full Q6_K head's
# time at 1-2 rows, 0.92-0.95x at 3, 1.01-1.03x at 4 and 1.09-1.16x at 5-6 (the flagship's answer states, 40 calls
# each, interleaved; experiments/kernel_log.md, 2026-12-07 21:28). The AVX-512 tiles keep MAX_ROWS (Zen 4: 1.12-1.20x
# faster at 1-6 rows).
MAX_ROWS_AVX2 = 3
SUM_TOL = 1e-4  # both kernels' fp32 rounding, relative to |W_j| |a| (K / 16 roundings of 2^-24 each: 6e-6 at K 1536)


@dataclass
class HeadScreen:
    """A GGUF head's screen (`build`): `layer` its Q4_K rows, `wn` / `dn` fp32 [N] upper bounds of |W_j| and
    |W_j - Q_j|, `head_type` the head's GGUF type. Derived: `act_group` the head kernel's activation group (256 for
    k-quants, 32 for the 32-weight blocks), `pwn` / `pdn` [ceil(N / 16)] the largest of `wn` / `dn` in each 16-row
    panel (what skinny.c's screen_head tests a panel with), `max_panels` the most panels it computes before the whole
    head is the cheaper read."""

    layer: GGUFLinear
    wn: Tensor
    dn: Tensor
    head_type: int
    act_group: int = field(init=False)
    pwn: Tensor = field(init=False, repr=False)
    pdn: Tensor = field(init=False, repr=False)
    max_panels: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.act_group = 32 if self.head_type in RECORD32 else 256
        pad = -self.wn.numel() % 16
        self.pwn, self.pdn = (torch.nn.functional.pad(t.float(), (0, pad)).view(-1, 16).amax(-1).contiguous()
                              for t in (self.wn, self.dn))
        self.max_panels = int(MAX_PANEL_SHARE * self.pwn.numel())


def build(head, cache_dir: Path | None = None) -> HeadScreen | None:
    """The screen of `head`, or None where it has none: not a one-part GGUF head without bias of a type in SCREENED,
    or an input width that is not whole super-blocks of 256 (the screen is Q4_K). With `cache_dir` (the engine's
    directory) the screen is read from `.head-screen-<sha256 of the head's panels>.safetensors` there, or built and
    written there under a file lock: Triton's two stub processes and every later load build it once."""
    if not isinstance(head, GGUFLinear) or len(head.parts) != 1 or head.bias is not None:
        return None
    qtype, K = int(head.parts[0, 0]), head.in_features
    if qtype not in SCREENED or K % 256:
        return None
    if cache_dir is None:
        return _build(head, qtype, K)
    key = hashlib.sha256(head.qweight.contiguous().numpy()).hexdigest()[:16]
    path = Path(cache_dir) / f"{CACHE_PREFIX}{key}.safetensors"
    try:
        lock = open(Path(cache_dir) / f"{CACHE_PREFIX}lock", "a+")  # noqa: SIM115 - held while building
    except OSError:
        return _build(head, qtype, K)  # a directory this process cannot write: built here, kept in memory
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        screen = _read(path, head)
        if screen is None:
            screen = _build(head, qtype, K)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            try:
                save_file({"qweight": screen.layer.qweight, "parts": screen.layer.parts, "wn": screen.wn,
                           "dn": screen.dn}, str(tmp))
                os.replace(tmp, path)  # whole or not at all: an interrupted write leaves no file that looks complete
                for old in path.parent.glob(f"{CACHE_PREFIX}*.safetensors"):  # a rebuilt engine's old head
                    if old != path:
                        old.unlink(missing_ok=True)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                log.warning("head screen: could not keep it in %s (%s); it is built again at the next load",
                            cache_dir, e)
    return screen


CACHE_PREFIX = ".head-screen-"


def _read(path: Path, head: GGUFLinear) -> HeadScreen | None:
    """The screen stored at `path` for `head` (its file name carries the head's hash), or None if absent or not one."""
    if not path.is_file():
        return None
    try:
        st = load_file(str(path))
        layer = GGUFLinear(st["qweight"], st["parts"])
        screen = HeadScreen(layer, st["wn"], st["dn"], int(head.parts[0, 0]))
    except Exception as e:  # noqa: BLE001 - a damaged file is rebuilt, never used
        log.warning("head screen: %s unreadable (%s); building it again", path, e)
        return None
    N = head.out_features
    if layer.out_features != N or layer.in_features != head.in_features or screen.wn.shape != (N,) \
            or screen.dn.shape != (N,):
        return None
    return screen


def _build(head: GGUFLinear, qtype: int, K: int) -> HeadScreen:
    t0 = time.perf_counter()
    try:
        W = head.dequant_kernel(0)
    except RuntimeError:  # no kernel library: the torch decode
        W = head.weight
    N = W.shape[0]
    raws, wn, dn = [], torch.empty(N), torch.empty(N)
    for r0 in range(0, N, ROWS):
        w = W[r0:r0 + ROWS]
        raw, Q = q4k_blocks(w)
        raws.append(raw)
        # fp32 norms, raised past their rounding: sums of 1,536 squares (well within 1e-4), and the difference's
        # own rounding (a few ulps of the sub-block's largest weight each: within 1e-4 |W_j|)
        wn[r0:r0 + ROWS] = w.norm(dim=1) * (1 + 1e-4)
        dn[r0:r0 + ROWS] = (w - Q).norm(dim=1) * (1 + 1e-4) + 1e-4 * wn[r0:r0 + ROWS]
    for t in (wn, dn):  # and up to the next fp32
        t.copy_(torch.nextafter(t, torch.full_like(t, float("inf"))))
    packed = torch.from_numpy(pack(Q4_K, np.concatenate(raws), K))
    layer = GGUFLinear(packed, torch.tensor([[Q4_K, N, 0, 0, K]], dtype=torch.int64))
    log.info("head screen: Q4_K rows for the %s head's %d x %d (%.0f MB for %.0f) in %.1f s", TYPE_NAMES[qtype], N, K,
             packed.numel() / 1e6, head.qweight.numel() / 1e6, time.perf_counter() - t0)
    return HeadScreen(layer, wn.contiguous(), dn.contiguous(), qtype)


ROWS = 8192  # head rows rounded at a time


def q4k_blocks(W: Tensor) -> tuple[np.ndarray, Tensor]:
    """Rows W [N, K] (K a multiple of 256) -> (GGUF Q4_K blocks uint8 [N, K / 256 * 144], their weights fp32 [N, K]
    as the Q4_K kernel multiplies them: d sc q - dmin m, each product as the kernel rounds it), by nearest rounding:
    each 32 columns' range [min(w, 0), max w] in 15 steps, the steps and minima as 6-bit multiples of the
    super-block's fp16 d and dmin (gguf_weights.q4k_fields reads them back)."""
    N, K = W.shape
    nsb = K // 256
    w = W.float().reshape(N, nsb, 8, 32)
    lo = w.amin(-1).clamp(max=0.0)
    step = (w.amax(-1) - lo) / 15.0
    d = (step.amax(-1) / 63.0).half().float()
    dmin = ((-lo).amax(-1) / 63.0).half().float()
    zero = torch.zeros(())
    sc = torch.where(d[..., None] > 0, torch.round(step / d[..., None].clamp_min(1e-30)), zero).clamp(0, 63)
    m = torch.where(dmin[..., None] > 0, torch.round(-lo / dmin[..., None].clamp_min(1e-30)), zero).clamp(0, 63)
    D, M = d[..., None] * sc, dmin[..., None] * m
    q = torch.where(D[..., None] > 0, torch.round((w + M[..., None]) / D[..., None].clamp_min(1e-30)), zero)
    q = q.clamp(0, 15).to(torch.uint8)
    sc8, m8 = sc.to(torch.uint8), m.to(torch.uint8)
    scales = torch.cat([sc8[..., :4] | ((sc8[..., 4:] >> 4) << 6), m8[..., :4] | ((m8[..., 4:] >> 4) << 6),
                        (sc8[..., 4:] & 15) | ((m8[..., 4:] & 15) << 4)], -1)  # q4k_fields' 12 bytes
    qs = q.reshape(N, nsb, 4, 2, 32)
    qs = qs[:, :, :, 0] | (qs[:, :, :, 1] << 4)  # byte l of 64 weights: weight l low, weight 32 + l high
    out = torch.cat([d.half().view(torch.uint8).reshape(N, nsb, 2), dmin.half().view(torch.uint8).reshape(N, nsb, 2),
                     scales, qs.reshape(N, nsb, 128)], -1)
    return out.reshape(N, nsb * 144).numpy(), (D[..., None] * q.float() - M[..., None]).reshape(N, K)


def max_rows() -> int:
    """Token rows the screen serves on the kernel build in use (MAX_ROWS, MAX_ROWS_AVX2)."""
    return MAX_ROWS_AVX2 if kernels.path() == "avx2" else MAX_ROWS


def logits(head: GGUFLinear, screen: HeadScreen, x: Tensor) -> Tensor:
    """Greedy-exact logits of token rows x [..., K] (module docstring): fp32 [..., N], the head kernel's own values
    on every row that could be a row's argmax, -inf elsewhere; the full head where the screen cannot help."""
    lib = kernels._load()
    xr = x.reshape(-1, x.shape[-1]).float().contiguous()
    R, K = xr.shape
    if lib is None or xr.device.type != "cpu" or not 0 < R <= max_rows():
        return head(x).float()  # no kernels, or more rows than the screen pays for
    N = screen.wn.numel()
    s = torch.empty(R, N)
    # the screen's matmul and every pass after it, in one call (skinny.c): nothing between them for Python to run
    done = lib.screen_head(xr.data_ptr(), R, K, screen.act_group, SUM_TOL, screen.layer.desc_ptr(), screen.head_type,
                           head.qweight.data_ptr(), N, s.data_ptr(), screen.wn.data_ptr(), screen.dn.data_ptr(),
                           screen.pwn.data_ptr(), screen.pdn.data_ptr(), screen.max_panels, kernels.threads())
    if done == -2:
        raise MemoryError("kernels.screen_head: skinny.c could not allocate its buffers")
    if done == -3:
        raise ValueError(f"head_screen: a screen of {screen.layer.out_features} x {screen.layer.in_features} for a "
                         f"head of {N} x {K}")
    if done < 0:  # too many panels left (the whole head is the cheaper read), or a state that is not finite
        return head(x).float()
    return s.view(*x.shape[:-1], N)
