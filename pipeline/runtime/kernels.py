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
    lib.skinny_matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 5
    lib.skinny_matmul.restype = None
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
