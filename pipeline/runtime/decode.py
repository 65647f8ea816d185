"""One entry point for every decoding method, so the CLI, the Triton model and the benchmarks agree.

`Bundle` holds what a deployment loaded (target, and the draft / Medusa heads when built) and its typed
speculation config (`pipeline.runtime.specconfig`); `decode(bundle, method, requests)` runs one batch with
the named method, one of `METHODS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.runtime.engine_io import load_engine
from pipeline.runtime.generate import Emit, Request, Result, generate
from pipeline.runtime.loadpolicy import plain_from, policy_for
from pipeline.runtime.medusa import MEDUSA, load_medusa_engine
from pipeline.runtime.model import Transformer
from pipeline.runtime.prompt_cache import PromptCache
from pipeline.runtime.specconfig import Method, SpecDecodeConfig
from pipeline.runtime.speculative import DRAFT_TARGET, PROMPT_LOOKUP, load_draft
from pipeline.runtime.suffix import HYBRID, SUFFIX, VERIFY_COST, SuffixStore


class _Baseline:
    """Plain decoding with the target alone."""

    name, resumable = "baseline", False

    def available(self, b: Bundle) -> bool:
        return True

    def run(self, b: Bundle, reqs: list[Request], k: int, on_emit: Emit | None, **opts) -> list[Result]:
        return generate(b.target, reqs, on_emit, prompt_cache=opts.get("prompt_cache"))


# Every decoding method, in the order deployments list them; a new method is its module plus one entry here.
METHODS: tuple[Method, ...] = (_Baseline(), DRAFT_TARGET, PROMPT_LOOKUP, MEDUSA, SUFFIX, HYBRID)
METHOD_NAMES = tuple(m.name for m in METHODS)
RESUMABLE = tuple(m.name for m in METHODS if m.resumable)  # can continue rows handed off mid-request (`resume=`)


@dataclass
class Bundle:
    """A loaded deployment and its speculation config (`spec`; the engine's limits alone when none is given)."""

    target: Transformer
    tokenizer: Any
    config: dict
    draft: Transformer | None = None
    medusa: Any = None
    draft_config: dict | None = None  # the draft engine's config.json (its measured k, when `auto` stored one)
    spec: SpecDecodeConfig | None = None
    prompt_cache: PromptCache | None = None  # prefix K/V of target and draft, shared by every method (prompt_cache.py)
    suffix_store: SuffixStore | None = None  # recent outputs the suffix drafter drafts from (made on first use)
    verify_cost: tuple[float, ...] = VERIFY_COST  # verifying S tokens in one-token steps (S = 1..): suffix lengths

    def __post_init__(self) -> None:
        self.use(self.spec or SpecDecodeConfig(max_draft_len=self.max_draft_len, num_draft_tokens=self.measured_k))

    def use(self, spec: SpecDecodeConfig) -> Bundle:
        """Decode with `spec` from now on; its max_draft_len must be the engine's."""
        if spec.max_draft_len != self.max_draft_len:
            raise ValueError(f"limits.max_draft_len: got {spec.max_draft_len} but the engine was built with "
                             f"max_draft_len {self.max_draft_len}; rebuild the engine (`make engine`) or set the spec "
                             "to the engine's")
        self.spec = spec
        return self

    def methods(self) -> list[str]:
        return [m.name for m in METHODS if m.available(self)]

    @property
    def max_draft_len(self) -> int:
        return int(self.config["build_config"].get("max_draft_len", 0))

    @property
    def measured_k(self) -> int | None:
        """The k that `num_draft_tokens: auto` measured and stored in the draft engine, if any."""
        k = ((self.draft_config or {}).get("speculation") or {}).get("num_draft_tokens")
        return k if isinstance(k, int) else None

    @property
    def end_ids(self) -> tuple[int, ...]:
        return tuple(self.target.cfg.eos_token_id or ())


def load_bundle(engine_dir: Path, device: str = "cpu", methods: tuple[str, ...] = METHOD_NAMES,
                verify: bool = True) -> Bundle:
    """Load engines/<name>/{target,draft,medusa} as far as they exist."""
    eng = load_engine(engine_dir / "target", device, verify=verify)
    eng.model.attach_head_screen(engine_dir / "target")  # greedy picks: a Q4_K screen of a GGUF head, then its rows
    draft = draft_config = medusa = None
    if ("draft_target" in methods or "hybrid" in methods) and (engine_dir / "draft" / "config.json").is_file():
        draft, draft_config = load_draft(engine_dir / "draft", device, verify=verify)
    if "medusa" in methods and (engine_dir / "medusa" / "config.json").is_file():
        medusa = load_medusa_engine(engine_dir / "medusa", eng.model, verify=verify)
    b = Bundle(eng.model, eng.tokenizer, eng.config, draft, medusa, draft_config)
    b.verify_cost = load_verify_cost(engine_dir / "target") or VERIFY_COST
    return b


VERIFY_COST_FILE = "verify_cost.json"  # bench's measured verify curve, stored beside the target's weights


def load_verify_cost(target_dir: Path) -> tuple[float, ...] | None:
    """The verify curve `make bench` measured on this machine (relative cost of S = 1.. tokens), if stored."""
    try:
        rel = json.loads((target_dir / VERIFY_COST_FILE).read_text())["relative"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(rel, list) or len(rel) < 2 or not all(isinstance(c, (int, float)) and c > 0 for c in rel):
        return None
    return tuple(float(c) for c in rel)


def apply_spec(b: Bundle, spec) -> Bundle:
    """Take the speculation config from the spec (pipeline.spec.Spec); a measured k stored by
    `num_draft_tokens: auto` stands for "auto"."""
    return b.use(SpecDecodeConfig.from_speculation(spec.speculation, spec.limits.max_draft_len, b.measured_k))


def method_named(name: str) -> Method:
    for m in METHODS:
        if m.name == name:
            return m
    raise ValueError(f"method: got {name!r}; the methods are {list(METHOD_NAMES)}")


def plain_rows(b: Bundle, method: str, max_rows: int) -> int | None:
    """With `draft_length: load`, the fewest rows (up to `max_rows`) from which `method` decodes plainly: a chain
    drafter's from its load policy's stored costs and prior acceptance (`loadpolicy.plain_from`), a method judged
    by the batch (`batch_plain_from`: Medusa's tree) from its own rule. None: it speculates at every row count up to
    `max_rows`, or the policy does not apply (`draft_length: fixed`, baseline, a method without it)."""
    if method == "baseline" or b.spec.draft_length != "load":
        return None
    m = method_named(method)
    if hasattr(m, "batch_plain_from"):
        return m.batch_plain_from(b, max_rows)
    if not getattr(m, "adaptive", False):
        return None
    try:
        pol = policy_for(b, method, b.spec.k_for(method))
    except ValueError:  # no k for this method here
        return None
    return plain_from(pol, max_rows, getattr(m, "policy_from_rows", 1))


def decode(b: Bundle, method: str, reqs: list[Request], on_emit: Emit | None = None,
           num_draft_tokens: int | None = None, disable_at_batch: int | None = None, **opts) -> list[Result]:
    """Run `reqs` as one batch with `method`; raise ValueError naming the method when it is unavailable.

    A batch at or above `disable_at_batch` (default: the spec's) runs the baseline code itself, so
    switching speculation off costs nothing; its results say `speculation_off`. A speculative method
    given `yield_to` checks it between rounds and, once it is true, returns a `Handoff` instead of a
    Result for each unfinished row (for `ContinuousBatch.adopt`); `resume=` Handoffs (from
    `ContinuousBatch.release`, with `reqs` their requests) continue such rows speculatively.
    A `num_draft_tokens` above the engine's max_draft_len is a SpeculationError (a ValueError), never clamped.
    """
    if method not in b.methods():
        raise ValueError(f"method {method!r} is not available here; this deployment serves {b.methods()}")
    if b.prompt_cache is not None:
        opts.setdefault("prompt_cache", b.prompt_cache)
    m = method_named(method)
    off = b.spec.off_at(method, len(reqs), disable_at_batch)
    # A batch the load policy would only step plainly runs the baseline's loop, as the scheduler serves it: Medusa's
    # tree judged by the batch, or a chain drafter whose prior drafts nothing at these rows (it then never proposes,
    # so its counts never move: the policy's plain steps, at the speculative loop's cost per step, 3% slower on
    # SmolLM2). Not for a batch that may hand its rows off (`yield_to`, `resume`), brings its own policy or its own k,
    # nor for suffix and hybrid (`policy_from_rows` 2), whose loop also keeps each answer in the suffix store.
    chain = (getattr(m, "adaptive", False) and getattr(m, "policy_from_rows", 1) == 1 and num_draft_tokens is None
             and not ({"policy", "resume"} & opts.keys() or opts.get("yield_to")))
    if not off and (hasattr(m, "batch_plain_from") or chain):
        at = plain_rows(b, method, len(reqs))
        off = at is not None and len(reqs) >= at
    if opts.get("resume") and (not m.resumable or off):
        raise ValueError(f"resume: {method!r} cannot continue handed-off rows here; {RESUMABLE} can, below "
                         "disable_at_batch (keep such rows in the continuous batch instead)")
    if method == "baseline":
        return m.run(b, reqs, 0, on_emit, **opts)
    if off:
        results = generate(b.target, reqs, on_emit, prompt_cache=opts.get("prompt_cache"))
        for r in results:
            r.speculation_off = True
        return results
    k = b.spec.k_for(method) if num_draft_tokens is None else b.spec.check_k(
        num_draft_tokens, "num_draft_tokens", "send a smaller k, or omit it for the deployment's default")
    if getattr(m, "adaptive", False) and b.spec.draft_length == "load" and "policy" not in opts:
        # per round and row from the load (loadpolicy.py); None: k
        opts["policy"] = policy_for(b, method, k, opts.get("draft_confidence"))
    return m.run(b, reqs, k, on_emit, **opts)
