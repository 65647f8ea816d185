"""Engine loading for the torch backend: read a built engine directory back into a model.

Below the rest of `runtime/` and free of the build (`pipeline/engine.py`, which writes what this
reads): `config.json` (TensorRT-LLM's shape plus the runtime's own fields) records the sha256 of
every file, so a damaged or half-written engine is named at load time, never run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pipeline.runtime import quant, shared
from pipeline.runtime.model import ModelConfig, Transformer, build_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineError(RuntimeError):
    """An engine that is missing, incomplete or damaged; the message names the file."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_config(engine_dir: Path, verify: bool = True) -> dict:
    """Read an engine's config.json; with `verify`, check every recorded file's hash."""
    cfg_path = engine_dir / "config.json"
    if not cfg_path.is_file():
        raise EngineError(f"{engine_dir} is not a built engine (no config.json); run `make engine`")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise EngineError(f"{cfg_path} is not valid JSON ({e}); rebuild with `make engine`") from None
    if verify:
        for name, digest in cfg.get("files", {}).items():
            f = engine_dir / name
            if not f.is_file():
                raise EngineError(f"{f} is missing; the engine is incomplete, rebuild with `make engine`")
            if sha256(f) != digest:
                raise EngineError(f"{f} does not match the sha256 in {cfg_path} (truncated or altered); "
                                  "rebuild with `make engine`")
    return cfg


@dataclass
class Engine:
    """A loaded engine: the model, its tokenizer and its config.json."""

    model: Transformer
    tokenizer: Any
    config: dict
    path: Path

    @property
    def max_draft_len(self) -> int:
        return int(self.config["build_config"]["max_draft_len"])


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError("device: cuda was asked for but torch sees no CUDA GPU; set device: cpu or auto")
    return torch.device(device)


def load_model_dir(engine_dir: Path, device: str = "cpu", dtype: str | None = None,
                   verify: bool = True) -> tuple[Transformer, dict]:
    cfg = read_config(engine_dir, verify=verify)
    mcfg = ModelConfig(**cfg["runtime"]["model"])
    state = load_file(str(engine_dir / "model.safetensors"))
    int4 = any(k.endswith(".qweight") and v.dtype == torch.uint8 for k, v in state.items())
    if int4 and cfg["runtime"].get("quant_format") != quant.FORMAT:
        raise EngineError(f"{engine_dir}: int4 weights in layout {cfg['runtime'].get('quant_format')!r}, this "
                          f"runtime reads {quant.FORMAT!r}; rebuild with `python -m pipeline engine SPEC --force`")
    dt = DTYPES[dtype or cfg["pretrained_config"]["dtype"]]
    dev = resolve_device(device)
    share = shared.enabled() and dev.type == "cpu"  # one copy for every process serving this engine
    model = build_model(mcfg, state, dt, dev, act8=quant.int8_activations(cfg), hugepages=not share)
    del state
    if share:
        shared.share_weights(model, engine_dir)
    return model, cfg


def load_tokenizer(engine_dir: Path):
    from transformers import AutoTokenizer  # heavy (about 1 s): only a loader that needs the tokenizer pays it

    return AutoTokenizer.from_pretrained(str(engine_dir))


def load_engine(engine_dir: Path, device: str = "cpu", dtype: str | None = None, verify: bool = True) -> Engine:
    model, cfg = load_model_dir(engine_dir, device, dtype, verify)
    return Engine(model, load_tokenizer(engine_dir), cfg, engine_dir)
