"""Helpers shared by the CLI and the stages it runs (bench, pick-k, training, validation).

They live here, below all their users, so that no stage imports `pipeline.cli` (which imports the stages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.spec import Spec


# How long an OpenMP thread that waits (at a barrier, or for the next parallel region) spins before it sleeps.
# libgomp's default, 300,000 pause instructions (several milliseconds, longer than the kernel's time slice),
# made a thread whose partner was preempted by another process spin through its own share of the CPU at every
# barrier: the served flagship target fell from 10.3 to 0.67 tokens/s beside one busy process (15x). 1000 pauses
# (tens of microseconds) still covers a parallel region's normal imbalance, so a quiet decode keeps its speed
# (10.6 tokens/s served), and a waiter then yields its core: 5.4 tokens/s busy (1.9x). Measured with
# experiments/contention.py and bench's contention section (docs/peers.md). The environment's own value wins;
# libgomp reads it once, when it is loaded, so it is set before torch is imported (pipeline/__main__.py) and for
# the served stubs (server_env). Since the C kernels run on their own pool (skinny.c `pool_run`, which chooses
# its wait from the machine's load), this covers torch's own OpenMP regions only.
OMP_ENV = {"GOMP_SPINCOUNT": "1000"}


def apply_omp_env(env) -> None:
    """Set OMP_ENV's variables in `env` (os.environ or a child's environment) where it does not set them."""
    for k, v in OMP_ENV.items():
        env.setdefault(k, v)


def setup_threads(spec: Spec) -> None:
    """One setting for torch's threads and the C kernels' (spec `threads`; 0 leaves the defaults)."""
    from pipeline.runtime import kernels  # heavy (torch, the C kernels): only when threads are set

    if spec.threads:
        kernels.configure_threads(spec.threads)


def chat_ids(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids for a prompt, with the model's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        return list(ids)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def split_prompts(texts: list[str], n_eval: int, train_texts: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(training, held-out) prompts, one rule for the draft, the Medusa heads and pick-k.

    Validation and the benchmark decode the first prompts (a warm-up, then `validate.max_prompts` of them; the
    benchmark 1 + 4), so those are held out and the acceptance measured on them is honest. With a separate
    training set (`train_texts`) they are all the held-out set; without one they are held out whenever 12 or
    more prompts remain to train on, else every sixth prompt is."""
    k = max(n_eval, 4) + 1
    if train_texts is not None:
        return list(train_texts), texts[:k]
    if 0 < n_eval and len(texts) - k >= 12:
        return texts[k:], texts[:k]
    return [t for i, t in enumerate(texts) if i % 6 != 5], [t for i, t in enumerate(texts) if i % 6 == 5]
