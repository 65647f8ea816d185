"""The speculation settings, typed and checked in one place, and the two interfaces a decoding method implements.

`SpecDecodeConfig` is read once, from the spec's `speculation:` block and the engine's `max_draft_len`
(`pipeline.spec.decode_config`), or from the served model's parameters (`pipeline/triton/model.py`,
which the repository writes from the same spec), and travels with the loaded `Bundle` through the
runtime, the server's parser and scheduler, bench and validate. Its limits are checked here, when it is
built and for every k a caller asks for (`check_k`): a draft length above `max_draft_len` is an error
everywhere, naming the field, the value and the fix, never a silent clamp. `num_draft_tokens: auto` is
not a value to clamp but a choice: the k measured at build time (stored in the draft engine), else the
smaller of `DEFAULT_K` and `max_draft_len`.

A decoding method is a `Method` (a name, whether it can continue handed-off rows, when it is available
and how it runs a batch); the chain drafters (draft model, prompt lookup) are `Drafter`s that propose
tokens for the shared verify loop in `pipeline.runtime.speculative`. Adding a method (an EAGLE-3 head, a
lookahead drafter) is a new module with its `Method` plus one entry in `pipeline.runtime.decode.METHODS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from pipeline.runtime.generate import Handoff, Request, Result

DEFAULT_K = 4  # draft length for `num_draft_tokens: auto` before a measured k is stored (at most max_draft_len)


class SpeculationError(ValueError):
    """A speculation setting outside its limits; the message names the field, the value and the fix."""


@dataclass(frozen=True)
class SpecDecodeConfig:
    """What speculation may do in one deployment. Frozen: `dataclasses.replace(cfg, ...)` makes a variant, checked
    again."""

    max_draft_len: int = 0  # the engine's limit (build_config.max_draft_len): no method drafts more per step
    num_draft_tokens: int | None = None  # draft_target's k; None = 'auto' with no measured k (DEFAULT_K)
    prompt_lookup_num_tokens: int = 4  # prompt lookup's k
    prompt_lookup_max_ngram: int = 3
    use_draft_logits: bool = True  # draft_target sampling: Leviathan rejection (True) or token matching
    disable_at_batch: int = 0  # from this many rows in flight, speculative requests decode plainly (0: never)
    draft_lookup_min_ngram: int = 0  # draft_target takes a prompt-lookup continuation this long or longer
    draft_confidence: float = 0.0  # draft_target stops a row's drafting below this draft probability
    draft_length: str = "fixed"  # "load": per round and row from the load (loadpolicy); "fixed": k every round
    suffix_store_bytes: int = 0  # suffix / hybrid: bytes of recent outputs kept to draft from (0: none)
    suffix_min_match: int = 4  # hybrid: the suffix draft from a match this long, the draft model below it

    def __post_init__(self) -> None:
        self.check()

    def _err(self, field: str, value: Any, fix: str) -> SpeculationError:
        return SpeculationError(f"speculation.{field}: got {value!r}; {fix}")

    def check(self) -> None:
        """Raise SpeculationError for the first field outside its limits (called on every construction)."""
        mdl = self.max_draft_len
        if mdl < 0:
            raise SpeculationError(f"limits.max_draft_len: got {mdl}; must be 0 or more")
        if self.num_draft_tokens is not None:
            self.check_k(self.num_draft_tokens, "speculation.num_draft_tokens",
                         "set it to 'auto' or a k within the limit, or raise limits.max_draft_len")
        if not 1 <= self.prompt_lookup_num_tokens <= max(mdl, 1):
            raise self._err("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens,
                            f"must be between 1 and limits.max_draft_len ({mdl})")
        if self.prompt_lookup_max_ngram < 1:
            raise self._err("prompt_lookup_max_ngram", self.prompt_lookup_max_ngram, "must be 1 or more")
        if self.disable_at_batch < 0:
            raise self._err("disable_at_batch", self.disable_at_batch,
                            "must be 0 (never switch speculation off) or the batch size from which to decode plainly")
        if not 0 <= self.draft_confidence < 1:
            raise self._err("draft_confidence", self.draft_confidence,
                            "must be 0 (always draft num_draft_tokens) or a probability below 1")
        if self.draft_length not in ("load", "fixed"):
            raise self._err("draft_length", self.draft_length,
                            "must be 'load' (chosen per round from the load) or 'fixed' (num_draft_tokens always)")
        if self.suffix_store_bytes < 0:
            raise self._err("suffix_store_bytes", self.suffix_store_bytes, "must be 0 (no store) or a byte budget")
        if self.suffix_min_match < 2:
            raise self._err("suffix_min_match", self.suffix_min_match, "must be 2 or more")
        if not 0 <= self.draft_lookup_min_ngram <= self.prompt_lookup_max_ngram:
            raise self._err("draft_lookup_min_ngram", self.draft_lookup_min_ngram,
                            f"must be 0 (the draft alone) or between 1 and prompt_lookup_max_ngram "
                            f"({self.prompt_lookup_max_ngram})")

    def check_k(self, k: int, field: str = "num_draft_tokens", fix: str = "") -> int:
        """`k` if 1 <= k <= max_draft_len, else a SpeculationError naming `field`, the value and `fix`."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.max_draft_len:
            if self.max_draft_len < 1:
                limit = ("the engine was built with limits.max_draft_len 0 and cannot speculate; rebuild it with "
                         "limits.max_draft_len of 1 or more")
            else:
                limit = f"must be between 1 and limits.max_draft_len ({self.max_draft_len})"
            raise SpeculationError(f"{field}: got {k!r}; {limit}" + (f"; {fix}" if fix else ""))
        return k

    def k_for(self, method: str) -> int:
        """The draft length of a request that names none: prompt lookup has its own; the others use
        num_draft_tokens ('auto': DEFAULT_K, or max_draft_len when that is smaller)."""
        if method == "prompt_lookup":
            return self.check_k(self.prompt_lookup_num_tokens, "speculation.prompt_lookup_num_tokens")
        if method == "suffix":  # the most a match may draft; its odds and the verify cost choose less
            return self.check_k(self.max_draft_len, "limits.max_draft_len")
        if self.num_draft_tokens is None:
            return self.check_k(min(DEFAULT_K, self.max_draft_len), "speculation.num_draft_tokens ('auto')")
        return self.num_draft_tokens

    def off_at(self, method: str, rows: int, disable_at_batch: int | None = None) -> bool:
        """True when a batch of `rows` requests of `method` should decode plainly (`disable_at_batch`, 0 = never;
        None: this config's)."""
        t = self.disable_at_batch if disable_at_batch is None else disable_at_batch
        return method != "baseline" and t > 0 and rows >= t

    @classmethod
    def from_speculation(cls, sp: Any, max_draft_len: int, measured_k: int | None = None,
                         k_bounded: bool = True) -> SpecDecodeConfig:
        """From a spec's `speculation:` block (pipeline.spec.SpeculationSpec). An integer num_draft_tokens
        wins; 'auto' takes `measured_k` (stored in the draft engine by the build) when there is one.
        `k_bounded=False` (tensorrt_llm without a draft engine, where no request drafts) leaves k out."""
        k = sp.num_draft_tokens if isinstance(sp.num_draft_tokens, int) else measured_k
        return cls(max_draft_len=max_draft_len, num_draft_tokens=k if k_bounded else None,
                   prompt_lookup_num_tokens=sp.prompt_lookup_num_tokens,
                   prompt_lookup_max_ngram=sp.prompt_lookup_max_ngram, use_draft_logits=sp.use_draft_logits,
                   disable_at_batch=sp.disable_at_batch, draft_lookup_min_ngram=sp.draft_lookup_min_ngram,
                   draft_confidence=sp.draft_confidence, draft_length=getattr(sp, "draft_length", "fixed"),
                   suffix_store_bytes=int(sp.suffix_store_bytes),
                   suffix_min_match=sp.suffix_min_match)

    def to_params(self) -> dict[str, str]:
        """The served model's config.pbtxt parameters (string values; max_draft_len is the engine's own)."""
        k = "auto" if self.num_draft_tokens is None else str(self.num_draft_tokens)
        return {"num_draft_tokens": k, "prompt_lookup_num_tokens": str(self.prompt_lookup_num_tokens),
                "prompt_lookup_max_ngram": str(self.prompt_lookup_max_ngram),
                "use_draft_logits": str(self.use_draft_logits).lower(), "disable_at_batch": str(self.disable_at_batch),
                "draft_lookup_min_ngram": str(self.draft_lookup_min_ngram),
                "draft_confidence": str(self.draft_confidence), "draft_length": self.draft_length,
                "suffix_store_bytes": str(self.suffix_store_bytes),
                "suffix_min_match": str(self.suffix_min_match)}

    @classmethod
    def from_params(cls, param: Callable[[str, str], str], max_draft_len: int,
                    measured_k: int | None = None) -> SpecDecodeConfig:
        """Read `to_params`' parameters back through `param(key, default)`; 'auto' takes `measured_k`."""
        k = param("num_draft_tokens", "auto")
        return cls(max_draft_len=max_draft_len, num_draft_tokens=int(k) if k.isdigit() else measured_k,
                   prompt_lookup_num_tokens=int(param("prompt_lookup_num_tokens", "4")),
                   prompt_lookup_max_ngram=int(param("prompt_lookup_max_ngram", "3")),
                   use_draft_logits=param("use_draft_logits", "true") == "true",
                   disable_at_batch=int(param("disable_at_batch", "0") or 0),
                   draft_lookup_min_ngram=int(param("draft_lookup_min_ngram", "0") or 0),
                   draft_confidence=float(param("draft_confidence", "0") or 0),
                   draft_length=param("draft_length", "fixed") or "fixed",
                   suffix_store_bytes=int(param("suffix_store_bytes", "0") or 0),
                   suffix_min_match=int(param("suffix_min_match", "4") or 4))


Emit = Callable[[int, list[int]], None]


class Drafter(Protocol):
    """Proposes draft tokens for one batch in the shared loop (`speculative.speculate`), which verifies them
    against one target forward per round with the exact acceptance rules (greedy match, Leviathan rejection
    when `propose` returns q, matching otherwise)."""

    width: int  # the most tokens one proposal holds (sizes the target's cache)

    def prefill(self, prompts: list[list[int]]) -> None:
        """Take in the prompts (a model drafter fills its own cache)."""

    def resume(self, handoffs: list[Handoff]) -> None:
        """Continue rows handed off mid-request (their drafter state, when `hand_off` gave one)."""

    def hand_off(self) -> list | None:
        """Each row's drafter state for its Handoff (None: the drafter keeps none)."""

    def propose(self, ctx: list[list[int]], pos: Tensor,
                gens: list[torch.Generator]) -> tuple[Tensor, dict[int, Tensor] | None, list[int]]:
        """Drafts [B, w], q per sampled row (None or missing rows: accept by matching), and each row's count."""


class Method(Protocol):
    """One decoding method as `decode` runs it (`b` is the loaded pipeline.runtime.decode.Bundle; not imported
    here, which would make a circle). Optional, under `draft_length: load`: `adaptive = True` (its rounds take the
    per-round DraftPolicy, `policy_from_rows` the fewest rows at which they do) or `batch_plain_from(b, max_rows)`
    (its batches judged whole: the fewest rows from which they decode plainly; Medusa)."""

    name: str
    resumable: bool  # can continue rows handed off mid-request (`resume=`)

    def available(self, b: Any) -> bool:
        """Whether the loaded deployment can run it (its draft, heads or max_draft_len are there)."""

    def run(self, b: Any, reqs: list[Request], k: int, on_emit: Emit | None,
            **opts) -> list[Result | Handoff]:
        """Decode `reqs` as one batch drafting at most `k` tokens a step (checked against b.spec already)."""
