"""One copy of a CPU model's weights for every process that serves it: the weights as the kernels read them (after
tile_model's layout work) live in a file beside the engine, and each process maps that file instead of holding its own
copy.

Triton serves `ensemble` and `tensorrt_llm_bls` as two stub processes of the same model (pipeline/triton/model.py),
each loading the engines: with private copies the flagship pair held its weights twice. Here the first process to load
writes `.shared-weights-<key>.bin` (under a file lock), and every process maps it copy-on-write (MAP_PRIVATE): the
pages are the page cache's, one copy however many processes map it, and a process that writes a weight in place gets
a private copy of that page only (nothing in serving does). A file whose bytes differ from the freshly laid-out
weights (an older layout, a rebuilt engine) is never used: it is compared tensor by tensor and rewritten.

The cost: file pages are 4 KB pages, where `quant.to_hugepages` puts a private copy on 2 MB pages (measured ~5% of a
one-token target step, 79 vs 75 ms, on the bf16 1.5B). `PIPELINE_SHARED_WEIGHTS=1` turns sharing on (the Triton model
sets it; the CLI and the benchmarks keep private huge pages).

Page-cache pages can be evicted where private memory (no swap) cannot. Beside the served flagship, another process
touching 18 GiB took the stubs' file-backed resident memory from 2.6 to 1.4 GB and the next 64-token request from 2.9
to 6.4 s; at 20 GiB to 0.7 GB and 38.8 s (the likely cause of one validate concurrency point at 4 tokens/s against
20-24, right after its transformers section had loaded the pair in bf16 in 16 GB). So each mapping is locked as its
pages are touched (mlock2 MLOCK_ONFAULT): a touched weight stays in memory, an embedding row never looked up is never
read. Locking never copies a page (a plain mlock of a writable private mapping would fault every page for writing, one
private copy per process). It needs CAP_IPC_LOCK or `ulimit -l` above the file's size; where it fails the process says
so on stderr (Triton's log) and serves unlocked. `PIPELINE_LOCK_WEIGHTS=0` turns it off. Locked, after the same 18
GiB: 2.6 GB stayed resident and the request took 3.4 s against 2.8 warm (what was evicted then was Python's and
torch's code).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import mmap
import os
import resource
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.runtime import kernels, quant

PREFIX = ".shared-weights-"
SCREEN_PREFIX = ".shared-screen-"  # a GGUF head's screen (head_screen.py), beside its model's file
MIN_BYTES = 16 << 10  # smaller tensors stay private: a 4 KB page apiece would waste more than they weigh
ALIGN = 4096
MLOCK_ONFAULT = 1  # linux/mman.h


def enabled() -> bool:
    """Whether models loaded in this process share their weights (`PIPELINE_SHARED_WEIGHTS=1`)."""
    return os.environ.get("PIPELINE_SHARED_WEIGHTS", "0") == "1"


def lock_enabled() -> bool:
    """Whether shared mappings are locked in memory as they are touched (`PIPELINE_LOCK_WEIGHTS`, on unless "0")."""
    return os.environ.get("PIPELINE_LOCK_WEIGHTS", "1") != "0"


def _slots(model: nn.Module) -> tuple[dict[int, Tensor], dict[int, list[tuple[dict, str]]], list[str]]:
    """The CPU tensors worth sharing by storage address, where each one sits (tied tensors: every table), and names."""
    tensors: dict[int, Tensor] = {}
    slots: dict[int, list[tuple[dict, str]]] = {}
    names: list[str] = []
    for mname, mod in model.named_modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES:
                    continue
                key = t.data_ptr()
                if key not in tensors:
                    tensors[key] = t
                    names.append(f"{mname}.{name}")
                slots.setdefault(key, []).append((table, name))
    return tensors, slots, names


def _bytes(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def share_weights(model: nn.Module, where: Path, prefix: str = PREFIX) -> int:
    """Point `model`'s weights at the shared file for them in directory `where` (written first if missing or stale);
    returns the bytes now shared (0 where the directory cannot be written and holds no such file). `prefix` names
    the file and its lock: one file per prefix in a directory (a new layout replaces the old one)."""
    tensors, slots, names = _slots(model)
    if not tensors:
        return 0
    layout, at = [], 0
    for name, t in zip(names, tensors.values()):
        n = t.numel() * t.element_size()
        layout.append((name, str(t.dtype), tuple(t.shape), at, n))
        at += (n + ALIGN - 1) & ~(ALIGN - 1)
    size = at
    key = hashlib.sha256(repr(layout).encode()).hexdigest()[:16]
    path = Path(where) / f"{prefix}{key}.bin"
    try:
        lock = open(Path(where) / f"{prefix}lock", "a+")  # noqa: SIM115 - held until the file is mapped
    except OSError:
        return 0
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        region = _map(path, size) if path.is_file() and path.stat().st_size == size else None
        if region is not None and not all(torch.equal(_bytes(t), _view(region, e[3], e[4]))
                                           for t, e in zip(tensors.values(), layout)):
            region = None  # stale bytes under a current name: never used
        if region is None:
            _write(path, size, tensors.values(), layout)
            for old in path.parent.glob(f"{prefix}*.bin"):  # other layouts; a process mapping one keeps its pages
                if old != path:
                    old.unlink(missing_ok=True)
            region = _map(path, size)
    if lock_enabled():
        _lock(region, size, path)
    for (key_, t), e in zip(tensors.items(), layout):
        view = _view(region, e[3], e[4]).view(t.dtype).view(t.shape)
        for table, name in slots[key_]:
            old = table[name]
            if isinstance(old, nn.Parameter):
                old.data = view  # every module holding this Parameter (a tied head) sees the move
            else:
                table[name] = view
    _own_small(model)
    kernels.weights_moved()
    _trim()
    return sum(e[4] for e in layout)


def _own_small(model: nn.Module) -> None:
    """Give the tensors too small to share (norms, biases) storage of their own: safetensors' load_file hands out
    views of one mapping of the engine file, so a single norm left pointing into it kept all of model.safetensors
    mapped and resident (measured: 217 MB of a 217 MB engine, beside the shared copy)."""
    done: dict[int, Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or t.numel() * t.element_size() >= MIN_BYTES:
                    continue
                key = t.data_ptr()
                if key not in done:
                    done[key] = t.detach().clone()
                if isinstance(t, nn.Parameter):
                    t.data = done[key]
                else:
                    table[name] = done[key]


def _view(region: mmap.mmap, at: int, n: int) -> Tensor:
    return torch.frombuffer(region, dtype=torch.uint8, count=n, offset=at)


def _map(path: Path, size: int) -> mmap.mmap:
    """The file mapped copy-on-write: page-cache pages shared with every other process that maps it."""
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    for advice in ("MADV_HUGEPAGE", "MADV_WILLNEED"):  # large folios where the filesystem has them; read ahead
        if hasattr(mmap, advice):
            try:
                region.madvise(getattr(mmap, advice))
            except OSError:
                pass
    return region


def _lock(region: mmap.mmap, size: int, path: Path) -> bool:
    """Lock the mapping's pages in memory as they are faulted in (module docstring); False, said on stderr, where the
    system refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if libc.mlock2(ctypes.c_void_p(addr), ctypes.c_size_t(size), MLOCK_ONFAULT) == 0:
        return True
    err = ctypes.get_errno()
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KB"
    print(f"[pipeline] weights not locked in memory: mlock2 of {path.name} ({size / 2**20:.0f} MB) failed: "
          f"{os.strerror(err)} (ulimit -l: {limit}). Under memory pressure the kernel may evict them and a request "
          f"will read them back from disk; raise `ulimit -l` to at least {size >> 10} KB (or grant CAP_IPC_LOCK), "
          f"or set PIPELINE_LOCK_WEIGHTS=0 to silence this.", file=sys.stderr, flush=True)
    return False


def locked_bytes(pid: int | str = "self") -> int:
    """Bytes of a process's address space under mlock (/proc/PID/status VmLck; 0 where absent)."""
    return quant.proc_bytes(f"/proc/{pid}/status", "VmLck")


def _write(path: Path, size: int, tensors, layout) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        for t, e in zip(tensors, layout):
            f.seek(e[3])
            f.write(memoryview(_bytes(t).numpy()))
        f.truncate(size)
    os.replace(tmp, path)


def _trim() -> None:
    """Give the heap's freed pages back to the system: the private copies the shared file replaced were freed, but
    glibc keeps freed heap memory, which would still count as resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def resident(pid: int | str = "self") -> dict[str, int]:
    """Rss, Pss and their anonymous / file parts of a process, in bytes (/proc/PID/smaps_rollup; {} where absent)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Anonymous", "Shared_Clean", "Private_Clean",
                            "Private_Dirty"):
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def shared_mappings(pid: int | str = "self") -> dict[str, dict[str, int]]:
    """Per mapped shared-weights file of a process (a model's or a head screen's): its Rss and Pss in bytes
    (/proc/PID/smaps)."""
    out: dict[str, dict[str, int]] = {}
    current = None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                    current = head[5] if len(head) > 5 and (PREFIX in head[5] or SCREEN_PREFIX in head[5]) else None
                    if current:
                        out.setdefault(current, {"Rss": 0, "Pss": 0})
                elif current and head and head[0] in ("Rss:", "Pss:"):
                    out[current][head[0][:-1]] += int(head[1]) * 1024
    except OSError:
        pass
    return out
