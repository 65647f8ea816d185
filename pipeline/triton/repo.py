"""Write triton_repo/<name>/ for the torch backend: tensorrtllm_backend's model names and client I/O.

`ensemble` and `tensorrt_llm_bls` are two instances of one python-backend model (`model.py`), with
tensorrtllm_backend's ensemble interface: each loads the engines and serves every decoding method
they support (request input `method`, default from its config). Not a platform "ensemble" over a
BLS model: Triton 2.51's ensemble does not pass a client's cancellation, deadline or disconnect on
to its steps, and a model that forwards requests by BLS calls lost final responses under load; each
of the two sees its own clients. They take turns at decoding steps (`gate.py`, a file lock in the
repository). `triton.models` serves only some of them; both are decoupled (streaming) or not as
`triton.decoupled` says. Every config.pbtxt is produced from Triton's own ModelConfig protobuf, so
it parses by construction.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from pathlib import Path

from pipeline.contract import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS
from pipeline.spec import Spec, decode_config

PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
MODEL_SOURCE = Path(__file__).resolve().parent / "model.py"
BLS = "tensorrt_llm_bls"
ENSEMBLE = "ensemble"
MODELS = (ENSEMBLE, BLS)
STEP_LOCK = ".step.lock"  # pipeline.triton.gate.LOCK_NAME (gate.py is not imported here: it is the served side's)

# The client contract is written once, as tensorrtllm_backend's ensemble (reference/trtllm.md 4.4) in
# engine_repo. The torch backend declares every one of its inputs, and the older era's names next to them, so
# none is "unexpected" to Triton: the parser (pipeline/triton/parse.py) honours each or refuses it with an error
# naming it. `stop` is tensorrt_llm's: stop the running request with this request id.
EXTRA_INPUTS: list[tuple[str, str, list[int]]] = [
    ("random_seed", "TYPE_UINT64", [1]),
    ("min_length", "TYPE_INT32", [1]),
    ("early_stopping", "TYPE_BOOL", [1]),
    ("return_num_input_tokens", "TYPE_BOOL", [1]),
    ("return_num_output_tokens", "TYPE_BOOL", [1]),
    ("prompt_embedding_table", "TYPE_FP16", [-1, -1]),
    ("prompt_table_extra_id", "TYPE_UINT64", [1]),
    ("prompt_vocab_size", "TYPE_INT32", [1]),
    ("lora_task_id", "TYPE_UINT64", [1]),
    ("lora_weights", "TYPE_FP16", [-1, -1]),
    ("lora_config", "TYPE_INT32", [-1, 3]),
    ("guided_decoding_guide_type", "TYPE_STRING", [1]),
    ("guided_decoding_guide", "TYPE_STRING", [1]),
    ("stop", "TYPE_BOOL", [1]),
    ("cache_prompt", "TYPE_BOOL", [1]),  # false: this request neither reuses nor keeps prompt-cache entries
    ("prediction", "TYPE_STRING", [1]),  # Predicted Outputs: text the answer likely repeats, the first draft source
]
SERVED_OUTPUTS = ("text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                  "num_input_tokens", "num_output_tokens")


def _served(table: list, names: tuple[str, ...]) -> list[tuple[str, str, list[int]]]:
    by_name = {t[0]: t for t in table}
    return [(n, by_name[n][1], list(by_name[n][2])) for n in names]


INPUTS: list[tuple[str, str, list[int]]] = [(t[0], t[1], list(t[2])) for t in ENSEMBLE_INPUTS] + [
    e for e in EXTRA_INPUTS if e[0] not in {t[0] for t in ENSEMBLE_INPUTS}]
# Every input is optional to Triton: a `stop` request carries only `stop`, and a missing text_input or
# max_tokens is refused by the model with an error naming it.
REQUIRED: tuple[str, ...] = ()
# tensorrtllm_backend's KV-reuse outputs (its tensorrt_llm model's names), sent with the perf outputs
# (return_perf_metrics or return_kv_cache_reuse_stats): blocks of prompt_cache.block_tokens tokens; and the exact
# count of prompt tokens taken from the prompt cache (vLLM's name; a hit may end inside a block).
KV_CACHE_OUTPUTS: list[tuple[str, str, list[int]]] = [
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    ("kv_cache_reused_blocks", "TYPE_INT32", [1]),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
    ("num_cached_tokens", "TYPE_INT32", [1]),
]
OUTPUTS: list[tuple[str, str, list[int]]] = _served(ENSEMBLE_OUTPUTS, SERVED_OUTPUTS) + KV_CACHE_OUTPUTS


def ensemble_io() -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    """(inputs, outputs) of the client contract the `ensemble` model serves (pipeline/contract.py), as (name,
    data_type, dims) lists. Its config declares INPUTS / OUTPUTS: these plus EXTRA_INPUTS."""
    shared = {t[0] for t in ENSEMBLE_INPUTS} | {t[0] for t in ENSEMBLE_OUTPUTS}
    return ([(n, t, list(d)) for n, t, d in INPUTS if n in shared],
            [(n, t, list(d)) for n, t, d in OUTPUTS if n in shared])


def client_model(spec: Spec, prefer: str = ENSEMBLE) -> str:
    """The served model a client of this spec talks to: `prefer` when the spec serves it, else the one it serves."""
    return prefer if prefer in spec.triton.models else spec.triton.models[0]


def served_methods(spec: Spec) -> list[str]:
    """The methods the spec's built engines serve (what the served model lists at start-up)."""
    bc = json.loads((spec.engine_dir / "target" / "config.json").read_text())["build_config"]
    draft = (spec.engine_dir / "draft" / "config.json").is_file()
    lookup = int(bc.get("max_draft_len", 0)) > 0  # the engine takes drafts: prompt lookup and the suffix drafter
    medusa = (spec.engine_dir / "medusa" / "config.json").is_file()
    return [m for m, on in (("baseline", True), ("draft_target", draft), ("prompt_lookup", lookup), ("medusa", medusa),
                            ("suffix", lookup), ("hybrid", lookup and draft)) if on]


def default_methods(spec: Spec) -> list[str]:
    """Preference order for requests without `method`: the spec's speculative methods, then baseline.

    The model serves the first one whose engine is built (so a missing draft falls back to Medusa).
    """
    auto = [m for m, on in (("draft_target", spec.has_draft), ("medusa", spec.has_medusa)) if on] + ["baseline"]
    named = spec.speculation.method  # speculation.method: the spec's choice first (the flagship's hybrid)
    return auto if named == "auto" else [named] + [m for m in auto if m != named]


def default_method(spec: Spec) -> str:
    """The method a request without `method` gets when every engine the spec names is built."""
    return default_methods(spec)[0]


def python_path() -> list[str]:
    """Directories the python-backend stub must see: this venv's site-packages and the `pipeline` package."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], str(PACKAGE_ROOT)]
    return list(dict.fromkeys(paths))


def _io(msg_list, entries, required=()):
    from tritonclient.grpc import model_config_pb2 as mc  # heavy (grpc): only writing a config pays it

    for name, dtype, dims in entries:
        m = msg_list.add()
        m.name = name
        m.data_type = mc.DataType.Value(dtype)
        m.dims.extend(dims)
        if required is not None and name not in required and hasattr(m, "optional"):
            m.optional = True


def model_config(spec: Spec, engine_dir: Path, name: str = BLS):
    """ModelConfig of one served model (`ensemble` or `tensorrt_llm_bls`: the same python model)."""
    from tritonclient.grpc import model_config_pb2 as mc  # heavy (grpc): only writing a config pays it

    # The batch dimension is explicit (max_batch_size 0, dims [-1, ...]): with Triton's own batching (max_batch_size
    # > 0) a request of batch size 0 got Triton core's "input byte size mismatch" and never reached the model; this
    # way the parser answers it in its own words and refuses batches above limits.max_batch_size (`max_rows`).
    # Triton then hands over requests one at a time, which costs nothing: execute only parses and queues, and the
    # scheduler batches rows itself.
    c = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    c.model_transaction_policy.decoupled = spec.triton.decoupled
    _io(c.input, [(n, t, [-1, *d]) for n, t, d in INPUTS], REQUIRED)
    _io(c.output, [(n, t, [-1, *d]) for n, t, d in OUTPUTS], None)
    g = c.instance_group.add()
    g.count = spec.triton.instance_count
    g.kind = mc.ModelInstanceGroup.KIND_CPU
    params = {
        "max_rows": str(spec.limits.max_batch_size),
        "engine_dir": str(Path(engine_dir).resolve()),
        "device": spec.device,
        "threads": str(spec.threads),
        "default_method": ",".join(default_methods(spec)),
        **decode_config(spec).to_params(),  # read back by SpecDecodeConfig.from_params in model.py
        "exclude_input_in_output": "true",
        "add_special_tokens": "true",
        "step_lock": "true",
        "shared_weights": "true",  # both served models map one copy of the weights (pipeline/runtime/shared.py)
        "prompt_cache_bytes": str(spec.prompt_cache.bytes),  # each served model's own prompt cache
        "prompt_cache_block_tokens": str(spec.prompt_cache.block_tokens),
        "stream_interval_ms": f"{spec.triton.stream_interval_ms:g}",  # PostedResponder's gap between pieces
        "kv_cache_bytes": str(spec.kv_cache.bytes),
        "prefill_chunk": str(spec.kv_cache.prefill_chunk),
        "python_path": ":".join(python_path()),
    }
    for key, value in params.items():
        c.parameters[key].string_value = value
    return c


def bls_config(spec: Spec, engine_dir: Path):
    return model_config(spec, engine_dir, BLS)


def to_pbtxt(config) -> str:
    from google.protobuf import text_format  # with tritonclient's protobufs

    return text_format.MessageToString(config)


def parse_pbtxt(text: str):
    """Parse a config.pbtxt with Triton's schema (raises on anything Triton would reject as syntax)."""
    from google.protobuf import text_format  # with tritonclient's protobufs
    from tritonclient.grpc import model_config_pb2 as mc  # heavy (grpc): only writing a config pays it

    return text_format.Parse(text, mc.ModelConfig())


def write_repo(spec: Spec, log=print) -> Path:
    """Write triton_repo/<name>/ (replacing it) and return its path."""
    if spec.backend != "torch":
        raise ValueError(f"backend: {spec.backend!r}; write_repo builds the torch backend's repository "
                         "(the tensorrt_llm backend uses pipeline.trtllm)")
    engine_dir = spec.engine_dir
    if not (engine_dir / "target" / "config.json").is_file():
        raise FileNotFoundError(f"{engine_dir / 'target'} is not built; run `make engine SPEC=...` first")
    repo = spec.repo_dir
    tmp = repo.parent / f".{repo.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name in spec.triton.models:
        (tmp / name / "1").mkdir(parents=True)
        shutil.copyfile(MODEL_SOURCE, tmp / name / "1" / "model.py")
        (tmp / name / "config.pbtxt").write_text(to_pbtxt(model_config(spec, engine_dir, name)))
    (tmp / STEP_LOCK).touch()
    if repo.exists():
        shutil.rmtree(repo)
    tmp.rename(repo)
    log(f"wrote {repo} (models {', '.join(spec.triton.models)}; default method, first built of: "
        f"{', '.join(default_methods(spec))}; python {sys.version.split()[0]})")
    return repo
