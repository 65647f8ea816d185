"""The tensorrt_llm backend: TensorRT-LLM engine plan, GPU preflight, memory plan and runner.

TensorRT-LLM cannot be installed on the development machines, so everything here is a plan that
prints exactly what would run, plus a runner that executes it where `tensorrt_llm` imports (the
NGC `tritonserver:<yy.mm>-trtllm-python-py3` container). The checks run from the engines'
`config.json` when they exist, otherwise from the plan itself, so a bad spec fails here before a
GPU hour is spent. Every name that changed between TensorRT-LLM releases lives in `era.ERA`.

Two eras (spec key `tensorrt_llm.era`): `llmapi` (default; TensorRT-LLM 1.2.1's LLM API on the PyTorch backend:
`llmapi` plans the LLM(...) arguments, trtllm-serve's command and YAML, and the GPU-free checks; `llmapi_repo`
writes the Triton repository around the container's llmapi model, with our client-contract model in
`llmapi_models/`; `harness.install_llmapi_standins` runs it here over `standins/llmapi_pkg`, a CPU `tensorrt_llm`)
and `engine` (legacy 0.18 engines, below). The names of both are pinned in `era` (ERA, LLMAPI_ERA).

Engine-era stages, one module each: `era` (the pinned release's names and tables), `planning` (commands and the
config.json they would write), `memory` (per-GPU memory plan), `preflight` (checks), `engine_repo` (the
engine era's Triton repository, tensorrtllm_backend's layout, with our python models in `engine_models/`),
`harness` (the CPU stand-ins of `standins/` installed into a generated repository, so the real tritonserver
loads it here), `runner` (running the plan, writing the repository, launching). This package re-exports the
first four; the others are imported where they are used.
"""

from pipeline.trtllm.era import ARCH_PATTERNS, CONVERTER_FAMILY, DTYPE_BYTES, ERA, KNOWN_ARCHS, Arch, Era, PlanError
from pipeline.trtllm.memory import GIB, MemoryPlan, ModelMemory, memory_plan
from pipeline.trtllm.planning import (
                                 Step,
                                 checkpoint_dir,
                                 convert_script,
                                 engine_dir,
                                 format_plan,
                                 gpu_placement,
                                 log_dir,
                                 medusa_choices,
                                 medusa_token_len,
                                 num_draft_tokens,
                                 plan,
                                 planned_engine_configs,
                                 read_engine_configs,
                                 resolve_arch,
                                 roles,
)
from pipeline.trtllm.preflight import preflight, spec_mode

__all__ = ["ARCH_PATTERNS", "CONVERTER_FAMILY", "DTYPE_BYTES", "ERA", "GIB", "KNOWN_ARCHS", "Arch", "Era",
           "MemoryPlan", "ModelMemory", "PlanError", "Step", "checkpoint_dir", "convert_script", "engine_dir",
           "format_plan", "gpu_placement", "log_dir", "medusa_choices", "medusa_token_len", "memory_plan",
           "num_draft_tokens", "plan", "planned_engine_configs", "preflight", "read_engine_configs",
           "resolve_arch", "roles", "spec_mode"]
