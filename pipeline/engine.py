"""Engine build for the torch backend (loading is pipeline/runtime/engine_io.py, below the runtime).

An engine directory holds `config.json` (modelled on TensorRT-LLM's: `version`,
`pretrained_config`, `build_config`) and the weights in the runtime's layout. It is written to a
temporary directory and renamed into place, and `config.json` records the sha256 of every file,
so an interrupted build never looks complete and a damaged file is named at load time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from pipeline import sources
from pipeline.runtime import gguf_weights, quant
from pipeline.runtime.engine_io import DTYPES, EngineError, sha256
from pipeline.runtime.model import ARCHITECTURES, ModelConfig, hf_to_runtime
from pipeline.spec import Spec

ENGINE_FORMAT = "pipeline-torch-engine/1"


def input_hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def is_current(dest: Path, want: str) -> bool:
    """True when `dest` holds a complete engine built from inputs hashing to `want`."""
    cfg = dest / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("input_hash") == want
    except (json.JSONDecodeError, OSError):
        return False


SERVING_LIMITS = ("max_batch_size", "max_input_len", "max_seq_len")  # size the runtime's caches, never the weights
# Also rewritten in place: no weight of the torch backend depends on max_draft_len (it sizes per-round buffers and
# the requests' k limit); only whether it is 0 does (the target's speculative_decoding_mode, hashed on its own), and
# a draft's pick-k table reads min(max_draft_len, 8) (its `same` check). Medusa's tree does depend on it: its engine
# hashes max_draft_len itself and rebuilds.
REFRESHABLE = (*SERVING_LIMITS, "max_draft_len")


def built_limits(cfg: dict, fallback: dict | None = None) -> dict:
    """The limits an engine's input_hash was computed from: `built_limits` in its config.json (recorded by builds
    and kept by in-place refreshes), else, for engines built before it was recorded, its build_config's values with
    `fallback` over them (right until a first refresh rewrote them)."""
    if isinstance(cfg.get("built_limits"), dict):
        return dict(cfg["built_limits"])
    bc = cfg.get("build_config") or {}
    return {**{k: bc[k] for k in REFRESHABLE if k in bc}, **(fallback or {})}


def refresh_limits(dest: Path, limits: dict, want: Callable[[dict], str], max_positions: int | None = None,
                   written: tuple[str, ...] = REFRESHABLE, fallback: dict | None = None,
                   same: Callable[[dict, dict], bool] | None = None) -> str:
    """When `dest`'s weights were built from these inputs and at most `REFRESHABLE` limits changed (`want(limits)`
    hashes the build inputs; `same(built, limits)`, when given, must also hold): "current" when its config.json
    already says these limits, else "written" after writing the `written` ones into it in place. "" when it must be
    rebuilt. A longer context, a bigger batch or a longer draft does not rebuild (nor retrain) what it never changed.
    The engine keeps its input_hash and `built_limits` (what its weights were built from), so the engines built on
    it stay current and every later change is checked against the same inputs."""
    cfg_path = dest / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    bc = cfg.get("build_config") or {}
    built = built_limits(cfg, fallback)
    if any(k not in built for k in REFRESHABLE) or any(k not in bc for k in written) or cfg.get("input_hash") != want(
            {**limits, **{k: built[k] for k in REFRESHABLE}}):
        return ""
    if same is not None and not same(built, limits):
        return ""
    if max_positions is not None and limits["max_seq_len"] > max_positions:
        raise EngineError(f"limits.max_seq_len {limits['max_seq_len']} exceeds the model's max_position_embeddings "
                          f"{max_positions}; lower it")
    if all(bc[k] == limits[k] for k in written):
        if cfg.get("built_limits") != built:  # an engine from before built_limits: record them while they are known
            cfg["built_limits"] = built
            _write_config(cfg_path, cfg)
        return "current"
    bc.update({k: limits[k] for k in written})
    cfg["built_limits"] = built
    _write_config(cfg_path, cfg)
    return "written"


def _write_config(path: Path, cfg: dict) -> None:
    tmp = path.with_name(f".config.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(cfg, indent=2))
    tmp.replace(path)


def write_atomic(dest: Path, write: Callable[[Path], dict]) -> None:
    """Run `write(tmpdir)` (which returns the config dict), hash the files, then rename into `dest`.

    config.json is written last and only inside the temporary directory, so a killed build leaves
    at most a `.tmp-*` directory that no loader treats as an engine.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        config = write(tmp)
        config["files"] = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def engine_config(mcfg: ModelConfig, spec: Spec, dtype: str, mode: str, max_draft_len: int,
                  quantization: str = "none", group_size: int = 128, **extra) -> dict:
    """A config.json in TensorRT-LLM's shape, plus the runtime's own fields.

    `quantization` (none/int8/int4/int4_a8) is recorded as TensorRT-LLM records it:
    `pretrained_config.quantization.quant_algo` W8A16 / W4A16 / W4A8 (null when none) with `group_size`.
    """
    return {
        "version": ENGINE_FORMAT,
        "backend": "torch",
        "pretrained_config": {
            "architecture": ARCHITECTURES.get(mcfg.model_type, "LlamaForCausalLM"),
            **({"qwen_type": "qwen2"} if mcfg.model_type == "qwen2" else {}),
            "dtype": dtype,
            "vocab_size": mcfg.vocab_size,
            "hidden_size": mcfg.hidden_size,
            "intermediate_size": mcfg.intermediate_size,
            "num_hidden_layers": mcfg.num_layers,
            "num_attention_heads": mcfg.num_heads,
            "num_key_value_heads": mcfg.num_kv_heads,
            "head_size": mcfg.head_dim,
            "hidden_act": "silu",
            "position_embedding_type": "rope_gpt_neox",
            "rotary_base": mcfg.rope_theta,
            "norm_epsilon": mcfg.rms_norm_eps,
            "max_position_embeddings": mcfg.max_position_embeddings,
            "share_embedding_table": mcfg.tie_embeddings,
            "quantization": quant.quant_config(quantization, group_size),
            "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        },
        "build_config": {
            "max_batch_size": spec.limits.max_batch_size,
            "max_input_len": spec.limits.max_input_len,
            "max_seq_len": spec.limits.max_seq_len,
            "max_draft_len": max_draft_len,
            "max_beam_width": 1,
            "speculative_decoding_mode": mode,
            "kv_cache_type": "static",
        },
        "runtime": {"model": mcfg.to_dict(), "layout": "fused_qkv+fused_gate_up", "device": spec.device,
                    **({"quant_format": quant.FORMAT} if quantization != "none" else {})},
        **extra,
    }


def save_hf(dest: Path, hf_cfg: dict, state: dict[str, Tensor], tokenizer, dtype: str, tied: bool) -> None:
    """An ordinary Hugging Face checkpoint of the draft's family (Llama, Mistral, Qwen2), written to a
    temporary dir and renamed into place."""
    from transformers import CONFIG_MAPPING  # heavy (transformers): only save_hf pays it

    cfg = dict(hf_cfg)
    model_type = cfg.pop("model_type", "llama")
    if model_type not in ARCHITECTURES:
        model_type = "llama"
    for key in ("quantization_config", "_name_or_path", "transformers_version", "torch_dtype", "layer_types",
                "_model_name_or_path"):
        cfg.pop(key, None)
    cfg.update(num_hidden_layers=state_layers(state), tie_word_embeddings=tied, dtype=dtype,
               architectures=[ARCHITECTURES[model_type]])
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        CONFIG_MAPPING[model_type](**cfg).save_pretrained(str(tmp))
        st = {k: v.to(DTYPES[dtype]).contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
        save_file(st, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def state_layers(state: dict[str, Tensor]) -> int:
    return len({k.split(".")[2] for k in state if k.startswith("model.layers.")})


def save_tokenizer(tok, dest: Path) -> None:
    tok.save_pretrained(str(dest))


def end_ids(mcfg: ModelConfig, tok) -> list[int]:
    """Every id that ends a turn: the config's, the tokenizer's eos, and for Qwen2 also <|endoftext|>
    (its generation config stops on both <|im_end|> and <|endoftext|>)."""
    ids = list(mcfg.eos_token_id or [])
    extra = [tok.eos_token_id]
    if mcfg.model_type == "qwen2":
        extra.append(tok.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tok.get_vocab() else None)
    return ids + [i for i in extra if i is not None and i not in ids]


def _max_positions(dest: Path) -> int | None:
    try:
        return int(json.loads((dest / "config.json").read_text())["pretrained_config"]["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_target(spec: Spec, force: bool = False, log=print) -> Path:
    """Build engines/<name>/target from the spec's target source (a no-op when inputs are unchanged)."""
    dest = spec.engine_dir / "target"
    src = sources.resolve(spec.target.source, Path(spec.root))
    mode = "draft_tokens_external" if spec.limits.max_draft_len > 0 else "none"
    qz, gs = spec.target.quantization, spec.target.group_size
    # Quantization joins the hash only when on, so unquantized engines built before it stay current.
    qpart = () if qz == "none" else ((qz, gs, *quant.layout_tag(qz)),)
    want = input_hash(ENGINE_FORMAT, src.fingerprint(), spec.dtype, vars(spec.limits), mode, *qpart)
    hf_ok = src.kind != "gguf" or (spec.engine_dir / "target_hf" / "config.json").is_file()
    rehash = lambda lim: input_hash(ENGINE_FORMAT, src.fingerprint(), spec.dtype, lim, mode, *qpart)  # noqa: E731
    done = "" if force or not hf_ok else refresh_limits(dest, vars(spec.limits), rehash, _max_positions(dest))
    if done:
        log(f"target engine {dest} is up to date" + (
            f"; limits {', '.join(REFRESHABLE)} written to its config.json" if done == "written" else ""))
        return dest
    t0 = time.perf_counter()
    log(f"loading {src.description} ...")
    hf_cfg, state, tok = sources.load_hf(src)
    dtype = DTYPES[spec.dtype]
    for k in list(state):  # in place, key by key: a 1.5B model in fp32 is 6 GB, so never hold two copies
        state[k] = state[k].to(dtype)
    mcfg = ModelConfig.from_hf(hf_cfg)
    mcfg.eos_token_id = end_ids(mcfg, tok)
    if spec.limits.max_seq_len > mcfg.max_position_embeddings:
        raise EngineError(f"limits.max_seq_len {spec.limits.max_seq_len} exceeds the model's "
                          f"max_position_embeddings {mcfg.max_position_embeddings}; lower it")

    hf_dir = None
    if src.kind == "gguf":
        # A dequantized Hugging Face checkpoint of the target, for TensorRT-LLM's converters and the peers.
        hf_dir = spec.engine_dir / "target_hf"
        log(f"writing {hf_dir} (Hugging Face checkpoint, {spec.dtype}) ...")
        save_hf(hf_dir, hf_cfg, state, tok, spec.dtype, mcfg.tie_embeddings)

    def write(tmp: Path) -> dict:
        # Quantize from the source precision, then cast what stays unquantized (embedding, norms).
        if qz == "gguf":  # the GGUF's own blocks (k-quants, blocks of 32), repacked, never re-rounded (gguf_weights.py)
            if src.kind != "gguf":
                raise EngineError(f"target.quantization: gguf reads a GGUF's own weights, and {src.description} is not "
                                  "a GGUF; use int4_a8 / int4 / int8 or none for it")
            try:
                weights = gguf_weights.gguf_state(hf_to_runtime(state, mcfg), src.path, mcfg.num_layers, log)
            except ValueError as e:
                raise EngineError(f"target.quantization: gguf: {e}") from None
            # fp32: the GGUF's F32 norms and biases and its dequantized embedding rows (a lookup), never rounded to bf16
            weights = quant.cast_state(weights, torch.float32)
        else:
            try:
                weights = quant.quantize_state(hf_to_runtime(state, mcfg), qz, gs,
                                               tie_embeddings=mcfg.tie_embeddings)
            except ValueError as e:
                raise EngineError(f"target.group_size: {e}") from None
            weights = quant.cast_state(weights, dtype)
        save_file(weights, str(tmp / "model.safetensors"))
        save_tokenizer(tok, tmp)
        (tmp / "hf_config.json").write_text(json.dumps(hf_cfg, indent=2, default=str))
        return engine_config(mcfg, spec, spec.dtype, mode, spec.limits.max_draft_len, qz, gs,
                             input_hash=want, built_limits=dict(vars(spec.limits)), source=src.description,
                             **({"hf_checkpoint": str(hf_dir)} if hf_dir else {}))

    log(f"writing {dest} ({spec.dtype}{'' if qz == 'none' else f', {qz} weights'}) ...")
    write_atomic(dest, write)
    log(f"target engine built in {time.perf_counter() - t0:.1f}s: {dest}")
    return dest
