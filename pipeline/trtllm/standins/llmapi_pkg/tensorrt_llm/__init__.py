"""CPU stand-in of the `tensorrt_llm` package (TensorRT-LLM 1.2.1's LLM API), backed by the project's torch runtime.

Only for the CPU harness: pipeline.trtllm.harness puts this directory on the python backend's path so Triton's
llmapi model (our stand-in of it) imports `tensorrt_llm` here. The names and behaviour follow the pinned
release (pipeline/trtllm/era.py LLMAPI_ERA): `LLM(model=<hf dir>, backend="pytorch", speculative_config=...)`,
`generate` / `generate_async` with `SamplingParams`, streaming `RequestOutput`s and per-request perf metrics.
"""

from tensorrt_llm._standin import (  # noqa: F401
    LLM,
    CompletionOutput,
    DraftTargetDecodingConfig,
    Eagle3DecodingConfig,
    KvCacheConfig,
    NGramDecodingConfig,
    RequestOutput,
    SamplingParams,
)

__version__ = "1.2.1+cpu-standin"
