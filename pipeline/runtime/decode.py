"""One entry point for every decoding method, so the CLI, the Triton model and the benchmarks agree.

`Bundle` holds what a deployment loaded (target, and the draft / Medusa heads when built);
`decode(bundle, method, requests)` runs one batch with the named method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.runtime.generate import Emit, Request, Result, generate
from pipeline.runtime.model import Transformer

METHODS = ("baseline", "draft_target", "prompt_lookup", "medusa")
RESUMABLE = ("draft_target", "prompt_lookup", "medusa")  # can continue rows handed off mid-request (`resume=`)


@dataclass
class Bundle:
    target: Transformer
    tokenizer: Any
    config: dict
    draft: Transformer | None = None
    medusa: Any = None
    options: dict = field(default_factory=dict)

    def methods(self) -> list[str]:
        out = ["baseline"]
        if self.draft is not None:
            out.append("draft_target")
        if self.config["build_config"].get("max_draft_len", 0) > 0:
            out.append("prompt_lookup")
        if self.medusa is not None:
            out.append("medusa")
        return out

    @property
    def max_draft_len(self) -> int:
        return int(self.config["build_config"].get("max_draft_len", 0))

    @property
    def end_ids(self) -> tuple[int, ...]:
        return tuple(self.target.cfg.eos_token_id or ())


def load_bundle(engine_dir: Path, device: str = "cpu", methods: tuple[str, ...] = METHODS,
                verify: bool = True) -> Bundle:
    """Load engines/<name>/{target,draft,medusa} as far as they exist."""
    from pipeline.runtime.engine_io import load_engine

    eng = load_engine(engine_dir / "target", device, verify=verify)
    b = Bundle(eng.model, eng.tokenizer, eng.config)
    if "draft_target" in methods and (engine_dir / "draft" / "config.json").is_file():
        from pipeline.runtime.speculative import load_draft

        b.draft, b.options["draft_config"] = load_draft(engine_dir / "draft", device, verify=verify)
        k = (b.options["draft_config"].get("speculation") or {}).get("num_draft_tokens")
        if isinstance(k, int):
            b.options["num_draft_tokens"] = k
    if "medusa" in methods and (engine_dir / "medusa" / "config.json").is_file():
        from pipeline.runtime.medusa import load_medusa_engine

        b.medusa = load_medusa_engine(engine_dir / "medusa", b.target, verify=verify)
    return b


def apply_spec(b: Bundle, spec) -> Bundle:
    """Speculation defaults from the spec; a measured k stored by `num_draft_tokens: auto` wins over "auto"."""
    sp = spec.speculation
    if isinstance(sp.num_draft_tokens, int):
        b.options["num_draft_tokens"] = sp.num_draft_tokens
    b.options["prompt_lookup_num_tokens"] = sp.prompt_lookup_num_tokens
    b.options["prompt_lookup_max_ngram"] = sp.prompt_lookup_max_ngram
    b.options["disable_at_batch"] = sp.disable_at_batch
    b.options["draft_lookup_min_ngram"] = sp.draft_lookup_min_ngram
    b.options["draft_confidence"] = sp.draft_confidence
    return b


def speculation_off(b: Bundle, method: str, rows: int, disable_at_batch: int | None = None) -> bool:
    """True when a batch of `rows` requests should decode plainly (`disable_at_batch`, 0 = never)."""
    t = b.options.get("disable_at_batch", 0) if disable_at_batch is None else disable_at_batch
    return method != "baseline" and t > 0 and rows >= t


def default_k(b: Bundle, method: str) -> int:
    """Draft length when a request names none: prompt lookup has its own; draft-target uses the spec's or the
    measured k stored in the draft engine."""
    key = "prompt_lookup_num_tokens" if method == "prompt_lookup" else "num_draft_tokens"
    return min(int(b.options.get(key, 4)), max(b.max_draft_len, 1))


def decode(b: Bundle, method: str, reqs: list[Request], on_emit: Emit | None = None,
           num_draft_tokens: int | None = None, disable_at_batch: int | None = None, **opts) -> list[Result]:
    """Run `reqs` as one batch with `method`; raise ValueError naming the method when it is unavailable.

    A batch at or above `disable_at_batch` (default: the spec's) runs the baseline code itself, so
    switching speculation off costs nothing; its results say `speculation_off`. A speculative method
    given `yield_to` checks it between rounds and, once it is true, returns a `Handoff` instead of a
    Result for each unfinished row (for `ContinuousBatch.adopt`); `resume=` Handoffs (from
    `ContinuousBatch.release`, with `reqs` their requests) continue such rows speculatively.
    """
    if method not in b.methods():
        raise ValueError(f"method {method!r} is not available here; this deployment serves {b.methods()}")
    if opts.get("resume") and (method not in RESUMABLE or speculation_off(b, method, len(reqs), disable_at_batch)):
        raise ValueError(f"resume: {method!r} cannot continue handed-off rows here; {RESUMABLE} can, below "
                         "disable_at_batch (keep such rows in the continuous batch instead)")
    if method == "baseline":
        return generate(b.target, reqs, on_emit)
    if speculation_off(b, method, len(reqs), disable_at_batch):
        results = generate(b.target, reqs, on_emit)
        for r in results:
            r.speculation_off = True
        return results
    k = num_draft_tokens or default_k(b, method)
    if k > b.max_draft_len:
        raise ValueError(f"num_draft_tokens {k} exceeds the engine's max_draft_len {b.max_draft_len}")
    if method == "draft_target":
        from pipeline.runtime.speculative import draft_target

        lookup = {"lookup_min_ngram": b.options.get("draft_lookup_min_ngram", 0),
                  "lookup_num_tokens": default_k(b, "prompt_lookup"),
                  "lookup_max_ngram": b.options.get("prompt_lookup_max_ngram", 3),
                  "draft_confidence": b.options.get("draft_confidence", 0.0)}
        return draft_target(b.target, b.draft, reqs, k, on_emit, **{**lookup, **opts})
    if method == "prompt_lookup":
        from pipeline.runtime.speculative import prompt_lookup

        return prompt_lookup(b.target, reqs, k, on_emit, max_ngram=b.options.get("prompt_lookup_max_ngram", 3), **opts)
    from pipeline.runtime.medusa import medusa_generate

    return medusa_generate(b.target, b.medusa, reqs, on_emit, **opts)
