"""`python -m pipeline readme [SPEC ...]`: the README's figures, rendered from the reports, never typed.

Reads reports/<name>/validate.json (through gRPC), bench.json (in-process), context.json and edit.json (validate's
side-by-side sections through the OpenAI endpoint) for each spec and rewrites the
block between `<!-- figures:begin -->` and `<!-- figures:end -->` in README.md; nothing else in the file
changes. Each figure carries the date of the run that measured it and the spec it ran, so a stale figure
shows its age instead of passing for today's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import spec as specmod
from pipeline.peers import ratio as peer_ratio

if TYPE_CHECKING:
    from pipeline.spec import Spec

BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
COLUMNS = "| method | tokens/s | speedup vs baseline | acceptance | mean accepted length | greedy identical |"


class ReadmeError(ValueError):
    """The README or the reports cannot be rendered; the message says what to run or add."""


def _when(report: dict) -> str:
    """The run's date and, where the report says, the CPU and kernel build it ran on (the same spec decodes about
    twice as fast with the AVX-512 build as with the AVX2 one)."""
    env = report.get("environment") or {}
    where = ", ".join(x for x in (env.get("cpu"), env.get("kernel_path") and f"kernel {env['kernel_path']}") if x)
    return str(env.get("date") or "undated") + (f" on {where}" if where else "")


def _methods_table(methods: dict) -> list[str]:
    lines = [COLUMNS, "|---|---|---|---|---|---|"]
    for m, e in methods.items():
        acc = f"{e['acceptance_rate']:.2f}" if m != "baseline" else ""
        lines.append(f"| {m} | {e['tokens_per_s']:.1f} | {e['speedup']:.2f}x | {acc} | "
                     f"{e['mean_accepted_len']:.2f} | {e['greedy_identical']}/{e['greedy_total']} |")
    return lines


def _peers(report: dict) -> list[str]:
    """One line on transformers in the same run, with our draft_target's ratio to assisted generation."""
    peers, methods = report.get("peers") or {}, report["methods"]
    parts = []
    gen = (peers.get("hf_generate") or {}).get("tokens_per_s")
    if gen:
        short = peers["hf_generate"].get("new_tokens")
        parts.append(f"transformers `generate` {gen:.1f} tokens/s" + (f" ({short}-token answers)" if short else "")
                     + " (baseline "
                     f"{methods['baseline']['tokens_per_s'] / gen:.2f}x it)")
    hfa = (peers.get("hf_assisted") or {}).get("tokens_per_s")
    if hfa and "draft_target" in methods:
        parts.append(f"transformers assisted generation with the same draft {hfa:.1f} tokens/s (draft_target "
                     f"{methods['draft_target']['tokens_per_s'] / hfa:.2f}x it)")
    for key, what in (("llama_cpp_server", "llama.cpp's llama-server on the target's own GGUF (the better of plain "
                                           "and with the draft's GGUF)"),):
        tps = (peers.get(key) or {}).get("tokens_per_s")
        if tps:
            r = peer_ratio(methods.get("draft_target", {}).get("tokens_per_s"), peers.get(key))
            ratio = f" (draft_target {r:.2f}x it)" if r is not None else ""
            parts.append(f"{what} {tps:.1f} tokens/s{ratio}")
    return [f"In the same run: {'; '.join(parts)}."] if parts else []


def _precision(table: dict) -> list[str]:
    """One line for the target's precision table: decode speed, roofline and agreement per precision."""
    parts = [f"{p} {e['tokens_per_s']:.1f} tokens/s ({e['speedup_vs_reference']:.2f}x, "
             f"{100 * e['roofline_fraction']:.0f}% of its roofline, agreement {e['agreement_vs_reference']:.3f})"
             for p in ("float32", "bfloat16", "int8", "int4", "int4_a8", "gguf") if (e := table.get(p))]
    if not parts:
        return []
    return [f"Target per weight precision ({table['new_tokens']} new tokens, decode steps only, each set against the "
            f"bandwidth read around it; vs {table['reference']}): " + "; ".join(parts) + "."]


def render_spec(name: str, spec_path: str, validate: dict | None, bench: dict | None) -> list[str]:
    """The figures of one spec, from whichever of its two reports exist."""
    out = [f"### `{name}` (`{spec_path}`)", ""]
    if validate is None and bench is None:
        return out + [f"No reports yet: run `make validate SPEC={spec_path}` (and `make bench SPEC={spec_path}`).", ""]
    if validate is not None:
        out += [f"Through gRPC at concurrency 1 (`reports/{name}/validate.json`, run {_when(validate)}): "
                f"{validate['prompts']} prompts x {validate['new_tokens']} new tokens, greedy.", ""]
        if validate.get("trimmed"):
            out += [f"Trimmed to fit the main job's 30 minutes: {'; '.join(validate['trimmed'])}.", ""]
        out += _methods_table(validate["methods"]) + [""] + _peers(validate)
        d = validate.get("draft") or {}
        if d.get("step_fraction_of_target"):
            cov = d.get("vocab_coverage")
            out.append(f"Draft as built: {d['dtype']}" + (f" {d['quantization']}" if d.get("quantization") else "")
                       + f", head of {d['vocab']} tokens" + (f" covering {100 * cov:.1f}% of the target's tokens"
                                                              if cov else "")
                       + f", k = {d['num_draft_tokens']} ({d['chosen_by']}); one draft step costs "
                       f"{d['step_fraction_of_target']:.3f} of a target step.")
        cross = validate.get("crossover") or {}
        if cross:
            out.append("Concurrency from which each method is no faster than baseline: " + ", ".join(
                f"{m} {'never' if c is None else c}" for m, c in cross.items()) + ".")
        out.append("")
    if bench is not None:
        out += [f"In-process (`reports/{name}/bench.json`, run {_when(bench)}): {bench['prompts']} prompts x "
                f"{bench['new_tokens']} new tokens, batch {bench['batch']}, {bench['dtype']}, greedy.", ""]
        out += _methods_table(bench["methods"]) + [""] + _peers(bench)
        rf = bench.get("roofline")
        if rf:
            if "fraction_at_median_bandwidth" in rf:
                out.append(f"Baseline reaches {100 * rf['fraction_of_limit']:.0f}% of the memory-bandwidth limit, "
                           f"each prompt against the bandwidth read around it (median reading "
                           f"{rf['bandwidth_gbs']:.1f} GB/s: {rf['limit_tokens_per_s']:.1f} tokens/s).")
            else:  # a report from before the per-prompt pairing: its speed median against its probe median
                out.append(f"Baseline reaches {100 * rf['fraction_of_limit']:.0f}% of the memory-bandwidth limit "
                           f"({rf['limit_tokens_per_s']:.1f} tokens/s at {rf['bandwidth_gbs']:.1f} GB/s, the medians).")
        out += _verify(bench)
        out += _precision(bench.get("precision") or {})
        out.append("")
    return out


def _verify(bench: dict) -> list[str]:
    """The 8-token verification against one step, and the floor its multiply-adds set on this CPU (issue 28)."""
    curve, f = bench.get("verify_cost_ms") or [], bench.get("verify_floor") or {}
    at = next((c for c in curve if c["tokens"] == 8), None)
    if at is None:
        return []
    line = f"Verifying 8 tokens costs {at['relative']:.2f} one-token steps ({at['ms']:.1f} ms)"
    if "floor_ms" in f:
        line += (f"; their multiply-adds alone at this CPU's int8 peak ({f['int8_macs_per_s'] / 1e9:.0f} G/s, "
                 f"{f['instruction'].split(' (')[0]}) take {f['floor_relative']:.2f} steps")
    amx = bench.get("verify_cost_amx")
    if amx and amx.get("mode") == "hardware":  # the run used AMX tiles: the AVX-512 tiles' figure beside it
        a, b = (next(c for c in amx[t] if c["tokens"] == 8) for t in ("amx", "avx512"))
        line += (f"; on the AVX-512 tiles in alternating rounds {b['relative']:.2f} steps ({b['ms']:.1f} ms), "
                 f"AMX {a['relative']:.2f}")
    return [line + "."]


def side_by_side(context: dict | None, edit: dict | None) -> list[str]:
    """The lines of validate's side-by-side sections with llama-server (context.json, edit.json), where they ran."""
    from pipeline import context_run, edit_run  # lazy: only when those reports exist

    out = []
    for report, mod in ((context, context_run), (edit, edit_run)):
        if report and "summary" in report:
            out += mod.readme_lines(report) + [""]
    return out


def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReadmeError(f"{path}: not valid JSON ({e}); rerun the command that writes it") from None


def render(specs: list[tuple[Spec, str]]) -> str:
    """The block for (spec, the path it was loaded from) pairs, in that order."""
    lines = ["<!-- Rendered by `python -m pipeline readme` (make readme) from reports/; edits here are lost. -->", ""]
    for s, path in specs:
        lines += render_spec(s.name, path, _read(s.report_dir / "validate.json"), _read(s.report_dir / "bench.json"))
        lines += side_by_side(_read(s.report_dir / "context.json"), _read(s.report_dir / "edit.json"))
    return "\n".join(lines).rstrip() + "\n"


def update(readme: Path, block: str) -> bool:
    """Replace the marked block in `readme` with `block`; True when the file changed."""
    text = readme.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ReadmeError(f"{readme}: needs exactly one {BEGIN} line followed by one {END} line where the "
                          "figures go; add them, then rerun")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{block}{END}{tail}"
    if new == text:
        return False
    tmp = readme.with_suffix(readme.suffix + ".tmp")
    tmp.write_text(new)
    tmp.replace(readme)
    return True


def cmd_readme(args) -> int:
    specs = [(specmod.load(p), p) for p in args.specs]
    readme = Path(args.readme)
    changed = update(readme, render(specs))
    print(f"{readme}: figures {'rewritten' if changed else 'already up to date'} from "
          + ", ".join(str(s.report_dir) for s, _ in specs))
    return 0


def register(sub) -> None:
    """The `readme` verb; it takes several specs, so it gets its own parser rather than the one-spec `verb`."""
    sp = sub.add_parser("readme", help="rewrite README.md's figures block from reports/<name>/*.json")
    sp.add_argument("specs", nargs="+", metavar="SPEC", help="specs whose reports to render, in order")
    sp.add_argument("--readme", default="README.md", help="the file holding the figures:begin/end markers")
    sp.set_defaults(fn=cmd_readme)
