"""`tensorrt_llm.llmapi.llm_utils.update_llm_args_with_extra_dict` of the CPU stand-in (see _standin)."""

from tensorrt_llm._standin import update_llm_args_with_extra_dict  # noqa: F401
