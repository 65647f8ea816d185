"""`python -m pipeline readme`: README figures rendered from reports (a synthetic pair here), never typed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline import readme
from pipeline import spec as specmod
from tests.conftest import write_spec

ROOT = Path(__file__).resolve().parent.parent

VALIDATE = {
    "spec": "demo", "prompts": 8, "new_tokens": 128,
    "methods": {
        "baseline": {"tokens_per_s": 20.04, "speedup": 1.0, "acceptance_rate": 0.0, "mean_accepted_len": 1.0,
                     "greedy_identical": 8, "greedy_total": 8},
        "draft_target": {"tokens_per_s": 43.26, "speedup": 2.163, "acceptance_rate": 0.8123,
                         "mean_accepted_len": 3.951, "greedy_identical": 8, "greedy_total": 8},
    },
    "peers": {"hf_generate": {"tokens_per_s": 4.0}, "hf_assisted": {"tokens_per_s": 10.0}},
    "crossover": {"draft_target": 4},
    "environment": {"date": "2026-12-01T05:40:00+00:00"},
}
BENCH = {
    "spec": "demo", "prompts": 4, "new_tokens": 128, "batch": 1, "dtype": "bfloat16",
    "methods": {
        "baseline": {"tokens_per_s": 21.5, "speedup": 1.0, "acceptance_rate": 0.0, "mean_accepted_len": 1.0,
                     "greedy_identical": 4, "greedy_total": 4},
        "prompt_lookup": {"tokens_per_s": 25.0, "speedup": 1.167, "acceptance_rate": 0.25,
                          "mean_accepted_len": 1.4, "greedy_identical": 3, "greedy_total": 4},
    },
    "peers": {"hf_generate": {"tokens_per_s": 8.6}},
    "roofline": {"bandwidth_gbs": 30.0, "limit_tokens_per_s": 55.0, "fraction_of_limit": 0.391},
    "verify_cost_ms": [{"tokens": 1, "ms": 36.0, "relative": 1.0}, {"tokens": 8, "ms": 52.92, "relative": 1.47}],
    "verify_floor": {"tokens": 8, "int8_macs_per_s": 4.29e11, "floor_ms": 28.8, "floor_relative": 0.8,
                     "instruction": "vpdpbusd zmm (AVX512_VNNI, 64 int8 multiply-adds)"},
    "precision": {"reference": "bfloat16", "new_tokens": 64,
                  "bfloat16": {"tokens_per_s": 12.04, "speedup_vs_reference": 1.0, "roofline_fraction": 0.7149,
                               "agreement_vs_reference": 1.0},
                  "int4": {"tokens_per_s": 40.06, "speedup_vs_reference": 3.567, "roofline_fraction": 0.5586,
                           "agreement_vs_reference": 0.9414}},
    "environment": {"date": "2026-11-30T22:10:00+00:00", "cpu": "AMD EPYC", "kernel_path": "avx2"},
}
README = "# Title\n\nProse before.\n\n<!-- figures:begin -->\nhand-typed 4.4x\n<!-- figures:end -->\n\nProse after.\n"


@pytest.fixture
def demo(tmp_path):
    path = write_spec(tmp_path, name="demo")
    s = specmod.load(path)
    s.report_dir.mkdir(parents=True)
    (s.report_dir / "validate.json").write_text(json.dumps(VALIDATE))
    (s.report_dir / "bench.json").write_text(json.dumps(BENCH))
    (tmp_path / "README.md").write_text(README)
    return s, path, tmp_path / "README.md"


def test_block_carries_every_figure_with_its_date_and_spec(demo):
    s, path, _ = demo
    block = readme.render([(s, str(path))])
    assert f"`demo` (`{path}`)" in block
    assert "run 2026-12-01T05:40:00+00:00)" in block  # a report without its CPU: the date alone
    assert "run 2026-11-30T22:10:00+00:00 on AMD EPYC, kernel avx2)" in block  # the machine it ran on
    assert "| draft_target | 43.3 | 2.16x | 0.81 | 3.95 | 8/8 |" in block
    assert "| baseline | 20.0 | 1.00x |  | 1.00 | 8/8 |" in block
    assert "| prompt_lookup | 25.0 | 1.17x | 0.25 | 1.40 | 3/4 |" in block
    assert "8 prompts x 128 new tokens" in block and "batch 1, bfloat16" in block
    # ratios to the peers come from the report's own figures: 20.04 / 4.0 and 43.26 / 10.0
    assert "baseline 5.01x it" in block and "draft_target 4.33x it" in block
    assert "baseline 2.50x it" in block  # bench: 21.5 / 8.6
    assert "draft_target 4" in block.split("no faster than baseline:")[1]
    assert "39% of the memory-bandwidth limit" in block
    assert ("Verifying 8 tokens costs 1.47 one-token steps (52.9 ms); their multiply-adds alone at this CPU's int8 "
            "peak (429 G/s, vpdpbusd zmm) take 0.80 steps.") in block
    assert ("bfloat16 12.0 tokens/s (1.00x, 71% of its roofline, agreement 1.000); "
            "int4 40.1 tokens/s (3.57x, 56% of its roofline, agreement 0.941)") in block
    assert "4.4x" not in block


def test_a_bench_on_amx_tiles_gives_the_avx512_tiles_verify_figure_beside_it(demo):
    s, path, _ = demo
    curve = lambda ms8, rel8: [{"tokens": t, "ms": 30.0, "relative": 1.0} for t in range(1, 8)] + [  # noqa: E731
        {"tokens": 8, "ms": ms8, "relative": rel8}]
    bench = dict(BENCH, verify_cost_amx={"mode": "hardware", "rounds": 9, "same_bits": True,
                                         "amx": curve(33.0, 1.1), "avx512": curve(66.0, 1.85)})
    (s.report_dir / "bench.json").write_text(json.dumps(bench))
    assert ("take 0.80 steps; on the AVX-512 tiles in alternating rounds 1.85 steps (66.0 ms), AMX 1.10."
            in readme.render([(s, str(path))]))
    bench["verify_cost_amx"]["mode"] = "emulated"  # the tile model's times mean nothing: not in the README
    (s.report_dir / "bench.json").write_text(json.dumps(bench))
    assert "AVX-512 tiles" not in readme.render([(s, str(path))])


def test_update_rewrites_only_the_marked_block_and_is_idempotent(demo):
    s, path, md = demo
    block = readme.render([(s, str(path))])
    assert readme.update(md, block) is True
    text = md.read_text()
    assert text.startswith("# Title\n\nProse before.\n\n<!-- figures:begin -->\n")
    assert text.endswith("<!-- figures:end -->\n\nProse after.\n")
    assert "hand-typed" not in text and "43.3" in text
    assert readme.update(md, block) is False and md.read_text() == text


def test_cli_renders_from_reports_and_says_when_there_are_none(demo, tmp_path):
    from pipeline.cli import main

    s, path, md = demo
    assert main(["readme", str(path), "--readme", str(md)]) == 0
    assert "| draft_target | 43.3 |" in md.read_text()
    (s.report_dir / "validate.json").unlink()
    (s.report_dir / "bench.json").unlink()
    assert main(["readme", str(path), "--readme", str(md)]) == 0
    assert f"No reports yet: run `make validate SPEC={path}`" in md.read_text()
    assert "43.3" not in md.read_text()


def test_missing_markers_are_an_error_that_says_what_to_add(demo):
    s, path, md = demo
    md.write_text("# no markers\n")
    with pytest.raises(readme.ReadmeError, match="figures:begin"):
        readme.update(md, readme.render([(s, str(path))]))
    assert md.read_text() == "# no markers\n"


# Settings, requirements and fixed sizes the pages state (a polling period, a kill timeout, a training budget, the
# time the quick test loop is kept under, the size of one work claim or of the bf16 target), not measurements.
# Each phrase is allowed wherever it appears; whitespace and line breaks inside a phrase do not matter.
SETTINGS = ("checked every 20 ms", "SIGKILL after 30 s", "4x the drafter training budget", "at most 250 ms",
            "every step (20 ms)", "more than 5% below", "32 mixed clients for 120 s", "`--request-timeout`, 120 s",
            "`--request-timeout`, default 120 s", "15 s past that", "kept under 90 s", "(32 KB of weights)",
            "`dtype: bfloat16`, 3.1 GB", "reads its 3.1 GB", "kept under 6 minutes", "about 14 GB", "24 GiB",
            "passes 10 GB resident")
# A number and a unit of speed, time, size or ratio: what a measurement looks like in prose.
UNITS = r"(?:tokens/s|tok/s|[KMGT]i?B/s|[KMGT]i?B\b|[mµu]s\b|ns\b|s\b|min\b|x\b|%)"
TYPED_FIGURE = re.compile(r".{0,40}\b\d+(?:\.\d+)?\s*" + UNITS + r".{0,20}")
# The front door. The pages under docs/ keep their measurements beside the commands and dates that made them, as
# experiments/*_log.md do; the README's figures come from reports only.
PAGES = [ROOT / "README.md"]


def typed_figures(text: str) -> list[str]:
    """The measured-looking figures of a page outside its rendered figures block (if it has one)."""
    if readme.BEGIN in text and readme.END in text:
        text = text[:text.index(readme.BEGIN)] + text[text.index(readme.END):]
    text = " ".join(text.split())  # a phrase wrapped onto two lines is still the phrase
    for allowed in SETTINGS:
        text = text.replace(" ".join(allowed.split()), "")
    return TYPED_FIGURE.findall(text)


@pytest.mark.parametrize("unit", ["4.4x", "2.28 x", "20.8 tokens/s", "12 tok/s", "30.0 GB/s", "8.5 GB", "3 GiB",
                                  "512 MB", "44 us", "98 µs", "0.7 ms", "120 ns", "20 min", "30 s", "76%"])
def test_the_figure_guard_sees_every_unit_a_measurement_comes_in(unit):
    assert typed_figures(f"A sentence that says it ran at {unit} on a machine.\n"), unit
    assert typed_figures(f"A figure wrapped onto the next line,\n  {unit}.\n"), unit
    assert not typed_figures(f"{readme.BEGIN}\nrendered: {unit}\n{readme.END}\n")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_pages_type_no_measured_figure_outside_the_rendered_block(page):
    """Speeds, speedups, timings, sizes and fractions in the README come from reports through `make readme`, never
    by hand."""
    typed = typed_figures(page.read_text())
    assert not typed, f"typed figures in {page.relative_to(ROOT)} outside the figures block: {typed}"


def test_a_paired_baseline_roofline_says_so_and_an_older_report_says_medians():
    paired = {**BENCH, "roofline": {**BENCH["roofline"], "fraction_at_median_bandwidth": 0.5}}
    new = "\n".join(readme.render_spec("demo", "x.yaml", None, paired))
    old = "\n".join(readme.render_spec("demo", "x.yaml", None, BENCH))
    assert "39% of the memory-bandwidth limit, each prompt against the bandwidth read around it" in new
    assert "(55.0 tokens/s at 30.0 GB/s, the medians)" in old and "each prompt" not in old
