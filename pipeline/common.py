"""Helpers shared by the CLI and the stages it runs (bench, pick-k, training, validation).

They live here, below all their users, so that no stage imports `pipeline.cli` (which imports the stages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.spec import Spec


def setup_threads(spec: Spec) -> None:
    """One setting for torch's threads and the C kernels' (spec `threads`; 0 leaves the defaults)."""
    from pipeline.runtime import kernels

    if spec.threads:
        kernels.configure_threads(spec.threads)


def chat_ids(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids for a prompt, with the model's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        return list(ids)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
