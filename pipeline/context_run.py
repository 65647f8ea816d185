"""validate's `context` section (issue 48 item 5): long and repeated prompts, ours against llama-server.

Through the OpenAI endpoint, ours and llama-server with its defaults (prompt cache on, `-c` large enough),
alternating request by request: cold time to first token and prefill tokens/s per prompt size (a first line unique
to the run and the size, so no cache holds any of it); warm, the largest cold prompt up to 4k sent again with
another question of 32-64 tokens; an agent trace, one conversation (a system prompt, a file, questions, each
system's own answers fed back) over several turns, each turn's time to first token and total time; and ours'
greedy answers with the prompt cache on and off (`cache_prompt: false`) compared. Written to
reports/<name>/context.json; `markdown` is validate.md's section, `readme_lines` the README block's.
"""

from __future__ import annotations

import importlib
import inspect
import time

from pipeline.sidebyside import System, identity, llama_systems, median, ratio
from pipeline.sidebyside import fmt as _f

# Text the prompts are cut from: Python's standard library (PSF-2.0), as shipped with the running Python.
SOURCES = ("argparse", "configparser", "difflib", "textwrap", "shlex", "calendar", "statistics", "heapq")
COLD_QUESTION = "In one sentence, what does the code above do?"
WARM_QUESTION = ("Now list the three functions above that a new contributor should read first, each with the "
                 "reason in a few words, and say which of them has the most branches.")
SYSTEM_PROMPT = ("You are a coding agent working in a Python repository. You read the files the user shows you and "
                 "answer precisely and briefly, quoting code only where it helps.")
TRACE_QUESTIONS = ("Which classes does this file define, and what is each for?",
                   "Which function would you change to add a new option, and why?",
                   "Write a short test for the function you just named.",
                   "Is there a bug or an edge case your test does not cover? Name one.",
                   "Propose a one-line docstring for the first class you listed.",
                   "Summarise our conversation in two sentences.")
COLD_TOKENS = 16      # new tokens of a cold request: its time to first token is the figure
ANSWER_TOKENS = 64    # new tokens of a warm request and of each trace turn (the answers fed back)
# Issue 48's done-when figures, set against the run's (None where the run lacks either side).
TARGETS = {"warm_over_cold": 0.10, "warm_over_llama": 1.2, "cold_prefill_over_llama": 2.0, "trace_over_llama": 0.6}


def source_text(tok, n_tokens: int, salt: str) -> str:
    """About `n_tokens` tokens of standard-library Python under a first line naming `salt`: prompts with different
    salts share no prefix, so none of them finds the others in a prompt cache."""
    body, ids = "", []
    for name in SOURCES:
        body += inspect.getsource(importlib.import_module(name)) + "\n"
        ids = tok(body, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            break
    head = f"# {salt}\n"
    keep = max(1, n_tokens - len(tok(head, add_special_tokens=False)["input_ids"]))
    return head + tok.decode(list(ids[:keep]))


def _user(text: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{text}\n\n{question}"}]


def _row(r: dict | None) -> dict | None:
    """A response's figures as the report keeps them (the text only where an identity check needs it)."""
    if r is None:
        return None
    return {k: r.get(k) for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "second_piece_s",
                                  "latency_s", "prefill_tokens_per_s", "server_prompt_ms")}


def fit_sizes(sizes: list[int], max_input: int) -> tuple[list[int], list[int]]:
    """(sizes that fit our endpoint's input limit with the question and chat template around them, the rest)."""
    room = max_input - 128
    return [s for s in sizes if s <= room], [s for s in sizes if s > room]


def run_context(spec, ours: System, tok, log=print, llama: list[System] | None = None) -> dict:
    """The whole section, measured: cold, warm, trace, identity; llama-server started here unless given."""
    v = spec.validate
    sizes, skipped = fit_sizes(list(v.context_sizes), spec.limits.max_input_len)
    trace_tokens = min(v.context_trace_tokens, spec.limits.max_input_len - 128)
    if llama is None:
        ctx = max([*sizes, trace_tokens, 0]) + 2048
        with llama_systems(spec, ("plain",), ctx, "context", log) as theirs:
            return run_context(spec, ours, tok, log, theirs)
    systems = [ours, *llama]
    nonce = time.strftime("%Y%m%dT%H%M%S")
    report: dict = {"spec": spec.name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "systems": {s.label: None for s in systems}, "sizes": sizes, "cold": [], "warm": None,
                    "trace": None, "identity": {}, "notes": []}
    if skipped:
        report["notes"].append(f"sizes {skipped} skipped: over limits.max_input_len ({spec.limits.max_input_len})")
    if trace_tokens < v.context_trace_tokens:
        report["notes"].append(f"agent trace grows to {trace_tokens} tokens, not validate.context_trace_tokens "
                               f"({v.context_trace_tokens}): limits.max_input_len is {spec.limits.max_input_len}")
    # Cold, alternating system by system at each size; the warm prompt's prefix is the largest cold one up to 4k.
    texts = {}
    for n in sizes:
        texts[n] = source_text(tok, n, f"validate context {nonce} cold {n}")
        row = {"size": n}
        for s in systems:
            row[s.label] = _row(s.ask(_user(texts[n], COLD_QUESTION), COLD_TOKENS))
        report["cold"].append(row)
        log(f"  context cold {n}: " + ", ".join(
            f"{s.label} TTFT {row[s.label]['ttft_s']:.2f} s" for s in systems if row.get(s.label)))
    warm_size = max((n for n in sizes if n <= 4096), default=None)
    if warm_size is not None:
        msgs = _user(texts[warm_size], WARM_QUESTION)
        answers = {s.label: s.ask(msgs, ANSWER_TOKENS) for s in systems}
        report["warm"] = {"prefix_tokens": warm_size, **{k: _row(r) for k, r in answers.items()}}
        off = ours.ask(msgs, ANSWER_TOKENS, extra={"cache_prompt": False})
        report["identity"]["warm"] = _identity_entry(answers[ours.label], off, ours)
        log(f"  context warm {warm_size}: " + ", ".join(
            f"{k} TTFT {r['ttft_s']:.2f} s (cached {r['cached_tokens']})" for k, r in answers.items() if r))
    if v.context_turns > 0:
        report["trace"] = _trace(systems, ours, tok, trace_tokens, v.context_turns, nonce, report, log,
                                 v.context_trace_identity)
    for s in systems:
        report["systems"][s.label] = s.unsupported or "ran"
    report["summary"] = summarize(report, ours.label, llama[0].label if llama else None)
    return report


def _identity_entry(on: dict | None, off: dict | None, ours: System) -> dict:
    if on is None or off is None:
        return {"identical": None, "note": ours.unsupported or "no answer"}
    return {"identical": on["text"] == off["text"], "cached_tokens_on": on["cached_tokens"],
            "cached_tokens_off": off["cached_tokens"], "tokens": on["completion_tokens"]}


def _trace(systems: list[System], ours: System, tok, total: int, turns: int, nonce: str, report: dict,
           log, identity_check: bool = True) -> dict:
    """The agent trace: each system its own conversation (its own answers fed back), turn i of every system before
    turn i + 1; then (`identity_check`) ours' last turn again with the prompt cache off."""
    file_tokens = max(64, total - turns * (ANSWER_TOKENS + 40) - 80)
    first = (f"Here is `cli.py`:\n```python\n{source_text(tok, file_tokens, f'validate trace {nonce}')}\n```\n\n"
             + TRACE_QUESTIONS[0])
    convs = {s.label: [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": first}]
             for s in systems}
    rows: dict[str, list] = {s.label: [] for s in systems}
    last = {}
    for i in range(turns):
        for s in systems:
            msgs = convs[s.label]
            r = s.ask(msgs, ANSWER_TOKENS)
            rows[s.label].append(_row(r))
            if r is None:
                continue
            last[s.label] = (list(msgs), r)
            msgs += [{"role": "assistant", "content": r["text"]},
                     {"role": "user", "content": TRACE_QUESTIONS[(i + 1) % len(TRACE_QUESTIONS)]}]
        log(f"  context trace turn {i + 1}/{turns}: " + ", ".join(
            f"{k} TTFT {v[-1]['ttft_s']:.2f} s, total {v[-1]['latency_s']:.2f} s" for k, v in rows.items() if v[-1]))
    if ours.label in last and identity_check:
        msgs, on = last[ours.label]
        report["identity"]["trace_last_turn"] = _identity_entry(on, ours.ask(msgs, ANSWER_TOKENS,
                                                                             extra={"cache_prompt": False}), ours)
    return {"turns": turns, "file_tokens": file_tokens, **rows}


def trace_totals(rows: list[dict | None]) -> dict | None:
    """A system's trace: total seconds, the sum of time to first token, the final prompt's tokens (None when a turn
    is missing: a partial trace is not comparable)."""
    if not rows or any(r is None for r in rows):
        return None
    return {"total_s": sum(r["latency_s"] for r in rows), "ttft_s": sum(r["ttft_s"] for r in rows),
            "final_prompt_tokens": rows[-1]["prompt_tokens"]}


def summarize(report: dict, ours: str, theirs: str | None) -> dict:
    """The section's headline figures from its rows, and issue 48's targets set against them."""
    def get(row: dict | None, label: str | None, key: str):
        return ((row or {}).get(label) or {}).get(key) if label else None

    cold = {r["size"]: r for r in report["cold"]}
    out: dict = {"cold": {}}
    for n, row in cold.items():
        a, b = get(row, ours, "prefill_tokens_per_s"), get(row, theirs, "prefill_tokens_per_s")
        out["cold"][str(n)] = {"ttft_s": get(row, ours, "ttft_s"), "llama_ttft_s": get(row, theirs, "ttft_s"),
                               "second_piece_s": get(row, ours, "second_piece_s"),
                               "llama_second_piece_s": get(row, theirs, "second_piece_s"),
                               "prefill_tokens_per_s": a, "llama_prefill_tokens_per_s": b,
                               "prefill_over_llama": ratio(a, b)}
    w = report.get("warm")
    if w:
        cold_w = cold.get(w["prefix_tokens"])
        out["warm"] = {"ttft_s": get(w, ours, "ttft_s"), "llama_ttft_s": get(w, theirs, "ttft_s"),
                       "warm_over_cold": ratio(get(w, ours, "ttft_s"), get(cold_w, ours, "ttft_s")),
                       "warm_over_llama": ratio(get(w, ours, "ttft_s"), get(w, theirs, "ttft_s")),
                       "cached_tokens": get(w, ours, "cached_tokens"),
                       "llama_cached_tokens": get(w, theirs, "cached_tokens")}
    t = report.get("trace")
    if t:
        a, b = trace_totals(t.get(ours) or []), trace_totals(t.get(theirs) or []) if theirs else None
        out["trace"] = {"ours": a, "llama": b,
                        "total_over_llama": ratio(a and a["total_s"], b and b["total_s"]),
                        "ttft_median_s": median([r and r["ttft_s"] for r in t.get(ours) or []]),
                        "llama_ttft_median_s": median([r and r["ttft_s"] for r in t.get(theirs) or []])
                        if theirs else None}
    ids = [e["identical"] for e in report["identity"].values() if e.get("identical") is not None]
    out["identical_cache_on_off"] = identity(ids, [True] * len(ids))
    four = out["cold"].get("4096") or (list(out["cold"].values())[-1] if out["cold"] else {})
    got = {"warm_over_cold": (out.get("warm") or {}).get("warm_over_cold"),
           "warm_over_llama": (out.get("warm") or {}).get("warm_over_llama"),
           "cold_prefill_over_llama": four.get("prefill_over_llama"),
           "trace_over_llama": (out.get("trace") or {}).get("total_over_llama")}
    out["targets"] = {k: {"target": lim, "measured": got[k],
                          "met": None if got[k] is None else (got[k] >= lim if k == "cold_prefill_over_llama"
                                                              else got[k] <= lim)}
                      for k, lim in TARGETS.items()}
    return out


def markdown(report: dict) -> list[str]:
    """validate.md's `Long and repeated contexts` section."""
    s = report["summary"]
    lines = ["## Long and repeated contexts (OpenAI endpoint, ours and llama-server alternating)", "",
             "Systems: " + "; ".join(f"{k}: {v}" for k, v in report["systems"].items()) + ".", "",
             "| prompt tokens | ours TTFT s | llama-server TTFT s | ours prefill tokens/s | llama-server prefill "
             "tokens/s | ours / llama-server |", "|---|---|---|---|---|---|"]
    for n, e in s["cold"].items():
        lines.append(f"| {n} cold | {_f(e['ttft_s'])} | {_f(e['llama_ttft_s'])} | "
                     f"{_f(e['prefill_tokens_per_s'], '.0f')} | {_f(e['llama_prefill_tokens_per_s'], '.0f')} | "
                     f"{_f(e['prefill_over_llama'], '.2f', 'x')} |")
    w = s.get("warm")
    if w:
        lines.append(f"| {report['warm']['prefix_tokens']} warm (+ a new question) | {_f(w['ttft_s'])} | "
                     f"{_f(w['llama_ttft_s'])} | cached {w['cached_tokens']} | cached {w['llama_cached_tokens']} | "
                     f"{_f(w['warm_over_llama'], '.2f', 'x')} |")
        lines += ["", f"Warm over cold time to first token (ours): {_f(w['warm_over_cold'], '.3f')}."]
    lines += ["", "Second streamed piece after a cold prompt (work put off past the first token, such as the draft's "
              "prefill, lands before it): " + "; ".join(
                  f"{n}: ours {_f(e['second_piece_s'])} s, llama-server {_f(e['llama_second_piece_s'])} s"
                  for n, e in s["cold"].items()) + "."]
    t = s.get("trace")
    if t:
        a, b = t["ours"], t["llama"]
        lines += ["", f"Agent trace ({report['trace']['turns']} turns, growing to "
                  f"{a['final_prompt_tokens'] if a else 'n/a'} prompt tokens): ours {_f(a and a['total_s'])} s in "
                  f"total (time to first token {_f(a and a['ttft_s'])} s of it), llama-server "
                  f"{_f(b and b['total_s'])} s ({_f(b and b['ttft_s'])} s); ours / llama-server "
                  f"{_f(t['total_over_llama'], '.2f', 'x')}."]
    i = s["identical_cache_on_off"]
    lines += ["", f"Greedy answers with the prompt cache on and off (`cache_prompt: false`): {i['identical']}/"
              f"{i['total']} identical.", "",
              "Issue 48's targets: " + "; ".join(
                  f"{k} {_f(e['measured'], '.2f')} (target {'>=' if k == 'cold_prefill_over_llama' else '<='} "
                  f"{e['target']}: {'met' if e['met'] else 'not met' if e['met'] is False else 'n/a'})"
                  for k, e in s["targets"].items()) + "."]
    if report["notes"]:
        lines += ["", "Notes: " + "; ".join(report["notes"]) + "."]
    return lines + [""]


def readme_lines(report: dict) -> list[str]:
    """The README block's line for the section."""
    s = report["summary"]
    parts = [f"cold {n} tokens: time to first token {_f(e['ttft_s'])} s against llama-server's "
             f"{_f(e['llama_ttft_s'])} s (prefill {_f(e['prefill_over_llama'], '.2f', 'x')} its tokens/s)"
             for n, e in s["cold"].items()]
    w, t = s.get("warm"), s.get("trace")
    if w:
        parts.append(f"warm {report['warm']['prefix_tokens']}-token prefix: {_f(w['ttft_s'])} s "
                     f"({_f(w['warm_over_cold'], '.3f')} of cold; llama-server {_f(w['llama_ttft_s'])} s)")
    if t:
        parts.append(f"{report['trace']['turns']}-turn agent trace {_f(t['ours'] and t['ours']['total_s'], '.1f')} s "
                     f"against {_f(t['llama'] and t['llama']['total_s'], '.1f')} s "
                     f"({_f(t['total_over_llama'], '.2f', 'x')})")
    i = s["identical_cache_on_off"]
    parts.append(f"answers with the cache on and off identical {i['identical']}/{i['total']}")
    return [f"Long and repeated contexts through the OpenAI endpoint (`reports/{report['spec']}/context.json`, run "
            f"{report['date']}): " + "; ".join(parts) + "."]
