"""The skinny CPU matmul (skinny.c), compiled on first use with the system C compiler.

It is built for AVX-512 when the CPU has it (avx512f/bw/vl/dq; avx512_bf16, whose vdpbf16ps the bf16
and int4 weights use; avx512_vnni, whose vpdpbusd the W4A8 weights use), else for AVX2 + FMA (which
emulates both exactly); both builds compute every output element by the same instruction sequence (see
skinny.c), so they agree bit for bit. Without a compiler or either instruction set, `linear` falls back
to torch (same results within 1e-4) and the model runs its torch layers. Nothing falls back silently: a
failed compile or a missing CPU feature is logged once (logger `pipeline.kernels`), and `path()` names
what runs ("avx512", "avx2" or "torch") for the reports' `environment`. `PIPELINE_KERNEL=avx2|avx512|torch`
forces a path.

The boundary: every entry point checks what the C code assumes (dtype, device, contiguity, element alignment, shapes
that chain, the layouts' multiples, cache slots in range) and raises ValueError naming the argument, its value and
what it must be; skinny.c refuses the same shapes again (weights_ok) and reports failed allocations, raised here as
MemoryError. The weight-type codes are skinny.c's own table (`skinny_weight_types`), read when the library is bound.

Weights are fp32 or bf16 tensors, or `quant.QLinear` layers (int8 / int4 / bf16 tiled), decoded in registers. With
bf16 and int4 weights each activation row is rounded to bf16 at the matmul (vdpbf16ps takes bf16 pairs);
fp32 and int8 weights multiply fp32 activations; W4A8 layers (int4 weights, `act8`) quantize each activation row
to int8 per group and multiply by integer dot products.
Any number of token rows goes through the kernel, so decoding, verification, trees and prefill all
compute each output element the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SRC = Path(__file__).with_name("skinny.c")
ISA_FLAGS = {"avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                        "-mavx512vnni", "-mf16c"],
             "avx2": ["-mavx2", "-mfma", "-mf16c"]}
# Both builds: only the fused multiply-adds written in skinny.c (fmaf, FMA intrinsics) fuse. GCC's default for GNU C is
# -ffp-contract=fast, which lets each build fuse a * b + c on its own, so plain C arithmetic (RoPE, RMSNorm, SwiGLU,
# the int8 row scale) could round differently in the two builds; the bit-for-bit contract needs it off.
CFLAGS = ["-O3", "-ffp-contract=off", "-pthread", "-shared", "-fPIC"]
# The K/V cache the kernels read and write: bf16, rounded as written (rope_write). Attention's two products are bf16
# dot products, twice the multiply-adds a cycle of fp32 FMAs, and a long context's cache half the bytes (skinny.c,
# attention).
KV_DTYPE = torch.bfloat16
# skinny.c's weight types the Python side names (codes from the library, `weight_types()`): fp32 / bf16 tensors by
# dtype; QLinear layouts in _weight_args.
TENSOR_WT = {torch.float32: "f32", torch.bfloat16: "bf16"}
WEIGHT_TYPE_NAMES = ("f32", "bf16", "i8", "i4", "bf16t", "i4t", "i8t", "i4a8", "gguf")
SK_EARG, SK_ENOMEM = 1, 2  # skinny.c's status codes
log = logging.getLogger("pipeline.kernels")
_libs: dict[str, ctypes.CDLL | None] = {}
_lib = None
_path: str | None = None
_warned_bf16: list[bool] = []


def _cpu_flags() -> set[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def supported_isas() -> list[str]:
    """The kernel builds this CPU can run, best first."""
    f = _cpu_flags()
    out = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= f:
        if {"avx512_bf16", "avx512_vnni"} <= f:
            out.append("avx512")
        elif not _warned_bf16:
            _warned_bf16.append(True)
            log.info("this CPU has AVX-512 but not AVX512_BF16 (vdpbf16ps) and AVX512_VNNI (vpdpbusd): the skinny "
                     "kernel runs its AVX2 build")
    if {"avx2", "fma", "f16c"} <= f:  # F16C: the Q4_K panels' fp16 scales (every AVX2 CPU has it)
        out.append("avx2")
    return out


def _build_dir() -> Path:
    base = os.environ.get("PIPELINE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "spec-pipeline")
    return Path(base)


def source_files(read: Callable[[str], str] | None = None) -> list[Path]:
    """skinny.c and every file it #includes with quotes, in include order (one translation unit: the build's digest
    covers them all). `read(name)` gives a file's text (default: this directory's), so a caller can read another
    revision's set."""
    read = read or (lambda name: SRC.with_name(name).read_text())
    out: list[str] = []

    def visit(name: str) -> None:
        out.append(name)
        for inc in re.findall(r'^#include "([^"]+)"', read(name), flags=re.M):
            if inc not in out:
                visit(inc)

    visit(SRC.name)
    return [SRC.with_name(n) for n in out]


def _compile(isa: str) -> ctypes.CDLL | None:
    """Build (or reuse) skinny-<isa>-<hash>.so; None, logged, when that fails."""
    if isa in _libs:
        return _libs[isa]
    _libs[isa] = None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler (cc/gcc) found: the skinny kernel is off, the runtime uses torch ops")
        return None
    flags = ISA_FLAGS[isa]
    src = b"".join(p.read_bytes() for p in source_files())
    key = src + " ".join(CFLAGS + flags).encode() + platform.node().encode()
    tag = hashlib.sha256(key).hexdigest()[:16]
    so = _build_dir() / f"skinny-{isa}-{tag}.so"
    if not so.is_file():
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        cmd = [cc, *CFLAGS, *flags, str(SRC), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 and isa == "avx512":
            # an assembler that predates AMX (binutils < 2.36) refuses the tile instructions: build without them
            # (the GGUF weights then run on the AVX-512 tiles; kernels.amx_unavailable() says so)
            retry = [cc, *CFLAGS, *flags, "-DSKINNY_NO_AMX", str(SRC), "-o", tmp]
            if subprocess.run(retry, capture_output=True, text=True).returncode == 0:
                log.warning("the avx512 skinny kernel compiled only without its AMX instructions (%s): %s",
                            " ".join(cmd), res.stderr.strip()[-500:])
                res, cmd = subprocess.CompletedProcess(retry, 0, "", ""), retry
        if res.returncode != 0:
            os.unlink(tmp)
            log.warning("compiling the %s skinny kernel failed (%s): %s", isa, " ".join(cmd),
                        res.stderr.strip()[-2000:])
            return None
        os.replace(tmp, so)
    _libs[isa] = lib = bind(so)
    return lib


def bind(so: Path) -> ctypes.CDLL:
    """Load a compiled skinny.c and declare its functions' signatures."""
    lib = ctypes.CDLL(str(so))
    lib.so_path = Path(so)  # amx_self_test runs this library again in a child process
    P, Int, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.skinny_matmul.argtypes = [P, P, P, P] + [Int] * 6
    lib.fused_linear.argtypes = [P, P, F32, P, P, P] + [Int] * 8
    lib.rope_write.argtypes = [P] * 9 + [Int] * 6
    lib.attention.argtypes = [P] * 6 + [Int] * 7 + [F32, Int]
    lib.rmsnorm.argtypes = [P, P, F32, P, Int, Int]
    lib.decoder_layer.argtypes = [P, P, Int, Int] + [P] * 6 + [Int, P, Int, Int]
    lib.decoder_layers.argtypes = [P, Int, P, Int, Int] + [P] * 6 + [ctypes.c_int64, Int, P, Int, Int]
    for f in (lib.skinny_matmul, lib.fused_linear, lib.attention, lib.decoder_layer, lib.decoder_layers):
        f.restype = Int  # skinny.c's SK_OK / SK_EARG / SK_ENOMEM
    for f in (lib.rope_write, lib.rmsnorm):
        f.restype = None
    lib.skinny_weight_types.restype = ctypes.c_char_p
    lib.skinny_contract_probe.argtypes = [F32, F32, F32]
    lib.skinny_contract_probe.restype = F32
    lib.skinny_isa.restype = ctypes.c_char_p
    lib.argmax_prob.argtypes = [P, Int, Int, P, P]
    lib.argmax_prob.restype = None
    lib.screen_head.argtypes = [P, Int, Int, Int, ctypes.c_double, P, Int, P, Int, P, P, P, P, P, Int, Int]
    lib.screen_head.restype = ctypes.c_int64
    lib.screen_bounds.argtypes = [P, Int, Int, Int, Int, ctypes.c_double, P]
    lib.screen_bounds.restype = Int
    lib.sample_rows.argtypes = [P, Int, Int, P, P]
    lib.sample_rows.restype = Int
    lib.softmax_rows.argtypes = [P, Int, Int, F32, P]
    lib.softmax_rows.restype = None
    lib.stream_read.argtypes = [P, ctypes.c_int64, Int]
    lib.stream_read.restype = ctypes.c_uint64
    lib.int8_peak.argtypes = [ctypes.c_int64, Int]
    lib.int8_peak.restype = ctypes.c_int64
    lib.gguf_dequant.argtypes = [P, Int, P]
    lib.gguf_dequant.restype = None
    lib.gguf_amx.argtypes = [Int]
    lib.gguf_amx.restype = Int
    lib.gguf_amx_probe.restype = Int
    lib.gguf_amx_min_rows.argtypes = [Int]
    lib.gguf_amx_min_rows.restype = Int
    lib.gguf_amx_selftest.argtypes = [Int]
    lib.gguf_amx_selftest.restype = Int
    if hasattr(lib, "gguf_amx_model_dp"):  # the AVX-512 build's tile model, for the tests
        lib.gguf_amx_model_dp.argtypes = [P, P, P] + [Int] * 4
        lib.gguf_amx_model_dp.restype = None
        lib.gguf_amx_model_unconfigured.restype = None
    table = dict(item.split("=") for item in lib.skinny_weight_types().decode().split())
    lib.weight_types = {name: int(code) for name, code in table.items()}
    missing = [n for n in WEIGHT_TYPE_NAMES if n not in lib.weight_types]
    if missing:
        raise RuntimeError(f"{so}: skinny.c's weight-type table lacks {missing} (it has {table})")
    return lib


def weight_types() -> dict[str, int]:
    """skinny.c's weight-type codes by name (its WEIGHT_TYPES table), from the library in use; {} without one."""
    lib = _load()
    return dict(lib.weight_types) if lib is not None else {}


def _status(rc: int, fn: str) -> None:
    """Raise for a failed C call: the Python checks run first, so SK_EARG means they missed a case."""
    if rc == SK_ENOMEM:
        raise MemoryError(f"kernels.{fn}: skinny.c could not allocate its scratch buffers")
    if rc != 0:
        raise ValueError(f"kernels.{fn}: skinny.c refused the arguments (status {rc}): shapes or a weight type it "
                         "cannot read")


def _fail(fn: str, arg: str, value, must: str) -> None:
    """Raise the boundary's error. Callers test their condition first (`if not ok: _fail(...)`), so the message
    is built only on failure: the checks run on every decode step."""
    raise ValueError(f"kernels.{fn}: {arg} is {value}; it must {must}")


def _cpu(fn: str, arg: str, t: torch.Tensor, dtype: torch.dtype | tuple, shape: tuple | None = None) -> None:
    """t is a contiguous, element-aligned CPU tensor of `dtype` (one or a tuple), of `shape` (None: any size there)."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if not (t.device.type == "cpu"):
        _fail(fn, f"{arg}.device", t.device, "be cpu")
    if t.dtype not in dtypes:
        _fail(fn, f"{arg}.dtype", t.dtype, f"be {' or '.join(map(str, dtypes))}")
    if shape is not None:
        if not (t.dim() == len(shape) and all(w is None or w == n for w, n in zip(shape, t.shape))):
            _fail(fn, f"{arg}.shape", list(t.shape), f"be {['*' if w is None else w for w in shape]}")
    if not (t.is_contiguous()):
        _fail(fn, arg, f"a non-contiguous view (strides {t.stride()})", "be contiguous (.contiguous())")
    if not (t.data_ptr() % t.element_size() == 0):
        _fail(fn, f"{arg}.data_ptr()", hex(t.data_ptr()),
              f"be a multiple of its element size {t.element_size()}")


def _choose() -> tuple[str, ctypes.CDLL | None]:
    forced = os.environ.get("PIPELINE_KERNEL", "").strip().lower()
    if os.environ.get("PIPELINE_NO_KERNEL") or forced == "torch":
        log.info("skinny kernel disabled by the environment: the runtime uses torch ops")
        return "torch", None
    isas = supported_isas()
    if not isas:
        log.warning("this CPU lacks AVX2, FMA or F16C (or is not x86-64): the runtime uses torch ops")
        return "torch", None
    if forced:
        if forced not in isas:
            log.warning("PIPELINE_KERNEL=%s is not supported by this CPU (it has %s)", forced, isas)
        else:
            isas = [forced]
    for isa in isas:
        lib = _compile(isa)
        if lib is not None:
            _amx_default(isa, lib)
            return isa, lib
    return "torch", None


AMX_PROBE = {0: "this CPU has no AMX-TILE / AMX-INT8 (CPUID leaf 7)",
             -1: "the OS has not enabled the AMX tile state (XCR0 bits 17-18)",
             -2: "Linux refused this process the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM; kernel 5.16 or later "
                 "grants it)",
             -3: "this avx512 library was compiled without the AMX instructions (the assembler refused them; see the "
                 "pipeline.kernels log)"}


def _amx_why(lib: ctypes.CDLL) -> str | None:
    """Why the AVX-512 library `lib` cannot use AMX tiles in this process (its gguf_amx_probe, then its self-test),
    None when it can."""
    probe = lib.gguf_amx_probe()
    if probe != 1:
        return AMX_PROBE.get(probe, f"probe {probe}")
    return amx_self_test(lib.so_path)


# The child that runs gguf_amx_selftest: ctypes alone (no torch), its result on stdout.
AMX_SELF_TEST_CHILD = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).gguf_amx_selftest(int(sys.argv[2])))"


def amx_self_test(so: Path, mode: int = 1, timeout: float = 120.0) -> str | None:
    """Run library `so`'s gguf_amx_selftest(mode) (1 the AMX instructions, 2 the software model of the tiles) in a child
    process; None when the tiles gave the AVX-512 tiles' bits, else why not.

    The AMX code has only run on the software model where it was written (no machine there has AMX), so on a machine
    with the instructions it proves itself before any model uses it, and a tile fault (SIGILL, SIGSEGV) or a hang
    kills the child, not the server. The hardware verdict is kept beside the library (`<so>.amx`): the library's name
    hashes its source, flags and host, so it is checked once per build and machine."""
    mark = so.with_name(so.name + ".amx")
    if mode == 1 and mark.is_file():
        verdict = mark.read_text().strip()
        return None if verdict == "ok" else verdict
    python = sys.executable or shutil.which("python3") or "python3"
    try:
        res = subprocess.run([python, "-c", AMX_SELF_TEST_CHILD, str(so), str(mode)], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:  # perhaps only a busy minute: not kept, the next process tries again
        return f"the AMX self-test did not finish in {timeout:.0f} s"
    out = res.stdout.strip()
    if res.returncode < 0:
        why = f"the AMX self-test was killed by {signal.Signals(-res.returncode).name}"
    elif res.returncode != 0 or not out.lstrip("-").isdigit():
        why = f"the AMX self-test failed (exit {res.returncode}): {(res.stderr or out).strip()[-300:]}"
    else:
        code = int(out)
        why = (None if code == 0 else
               f"the AMX self-test could not run (gguf_amx_selftest({mode}) = {code})" if code < 0 else
               f"the AMX tiles differ from the AVX-512 tiles (at {code // 1000} token rows, {code // 100 % 10 + 1} "
               f"thread(s), output column {code % 100} mod 100)")
    if mode == 1:
        tmp = mark.with_name(mark.name + f".{os.getpid()}")
        tmp.write_text((why or "ok") + "\n")
        os.replace(tmp, mark)
    return why


def _amx_default(isa: str, lib: ctypes.CDLL) -> None:
    """Turn on the GGUF weights' AMX tiles in the AVX-512 build where this process may use them (gguf_kernels.c:
    same integers, same float steps, same bits), unless PIPELINE_AMX=0."""
    if isa != "avx512":
        return
    if os.environ.get("PIPELINE_AMX", "").strip() == "0":
        lib.gguf_amx(0)
        log.info("PIPELINE_AMX=0: the GGUF weights run on the AVX-512 tiles")
        return
    why, probe = _amx_why(lib), lib.gguf_amx_probe()
    if why is None:
        lib.gguf_amx(1)
        rows = os.environ.get("PIPELINE_AMX_MIN_ROWS", "").strip()
        if rows:
            if not rows.isdigit() or not 1 <= int(rows) <= 1024:
                raise ValueError(f"PIPELINE_AMX_MIN_ROWS is {rows!r}; it must be a whole number of token rows, "
                                 "1 to 1024 (unset: 11)")
            lib.gguf_amx_min_rows(int(rows))
        log.info("the GGUF weights run on AMX tiles (TDPBSSD) from %d token rows", lib.gguf_amx_min_rows(0))
    elif probe == 1:  # the CPU and OS allow AMX, but the tiles failed their self-test
        log.warning("AMX unused: %s; the GGUF weights run on the AVX-512 tiles (PIPELINE_AMX=0 skips the test)", why)
    elif probe != 0:  # a CPU without AMX is the common case, not worth a line
        log.info("AMX unused: %s", why)


def amx() -> str:
    """How the GGUF weights' int8 products run in the AVX-512 build: 'hardware' (AMX tiles), 'emulated' (the same AMX
    code on gguf_kernels.c's software model of the tiles, for tests) or 'off' (the AVX-512 tiles)."""
    lib = _load()
    if lib is None or _path != "avx512":
        return "off"
    return {0: "off", 1: "hardware", 2: "emulated"}[lib.gguf_amx(-1)]


def amx_unavailable() -> str | None:
    """Why this process cannot use AMX tiles (None when it can)."""
    lib = _load()
    if lib is None or _path != "avx512":
        return f"the {path()} kernel path has no AMX tiles (the AVX-512 build does)"
    return _amx_why(lib)


def set_amx(mode: str) -> str:
    """Switch the GGUF tiles of the AVX-512 build: 'off', 'hardware' (refused, naming why, where this process cannot
    use AMX) or 'emulated' (tests); returns the previous mode."""
    modes = {"off": 0, "hardware": 1, "emulated": 2}
    if mode not in modes:
        raise ValueError(f"kernels.set_amx: mode is {mode!r}; it must be one of {sorted(modes)}")
    prev = amx()
    if _load() is None or _path != "avx512":
        if mode == "off":
            return prev
        raise ValueError(f"kernels.set_amx({mode!r}): the {path()} kernel path has no AMX tiles; switch to the "
                         "avx512 build first (kernels.set_path)")
    why = amx_unavailable() if mode == "hardware" else None
    if why:
        raise ValueError(f"kernels.set_amx('hardware'): {why}")
    _lib.gguf_amx(modes[mode])
    return prev


def amx_min_rows(rows: int | None = None) -> int:
    """The fewest token rows a GGUF matmul needs for the AMX tiles to take it (fewer run on the AVX-512 tiles, same
    bits: the tiles decode every weight whatever the rows, which costs more than vpdpbusd at a few rows). `rows` sets it
    (1 runs the AMX code at every row count, as the tests do); returns the value before. 0 where the build has no
    tiles."""
    lib = _load()
    if lib is None or _path != "avx512":
        return 0
    if rows is not None and not 1 <= rows <= 1024:
        raise ValueError(f"kernels.amx_min_rows: rows is {rows}; it must be 1 to 1024")
    prev = lib.gguf_amx_min_rows(0)
    if rows is not None:
        lib.gguf_amx_min_rows(rows)
    return prev


def amx_faults() -> int:
    """Tile operations the software model saw that the hardware would refuse (#UD); 0 unless the AMX code is wrong."""
    lib = _load()
    return ctypes.c_longlong.in_dll(lib, "gg_amx_faults").value if lib is not None and _path == "avx512" else 0


def _load():
    global _lib, _path
    if _path is None:
        _path, _lib = _choose()
    return _lib


def path() -> str:
    """Which matmul path runs: 'avx512+amx' (the AVX-512 build with the GGUF weights on AMX tiles), 'avx512', 'avx2' or
    'torch' (for the reports' environment)."""
    lib = _load()
    if _path == "avx512" and lib is not None and lib.gguf_amx(-1) == 1:
        return "avx512+amx"
    return _path or "torch"


def set_path(name: str) -> str:
    """Switch the kernel build ('avx512+amx', 'avx512', 'avx2' or 'torch', as `path()` names them); returns the
    previous one. For tests and A/B runs."""
    global _lib, _path
    prev = path()
    if name == "torch":
        _path, _lib = "torch", None
        return prev
    isa, _, extra = name.partition("+")
    if isa not in supported_isas() or extra not in ("", "amx") or extra and isa != "avx512":
        raise ValueError(f"kernel path {name!r} is not supported by this CPU (it has {supported_isas()}"
                         + (", and avx512+amx where the AVX-512 build may use AMX tiles)" if extra else ")"))
    lib = _compile(isa)
    if lib is None:
        raise RuntimeError(f"the {isa} skinny kernel did not compile (see the pipeline.kernels log)")
    if extra and _amx_why(lib):
        raise ValueError(f"kernel path {name!r}: {_amx_why(lib)}")
    if isa == "avx512":
        lib.gguf_amx(1 if extra else 0)
    _path, _lib = isa, lib
    return prev


def available() -> bool:
    return _load() is not None


def tiles() -> bool:
    """Whether CPU weights are tiled at load (quant.tile_model): only where the AVX-512 build runs.

    Tiles pay for AVX-512's 8-row int4 / int8 and 4-row bf16 tiles (1.05-1.13x one-token matmuls on Zen 4). The AVX2
    build reads 1-2 rows at a time, so a tile of 4 or 8 becomes strided reads: on Zen 3 (AVX2), a 17920 x 1536 matmul
    ran bf16 0.88x at one token and 0.58x at two, int8 0.53x, int4 1.01x against row-major (experiments/kernel_log.md).
    `PIPELINE_TILES=1` or `0` overrides (for A/B runs and tests)."""
    forced = os.environ.get("PIPELINE_TILES", "").strip()
    if forced in ("0", "1"):
        return forced == "1" and available()
    return _path == "avx512" and available()


def _quantized(w) -> bool:
    """A quant.QLinear (int8 / int4 / tiled bf16 weights), told by its buffers so this module need not import quant."""
    return hasattr(w, "qweight") and hasattr(w, "scales")


def _weight_args(w, fn: str = "linear", arg: str = "w") -> tuple[int, int | None, int, int, int, int]:
    """(weight ptr, scales ptr, skinny.c weight type, group size, N, K) for a tensor or a QLinear, after checking that
    the kernel can read it (skinny.c's weights_ok, and buffers as large as the shapes say)."""
    codes = _load().weight_types
    if _quantized(w):
        N, K, gs = w.out_features, w.in_features, w.group_size
        if w.algo == "gguf":  # a gg_desc_t of the layer's GGUF parts (gguf_weights.GGUFLinear checks its panels)
            if not (K % 32 == 0):
                _fail(fn, f"{arg}.in_features", K, "be a multiple of 32 (whole GGUF blocks)")
            return w.desc_ptr(), None, codes["gguf"], 0, N, K
        if w.algo == "int8":  # quant.tile's 8 x 16 tiles, or row-major
            name = "i8t" if w.tiled else "i8"
        elif w.algo == "bf16":
            name = "bf16t"
        elif w.act8:
            if not w.blocks_a8:
                raise ValueError("a W4A8 layer runs on the CPU kernel only in its 16-row blocks: lay the model out "
                                 "with quant.tile_model (build_model does)")
            name = "i4a8"
        else:
            name = "i4t" if w.tiled else "i4"
        rows = -(-N // 16) * 16 if name == "i4a8" else N
        _cpu(fn, f"{arg}.qweight", w.qweight, {"i8": torch.int8, "i8t": torch.int8, "bf16t": torch.bfloat16}.get(
            name, torch.uint8))
        bits = {"i8": 8, "i8t": 8, "bf16t": 16}.get(name, 4)
        if not (w.qweight.numel() * w.qweight.element_size() * 8 >= rows * K * bits):
            _fail(fn, f"{arg}.qweight.shape",
                  list(w.qweight.shape), f"hold {rows} x {K} {bits}-bit weights (out_features x in_features)")
        if name != "bf16t":
            want = rows if w.algo == "int8" else rows * (K // gs) if gs and K % gs == 0 else None
            _cpu(fn, f"{arg}.scales", w.scales, torch.float32 if w.algo == "int8" else torch.bfloat16)
            if not (want is None or w.scales.numel() >= want):
                _fail(fn, f"{arg}.scales.shape", list(w.scales.shape),
                      f"hold {want} scales")
        if name in ("i4", "i4t", "i4a8"):
            m = 16 if name == "i4a8" else 32
            if not (gs > 0 and gs % m == 0):
                _fail(fn, f"{arg}.group_size", gs, f"be a positive multiple of {m}")
            if not (K % gs == 0):
                _fail(fn, f"{arg}.in_features", K, f"be a multiple of the group size {gs}")
        need_k, need_n = {"i4t": (128, 8), "bf16t": (32, 4), "i8t": (16, 8)}.get(name, (1, 1))
        if not (K % need_k == 0):
            _fail(fn, f"{arg}.in_features", K, f"be a multiple of {need_k} in layout {name} (quant.tile)")
        if not (N % need_n == 0):
            _fail(fn, f"{arg}.out_features", N, f"be a multiple of {need_n} in layout {name} (quant.tile)")
        return w.qweight.data_ptr(), None if name == "bf16t" else w.scales.data_ptr(), codes[name], gs, N, K
    if w.dtype not in TENSOR_WT:
        raise ValueError(f"kernels.{fn}: {arg}.dtype is {w.dtype}; the CPU kernels read float32 or bfloat16 weights "
                         "(set dtype: float32 or bfloat16)")
    if not w.is_contiguous():
        raise ValueError(f"kernels.{fn}: {arg} is not contiguous; the CPU kernels need contiguous weights")
    _cpu(fn, arg, w, w.dtype, (None, None))
    if not (w.shape[0] > 0 and w.shape[1] > 0):
        _fail(fn, f"{arg}.shape", list(w.shape), "have no zero dimension")
    return w.data_ptr(), None, codes[TENSOR_WT[w.dtype]], 0, w.shape[0], w.shape[1]


def _dot_bf16(w) -> bool:
    """True for the weights the kernel multiplies by bf16 dot products (bf16, int4): x is rounded to bf16."""
    return w.algo in ("int4", "bf16") and not w.act8 if _quantized(w) else w.dtype == torch.bfloat16


def _torch_linear(x: torch.Tensor, w) -> torch.Tensor:
    if _quantized(w) and w.algo == "gguf":
        return w.reference(x)  # the kernel's arithmetic in torch (gguf_weights.reference_matmul)
    if _quantized(w) and w.act8:
        return w.linear_a8(x)
    weight = w.weight if _quantized(w) else w
    if x.dtype == torch.float32 and x.device.type == "cpu" and _dot_bf16(w):
        x = x.bfloat16().float()  # the kernel's rounding of the activations (skinny.c), so both paths agree
    return F.linear(x, weight.to(device=x.device, dtype=x.dtype))


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., K] @ w[N, K].T in fp32 (w a tensor or a QLinear); the kernel takes every CPU inference call."""
    lib = _load()
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if (lib is None or x.device.type != "cpu" or rows == 0 or x.dtype != torch.float32
            or not _quantized(w) and (w.dtype not in TENSOR_WT or torch.is_grad_enabled() and w.requires_grad)):
        return _torch_linear(x, w)
    if _quantized(w) and w.act8 and not w.blocks_a8:
        return _torch_linear(x, w)
    wp, sp, wt, gs, N, K = _weight_args(w if _quantized(w) else w.contiguous())
    if not (x.shape[-1] == K):
        _fail("linear", "x.shape", list(x.shape), f"end in the weight's in_features {K}")
    xc = x.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    _status(lib.skinny_matmul(xc.data_ptr(), wp, sp, y.data_ptr(), rows, K, N, _threads, wt, gs), "linear")
    return y


def threads() -> int:
    """Threads for the C kernels: torch's own ops run single-threaded on small decode shapes (see model.py)."""
    return _threads


_threads = max(1, os.cpu_count() or 1)


def set_threads(n: int) -> None:
    global _threads
    _threads = max(1, n)


def configure_threads(n: int) -> None:
    """One thread setting for torch and the C kernels (n <= 0: every core)."""
    n = n if n > 0 else max(1, os.cpu_count() or 1)
    torch.set_num_threads(n)
    set_threads(n)


def fast_path(tokens: torch.Tensor) -> bool:
    """True when a CPU inference step (tokens [B, S], any S) can run through the fused C layer."""
    return tokens.device.type == "cpu" and not torch.is_grad_enabled() and _load() is not None


def fused_linear(x: torch.Tensor, w, *, norm: torch.Tensor | None = None, eps: float = 0.0,
                 swiglu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """pre(x) @ w.T where pre is RMSNorm(norm) or SwiGLU; with `out`, the product is added into it."""
    lib = _load()
    wp, sp, wt, gs, N, K = _weight_args(w, "fused_linear")
    _cpu("fused_linear", "x", x, torch.float32)
    width = 2 * K if swiglu else K
    if not (x.dim() >= 1 and x.shape[-1] == width):
        _fail("fused_linear", "x.shape", list(x.shape),
              f"end in {width} (the weight's in_features {K}{', twice for SwiGLU' if swiglu else ''})")
    if not (not (swiglu and norm is not None)):
        _fail("fused_linear", "norm", "given with swiglu", "be None with swiglu")
    S = x.numel() // width
    if norm is not None:
        _cpu("fused_linear", "norm", norm, torch.float32, (K,))
    if out is not None:
        _cpu("fused_linear", "out", out, torch.float32)
        if not (out.shape == (*x.shape[:-1], N)):
            _fail("fused_linear", "out.shape", list(out.shape),
                  f"be {[*x.shape[:-1], N]}")
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    mode = 2 if swiglu else (1 if norm is not None else 0)
    _status(lib.fused_linear(x.data_ptr(), norm.data_ptr() if norm is not None else None, eps, wp, sp, y.data_ptr(),
                             S, K, N, _threads, wt, gs, mode, int(out is not None)), "fused_linear")
    return y


def rope_write(qkv: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kc: torch.Tensor, vc: torch.Tensor, hq: int, hkv: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Add the q/k/v bias (fp32, when given), rotate q/k, write k/v into the caches at `slots`; return rotated q."""
    _check_rope("rope_write", qkv, pos, slots, cos, sin, kc, vc, hq, hkv, bias)
    B, S, _, D = qkv.shape
    q = torch.empty(B, S, hq, D, dtype=torch.float32)
    _lib.rope_write(qkv.data_ptr(), bias.data_ptr() if bias is not None else None, pos.data_ptr(), slots.data_ptr(),
                    cos.data_ptr(), sin.data_ptr(), q.data_ptr(), kc.data_ptr(), vc.data_ptr(), B, S, hq, hkv, D,
                    kc.shape[2])
    return q


def _check_rope(fn: str, qkv: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, hq: int, hkv: int,
                bias: torch.Tensor | None) -> None:
    """rope_write's arguments: shapes that agree, and every position and slot inside the tables and the caches."""
    if not (hq > 0 and hkv > 0 and hq % hkv == 0):
        _fail(fn, "hq, hkv", (hq, hkv), "be positive, hq a multiple of hkv")
    _cpu(fn, "qkv", qkv, torch.float32, (None, None, hq + 2 * hkv, None))
    B, S, _, D = qkv.shape
    if not (D % 2 == 0):
        _fail(fn, "head_dim", D, "be even (half-rotation RoPE)")
    for name, t in (("pos", pos), ("slots", slots)):
        _cpu(fn, name, t, torch.int64, (B, S))
    _cpu(fn, "cos", cos, torch.float32, (None, D))
    _cpu(fn, "sin", sin, torch.float32, tuple(cos.shape))
    _cpu(fn, "kc", kc, KV_DTYPE, (B, hkv, None, D))
    _cpu(fn, "vc", vc, KV_DTYPE, tuple(kc.shape))
    if bias is not None:
        _cpu(fn, "bias", bias, torch.float32, ((hq + 2 * hkv) * D,))
    _in_range(fn, "pos", pos, cos.shape[0], "the RoPE tables' rows")
    _in_range(fn, "slots", slots, kc.shape[2], "the cache length")


def _in_range(fn: str, arg: str, t: torch.Tensor, n: int, what: str) -> None:
    if t.numel():
        lo, hi = (int(v) for v in torch.aminmax(t))
        if not (0 <= lo and hi < n):
            _fail(fn, f"{arg} (min, max)", (lo, hi), f"lie in [0, {n}) ({what})")


def attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor | None, kv_len: int,
              slots: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention of q [B, S, Hq, D] over cache slots [0, kv_len): under `mask` [B, S, kv_len] (uint8),
    or without one each query sees the slots up to its own (`slots` [B, S], int64)."""
    _cpu("attention", "q", q, torch.float32, (None, None, None, None))
    B, S, Hq, D = q.shape
    _cpu("attention", "kc", kc, KV_DTYPE, (B, None, None, D))
    _cpu("attention", "vc", vc, KV_DTYPE, tuple(kc.shape))
    if not (Hq % kc.shape[1] == 0):
        _fail("attention", "kc.shape[1] (kv heads)", kc.shape[1], f"divide the {Hq} query heads")
    if not (0 <= kv_len <= kc.shape[2]):
        _fail("attention", "kv_len", kv_len, f"lie in [0, {kc.shape[2]}] (the cache length)")
    if mask is not None:
        _cpu("attention", "mask", mask, (torch.uint8, torch.bool), (B, S, kv_len))
    else:
        if not (slots is not None):
            _fail("attention", "slots", None, "be given when mask is None")
        _cpu("attention", "slots", slots, torch.int64, (B, S))
    out = torch.empty_like(q)
    _status(_lib.attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), None if mask is None else mask.data_ptr(),
                           None if slots is None else slots.data_ptr(), out.data_ptr(), B, S, Hq, kc.shape[1], D,
                           kc.shape[2], kv_len, D ** -0.5, _threads), "attention")
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows x [..., K] by an fp32 weight [K], in one C call instead of five torch ops (the torch
    ops around a draft step's layers, the norm among them, took 0.7 ms once its weights had streamed by)."""
    _cpu("rmsnorm", "x", x, torch.float32)
    K = x.shape[-1]
    _cpu("rmsnorm", "weight", weight, torch.float32, (K,))
    out = torch.empty_like(x)
    _lib.rmsnorm(x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), x.numel() // K, K)
    return out


def argmax_prob(logits: torch.Tensor, with_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(argmax, its softmax probability) per row of fp32 logits [B, N]: torch's argmax (the first largest value) and
    softmax(...).amax(-1), in one C pass on CPU (the probability through the kernels' exp, within 1e-6 of torch's);
    without `with_prob` the probability is None and its exp pass is skipped."""
    if _load() is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return logits.argmax(-1), torch.softmax(logits, -1).amax(-1) if with_prob else None
    lg = logits.contiguous()
    idx = torch.empty(lg.shape[0], dtype=torch.long)
    prob = torch.empty(lg.shape[0], dtype=torch.float32) if with_prob else None
    _lib.argmax_prob(lg.data_ptr(), lg.shape[0], lg.shape[1], idx.data_ptr(), None if prob is None else prob.data_ptr())
    return idx, prob


@contextlib.contextmanager
def torch_on_caller():
    """torch's ops inside run on the calling thread alone (torch.set_num_threads(1), restored after; OpenMP's thread
    count is the caller's own setting). Sampling's vocabulary-wide ops (a fill, a division, a scatter over 151,936
    entries) are OpenMP regions, and right after a kernel call the pool's workers hold the cores spinning: a region's
    worker waited for one, 0.5-0.8 ms on average and 3-8 ms at the 97th percentile where the op alone takes 0.07-0.1
    on one thread (2-core Zen 4)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def softmax_rows(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(logits / temperature) over the last dimension, on the calling thread (skinny.c's softmax_rows:
    torch's OpenMP regions wait for a core the kernels' pool holds); torch's softmax without the kernel. A row with
    NaN or +inf, or all -inf, comes out NaN, as torch's does."""
    x = logits.float()
    if _load() is None or x.device.type != "cpu" or x.dim() == 0:
        return torch.softmax(x / temperature, dim=-1)
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib.softmax_rows(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], temperature, out.data_ptr())
    return out


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative weights [B, N] (any positive total), the first index whose running total exceeds
    u[b] x the row's total: index i with odds p_i / total for u [B] uniform in [0, 1) (float64), in one C pass a
    row (skinny.c's sample_rows; torch's float64 cumsum without the kernel). A row with a negative, NaN or infinite
    entry, or nothing positive, raises ValueError, as torch.multinomial refuses it."""
    flat = probs.float().contiguous()
    if flat.dim() != 2 or u.shape != (flat.shape[0],):
        raise ValueError(f"sample_rows: probs {list(probs.shape)} and u {list(u.shape)}; want [B, N] and [B]")
    uu = u.to(torch.float64).contiguous()
    idx = None
    if _load() is not None and flat.device.type == "cpu":
        idx = torch.empty(flat.shape[0], dtype=torch.long)
        rc = _lib.sample_rows(flat.data_ptr(), flat.shape[0], flat.shape[1], uu.data_ptr(), idx.data_ptr())
        if rc < 0:
            raise MemoryError("sample_rows: no memory for a row's block sums")
        bad = rc - 1
    else:
        ok = ((flat >= 0) & (flat < float("inf"))).all(-1) & (flat.double().sum(-1) > 0)
        bad = -1 if bool(ok.all()) else int((~ok).nonzero()[0])
    if bad >= 0:
        raise ValueError(f"sample_rows: row {bad} has a negative, NaN or infinite weight or none positive; "
                         "sampling needs a distribution (check the logits for NaN/inf)")
    if idx is not None:
        return idx
    run = flat.double().cumsum(-1)
    idx = torch.searchsorted(run, (uu * run[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    # rounding past the end, or onto a zero entry: the last positive entry at or before it
    pos = torch.arange(flat.shape[1]).expand_as(flat).masked_fill(flat <= 0, -1).cummax(-1).values
    return pos.gather(-1, idx.clamp(max=flat.shape[1] - 1).unsqueeze(-1)).squeeze(-1)


def stream_read(x: torch.Tensor) -> int:
    """Read every byte of a contiguous tensor once on the kernels' threads (the bench's bandwidth probe)."""
    _cpu("stream_read", "x", x, x.dtype)
    return _lib.stream_read(x.data_ptr(), x.numel() * x.element_size() // 64 * 64, _threads)


PEAK_INSTRUCTION = {"avx512": "vpdpbusd zmm (AVX512_VNNI, 64 int8 multiply-adds)",
                    "avx512+amx": "vpdpbusd zmm (AVX512_VNNI, 64 int8 multiply-adds; the GGUF tiles' TDPBSSD is not "
                                  "timed)",
                    "avx2": "vpmaddubsw ymm + vpaddw (AVX2, 32 int8 multiply-adds)"}


def int8_peak(seconds: float = 0.2) -> dict:
    """The int8 multiply-add rate of this build's dot-product instruction on the kernels' threads, best of 3 runs
    of about `seconds` / 3: no kernel of the build multiplies faster, so S tokens' multiply-adds over it bound an
    S-token forward from below (bench's `verify_floor`)."""
    if _load() is None:
        raise RuntimeError("int8_peak needs the skinny kernel (a C compiler and an AVX2 CPU); the torch path has no "
                           "int8 dot product to measure")
    iters, best = 1 << 12, 0.0
    while True:  # grow the run until it lasts a tenth of the budget, then time three of a third each
        t = time.perf_counter()
        _lib.int8_peak(iters, _threads)
        took = time.perf_counter() - t
        if took > seconds / 10 or iters > 1 << 34:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / 3 / took))
    for _ in range(3):
        t = time.perf_counter()
        macs = _lib.int8_peak(iters, _threads)
        best = max(best, macs / (time.perf_counter() - t))
    return {"macs_per_s": best, "instruction": PEAK_INSTRUCTION[path()], "threads": _threads}


_epoch = 0


def weights_moved() -> None:
    """Say that weight tensors were moved or replaced (`.data =`, a module's table entry, `.to()`): each cached
    layer plan (`Block.fast`) checks its addresses at its next step. In-place updates need no call: plans point
    at the memory. Checking the addresses every step had cost ~0.5 ms of the 0.5B draft's 9 ms step (cold: the
    weights stream evicts the Python objects the check reads)."""
    global _epoch
    _epoch += 1


def weights_epoch() -> int:
    return _epoch


class _Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("sc", ctypes.c_void_p), ("wt", ctypes.c_int), ("gs", ctypes.c_int),
                ("N", ctypes.c_int), ("K", ctypes.c_int)]


class LayerPlan(ctypes.Structure):
    """skinny.c's layer_t: one decoder layer's weight pointers and shapes, built once per layer (`layer_plan`)."""

    _fields_ = [("qkv", _Lin), ("o", _Lin), ("up", _Lin), ("down", _Lin), ("bias", ctypes.c_void_p),
                ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("hq", ctypes.c_int), ("hkv", ctypes.c_int), ("d", ctypes.c_int)]


def layer_plan(wqkv, wo, w13, w2, bias: torch.Tensor | None, attn_norm: torch.Tensor, ffn_norm: torch.Tensor,
               eps: float, hq: int, hkv: int, head_dim: int) -> LayerPlan:
    """skinny.c's layer_t for `decoder_layer`: pointers, shapes and weight types of one decoder layer."""
    lins, shapes = [], []
    for name, w in (("wqkv", wqkv), ("wo", wo), ("w13", w13), ("w2", w2)):
        wp, sp, wt, gs, N, K = _weight_args(w, "layer_plan", name)
        lins.append(_Lin(wp, sp or 0, wt, gs, N, K))
        shapes.append((N, K))
    (nqkv, H), (no, ko), (n13, k13), (n2, k2) = shapes
    chain = [("wqkv", (nqkv, H), ((hq + 2 * hkv) * head_dim, H)), ("wo", (no, ko), (H, hq * head_dim)),
             ("w13", (n13, k13), (2 * (n13 // 2), H)), ("w2", (n2, k2), (H, n13 // 2))]
    for name, got, want in chain:
        if not (got == want):
            _fail("layer_plan", f"{name} (out_features, in_features)", got,
                  f"be {want} (hidden {H}, {hq} + 2 x {hkv} heads of {head_dim}, down's in_features half of gate/up's "
                  "out_features)")
    for name, t in (("attn_norm", attn_norm), ("ffn_norm", ffn_norm)):
        _cpu("layer_plan", name, t, torch.float32, (H,))
    if bias is not None:
        _cpu("layer_plan", "bias", bias, torch.float32, (nqkv,))
    ptr = [0 if t is None else t.data_ptr() for t in (bias, attn_norm, ffn_norm)]
    plan = LayerPlan(*lins, *ptr, eps, head_dim ** -0.5, hq, hkv, head_dim)
    # The plan holds what it points into, so a plan can never outlive its memory (weights replaced later are the
    # caller's to track: `weights_moved`).
    plan._keep = tuple(t for x in (wqkv, wo, w13, w2, bias, attn_norm, ffn_norm) if x is not None
                       for t in ((x.qweight, x.scales) if _quantized(x) else (x,)))
    return plan


def plan_array(plans: list[LayerPlan]):
    """A C array of pointers to layer plans, for `decoder_layers` (the plans must outlive it)."""
    return (ctypes.POINTER(LayerPlan) * len(plans))(*(ctypes.pointer(p) for p in plans))


def decoder_layers(plans, n: int, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, kv_len: int) -> None:
    """`decoder_layer` for each of the n layers in turn, in one C call: plans from `plan_array`, k / v the cache's
    [layers, B, H_kv, length, D] buffers (each layer's block contiguous, as KVCache.rows keeps it)."""
    if not (0 <= n <= len(plans)):
        _fail("decoder_layers", "n", n, f"lie in [0, {len(plans)}] (the plans given)")
    _cpu("decoder_layers", "x", x, torch.float32, (None, None, None))
    B, S, H = x.shape
    if not (k.dim() == 5 and max(n, 1) <= k.shape[0]):
        _fail("decoder_layers", "k.shape", list(k.shape),
              f"be [>= {max(n, 1)} layers, B, H_kv, length, D]")
    _check_step("decoder_layers", x, pos, slots, cos, sin, k[0], v[0], mask, kv_len)
    for name, t in (("k", k), ("v", v)):
        if not (t.shape == k.shape and t.stride() == k.stride()):
            _fail("decoder_layers", f"{name}.shape", list(t.shape),
                  f"be {list(k.shape)} with strides {k.stride()}")
    if n:  # the plans of one model share these (layer_plan checked each plan's own shapes)
        p0 = plans[0].contents
        if not ((p0.qkv.K, p0.hkv, p0.d) == (H, k.shape[2], k.shape[4])):
            _fail("decoder_layers",
                  "the plans' (hidden, kv heads, head_dim)", (p0.qkv.K, p0.hkv, p0.d),
                  f"be x's hidden size and the cache's: {(H, k.shape[2], k.shape[4])}")
    _status(_lib.decoder_layers(plans, n, x.data_ptr(), B, S, pos.data_ptr(), slots.data_ptr(), cos.data_ptr(),
                                sin.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), k.shape[3],
                                None if mask is None else mask.data_ptr(), kv_len, _threads), "decoder_layers")


def _check_step(fn: str, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor | None, kv_len: int) -> None:
    """A decoder step's arguments besides the plans: x [B, S, H]; pos / slots [B, S] int64 inside the RoPE tables and
    the caches; one layer's caches [B, H_kv, length, D], each a contiguous block; kv_len within the cache length."""
    B, S, _ = x.shape
    for name, t in (("pos", pos), ("slots", slots)):
        _cpu(fn, name, t, torch.int64, (B, S))
    for name, t in (("kc", kc), ("vc", vc)):
        if not (t.dim() == 4 and t.shape[0] == B):
            _fail(fn, f"{name}.shape", list(t.shape), f"be [{B}, H_kv, length, D]")
        if not (t.device.type == "cpu" and t.dtype == KV_DTYPE):
            _fail(fn, name, f"{t.dtype} on {t.device}",
                  "be bfloat16 on cpu (the kernels' K/V cache: Transformer.new_cache makes it)")
        inner = (t.shape[2] * t.shape[3], t.shape[3], 1)
        if not (t.stride()[1:] == inner):
            _fail(fn, f"{name}.stride()", t.stride(), f"end in {inner} (each row's heads, slots "
                  "and columns contiguous)")
    if not (vc.shape == kc.shape):
        _fail(fn, "vc.shape", list(vc.shape), f"be kc's {list(kc.shape)}")
    D = kc.shape[3]
    _cpu(fn, "cos", cos, torch.float32, (None, D))
    _cpu(fn, "sin", sin, torch.float32, tuple(cos.shape))
    if not (0 <= kv_len <= kc.shape[2]):
        _fail(fn, "kv_len", kv_len, f"lie in [0, {kc.shape[2]}] (the cache length)")
    if mask is not None:
        _cpu(fn, "mask", mask, (torch.uint8, torch.bool), (B, S, kv_len))
    _in_range(fn, "pos", pos, cos.shape[0], "the RoPE tables' rows")
    _in_range(fn, "slots", slots, kc.shape[2], "the cache length")


def decoder_layer(plan: LayerPlan, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor | None,
                  kv_len: int) -> None:
    """One decoder layer on x [B, S, H] (fp32, updated in place) in one C call: RMSNorm + QKV (+ bias), RoPE and
    the cache write, attention (mask None: each query sees the slots up to its own), the output projection,
    RMSNorm + gate/up, SwiGLU + down, both residuals."""
    _cpu("decoder_layer", "x", x, torch.float32, (None, None, plan.qkv.K))
    _check_step("decoder_layer", x, pos, slots, cos, sin, kc, vc, mask, kv_len)
    if not ((kc.shape[1], kc.shape[3]) == (plan.hkv, plan.d)):
        _fail("decoder_layer", "kc.shape", list(kc.shape),
              f"have {plan.hkv} kv heads of {plan.d} (the plan's)")
    B, S, _ = x.shape
    _status(_lib.decoder_layer(ctypes.byref(plan), x.data_ptr(), B, S, pos.data_ptr(), slots.data_ptr(),
                               cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[2],
                               None if mask is None else mask.data_ptr(), kv_len, _threads), "decoder_layer")
