"""Choosing k (draft tokens per step) from costs measured on this machine and measured acceptance.

E[tokens per step](k) = 1 + sum_{i<=k} P(the first i drafts are accepted), from per-position
acceptance (the i.i.d. form is (1 - a^(k+1)) / (1 - a)); time per step(k) = k * c_draft +
c_verify(k + 1). The best k maximises their ratio. The table is printed and stored, never applied
silently: `python -m pipeline pick-k SPEC` re-measures and rewrites the stored choice.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline import spec as specmod
from pipeline.common import chat_ids, setup_threads, split_prompts
from pipeline.runtime import kernels
from pipeline.runtime.decode import load_bundle
from pipeline.runtime.generate import Request
from pipeline.runtime.loadpolicy import ROWS_MEASURED
from pipeline.runtime.model import Transformer
from pipeline.runtime.speculative import draft_target
from pipeline.sources import read_prompts


def best_time(fn, reps: int) -> float:
    """Seconds of fn's fastest run of `reps` (at least one): a shared machine's contention only adds time."""
    best = float("inf")
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def verify_costs(model: Transformer, max_tokens: int, context: int = 128, reps: int = 5,
                 tree: bool = False, between: Callable[[], None] | None = None,
                 rounds: list[list[float]] | None = None, rows: int = 1) -> list[float]:
    """Seconds for one target forward plus its logits over n = 1..max_tokens new tokens after `context` tokens.

    The one timer behind pick-k, the Medusa tree growth and the benchmark's verify-cost curve. Sizes are timed
    in interleaved rounds after a warm-up round and the minimum kept, so load from other processes hits every
    size alike; the curve is then made non-decreasing (more tokens never cost less). `tree`: with an explicit
    attention mask, as Medusa's tree verification runs. `between` runs after each timed round (another
    timer that must see the same load, such as the draft step's). `rounds`, when given, receives each timed round's
    seconds per size (sizes timed within a fraction of a second of each other: bench's paired ratios). `rows`: a batch
    of that many rows, n tokens each (the load-adaptive draft length's costs by batch size)."""
    cache = _verify_cache(model, rows, context, max_tokens)
    best = [float("inf")] * max_tokens
    for r in range(reps + 1):
        this = _verify_round(model, cache, rows, context, max_tokens, tree)
        if r:
            best = [min(b, x) for b, x in zip(best, this)]
        if r and rounds is not None:
            rounds.append(this)
        if r and between is not None:
            between()
    return _non_decreasing(best)


def _verify_cache(model: Transformer, rows: int, context: int, max_tokens: int):
    """A cache of `rows` rows holding `context` tokens, with room for a verification of `max_tokens` after them."""
    cache = model.new_cache(rows, context + max_tokens + 2)
    at = torch.arange(context)[None].expand(rows, -1).contiguous()
    model(torch.zeros(rows, context, dtype=torch.long), at, cache)
    return cache


def _verify_round(model: Transformer, cache, rows: int, context: int, max_tokens: int,
                  tree: bool = False) -> list[float]:
    """Seconds of one forward plus its logits over n = 1..max_tokens new tokens per row after `context` tokens."""
    out = []
    for n in range(1, max_tokens + 1):
        tok = torch.zeros(rows, n, dtype=torch.long)
        kv = context + n
        mask = dict(mask=torch.ones(1, n, kv, dtype=torch.bool), kv_len=kv) if tree else {}
        t = time.perf_counter()
        model.logits(model(tok, (context + torch.arange(n)[None]).expand(rows, -1).contiguous(), cache, **mask))
        out.append(time.perf_counter() - t)
    return out


def _non_decreasing(costs: list[float]) -> list[float]:
    """More tokens never cost less: each cost at least the one before it."""
    out = list(costs)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1])
    return out


def measure_costs(target: Transformer, draft: Transformer, max_k: int, context: int = 64, reps: int = 5,
                  rows: int = 1) -> dict:
    """Seconds for one draft step (incl. its head, argmax and confidence) and for target verification of 1..max_k+1
    tokens, for a batch of `rows` rows: `measure_costs_by_rows` at that one size. Draft steps are timed between the
    verify rounds: this machine's memory bandwidth drifts by tens of percent within a minute, and a draft timed
    before the target put that drift into the step fraction."""
    return measure_costs_by_rows(target, draft, max_k, (rows,), context, reps)[str(rows)]


@torch.inference_mode()
def measure_costs_by_rows(target: Transformer, draft: Transformer, max_k: int,
                          rows: tuple[int, ...] = ROWS_MEASURED, context: int = 64, reps: int = 4,
                          order: list[int] | None = None) -> dict[str, dict]:
    """`measure_costs` at each batch size in `rows` (stored as `costs_by_rows`, keys are row counts as strings: JSON):
    what the load-adaptive draft length (loadpolicy.py) weighs each round.

    Every batch size is timed in the same rounds (each round: every size in turn, its verify of 1..max_k+1 tokens
    and then its draft step; the sizes' order rotating round by round), after a warm-up round, and each cell keeps
    its minimum. Why: this machine's memory reads at one of two speeds that switch within minutes, and the sizes
    timed one after another had the one-row curve read in a slow minute (a one-token step 27.6 ms) and two rows in a
    fast one (two one-token rows 22.0 ms): the policy then took one-row verification as nearly flat and drafted
    widths it could not pay for. Timed together, every cell sees the same minutes. `order`, when given, receives the
    row counts in the order they were timed (warm-up included)."""
    V = target.cfg.vocab_size
    n_max = max_k + 1
    state = {}
    for r in rows:
        ctx = torch.randint(0, V, (r, context))
        dc = draft.new_cache(r, context + 8)
        draft(ctx, torch.arange(context)[None].expand(r, -1).contiguous(), dc)
        state[r] = (ctx, dc, _verify_cache(target, r, context, n_max), torch.full((r, 1), context))
    best = {r: {"c_draft": float("inf"), "c_verify": [float("inf")] * n_max} for r in rows}
    for rnd in range(reps + 1):
        for r in list(rows[rnd % len(rows):]) + list(rows[:rnd % len(rows)]):
            ctx, dc, tc, one = state[r]
            verify = _verify_round(target, tc, r, context, n_max)
            # a drafting step as _ModelDrafter runs it: body, head, argmax and confidence
            step = best_time(lambda c=ctx, o=one, d=dc: kernels.argmax_prob(draft.logits(draft(c[:, :1], o, d)[:, 0])),
                             2)
            if rnd:
                b = best[r]
                b["c_verify"] = [min(x, y) for x, y in zip(b["c_verify"], verify)]
                b["c_draft"] = min(b["c_draft"], step)
            if order is not None:
                order.append(r)
    return {str(r): {"c_draft": b["c_draft"], "c_verify": _non_decreasing(b["c_verify"])} for r, b in best.items()}


def measure_acceptance(target: Transformer, draft: Transformer, prompts: list[list[int]], max_k: int,
                       max_new: int = 48, emitted: list[int] | None = None) -> list[float]:
    """P(draft position i is accepted) for i < max_k, greedy, over the given prompts; the target's tokens
    are appended to `emitted` when given."""
    acc, prop = [0] * max_k, [0] * max_k
    for r in draft_target(target, draft, [Request(p, max_new) for p in prompts], max_k):
        acc = [a + b for a, b in zip(acc, r.accepted_per_position)]
        prop = [a + b for a, b in zip(prop, r.proposed_per_position)]
        if emitted is not None:
            emitted += r.tokens
    return [a / p if p else 0.0 for a, p in zip(acc, prop)]


def vocab_coverage(draft: Transformer, tokens: list[int]) -> float | None:
    """Share of the target's tokens a reduced draft head can propose (None for a full head)."""
    ids = getattr(draft, "vocab_ids", None)
    if ids is None or not tokens:
        return None
    kept = set(ids.tolist())
    return sum(t in kept for t in tokens) / len(tokens)


def expected_tokens(rates: list[float], k: int) -> float:
    """Tokens per target step with k drafts, from per-position (cumulative) acceptance."""
    return 1.0 + sum(rates[:k])


def expected_tokens_iid(alpha: float, k: int) -> float:
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def speed_table(costs: dict, rates: list[float]) -> list[dict]:
    base = costs["c_verify"][0]
    alpha = rates[0] if rates else 0.0
    rows = []
    for k in range(1, len(rates) + 1):
        t = k * costs["c_draft"] + costs["c_verify"][k]
        e = expected_tokens(rates, k)
        rows.append({"k": k, "accept_pos": round(rates[k - 1], 3), "tokens_per_step": round(e, 3),
                     "tokens_per_step_iid": round(expected_tokens_iid(alpha, k), 3), "step_ms": round(1e3 * t, 2),
                     "speedup": round(e * base / t, 3)})
    return rows


def format_table(rows: list[dict], costs: dict) -> str:
    head = (f"draft step {1e3 * costs['c_draft']:.1f} ms, target step {1e3 * costs['c_verify'][0]:.1f} ms "
            f"(verify k+1: {', '.join(f'{1e3 * c:.1f}' for c in costs['c_verify'])} ms)\n"
            f"{'k':>3} {'P(acc pos k)':>12} {'E[tok/step]':>11} {'iid':>6} {'step ms':>8} {'speedup':>8}")
    lines = [f"{r['k']:>3} {r['accept_pos']:>12.3f} {r['tokens_per_step']:>11.2f} {r['tokens_per_step_iid']:>6.2f} "
             f"{r['step_ms']:>8.1f} {r['speedup']:>8.2f}" for r in rows]
    return "\n".join([head, *lines])


def measure_and_pick(target: Transformer, draft: Transformer, prompts: list[list[int]], max_k: int,
                     log=print, fixed: int | None = None) -> dict:
    """Measure, print the table, return the `speculation` block stored in the draft engine's config.

    `fixed`: the spec's own k (1..max_k), kept whatever the table says; it is still measured and reported."""
    by_rows = measure_costs_by_rows(target, draft, max_k)
    costs = by_rows["1"]
    emitted: list[int] = []
    rates = measure_acceptance(target, draft, prompts, max_k, emitted=emitted)
    rows = speed_table(costs, rates)
    best = rows[fixed - 1] if fixed else max(rows, key=lambda r: r["speedup"])
    log(format_table(rows, costs))
    if fixed:
        log(f"num_draft_tokens: {fixed} (from the spec; expected speedup {best['speedup']:.2f}x without "
            f"draft_confidence, best of the table k = {max(rows, key=lambda r: r['speedup'])['k']})")
    else:
        log(f"num_draft_tokens: auto -> k = {best['k']} (expected speedup {best['speedup']:.2f}x on this machine)")
    out = {"num_draft_tokens": best["k"], "chosen_by": "spec" if fixed else "measured",
           "expected_speedup": best["speedup"],
           "table": rows, "costs_s": costs, "costs_by_rows": by_rows,
           "draft_step_fraction": costs["c_draft"] / costs["c_verify"][0]}
    cov = vocab_coverage(draft, emitted)
    if cov is not None:
        out["coverage"] = round(cov, 4)
        log(f"reduced draft head covers {cov:.1%} of the target's tokens on the tuning prompts")
    log(f"draft step = {out['draft_step_fraction']:.3f} of a target step")
    log(rows_line(by_rows))
    return out


def rows_line(by_rows: dict[str, dict]) -> str:
    """The costs by rows in one line of the build's and the re-timing's log."""
    return "by rows (draft step / verify 1, k+1 tokens per row, ms): " + "; ".join(
        f"{r}: {1e3 * c['c_draft']:.1f} / {1e3 * c['c_verify'][0]:.1f}, {1e3 * c['c_verify'][-1]:.1f}"
        for r, c in by_rows.items())


def remeasure_costs(target: Transformer, draft: Transformer, stored: dict, log=print) -> dict:
    """The stored `speculation` block with its costs (one row and by rows) measured again and the table's step times
    and speedups recomputed from them; the acceptance and the chosen k are kept (they do not depend on the machine's
    load). Why: `make all` builds the engines beside `make peers` (`make -j2 engine peers`), which compiles llama.cpp
    on a CPU's first run, so pick-k may have timed them on cores the compiler shared; `make all` re-times them once
    that is done (about 30 s; with llama.cpp already built it changes little). (The machine's own drift moves them
    too: a quiet one-token step read 24.0 ms and, 20 minutes later, 31.3-32.3 ms on the 2-core Zen 4 of
    2026-12-04; the flagship's engine, built beside the compile, had stored 34.3.)"""
    table = stored.get("table") or []
    if not table:
        raise ValueError("the draft engine's speculation block has no pick-k table to keep; run `python -m pipeline "
                         "pick-k SPEC --write` (it measures the acceptance too)")
    max_k = len(table)
    by_rows = measure_costs_by_rows(target, draft, max_k)
    costs = by_rows["1"]
    rows = speed_table(costs, [float(r["accept_pos"]) for r in table])
    k = int(stored["num_draft_tokens"])
    out = {**stored, "table": rows, "costs_s": costs, "costs_by_rows": by_rows,
           "expected_speedup": rows[k - 1]["speedup"], "draft_step_fraction": costs["c_draft"] / costs["c_verify"][0]}
    log(format_table(rows, costs))
    log(rows_line(by_rows))
    log(f"re-timed: target step {1e3 * stored['costs_s']['c_verify'][0]:.1f} -> {1e3 * costs['c_verify'][0]:.1f} ms, "
        f"draft step {1e3 * stored['costs_s']['c_draft']:.1f} -> {1e3 * costs['c_draft']:.1f} ms; k = {k} kept")
    return out


def store(engine_dir: Path, speculation: dict) -> None:
    """Rewrite the `speculation` block of engines/<name>/draft/config.json in place (atomic replace)."""
    p = engine_dir / "draft" / "config.json"
    cfg = json.loads(p.read_text())
    cfg["speculation"] = speculation
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, p)


def cmd_pick_k(args) -> int:
    s = specmod.load(args.spec)
    setup_threads(s)
    b = load_bundle(s.engine_dir, s.device, methods=("draft_target",))
    if args.costs:
        stored = ((b.draft_config or {}).get("speculation") or {}) if b.draft is not None else {}
        if not stored.get("table"):
            print(f"pick-k --costs: {s.engine_dir} has no draft engine with a pick-k table: nothing to re-time")
            return 0
        out = remeasure_costs(b.target, b.draft, stored)
        if args.write:
            store(s.engine_dir, out)
            print(f"stored the re-timed costs in {s.engine_dir / 'draft' / 'config.json'}")
        return 0
    if b.draft is None:
        raise ValueError(f"{s.engine_dir}/draft is not built; set draft.source and run `python -m pipeline engine "
                         f"{args.spec}` first")
    max_k = args.max_k or min(b.max_draft_len, 8)
    texts = read_prompts(s.path(s.validate.prompts))
    held = split_prompts(texts, s.validate.max_prompts)[1] or texts[:4]
    out = measure_and_pick(b.target, b.draft, [chat_ids(b.tokenizer, t) for t in held], max_k)
    if args.write:
        store(s.engine_dir, out)
        print(f"stored k = {out['num_draft_tokens']} in {s.engine_dir / 'draft' / 'config.json'}")
    return 0

