"""Write triton_repo/<name>/ for the torch backend: tensorrtllm_backend's model names and client I/O.

One python-backend model, `tensorrt_llm_bls`, holds the weights once and serves every decoding
method the engines support (request input `method`, default from its config). `ensemble` is a real
Triton ensemble over it, so clients written for tensorrtllm_backend's ensemble work unchanged.
Every config.pbtxt is produced from Triton's own ModelConfig protobuf, so it parses by construction.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

from pipeline.spec import Spec
from pipeline.triton.trtllm_repo import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS

PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
MODEL_SOURCE = Path(__file__).resolve().parent / "model.py"
BLS = "tensorrt_llm_bls"
ENSEMBLE = "ensemble"

# The client contract is written once, as tensorrtllm_backend's ensemble (reference/trtllm.md 4.4) in
# trtllm_repo; the torch backend serves these of its tensors, in this order (penalties, min_tokens and log
# probabilities it does not implement, so its ensemble does not declare them).
SERVED_INPUTS = ("text_input", "max_tokens", "temperature", "top_k", "top_p", "seed", "end_id", "pad_id",
                 "stop_words", "bad_words", "stream", "exclude_input_in_output", "return_perf_metrics",
                 "num_draft_tokens", "use_draft_logits", "disable_at_batch", "method")
SERVED_OUTPUTS = ("text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                  "num_input_tokens", "num_output_tokens")


def _served(table: list, names: tuple[str, ...]) -> list[tuple[str, str, list[int]]]:
    by_name = {t[0]: t for t in table}
    return [(n, by_name[n][1], list(by_name[n][2])) for n in names]


INPUTS: list[tuple[str, str, list[int]]] = _served(ENSEMBLE_INPUTS, SERVED_INPUTS)
REQUIRED = ("text_input", "max_tokens")
OUTPUTS: list[tuple[str, str, list[int]]] = _served(ENSEMBLE_OUTPUTS, SERVED_OUTPUTS)


def ensemble_io() -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    """(inputs, outputs) of the `ensemble` model as (name, data_type, dims) lists."""
    return [(n, t, list(d)) for n, t, d in INPUTS], [(n, t, list(d)) for n, t, d in OUTPUTS]


def default_methods(spec: Spec) -> list[str]:
    """Preference order for requests without `method`: the spec's speculative methods, then baseline.

    The model serves the first one whose engine is built (so a missing draft falls back to Medusa).
    """
    return [m for m, on in (("draft_target", spec.has_draft), ("medusa", spec.has_medusa)) if on] + ["baseline"]


def default_method(spec: Spec) -> str:
    """The method a request without `method` gets when every engine the spec names is built."""
    return default_methods(spec)[0]


def python_path() -> list[str]:
    """Directories the python-backend stub must see: this venv's site-packages and the `pipeline` package."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], str(PACKAGE_ROOT)]
    return list(dict.fromkeys(paths))


def _io(msg_list, entries, required=()):
    from tritonclient.grpc import model_config_pb2 as mc

    for name, dtype, dims in entries:
        m = msg_list.add()
        m.name = name
        m.data_type = mc.DataType.Value(dtype)
        m.dims.extend(dims)
        if required is not None and name not in required and hasattr(m, "optional"):
            m.optional = True


def bls_config(spec: Spec, engine_dir: Path):
    """ModelConfig of the python model that runs every method."""
    from tritonclient.grpc import model_config_pb2 as mc

    c = mc.ModelConfig(name=BLS, backend="python", max_batch_size=spec.limits.max_batch_size)
    c.model_transaction_policy.decoupled = True
    c.dynamic_batching.max_queue_delay_microseconds = spec.triton.max_queue_delay_us
    _io(c.input, INPUTS, REQUIRED)
    _io(c.output, OUTPUTS, None)
    g = c.instance_group.add()
    g.count = spec.triton.instance_count
    g.kind = mc.ModelInstanceGroup.KIND_CPU
    k = spec.speculation.num_draft_tokens
    params = {
        "engine_dir": str(Path(engine_dir).resolve()),
        "device": spec.device,
        "threads": str(spec.threads),
        "default_method": ",".join(default_methods(spec)),
        "num_draft_tokens": str(k) if isinstance(k, int) else "auto",
        "prompt_lookup_num_tokens": str(spec.speculation.prompt_lookup_num_tokens),
        "prompt_lookup_max_ngram": str(spec.speculation.prompt_lookup_max_ngram),
        "use_draft_logits": str(spec.speculation.use_draft_logits).lower(),
        "disable_at_batch": str(spec.speculation.disable_at_batch),
        "draft_lookup_min_ngram": str(spec.speculation.draft_lookup_min_ngram),
        "draft_confidence": str(spec.speculation.draft_confidence),
        "exclude_input_in_output": "true",
        "add_special_tokens": "true",
        "python_path": ":".join(python_path()),
    }
    for key, value in params.items():
        c.parameters[key].string_value = value
    return c


def ensemble_config(spec: Spec):
    """A platform "ensemble" that forwards every input and output to the BLS model."""
    from tritonclient.grpc import model_config_pb2 as mc

    c = mc.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=spec.limits.max_batch_size)
    # Every ensemble input is optional: Triton 2.51 answers an ensemble request that lacks a required
    # input with an empty success, while the BLS model rejects it with an error naming the input.
    _io(c.input, INPUTS, ())
    _io(c.output, OUTPUTS, None)
    step = c.ensemble_scheduling.step.add()
    step.model_name = BLS
    step.model_version = -1
    for name, _, _ in INPUTS:
        step.input_map[name] = name
    for name, _, _ in OUTPUTS:
        step.output_map[name] = name
    return c


def to_pbtxt(config) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(config)


def parse_pbtxt(text: str):
    """Parse a config.pbtxt with Triton's schema (raises on anything Triton would reject as syntax)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

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
    (tmp / BLS / "1").mkdir(parents=True)
    (tmp / ENSEMBLE / "1").mkdir(parents=True)
    shutil.copyfile(MODEL_SOURCE, tmp / BLS / "1" / "model.py")
    (tmp / BLS / "config.pbtxt").write_text(to_pbtxt(bls_config(spec, engine_dir)))
    (tmp / ENSEMBLE / "config.pbtxt").write_text(to_pbtxt(ensemble_config(spec)))
    if repo.exists():
        shutil.rmtree(repo)
    tmp.rename(repo)
    log(f"wrote {repo} (models {ENSEMBLE}, {BLS}; default method, first built of: {', '.join(default_methods(spec))}; "
        f"python {sys.version.split()[0]})")
    return repo
