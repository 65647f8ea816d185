"""The skinny CPU matmul (skinny.c), compiled on first use with the system C compiler.

When no compiler or no AVX2/FMA is available, `linear` falls back to torch's F.linear; `available()`
says which path runs, and the benchmark report records it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

SRC = Path(__file__).with_name("skinny.c")
MAX_ROWS = 32
_lib = None
_tried = False


def _cpu_ok() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build_dir() -> Path:
    base = os.environ.get("PIPELINE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "spec-pipeline")
    return Path(base)


def _load():
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PIPELINE_NO_KERNEL") or not _cpu_ok():
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    tag = hashlib.sha256(SRC.read_bytes() + platform.node().encode()).hexdigest()[:16]
    so = _build_dir() / f"skinny-{tag}.so"
    if not so.is_file():
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        cmd = [cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", str(SRC), "-o", tmp]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            os.unlink(tmp)
            return None
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    P, Int, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.skinny_matmul.argtypes = [P, P, P] + [Int] * 5
    lib.fused_linear.argtypes = [P, P, F32, P, P] + [Int] * 7
    lib.rope_write.argtypes = [P] * 9 + [Int] * 6
    lib.attention.argtypes = [P] * 5 + [Int] * 7 + [F32, Int]
    for f in (lib.skinny_matmul, lib.fused_linear, lib.rope_write, lib.attention):
        f.restype = None
    _lib = lib
    return lib


def available() -> bool:
    return _load() is not None


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K].T in fp32; the kernel handles few-row CPU calls, torch the rest."""
    lib = _load()
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if (lib is None or x.device.type != "cpu" or rows == 0 or rows > MAX_ROWS or x.dtype != torch.float32
            or w.dtype not in (torch.float32, torch.bfloat16) or torch.is_grad_enabled() and w.requires_grad):
        return F.linear(x, w.to(x.dtype))
    N, K = w.shape
    xc = x.contiguous()
    wc = w if w.is_contiguous() else w.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    lib.skinny_matmul(xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rows, K, N, torch.get_num_threads(),
                      int(w.dtype == torch.bfloat16))
    return y


def threads() -> int:
    """Threads for the C kernels: torch's own ops run single-threaded on small decode shapes (see model.py)."""
    return _threads


_threads = max(1, os.cpu_count() or 1)


def set_threads(n: int) -> None:
    global _threads
    _threads = max(1, n)


def fast_path(tokens: torch.Tensor) -> bool:
    """True when a few-token CPU step (tokens [B, S]) can run through the fused C layer."""
    return (tokens.device.type == "cpu" and not torch.is_grad_enabled() and tokens.numel() <= MAX_ROWS
            and _load() is not None)


def fused_linear(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
                 swiglu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """pre(x) @ w.T where pre is RMSNorm(norm) or SwiGLU; with `out`, the product is added into it."""
    lib = _load()
    K = x.shape[-1] // 2 if swiglu else x.shape[-1]
    S = x.numel() // x.shape[-1]
    N = w.shape[0]
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    mode = 2 if swiglu else (1 if norm is not None else 0)
    lib.fused_linear(x.data_ptr(), norm.data_ptr() if norm is not None else None, eps, w.data_ptr(), y.data_ptr(),
                     S, K, N, _threads, int(w.dtype == torch.bfloat16), mode, int(out is not None))
    return y


def rope_write(qkv: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kc: torch.Tensor, vc: torch.Tensor, hq: int, hkv: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Add the q/k/v bias (fp32, when given), rotate q/k, write k/v into the caches at `slots`; return rotated q."""
    B, S, _, D = qkv.shape
    q = torch.empty(B, S, hq, D, dtype=torch.float32)
    _lib.rope_write(qkv.data_ptr(), bias.data_ptr() if bias is not None else None, pos.data_ptr(), slots.data_ptr(),
                    cos.data_ptr(), sin.data_ptr(), q.data_ptr(), kc.data_ptr(), vc.data_ptr(), B, S, hq, hkv, D,
                    kc.shape[2])
    return q


def attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Masked grouped-query attention of q [B, S, Hq, D] over cache slots [0, kv_len)."""
    B, S, Hq, D = q.shape
    out = torch.empty_like(q)
    _lib.attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), mask.data_ptr(), out.data_ptr(), B, S, Hq, kc.shape[1],
                   D, kc.shape[2], kv_len, D ** -0.5, _threads)
    return out
