"""The llmapi era's Triton repository: NVIDIA's llmapi `tensorrt_llm` model plus our client-contract models.

- `tensorrt_llm/`: Triton's llmapi python model. Its config.pbtxt declares exactly the pinned tensors
  (era.LLMAPI_ERA.inputs / outputs); `1/model.yaml` is written from the spec (llmapi.model_yaml); its
  `1/model.py` and `helpers.py` are the container's, referenced, not copied into this project: copied from
  LLMAPI_ERA.model_dir when that exists here, else listed in `<repo>.copy.sh` to run in the container.
  max_batch_size and the decoupled policy are written both in model.yaml's triton_config (what its model.py
  sets in auto_complete_config) and in config.pbtxt, equal, so launchers with and without auto-complete agree.
- `ensemble` / `tensorrt_llm_bls` (triton.models): our python model (llmapi_models/client_model.py) with the
  project's client contract (pipeline/contract.py): text in, text out (streamed or whole), acceptance figures
  and token counts out; it calls `tensorrt_llm` by BLS with the sampling_param_* names.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.contract import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS
from pipeline.spec import Spec
from pipeline.trtllm import llmapi
from pipeline.trtllm.era import LLMAPI_ERA, PlanError
from pipeline.trtllm.planning import write_copy_script

LLM_MODEL = "tensorrt_llm"
CLIENT_MODEL_SOURCE = Path(__file__).resolve().parent / "llmapi_models" / "client_model.py"
LLMAPI_COPY = LLMAPI_ERA.image
CLIENT_OUTPUTS = ("text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                  "num_input_tokens", "num_output_tokens")


def llm_config():
    """ModelConfig of `tensorrt_llm`: the pinned inputs/outputs, one CPU instance, policy as model.yaml says."""
    from tritonclient.grpc import model_config_pb2 as mc  # lazy: tritonclient.grpc (~0.5 s), as parse_config

    c = mc.ModelConfig(name=LLM_MODEL, backend="python", max_batch_size=0)
    c.model_transaction_policy.decoupled = True
    for name, dtype, dims, optional in LLMAPI_ERA.inputs:
        t = c.input.add(name=name, data_type=mc.DataType.Value(dtype), dims=list(dims))
        t.optional = optional
    for name, dtype, dims in LLMAPI_ERA.outputs:
        c.output.add(name=name, data_type=mc.DataType.Value(dtype), dims=list(dims))
    g = c.instance_group.add(count=1)
    g.kind = mc.ModelInstanceGroup.KIND_CPU
    return c


def client_config(spec: Spec, name: str, python_path: str = ""):
    """ModelConfig of our client-contract model (`ensemble` or `tensorrt_llm_bls`)."""
    from tritonclient.grpc import model_config_pb2 as mc  # lazy: tritonclient.grpc (~0.5 s), as parse_config

    c = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    c.model_transaction_policy.decoupled = spec.triton.decoupled
    for n, dtype, dims, *_ in ENSEMBLE_INPUTS:
        t = c.input.add(name=n, data_type=mc.DataType.Value(dtype), dims=[-1, *dims])
        t.optional = True
    t = c.input.add(name="stop", data_type=mc.DataType.Value("TYPE_BOOL"), dims=[-1, 1])
    t.optional = True
    by_name = {t[0]: t for t in ENSEMBLE_OUTPUTS}
    for n in CLIENT_OUTPUTS:
        c.output.add(name=n, data_type=mc.DataType.Value(by_name[n][1]), dims=[-1, *by_name[n][2]])
    g = c.instance_group.add(count=1)
    g.kind = mc.ModelInstanceGroup.KIND_CPU
    m = llmapi.method(spec)
    params = {"llm_model": LLM_MODEL, "tokenizer_dir": llmapi.source(spec, "target"),
              "method": {"draft_target": "draft_target", "ngram": "prompt_lookup", "eagle3": "eagle3",
                         "none": "baseline"}[m],
              "num_draft_tokens": str(llmapi.draft_len(spec) if m != "none" else 0),
              "streamed_text": LLMAPI_ERA.streamed_text, "max_rows": "1", "python_path": python_path}
    for k, v in params.items():
        c.parameters[k].string_value = v
    return c


def to_pbtxt(config) -> str:
    from google.protobuf import text_format  # lazy: protobuf, as parse_config

    return text_format.MessageToString(config)


def parse_config(text: str):
    # lazy: tritonclient.grpc (~0.5 s, grpc) and protobuf, only where a config is written or read
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    return text_format.Parse(text, mc.ModelConfig())


def write_llmapi_repo(spec: Spec, container_model_dir: str | Path = LLMAPI_ERA.model_dir,
                      python_path: str = "") -> tuple[Path, list[tuple[str, str, bool]]]:
    """Write triton_repo/<name>/ for the llmapi era; returns (repo, [(container file, destination, copied)])."""
    if spec.tensorrt_llm.era != "llmapi":
        raise PlanError(f"tensorrt_llm.era: got {spec.tensorrt_llm.era!r}; this writer is the llmapi era's "
                        "(engine-era repositories come from pipeline.trtllm.engine_repo)")
    repo = spec.repo_dir
    tmp = repo.parent / f".{repo.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / LLM_MODEL / "1").mkdir(parents=True)
    (tmp / LLM_MODEL / "config.pbtxt").write_text(to_pbtxt(llm_config()))
    (tmp / LLM_MODEL / "1" / LLMAPI_ERA.yaml_name).write_text(llmapi.dump_yaml(llmapi.model_yaml(spec)))
    for name in spec.triton.models:
        (tmp / name / "1").mkdir(parents=True)
        (tmp / name / "config.pbtxt").write_text(to_pbtxt(client_config(spec, name, python_path)))
        shutil.copyfile(CLIENT_MODEL_SOURCE, tmp / name / "1" / "model.py")
    if repo.exists():
        shutil.rmtree(repo)
    tmp.rename(repo)
    copies = []
    for f in LLMAPI_ERA.model_files:
        src = Path(container_model_dir) / f
        dst = repo / LLM_MODEL / "1" / f
        done = src.is_file()
        if done:
            shutil.copyfile(src, dst)
        copies.append((str(src), str(dst), done))
    write_copy_script(repo.parent / f"{repo.name}.copy.sh", LLMAPI_ERA.image + ": the llmapi model's code, referenced, "
                      "not shipped.", [f"cp {s} {d}" for s, d, done in copies if not done])
    return repo, copies
