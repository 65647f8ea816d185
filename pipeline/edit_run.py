"""validate's `edit` section (issue 49 item 5): whole-file edits, ours against llama-server, decode tokens/s.

The edit set (validate.edit_set, build/edit_set.json: each case an instruction and the original file, 300-1,500
tokens, from Python's standard library, PSF-2.0; experiments/make_edit_set.py writes it) is sent through the OpenAI
endpoint, case by case, each case to every system in turn: ours with each method it serves, its default method with
`prediction` = the original file and with an unrelated file (another case's) as the prediction; llama-server plain,
with `--spec-type ngram-mod` (its model-free drafter) and `draft-simple` with the draft GGUF. Every answer of ours
is checked greedy-identical to ours' baseline. Decode tokens/s (the tokens after the first over the time after it,
summed over the cases) per system. Written to reports/<name>/edit.json.

Every request of ours carries `cache_prompt: false`: each system meets each case as a user's first request would,
with no prompt-cache K/V and no suffix store (pipeline/runtime/suffix.py: such a request neither drafts from earlier
outputs nor leaves its own). Without it the systems after the first drafted the earlier systems' answer to the same
case from the store, and the prediction figures measured that replay, not the prediction.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.sidebyside import LLAMA_MODES, System, decode_rate, identity, llama_systems, median, ratio
from pipeline.sidebyside import fmt as _f

SYSTEM_PROMPT = ("You are a coding assistant. Reply with the complete edited file in one Python code block, "
                 "nothing else.")
STORE_METHODS = ("suffix", "hybrid")  # the methods whose answers go into the suffix store (pipeline/runtime/suffix.py)
FRESH = {"cache_prompt": False}  # every request of ours: no prompt cache, no suffix store (the module's docstring)
EXTRA_TOKENS = 160  # new tokens allowed beyond the original file's (hints and docstrings make it longer)
# Issue 49's done-when figures for the default method, set against the run's (None where the run lacks a side).
TARGETS = {"default_over_llama_plain": 4.0, "default_over_best_llama_spec": 1.5, "prediction_over_llama_plain": 5.0,
           "unrelated_prediction_slowdown": 0.05}


def load_cases(path: Path, limit: int = 0) -> list[dict]:
    """The edit set's cases (the first `limit`, 0: all); a missing or malformed file names the key and the fix."""
    if not path.is_file():
        raise FileNotFoundError(f"validate.edit_set: {path} does not exist; write it with "
                                "`.venv/bin/python experiments/make_edit_set.py` or set validate.edit_set: '' to skip")
    cases = json.loads(path.read_text()).get("cases") or []
    for c in cases:
        missing = [k for k in ("id", "instruction", "original") if not c.get(k)]
        if missing:
            raise ValueError(f"validate.edit_set: case {c.get('id', '?')} in {path} lacks {missing}; rewrite the file "
                             "with experiments/make_edit_set.py")
    return cases[:limit] if limit else cases


def _tokens(case: dict) -> int:
    """The original file's tokens (counted when the set was written; else a rough count from its length)."""
    return case.get("tokens") or len(case["original"]) // 3


def fit_cases(cases: list[dict], max_input: int) -> tuple[list[dict], list[str]]:
    """(the cases whose file and instruction fit our endpoint's input limit, a note naming the others)."""
    fit = [c for c in cases if _tokens(c) + 128 <= max_input]
    left = [c["id"] for c in cases if c not in fit]
    return fit, ([f"cases {left} skipped: over limits.max_input_len ({max_input})"] if left else [])


def messages(case: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{case['instruction']}\n\n```python\n{case['original']}```"}]


def our_systems(url: str, model: str, methods: list[str | None], default: str | None) -> list[System]:
    """Ours: every method served, the default first, then the default with `prediction` set per case (the original
    file, an unrelated one); every one sends `cache_prompt: false` (FRESH)."""
    d = default or (methods[0] if methods else None)
    out = [System(m or "server default", url, model, method=m, extra=dict(FRESH))
           for m in sorted(methods, key=lambda m: m != d)]
    out += [System(f"{d or 'default'} + prediction (the original)", url, model, method=d, extra=dict(FRESH)),
            System(f"{d or 'default'} + prediction (an unrelated file)", url, model, method=d, extra=dict(FRESH))]
    return out


def store_exposure(ours: list[System]) -> dict[str, list[str]]:
    """Per system, the systems sent the same case before it whose answer the suffix store held when it drafted: those
    of a method that feeds the store (suffix, hybrid) sent without `cache_prompt: false`, counted for a system that
    reads it (sent without it too). Empty throughout when every system sends it, as `our_systems` makes them."""
    seen: list[str] = []
    out = {}
    for s in ours:
        fresh = s.extra.get("cache_prompt") is False
        out[s.label] = [] if fresh else list(seen)
        if s.method in STORE_METHODS and not fresh:
            seen.append(s.label)
    return out


def run_edit(spec, url: str, model: str, methods: list[str | None], default: str | None, log=print,
             llama: list[System] | None = None, spent: Callable[[], str] | None = None) -> dict:
    """The section, measured; llama-server's three modes are started here unless given. `spent`: why no further
    case may start ('' while one may: validate's Budget for a case), checked from the second case on (the report's
    notes say how many ran)."""
    v = spec.validate
    cases, notes = fit_cases(load_cases(spec.path(v.edit_set), v.max_edit_cases), spec.limits.max_input_len)
    if llama is None:
        longest = max((_tokens(c) for c in cases), default=0)
        with llama_systems(spec, LLAMA_MODES, 2 * longest + 2048, "edit", log) as theirs:
            return run_edit(spec, url, model, methods, default, log, theirs, spent)
    ours = our_systems(url, model, methods, default)
    pred_orig, pred_other = ours[-2], ours[-1]
    systems = [*ours, *llama]
    rows: dict[str, list] = {s.label: [] for s in systems}
    for i, case in enumerate(cases):
        why = spent() if i and spent is not None else ""
        if why:
            notes.append(f"{i} of {len(cases)} cases ran: {why} (`python -m pipeline validate SPEC --only "
                         "side-by-side` runs them all)")
            log(f"  {why}: {i} of {len(cases)} edit cases")
            cases = cases[:i]
            break
        other = cases[(i + 1) % len(cases)]["original"] if len(cases) > 1 else "def unrelated():\n    pass\n"
        n = min(_tokens(case) + EXTRA_TOKENS, spec.limits.max_seq_len - spec.limits.max_input_len,
                v.edit_new_tokens or 1 << 30)
        for s in systems:
            extra = ({"prediction": {"type": "content", "content": case["original"]}} if s is pred_orig else
                     {"prediction": {"type": "content", "content": other}} if s is pred_other else None)
            r = s.ask(messages(case), n, extra=extra)
            rows[s.label].append(None if r is None else {
                k: r[k] for k in ("text", "completion_tokens", "ttft_s", "latency_s", "decode_tokens_per_s",
                                  "finish_reason", "accepted_prediction_tokens", "rejected_prediction_tokens",
                                  "acceptance_rate")})
        log(f"  edit {i + 1}/{len(cases)} {case['id']}: " + ", ".join(
            f"{k} {_f(r[-1] and r[-1]['decode_tokens_per_s'], '.1f')}" for k, r in rows.items()) + " decode tokens/s")
    report = {"spec": spec.name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "edit_set": v.edit_set, "new_tokens": v.edit_new_tokens or "the whole file",
              "cases": [{k: c.get(k) for k in ("id", "kind", "source", "license", "tokens", "bug_introduced")}
                        for c in cases],
              "default_method": default, "systems": {s.label: s.unsupported or "ran" for s in systems},
              "ours": [s.label for s in ours], "llama": [s.label for s in llama], "notes": notes,
              "suffix_store_bytes": int(getattr(spec.speculation, "suffix_store_bytes", 0) or 0),
              "cache_prompt": {s.label: s.extra.get("cache_prompt", True) for s in ours},
              "after_store_methods": store_exposure(ours), "runs": rows}
    report["summary"] = summarize(report, baseline_label(methods), pred_orig.label, pred_other.label,
                                  default or (methods[0] if methods else None))
    return report


def baseline_label(methods: list[str | None]) -> str:
    return "baseline" if "baseline" in methods else (methods[0] or "server default") if methods else "server default"


def system_figures(rows: list[dict | None], reference: list[dict | None]) -> dict:
    """One system's figures over the cases: decode tokens/s (summed), its per-case median, greedy identity against
    the reference's answers, prediction tokens accepted and rejected (when reported)."""
    done = [r for r in rows if r is not None]
    parts = [(r["completion_tokens"] or 0, r["latency_s"] - r["ttft_s"]) for r in done]
    acc = [r["accepted_prediction_tokens"] for r in done if r.get("accepted_prediction_tokens") is not None]
    rej = [r["rejected_prediction_tokens"] for r in done if r.get("rejected_prediction_tokens") is not None]
    return {"cases": len(done), "decode_tokens_per_s": decode_rate(parts),
            "decode_tokens_per_s_median": median([r["decode_tokens_per_s"] for r in done]),
            "identical_to_baseline": identity([r and r["text"] for r in rows], [r and r["text"] for r in reference]),
            "accepted_prediction_tokens": sum(acc) if acc else None,
            "rejected_prediction_tokens": sum(rej) if rej else None}


def paired(rows: list[dict | None], reference: list[dict | None]) -> float | None:
    """The median over cases of one system's decode tokens/s over the reference's on the same case (cases where
    either is missing left out): the two ran minutes apart at most, so the machine's drift cancels case by case."""
    return median([ratio(a["decode_tokens_per_s"], b["decode_tokens_per_s"]) for a, b in zip(rows, reference)
                   if a is not None and b is not None])


def summarize(report: dict, base: str, pred_orig: str, pred_other: str, default: str | None) -> dict:
    """Each system's figures and the ratios issue 49 asks for, with its targets set against them."""
    runs = report["runs"]
    ref = runs.get(base) or []
    per = {k: system_figures(rs, ref) for k, rs in runs.items()}
    rate = {k: e["decode_tokens_per_s"] for k, e in per.items()}
    d = rate.get(default or "") or rate.get("server default")
    plain = rate.get("llama-server plain")
    spec_modes = [rate.get(f"llama-server {m}") for m in LLAMA_MODES if m != "plain"]
    best_spec = max((x for x in spec_modes if x is not None), default=None)
    with_pred, unrelated = rate.get(pred_orig), rate.get(pred_other)
    got = {"default_over_llama_plain": ratio(d, plain), "default_over_best_llama_spec": ratio(d, best_spec),
           "prediction_over_llama_plain": ratio(with_pred, plain),
           "unrelated_prediction_slowdown": None if ratio(unrelated, d) is None else 1 - ratio(unrelated, d)}
    ours_ids = [per[k]["identical_to_baseline"] for k in report["ours"] if per[k]["cases"]]
    none = runs.get(default or "") or runs.get("server default") or []
    prediction = {"original_over_none": ratio(with_pred, d), "unrelated_over_none": ratio(unrelated, d),
                  "original_over_none_per_case_median": paired(runs.get(pred_orig) or [], none),
                  "unrelated_over_none_per_case_median": paired(runs.get(pred_other) or [], none)}
    return {"systems": per, "default_method": default, "best_llama_spec_tokens_per_s": best_spec,
            "prediction": prediction,
            "ours_identical": {"identical": sum(i["identical"] for i in ours_ids),
                               "total": sum(i["total"] for i in ours_ids)},
            "targets": {k: {"target": lim, "measured": got[k],
                            "met": None if got[k] is None else (got[k] <= lim if k == "unrelated_prediction_slowdown"
                                                                else got[k] >= lim)}
                        for k, lim in TARGETS.items()}}


def markdown(report: dict) -> list[str]:
    """validate.md's `Edits` section."""
    s = report["summary"]
    plain = s["systems"].get("llama-server plain", {}).get("decode_tokens_per_s")
    lines = [f"## Edits (OpenAI endpoint, {len(report['cases'])} cases of {report['edit_set']}, every system in turn "
             f"per case; new tokens per answer: {report.get('new_tokens', 'the whole file')})", "",
             "| system | decode tokens/s | per-case median | vs llama-server plain | identical to our baseline | "
             "prediction tokens accepted / rejected | status |", "|---|---|---|---|---|---|---|"]
    for k, e in s["systems"].items():
        ident = f"{e['identical_to_baseline']['identical']}/{e['identical_to_baseline']['total']}"
        pred = ("" if e["accepted_prediction_tokens"] is None else
                f"{e['accepted_prediction_tokens']} / {e['rejected_prediction_tokens']}")
        status = report["systems"][k]
        lines.append(f"| {k} | {_f(e['decode_tokens_per_s'], '.1f')} | {_f(e['decode_tokens_per_s_median'], '.1f')} | "
                     f"{_f(ratio(e['decode_tokens_per_s'], plain), '.2f', 'x')} | {ident} | {pred} | "
                     f"{'' if status == 'ran' else status} |")
    i = s["ours_identical"]
    pr = s.get("prediction") or {}
    if pr:
        lines += ["", f"Predicted Outputs with the default method ({s['default_method']}), each request of ours sent "
                  "with `cache_prompt: false` (no prompt cache, no suffix store): with the original file as the "
                  f"prediction {_f(pr['original_over_none'], '.2f', 'x')} the speed without one (per-case median "
                  f"{_f(pr['original_over_none_per_case_median'], '.2f', 'x')}); with an unrelated file "
                  f"{_f(pr['unrelated_over_none'], '.2f', 'x')} (per-case median "
                  f"{_f(pr['unrelated_over_none_per_case_median'], '.2f', 'x')})."]
    lines += ["", f"Ours greedy-identical to our baseline: {i['identical']}/{i['total']} answers (llama-server's rows "
              "compare its answers with ours' baseline for reference; its numerics differ).", "",
              "Issue 49's targets (default method " + str(s["default_method"]) + "): " + "; ".join(
                  f"{k} {_f(e['measured'], '.2f')} (target {'<=' if k == 'unrelated_prediction_slowdown' else '>='} "
                  f"{e['target']}: {'met' if e['met'] else 'not met' if e['met'] is False else 'n/a'})"
                  for k, e in s["targets"].items()) + ".",
              "", "Cases: " + "; ".join(f"{c['id']} ({c['kind']}, {c['tokens']} tokens)" for c in report["cases"])
              + f". Source: {report['cases'][0]['license'] if report['cases'] else ''}, see {report['edit_set']}.", "",
              *([f"Notes: {'; '.join(report['notes'])}.", ""] if report.get("notes") else [])]
    after = {k: v for k, v in (report.get("after_store_methods") or {}).items() if v}
    if report.get("suffix_store_bytes") and after:
        lines += ["With the suffix store on (speculation.suffix_store_bytes), these ran after systems that feed it, "
                  "on the same case, so the store held an answer to it: " + "; ".join(
                      f"{k} (after {', '.join(v)})" for k, v in after.items()) + ".", ""]
    return lines


def readme_lines(report: dict) -> list[str]:
    """The README block's line for the section."""
    s = report["summary"]
    sy = s["systems"]
    parts = [f"{k} {_f(e['decode_tokens_per_s'], '.1f')}" for k, e in sy.items() if e["decode_tokens_per_s"]]
    t = s["targets"]
    i = s["ours_identical"]
    pred = t["prediction_over_llama_plain"]["measured"]
    unrelated = (s.get("prediction") or {}).get("unrelated_over_none")
    return [f"Edits through the OpenAI endpoint (`reports/{report['spec']}/edit.json`, run {report['date']}, "
            f"{len(report['cases'])} cases), decode tokens/s: " + ", ".join(parts)
            + f". Default method ({s['default_method']}) {_f(t['default_over_llama_plain']['measured'], '.2f', 'x')} "
            f"llama-server plain, {_f(t['default_over_best_llama_spec']['measured'], '.2f', 'x')} its best speculative "
            f"mode; with `prediction` = the original file {_f(pred, '.2f', 'x')} llama-server plain, with an unrelated "
            f"file {_f(unrelated, '.2f', 'x')} the speed without one (each request of ours with `cache_prompt: false`);"
            f" ours greedy-identical to baseline {i['identical']}/{i['total']}."]
