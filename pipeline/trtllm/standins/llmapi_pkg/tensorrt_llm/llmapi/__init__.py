"""`tensorrt_llm.llmapi` of the CPU stand-in: the config classes and LLM (see tensorrt_llm/__init__.py)."""

from tensorrt_llm._standin import (  # noqa: F401
    LLM,
    DraftTargetDecodingConfig,
    Eagle3DecodingConfig,
    KvCacheConfig,
    NGramDecodingConfig,
    RequestOutput,
    SamplingParams,
)
