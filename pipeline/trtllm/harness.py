"""The CPU harness of the tensorrt_llm backend: a generated repository loaded whole by the real tritonserver here.

`install_standins` takes a repository written by `engine_repo.write_repo` and puts our stand-ins
(pipeline/trtllm/standins/) where NVIDIA's container would provide the models: the C++
`tensorrt_llm` / `tensorrt_llm_draft` backend (torch runtime engines instead of TensorRT ones) and
NVIDIA's python preprocessing, postprocessing and (for `bls: nvidia`) tensorrt_llm_bls. Every
config.pbtxt keeps the I/O the writer generated; only `backend:` of the LLM models changes and
`standin_*` / `python_path` parameters are added, so whatever the generated configs get wrong,
tritonserver rejects here as it would on a GPU. With `nvidia_bls_as`, a draft-target repository
also gets the `bls: nvidia` variant of tensorrt_llm_bls under that name, so one server answers both
BLS flavours.

What this cannot show: TensorRT engines, the C++ executor's batching, KV reuse, logits-based
acceptance, MPI/orchestrator launch and GPU memory; those need a GPU.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from pipeline.spec import Spec
from pipeline.trtllm import engine_repo
from pipeline.trtllm.era import LLMAPI_ERA
from pipeline.trtllm.llmapi_repo import LLM_MODEL, parse_config, to_pbtxt

STANDINS = Path(__file__).resolve().parent / "standins"


def _with_params(text: str, params: dict[str, str]) -> str:
    return text + engine_repo._params_text(params)


def install_standins(spec: Spec, repo: Path, engines: dict[str, Path], python_path: str,
                     medusa_heads: Path | None = None, nvidia_bls_as: str | None = None) -> list[str]:
    """Replace the container-only models of `repo` with stand-ins; returns the model names installed.

    `engines` maps a role (target, draft, medusa) to a torch-backend engine directory; `medusa_heads`
    is the FasterDecoding head directory the Medusa stand-in loads with the config's medusa_choices.
    """
    installed = []
    llm_role = "medusa" if spec.has_medusa else "target"
    for name, role in (("tensorrt_llm", llm_role), ("tensorrt_llm_draft", "draft")):
        cfg = repo / name / "config.pbtxt"
        if not cfg.is_file():
            continue
        text = cfg.read_text()
        if 'backend: "tensorrtllm"' not in text:
            raise ValueError(f"{cfg}: not a tensorrtllm-backend model")
        mode = "draft_tokens_external" if role == "target" and spec.has_draft else (
            "medusa" if role == "medusa" else "none")
        text = _with_params(text.replace('backend: "tensorrtllm"', 'backend: "python"', 1), {
            "standin_engine_dir": str(engines["target" if role == "medusa" else role]),
            "standin_mode": mode, "standin_medusa_dir": str(medusa_heads or ""), "python_path": python_path})
        engine_repo.parse_config(text)
        cfg.write_text(text)
        shutil.copyfile(STANDINS / "llm.py", repo / name / "1" / "model.py")
        installed.append(name)
    for name in ("preprocessing", "postprocessing"):
        cfg = repo / name / "config.pbtxt"
        cfg.write_text(_with_params(cfg.read_text(), {"python_path": python_path}))
        shutil.copyfile(STANDINS / f"{name}.py", repo / name / "1" / "model.py")
        installed.append(name)
    if spec.tensorrt_llm.bls == "nvidia":
        shutil.copyfile(STANDINS / "nvidia_bls.py", repo / "tensorrt_llm_bls" / "1" / "model.py")
        installed.append("tensorrt_llm_bls")
    elif nvidia_bls_as:
        other = dataclasses.replace(spec, tensorrt_llm=dataclasses.replace(spec.tensorrt_llm, bls="nvidia"))
        text = engine_repo.build_configs(other)["tensorrt_llm_bls"]
        text = text.replace('name: "tensorrt_llm_bls"', f'name: "{nvidia_bls_as}"', 1)
        engine_repo.parse_config(text)
        (repo / nvidia_bls_as / "1").mkdir(parents=True, exist_ok=True)
        (repo / nvidia_bls_as / "config.pbtxt").write_text(text)
        shutil.copyfile(STANDINS / "nvidia_bls.py", repo / nvidia_bls_as / "1" / "model.py")
        installed.append(nvidia_bls_as)
    return installed


LLMAPI_PACKAGE = STANDINS / "llmapi_pkg"


def install_llmapi_standins(repo: Path, python_path: str) -> list[str]:
    """The llmapi era: our stand-in of the container's llmapi model.py in `tensorrt_llm/1/`, the stand-in
    `tensorrt_llm` package on its path, and `python_path` on every python model of the repository.

    The generated config.pbtxt files keep their I/O; only a `python_path` parameter is added.
    """
    installed = []
    for cfg_path in sorted(repo.glob("*/config.pbtxt")):
        cfg = parse_config(cfg_path.read_text())
        extra = f"{LLMAPI_PACKAGE}:{python_path}" if cfg.name == LLM_MODEL else python_path
        cfg.parameters["python_path"].string_value = extra
        cfg_path.write_text(to_pbtxt(cfg))
    dest = repo / LLM_MODEL / "1"
    shutil.copyfile(STANDINS / "llmapi_model.py", dest / "model.py")
    for f in LLMAPI_ERA.model_files[1:]:
        (dest / f).unlink(missing_ok=True)
    installed.append(LLM_MODEL)
    return installed
