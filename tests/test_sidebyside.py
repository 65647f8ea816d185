"""validate's side-by-side sections (pipeline/sidebyside.py, context_run.py, edit_run.py): the functions that turn
timings into the reports' figures, llama-server's command lines per mode, and both sections end to end through our
own OpenAI endpoint on a tiny model (llama-server cannot run on a non-GGUF target: recorded as unsupported)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline import context_run, edit_run, sidebyside
from pipeline import spec as specmod
from pipeline.openai_client import ApiRequestError
from pipeline.sidebyside import decode_rate, figures, identity, llama_command, ratio, refused_field
from tests.conftest import write_spec


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_it():
    assert decode_rate([(11, 1.0), (21, 1.0)]) == pytest.approx(15.0)
    assert decode_rate([(1, 0.5)]) is None  # one token: all of it was the prefill's
    assert decode_rate([]) is None


def test_identity_counts_equal_pairs_and_names_the_ones_that_differ_skipping_missing_answers():
    assert identity(["a", "b", None, "d"], ["a", "x", "c", "d"]) == {"identical": 2, "total": 3, "differ": [1]}
    assert ratio(3.0, 0.0) is None and ratio(None, 2.0) is None and ratio(3.0, 2.0) == 1.5


def test_figures_read_ours_usage_and_llama_servers_timings_alike():
    ours = figures({"text": "x", "ttft_s": 0.5, "latency_s": 2.5, "usage": {
        "prompt_tokens": 1000, "completion_tokens": 41, "prompt_tokens_details": {"cached_tokens": 900},
        "completion_tokens_details": {"accepted_prediction_tokens": 30, "rejected_prediction_tokens": 2}}})
    assert ours["cached_tokens"] == 900 and ours["prefill_tokens_per_s"] == pytest.approx(200.0)
    assert ours["decode_tokens_per_s"] == pytest.approx(20.0) and ours["accepted_prediction_tokens"] == 30
    # llama-server's last chunk without usage: prompt tokens are computed (prompt_n) plus reused (cache_n)
    theirs = figures({"text": "y", "ttft_s": 1.0, "latency_s": 3.0,
                      "timings": {"prompt_n": 100, "cache_n": 300, "predicted_n": 11, "prompt_ms": 950.0}})
    assert theirs["prompt_tokens"] == 400 and theirs["cached_tokens"] == 300
    assert theirs["prefill_tokens_per_s"] == pytest.approx(100.0) and theirs["decode_tokens_per_s"] == 5.0


def test_a_400_on_a_field_the_system_sent_is_unsupported_and_any_other_error_is_a_failure():
    e = ApiRequestError(400, {"message": "predicted outputs are not supported; omit it", "param": "prediction"})
    assert "prediction" in refused_field(e, ["prediction"]) and "not supported" in refused_field(e, ["prediction"])
    assert refused_field(e, ["cache_prompt"]) is None
    assert refused_field(ApiRequestError(500, {"param": "prediction"}), ["prediction"]) is None


def test_a_system_whose_server_is_gone_is_recorded_failed_and_asked_no_more():
    from pipeline.triton.server import free_port

    s = sidebyside.System("llama-server plain", f"http://127.0.0.1:{free_port()}/v1", "m", ours=False)
    assert s.ask([{"role": "user", "content": "hi"}], 4) is None
    assert s.unsupported.startswith("failed: ApiRequestError") and s.ask([], 4) is None


def test_llama_server_modes_pass_the_flags_of_the_pinned_llama_cpp():
    exe, gguf, draft = Path("/x/llama-server"), Path("/m/t.gguf"), Path("/m/d.gguf")
    plain = llama_command(exe, gguf, 8123, 2, 20480, "plain")
    assert plain[plain.index("-c") + 1] == "20480" and "--spec-type" not in plain and "cache_prompt" not in plain
    ngram = llama_command(exe, gguf, 8123, 2, 4096, "ngram-mod")
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-mod" and "-md" not in ngram
    d = llama_command(exe, gguf, 8123, 2, 4096, "draft-simple", draft)
    assert d[d.index("--spec-type") + 1] == "draft-simple" and d[d.index("-md") + 1] == str(draft)
    assert d[d.index("--spec-draft-n-max") + 1] == str(sidebyside.LLAMA_DRAFT_N_MAX)
    with pytest.raises(ValueError, match="draft"):
        llama_command(exe, gguf, 8123, 2, 4096, "draft-simple")


def _row(ttft: float, latency: float = 1.0, prompt: int = 4096, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 16, "ttft_s": ttft,
            "latency_s": latency, "prefill_tokens_per_s": (prompt - cached) / ttft, "server_prompt_ms": None}


def test_context_summary_sets_warm_cold_prefill_and_trace_ratios_against_issue_48s_targets():
    report = {"cold": [{"size": 4096, "ours": _row(10.0), "llama": _row(40.0)}],
                "warm": {"prefix_tokens": 4096, "ours": _row(0.5, cached=4090), "llama": _row(0.4, cached=4090)},
                "trace": {"turns": 2, "ours": [_row(5.0, 8.0), _row(0.5, 3.0)], "llama": [_row(9.0, 12.0), None]},
                "identity": {"warm": {"identical": True}, "trace_last_turn": {"identical": False}}}
    s = context_run.summarize(report, "ours", "llama")
    assert s["cold"]["4096"]["prefill_over_llama"] == pytest.approx(4.0)
    assert s["warm"]["warm_over_cold"] == pytest.approx(0.05) and s["warm"]["warm_over_llama"] == pytest.approx(1.25)
    assert s["trace"]["ours"]["total_s"] == 11.0 and s["trace"]["llama"] is None  # a partial trace is not compared
    t = s["targets"]
    assert t["cold_prefill_over_llama"]["met"] is True and t["warm_over_cold"]["met"] is True
    assert t["warm_over_llama"]["met"] is False and t["trace_over_llama"]["met"] is None
    assert s["identical_cache_on_off"] == {"identical": 1, "total": 2, "differ": [1]}


def _edit(text: str, n: int, secs: float) -> dict:
    return {"text": text, "completion_tokens": n, "ttft_s": 0.5, "latency_s": 0.5 + secs,
            "decode_tokens_per_s": (n - 1) / secs, "accepted_prediction_tokens": None,
            "rejected_prediction_tokens": None}


def test_edit_summary_checks_every_method_against_baseline_and_ratios_against_llama_server():
    runs = {"baseline": [_edit("a", 101, 4.0), _edit("b", 101, 4.0)],
            "hybrid": [_edit("a", 101, 1.0), _edit("b!", 101, 1.0)],
            "hybrid + prediction (the original)": [_edit("a", 101, 0.5), _edit("b", 101, 0.5)],
            "hybrid + prediction (an unrelated file)": [None, None],
            "llama-server plain": [_edit("a", 101, 5.0), _edit("b", 101, 5.0)],
            "llama-server ngram-mod": [_edit("a", 101, 2.5), _edit("b", 101, 2.5)],
            "llama-server draft-simple": [None, None]}
    report = {"runs": runs, "ours": list(runs)[:4]}
    s = edit_run.summarize(report, "baseline", "hybrid + prediction (the original)",
                           "hybrid + prediction (an unrelated file)", "hybrid")
    assert s["systems"]["hybrid"]["decode_tokens_per_s"] == pytest.approx(100.0)
    assert s["systems"]["hybrid"]["identical_to_baseline"] == {"identical": 1, "total": 2, "differ": [1]}
    assert s["ours_identical"] == {"identical": 5, "total": 6}  # the unsupported system counts nothing
    t = s["targets"]
    assert t["default_over_llama_plain"]["measured"] == pytest.approx(5.0) and t["default_over_llama_plain"]["met"]
    assert t["default_over_best_llama_spec"]["measured"] == pytest.approx(2.5)
    assert t["prediction_over_llama_plain"]["measured"] == pytest.approx(10.0)
    assert t["unrelated_prediction_slowdown"]["met"] is None


def test_every_request_of_ours_is_sent_without_caches_so_no_system_drafts_an_earlier_systems_answer():
    """Each of ours sends `cache_prompt: false` (no prompt cache, no suffix store): the prediction rows measure the
    prediction, not the store's copy of the default method's answer to the same case. A system sent without it
    would still be named with the store feeders before it."""
    ours = edit_run.our_systems("u", "m", ["baseline", "suffix", "hybrid", "draft_target"], "hybrid")
    assert [x.label for x in ours] == ["hybrid", "baseline", "suffix", "draft_target",
                                       "hybrid + prediction (the original)", "hybrid + prediction (an unrelated file)"]
    assert all(x.extra == {"cache_prompt": False} for x in ours)
    assert all(v == [] for v in edit_run.store_exposure(ours).values())
    for x in ours:
        x.extra = {}
    seen = edit_run.store_exposure(ours)
    assert seen["hybrid"] == [] and seen["baseline"] == ["hybrid"]
    assert seen["hybrid + prediction (an unrelated file)"] == ["hybrid", "suffix", "hybrid + prediction (the original)"]


def test_prediction_ratios_set_each_case_against_the_default_without_a_prediction_on_that_case():
    runs = {"baseline": [_edit("a", 101, 4.0), _edit("b", 101, 4.0)],
            "hybrid": [_edit("a", 101, 2.0), _edit("b", 101, 1.0)],
            "hybrid + prediction (the original)": [_edit("a", 101, 0.5), None],
            "hybrid + prediction (an unrelated file)": [_edit("a", 101, 2.0), _edit("b", 101, 1.25)]}
    report = {"runs": runs, "ours": list(runs)}
    s = edit_run.summarize(report, "baseline", "hybrid + prediction (the original)",
                           "hybrid + prediction (an unrelated file)", "hybrid")
    pr = s["prediction"]
    assert pr["original_over_none_per_case_median"] == pytest.approx(4.0)  # case b has no answer: left out
    assert pr["unrelated_over_none_per_case_median"] == pytest.approx((1.0 + 0.8) / 2)
    assert pr["unrelated_over_none"] == pytest.approx(200 / 3.25 / (200 / 3.0))  # summed tokens over summed time
    t = s["targets"]["unrelated_prediction_slowdown"]
    assert t["measured"] == pytest.approx(1 - pr["unrelated_over_none"]) and t["met"] is False
    md = "\n".join(edit_run.markdown({**report, "summary": s, "cases": [], "edit_set": "e.json",
                                      "systems": {k: "ran" for k in runs}}))
    assert "`cache_prompt: false`" in md and "per-case median 4.00x" in md


def test_the_edit_set_has_12_cases_of_300_to_1500_tokens_with_their_source_and_license():
    cases = edit_run.load_cases(Path(__file__).resolve().parent.parent / "build" / "edit_set.json")
    assert len(cases) >= 12 and len({c["id"] for c in cases}) == len(cases)
    assert all(300 <= c["tokens"] <= 1500 and c["license"] and "standard library" in c["source"] for c in cases)
    assert {"rename", "type hints", "docstrings", "refactor", "bug fix"} <= {c["kind"] for c in cases}
    assert all(c["bug_introduced"] for c in cases if c["kind"] == "bug fix")


def test_trimmed_names_the_side_by_side_sections_a_short_run_leaves_out(tmp_path):
    from pipeline.validate import trimmed

    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    short = {"prompts": str(prompts), "context_sizes": [1024, 4096], "context_turns": 4, "context_trace_tokens": 4096,
             "context_trace_identity": False, "max_edit_cases": 4, "edit_new_tokens": 256}
    out = trimmed(specmod.parse({"name": "t", "validate": short}, root=tmp_path))
    assert out == ["cold prompts of [1024, 4096] tokens (full run: [1024, 4096, 16384]; validate.context_sizes)",
                   "a 4-turn agent trace to 4096 tokens (full run: 6 turns to 8192; validate.context_turns, "
                   "context_trace_tokens)",
                   "the agent trace's last turn not sent again with the prompt cache off (full run: it is; "
                   "validate.context_trace_identity)",
                   "the first 4 edit cases (full run: all of build/edit_set.json; validate.max_edit_cases)",
                   "edit answers cut at 256 new tokens (full run: the whole file; validate.edit_new_tokens)"]
    assert trimmed(specmod.parse({"name": "t", "validate": {"prompts": str(prompts)}}, root=tmp_path)) == []
    off = {"prompts": str(prompts), "context_sizes": [], "edit_set": "", "max_edit_cases": 4}
    assert trimmed(specmod.parse({"name": "t", "validate": off}, root=tmp_path)) == []  # sections off: nothing cut


def test_side_by_side_keys_are_checked_with_their_path(tmp_path):
    for bad, key in (({"context_sizes": [0]}, "validate.context_sizes"), ({"max_edit_cases": -1},
                                                                          "validate.max_edit_cases"),
                     ({"edit_new_tokens": -5}, "validate.edit_new_tokens")):
        with pytest.raises(specmod.SpecError, match=key):
            specmod.parse({"name": "t", "validate": bad}, root=tmp_path)


def test_a_missing_edit_set_names_the_key_and_how_to_write_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="validate.edit_set.*make_edit_set"):
        edit_run.load_cases(tmp_path / "nope.json")


@pytest.fixture(scope="module")
def served_tiny(tiny_root, tiny_engine):
    """`serve` on the tiny target as its own draft, with a prompt cache, long enough inputs for the sections."""
    from pipeline.cli import main
    from pipeline.train.draft import build_draft
    from pipeline.triton import server as srvmod

    grpc, http, metrics, api = srvmod.free_ports(4)
    ports = {"grpc_port": grpc, "http_port": http, "metrics_port": metrics}
    path = write_spec(tiny_root, name="sbs", draft={"source": "models/target"},
                      triton={**ports, "startup_timeout_s": 240}, openai={"port": api},
                      prompt_cache={"bytes": 1 << 26, "block_tokens": 16},
                      limits={"max_batch_size": 4, "max_input_len": 384, "max_seq_len": 512, "max_draft_len": 8},
                      validate={"context_sizes": [40, 120], "context_turns": 2, "context_trace_tokens": 256,
                                "max_edit_cases": 2, "edit_new_tokens": 24})
    s = specmod.load(path)
    from pipeline.engine import build_target

    build_target(s, log=lambda *a, **k: None)
    build_draft(s, log=lambda *a, **k: None)
    assert main(["serve", str(path)]) == 0
    try:
        yield s
    finally:
        main(["stop", str(path)])


@pytest.mark.server
def test_side_by_side_end_to_end_through_our_endpoint_with_llama_server_recorded_unsupported(served_tiny, tmp_path):
    from pipeline import readme, validate

    s = served_tiny
    cases = edit_run.load_cases(Path("build/edit_set.json").resolve())[:3]
    small = [{**c, "original": c["original"][:120], "tokens": 40} for c in cases]  # the tiny model's room
    s.validate.edit_set = str(tmp_path / "edit.json")
    Path(s.validate.edit_set).write_text(json.dumps({"cases": small}))
    lines: list[str] = []
    report = validate.run_side_by_side(s, log=lines.append)  # `validate --only side-by-side`, the server up
    assert any(ln.startswith("sections took context") and ", edit " in ln for ln in lines), lines
    ctx = json.loads((s.report_dir / "context.json").read_text())
    ed = json.loads((s.report_dir / "edit.json").read_text())

    assert [r["size"] for r in ctx["cold"]] == [40, 120]
    for row in ctx["cold"]:
        assert row["ours"]["prompt_tokens"] >= row["size"] and row["ours"]["ttft_s"] > 0
        assert row["ours"]["second_piece_s"] is None or row["ours"]["second_piece_s"] >= row["ours"]["ttft_s"]
        assert row["llama-server plain"] is None
    warm = ctx["warm"]["ours"]
    assert ctx["warm"]["prefix_tokens"] == 120 and warm["cached_tokens"] >= 100  # the cold 120's prefix reused
    assert ctx["identity"]["warm"]["identical"] is True and ctx["identity"]["warm"]["cached_tokens_off"] == 0
    turns = ctx["trace"]["ours"]
    assert len(turns) == 2 and turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] and turns[1]["cached_tokens"] > 0
    assert ctx["identity"]["trace_last_turn"]["identical"] is True
    assert ctx["systems"]["llama-server plain"].startswith("the target is not a GGUF")

    methods = [k for k in ed["ours"] if "prediction" not in k]
    assert {"baseline", "draft_target", "prompt_lookup"} <= set(methods)
    assert all(ed["systems"][k] == "ran" for k in methods)
    for k in ed["ours"]:  # prediction: measured where the endpoint takes it, else unsupported with its reason
        assert ed["systems"][k] == "ran" or "`prediction`" in ed["systems"][k]
        if "prediction" in k and ed["systems"][k] == "ran":  # OpenAI's usage.completion_tokens_details read back
            assert ed["summary"]["systems"][k]["accepted_prediction_tokens"] is not None
    assert all(ed["systems"][k].startswith("the target is not a GGUF") for k in ed["llama"])
    ran = [k for k in ed["ours"] if ed["systems"][k] == "ran"]
    i = ed["summary"]["ours_identical"]
    assert len(ed["cases"]) == 2  # validate.max_edit_cases of the 3
    assert i["total"] == 2 * len(ran) and i["identical"] == i["total"]  # every method greedy-identical
    # (the tiny model's answers arrive as one piece, so decode tokens/s has no time after a first token to use)
    assert all(1 <= r["completion_tokens"] <= 24 and r["latency_s"] >= r["ttft_s"] for k in ran for r in ed["runs"][k])

    # validate.json keeps the sections without the answers; validate.md and the README block render them
    assert "runs" not in report["edit"] and report["context"]["summary"] == ctx["summary"]
    md = "\n".join(validate.side_by_side_markdown(report))
    assert "## Long and repeated contexts" in md and "## Edits" in md and "120 warm" in md
    block = "\n".join(readme.side_by_side(ctx, ed))
    assert "context.json" in block and "edit.json" in block and "identical to baseline" in block


@pytest.mark.server
def test_a_spent_validate_budget_stops_edit_cases_after_the_first_and_leaves_unstarted_sections_out(
        served_tiny, tmp_path, monkeypatch):
    """validate.budget_s on a machine slower than the spec was trimmed for: a section that would start after it is
    spent is left out and named in `trimmed`; the edit section, once started, runs no case past the first after it."""
    from pipeline import validate
    from pipeline.runtime.engine_io import load_tokenizer

    s = served_tiny
    cases = edit_run.load_cases(Path("build/edit_set.json").resolve())[:3]
    monkeypatch.setattr(s.validate, "edit_set", str(tmp_path / "edit.json"))
    monkeypatch.setattr(s.validate, "max_edit_cases", 0)
    monkeypatch.setattr(s.validate, "context_sizes", [])  # the edit section alone: the context one is the same check
    monkeypatch.setattr(s.validate, "budget_s", 60.0)
    Path(s.validate.edit_set).write_text(json.dumps({"cases": [{**c, "original": c["original"][:120], "tokens": 40}
                                                                for c in cases]}))
    tok = load_tokenizer(s.engine_dir / "target")
    lines: list[str] = []
    report: dict = {"trimmed": []}
    budget = validate.Budget(60.0, t0=time.perf_counter() - 61)  # 60 s spent
    validate.side_by_side(s, tok, report, lines.append, lambda name: None,  # spent once case 1 is done
                          lambda need_s=0.0: budget(need_s) if any(ln.startswith("  edit 1/3") for ln in lines) else "")
    assert [c["id"] for c in report["edit"]["cases"]] == [cases[0]["id"]]
    assert all(len(r) == 1 for r in json.loads((s.report_dir / "edit.json").read_text())["runs"].values())
    assert "1 of 3 cases ran: validate.budget_s (60 s) was spent" in " ".join(report["edit"]["notes"])
    assert "  validate.budget_s (60 s) was spent: 1 of 3 edit cases" in lines

    spent: dict = {"trimmed": []}
    validate.side_by_side(s, tok, spent, lines.append, lambda name: None, budget)
    assert spent["edit"]["error"].startswith("left out: validate.budget_s (60 s) was spent; ")
    assert "context" not in spent  # a section the spec turns off is not named as left out
    assert spent["trimmed"] == ["the edit section left out: validate.budget_s (60 s) was spent"]
    assert "Not measured: left out: validate.budget_s (60 s)" in "\n".join(validate.side_by_side_markdown(spent))

    # under the main job's deadline each section is weighed alone: the context section (1.35 of the exactness pass's
    # 100 s) would end past it and is left out, the edit section (0.5 a case) still runs all its cases
    monkeypatch.setattr(s.validate, "context_sizes", [256])
    mixed: dict = {"trimmed": []}
    deadline = validate.Budget(0.0, time.time() + validate.END_RESERVE_S + 90)
    validate.side_by_side(s, tok, mixed, lines.append, lambda name: None, deadline, 100.0)
    assert mixed["context"]["error"].startswith("left out: it would end past the main job's deadline (about 135 s "
                                                "needed, "), mixed["context"]
    assert [c["id"] for c in mixed["edit"]["cases"]] == [c["id"] for c in cases]
    (note,) = mixed["trimmed"]  # the seconds left depend on how long the endpoint took to start
    assert note.startswith("the context section left out: it would end past the main job's deadline (about 135 s "
                           "needed, ") and note.endswith(" s left by PIPELINE_MAIN_JOB_DEADLINE from `make all`)"), note
