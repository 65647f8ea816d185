"""`validate` on a tiny deployment: the report's keys, exactness from real server responses, the plots."""

import json

import pytest

from pipeline import spec as specmod
from pipeline.runtime import kernels
from tests.conftest import make_model_dir, write_spec


@pytest.fixture(scope="module")
def tiny_all(tmp_path_factory, tiny_tokenizer):
    """A tiny target with a (different) tiny draft and briefly trained Medusa heads, all engines built."""
    from pipeline.engine import build_target
    from pipeline.train.draft import build_draft
    from pipeline.train.medusa import build_medusa
    from pipeline.triton.server import free_port

    root = tmp_path_factory.mktemp("val")
    make_model_dir(root / "models" / "target", tokenizer=tiny_tokenizer)
    make_model_dir(root / "models" / "draft", layers=1, seed=3, tokenizer=tiny_tokenizer)
    ports = [free_port() for _ in range(3)]
    p = write_spec(root, name="val",
                   draft={"source": "models/draft"},
                   speculation={"num_draft_tokens": 4, "draft_lookup_min_ngram": 2},
                   medusa={"source": "train", "num_heads": 2, "choices": [[0], [1], [0, 0]],
                           "train": {"steps": 10, "minutes": 0.5, "sequences": 8, "seq_len": 24, "batch_size": 4}},
                   triton={"http_port": ports[0], "grpc_port": ports[1], "metrics_port": ports[2]},
                   # A budget spent at once: validate stops after MIN_BUDGET_PROMPTS of the 5 and says so.
                   validate={"max_prompts": 5, "prompt_budget_s": 1e-9, "max_new_tokens": 8, "concurrency": [1, 2],
                             "temperatures": [0.0, 0.7], "distribution_samples": 16,
                             # the side-by-side sections: tests/test_sidebyside.py
                             "context_sizes": [], "edit_set": ""})
    s = specmod.load(p)
    quiet = lambda *a, **k: None  # noqa: E731
    build_target(s, log=quiet)
    build_draft(s, log=quiet)
    build_medusa(s, log=quiet)
    return s


@pytest.mark.server
def test_validate_writes_the_report_from_server_responses(tiny_all, stand_in_server):
    from pipeline.sources import spec_prompts
    from pipeline.triton.repo import write_repo
    from pipeline.triton.server import running_pid
    from pipeline.validate import MIN_BUDGET_PROMPTS, run_validate

    s = tiny_all
    write_repo(s, log=lambda *a: None)
    lines: list[str] = []
    report = run_validate(s, log=lines.append)
    ran = MIN_BUDGET_PROMPTS
    # llama-server (a stand-in: it cannot be built in the tests) decoded each prompt plainly right after ours: its
    # warm-up, then prompt i between our prompt i and i + 1; after the pass only the concurrency curve's servers
    # (llama-server -np N per level: a warm-up request, then N clients over every prompt: peer_curve.curve_requests)
    warm, *prompts = spec_prompts(s, s.validate.max_prompts + 1)
    reqs = stand_in_server()
    assert [r["prompt"] for r in reqs[:ran + 1]] == [warm, *prompts[:ran]]
    levels = s.validate.concurrency
    curve = reqs[ran + 1:]
    assert len(curve) == sum(1 + max(c, ran) for c in levels) and len({r["port"] for r in curve}) == len(levels)
    # the peer's curve asks for what ours does: validate.curve_tokens unset, the run's own 8 tokens
    assert report["curve_tokens"] == 8 and {r["max_tokens"] for r in curve} == {8}
    peer = [e for e in report["batch_curve"] if e["method"] == "llama-server"]
    assert [e["concurrency"] for e in peer] == levels and all(e["itl_ms_p99"] >= e["itl_ms_p50"] for e in peer)
    ours = [e for e in report["batch_curve"] if e["method"] == "baseline"]
    assert [e["concurrency"] for e in ours] == levels and all(e["ttft_ms_p99"] >= e["ttft_ms_p50"] > 0 for e in ours)
    # the default method (draft_target here) and baseline: two bursts a level, pooled; the others one
    for e in report["batch_curve"]:
        if e["method"] in ("baseline", "draft_target"):
            assert len(e["bursts_tokens_per_s"]) == 2
            assert min(e["bursts_tokens_per_s"]) <= e["tokens_per_s"] <= max(e["bursts_tokens_per_s"]), e
        else:
            assert "bursts_tokens_per_s" not in e, e
    import re  # the progress line names both bursts of the two read twice

    level = [ln for ln in lines if ln.lstrip().startswith("concurrency 1: ")][0]
    assert re.search(r"baseline [\d.]+ \([\d.]+, [\d.]+\)", level) and re.search(r"medusa [\d.]+(,|$)", level), level
    assert set(report["vs_llama_server_at_concurrency"]["baseline"]) == {str(c) for c in levels}
    # the methods ran in the spec's order on even prompts, reversed on odd ones (no method always after another)
    assert report["method_order"] == [list(report["methods"]) if i % 2 == 0 else list(report["methods"])[::-1]
                                      for i in range(ran)]
    passes = [ln for ln in lines if ln.lstrip().startswith("prompt ") and "tokens/s" in ln]
    assert len(passes) == ran and all("llama-server plain" in ln for ln in passes), passes
    plain = report["peers"]["llama_cpp_server"]["plain"]
    assert plain["interleaved"] is True and len(plain["per_prompt_tokens_per_s"]) == ran
    # the memory's read speed probed before and after each prompt's requests, and named in its progress line
    mem = report["memory_gbs_by_prompt"]
    assert len(mem) == ran and all(len(p) == 2 and min(p) > 0 for p in mem), mem
    assert all(re.search(r"\(memory [\d.]+ / [\d.]+ GB/s\)", ln) for ln in passes), passes
    assert report["prompts"] == ran and f"{ran} of 5 prompts ran" in " ".join(report["trimmed"])
    assert running_pid(s) is None, "validate must stop the server it started"
    on_disk = json.loads((s.report_dir / "validate.json").read_text())
    assert on_disk["methods"].keys() == report["methods"].keys()
    # where the minutes went, section by section, in the order they ran
    assert list(on_disk["phase_seconds"]) == ["exactness", "acceptance_per_position", "transformers",
                                              "llama_cpp_server", "batch_curve_and_temperatures", "distribution"]
    assert all(v >= 0 for v in on_disk["phase_seconds"].values()) and on_disk["phase_seconds"]["exactness"] > 0
    methods = on_disk["methods"]
    assert {"baseline", "draft_target", "prompt_lookup", "medusa"} <= set(methods)
    for name, m in methods.items():
        for key in ("tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_len", "greedy_identical",
                    "greedy_total"):
            assert key in m, (name, key)
        assert m["greedy_total"] == ran and m["tokens_per_s"] > 0
        # Greedy exactness is computed from what the server sent back; every method here is exact.
        assert m["greedy_identical"] == m["greedy_total"], (name, m["divergences"])
    # Every figure recomputed from what the report carries: per-prompt tokens/s and token totals.
    import statistics

    base = methods["baseline"]["per_prompt_tokens_per_s"]
    assert methods["baseline"]["speedup"] == 1.0 and methods["baseline"]["mean_accepted_len"] == 1.0
    for name, m in methods.items():
        tps = m["per_prompt_tokens_per_s"]
        assert m["tokens_per_s"] == pytest.approx(statistics.median(tps))
        assert m["speedup"] == pytest.approx(statistics.median([a / b for a, b in zip(tps, base)])), name
        out, acc, prop = m["num_output_tokens"], m["total_accepted_draft_tokens"], m["total_draft_tokens"]
        assert 0 < out <= ran * s.validate.max_new_tokens
        assert m["acceptance_rate"] == pytest.approx(acc / prop if prop else 0.0)
        assert m["mean_accepted_len"] == pytest.approx(out / (out - acc))
    assert methods["draft_target"]["total_draft_tokens"] > 0
    assert 0 <= methods["draft_target"]["acceptance_rate"] <= 1
    assert methods["draft_target"]["lookup_min_ngram"] == 2
    for peer in ("hf_generate", "hf_assisted"):  # the spec's 8 tokens: under validate's PEER_TOKENS cap
        assert on_disk["peers"][peer]["tokens_per_s"] > 0 and on_disk["peers"][peer]["new_tokens"] == 8
    md = (s.report_dir / "validate.md").read_text()
    assert "transformers hf_generate (2 prompts x 8 tokens)" in md
    assert "## Concurrency curve (aggregate tokens/s, requests of 8 new tokens)" in md
    assert "baseline and draft_target: two bursts a level, before and after the other methods, pooled" in md
    curve = on_disk["batch_curve"]
    assert {(e["concurrency"], e["method"]) for e in curve} == {(c, m) for c in (1, 2)
                                                               for m in [*methods, "llama-server"]}
    # issue 51's targets from the same curve: the default over baseline per level, as the table's figures give it
    tps = {(e["concurrency"], e["method"]): e["tokens_per_s"] for e in curve}
    targets = on_disk["curve_targets"]
    assert targets["default_method"] == "draft_target" and set(targets["over_baseline"]) == {"1", "2"}
    for c, e in targets["over_baseline"].items():
        assert e["measured"] == pytest.approx(tps[(int(c), "draft_target")] / tps[(int(c), "baseline")])
    assert "Issue 51's targets (default method draft_target): over baseline at 1: " in md
    # each burst, ours and the peer's, with the steal time the machine reported over it (None off Linux)
    assert all("steal_ms" in e and (e["steal_ms"] is None or e["steal_ms"] >= 0) for e in curve)
    assert "environment" in on_disk and on_disk["environment"]["packages"]["torch"]
    env = on_disk["environment"]  # the kernel build, and why the AVX-512 one does not use AMX tiles where it does not
    assert env["kernel_path"] == kernels.path()
    assert env["amx_unavailable"] == (kernels.amx_unavailable() if env["kernel_path"].startswith("avx512") else None)
    assert on_disk["advice"]["recommended_method"] in methods
    for m, d in on_disk["distribution"].items():
        assert d["samples"] == 16 and 0 <= d["same_seed_identical"] <= 1, m
    # the draft model's samples came from speculative rounds, one request at a time, not from plain steps under load
    assert on_disk["distribution"]["draft_target"]["draft_tokens"] > 0
    # the default method (draft_target here) at T = 0.7 too, against baseline at 0.7, through the server
    low = on_disk["distribution"]["draft_target at T=0.7"]
    assert low["temperature"] == 0.7 and low["draft_tokens"] > 0 and low["consistent"]
    assert on_disk["distribution"]["draft_target"]["temperature"] == 1.0
    assert "- draft_target at T=0.7: chi2" in md
    for png in ("speed.png", "batch_curve.png", "acceptance.png"):
        assert (s.report_dir / png).stat().st_size > 1000
    assert "Advice" in (s.report_dir / "validate.md").read_text()
    # the first prompt once more per method after the pass: the cold start set against the same prompt warm
    again = [ln for ln in lines if ln.lstrip().startswith("first prompt again:")]
    assert len(again) == 1 and lines.index(again[0]) > lines.index(passes[-1])
    first = on_disk["first_prompt"]
    assert first.keys() == methods.keys()
    for name, e in first.items():
        assert e["first_tokens_per_s"] == methods[name]["per_prompt_tokens_per_s"][0]
        assert e["again_over_first"] == pytest.approx(e["again_tokens_per_s"] / e["first_tokens_per_s"])
        assert e["median_over_first"] == pytest.approx(
            statistics.median(methods[name]["per_prompt_tokens_per_s"]) / e["first_tokens_per_s"])
    assert "First prompt run again after the pass" in (s.report_dir / "validate.md").read_text()


@pytest.mark.server
def test_a_main_job_deadline_leaves_out_the_sections_that_would_end_past_it_and_the_report_names_them(
        tiny_all, stand_in_server, monkeypatch):
    """`make all` on a machine slower than the spec was trimmed for: past the exactness pass, the peers and the
    acceptance (the core figures), a section that would end past the main job's deadline does not start; the
    report, validate.md and the log say which and why, and the figures that ran are whole."""
    import time

    from pipeline.triton.repo import write_repo
    from pipeline.validate import DEADLINE_ENV, END_RESERVE_S, MIN_BUDGET_PROMPTS, run_validate

    s = tiny_all
    write_repo(s, log=lambda *a: None)
    monkeypatch.setenv(DEADLINE_ENV, str(time.time() + END_RESERVE_S))  # spent as soon as anything has run
    lines: list[str] = []
    report = run_validate(s, log=lines.append)
    methods = report["methods"]
    assert all(m["greedy_identical"] == m["greedy_total"] == MIN_BUDGET_PROMPTS for m in methods.values())
    assert report["peers"]["llama_cpp_server"]["plain"]["tokens_per_s"] > 0 and report["acceptance_per_position"]
    assert report["batch_curve"] == [] and report["temperatures"] == [] and report["crossover"] == {}
    assert report["distribution"] == {}
    why = "it would end past the main job's deadline"
    assert report["curve_left_out"].startswith(why) and report["distribution_left_out"].startswith(why)
    assert DEADLINE_ENV in report["curve_left_out"]
    trimmed = " ".join(report["trimmed"])
    assert f"the concurrency curve and the temperatures left out: {why}" in trimmed
    assert f"the distribution test left out: {why}" in trimmed
    assert any(ln.startswith(f"  the concurrency curve and the temperatures left out: {why}") for ln in lines)
    assert "curve_targets" not in report and report["advice"]["recommended_method"] in methods
    md = (s.report_dir / "validate.md").read_text()
    assert f"Left out: {why}" in md and "Left out with the curve" in md and "| concurrency |" not in md
    assert (s.report_dir / "batch_curve.png").stat().st_size > 1000
    assert not stand_in_server()[MIN_BUDGET_PROMPTS + 1:], "llama-server -np N ran though the curve was left out"


def test_a_section_starts_only_where_it_would_end_before_the_main_jobs_deadline(monkeypatch):
    """Budget(need_s): '' while a section of need_s seconds ends END_RESERVE_S before the deadline; otherwise why
    not, naming where the deadline came from. validate.budget_s still applies on its own."""
    import time

    from pipeline.validate import DEADLINE_ENV, END_RESERVE_S, Budget, main_job_deadline

    soon = Budget(0.0, time.time() + END_RESERVE_S + 100)
    assert soon() == "" and soon(90) == ""
    assert soon(200).startswith("it would end past the main job's deadline (about 200 s needed, ")
    assert DEADLINE_ENV in soon(200)
    assert Budget(0.0)(1e9) == ""  # no deadline: nothing is left out for time
    assert Budget(60.0, t0=time.perf_counter() - 61)() == "validate.budget_s (60 s) was spent"
    assert Budget(60.0, time.time() + 1e6)(5) == ""
    monkeypatch.delenv(DEADLINE_ENV, raising=False)
    assert main_job_deadline() is None
    monkeypatch.setenv(DEADLINE_ENV, "")  # MAIN_JOB_S=0: make exports it empty
    assert main_job_deadline() is None
    monkeypatch.setenv(DEADLINE_ENV, "1796646127")
    assert main_job_deadline() == 1796646127.0
    monkeypatch.setenv(DEADLINE_ENV, "soon")
    with pytest.raises(ValueError, match=f"{DEADLINE_ENV}='soon' is not a time in Unix seconds"):
        main_job_deadline()


def test_make_all_gives_its_steps_a_deadline_main_job_s_from_its_start_and_no_other_target_one():
    """The Makefile's `all` exports PIPELINE_MAIN_JOB_DEADLINE (its start + MAIN_JOB_S) to what it runs, the
    sub-makes' validate included; MAIN_JOB_S=0 exports none, and `make validate` alone has none."""
    import shutil
    import subprocess
    import time

    from pipeline.validate import DEADLINE_ENV

    if shutil.which("make") is None:
        pytest.skip("no make here")
    # the probe fails, so make stops before `all`'s own steps; `-o setup`: the venv is not touched
    probe = ["--eval", f'probe: ; @echo "[$${DEADLINE_ENV}]"; exit 3']

    def seen(*args: str) -> str:
        out = subprocess.run(["make", "-s", "-o", "setup", *probe, *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0 and "probe" in out.stderr, (out.returncode, out.stderr)
        return out.stdout.strip().splitlines()[-1]

    t = time.time()
    got = seen("--eval", "all: probe", "all")
    assert got.startswith("[") and abs(float(got[1:-1]) - (t + 1800)) < 30, got
    got = seen("--eval", "all: probe", "MAIN_JOB_S=600", "all")
    assert abs(float(got[1:-1]) - (t + 600)) < 30, got
    assert seen("--eval", "all: probe", "MAIN_JOB_S=0", "all") == "[]"
    assert seen("probe") == "[]"


def test_divergence_reports_position_tokens_and_margin(tiny_engine):
    from pipeline.runtime.decode import load_bundle
    from pipeline.runtime.generate import Request, generate
    from pipeline.validate import divergence

    b = load_bundle(tiny_engine.parent, methods=("baseline",))
    prompt = [5, 9, 14, 3]
    base = generate(b.target, [Request(prompt, 10)])[0].tokens
    other = base[:6] + [(base[6] + 1) % b.target.cfg.vocab_size] + base[7:]
    d = divergence(b, prompt, base, other, near_tie=0.05)
    assert d["position"] == 6 and d["baseline_token"] == base[6] and d["method_token"] == other[6]
    assert d["top2_margin"] >= 0
    assert d["classification"] == ("numeric near-tie" if d["top2_margin"] <= 0.05 else "real disagreement")
    assert divergence(b, prompt, base, list(base), near_tie=0.05) is None


def test_chi2_two_sample_tells_same_from_different():
    import random

    from pipeline.validate import chi2_two_sample

    rng = random.Random(0)
    a = [rng.choice("abcd") for _ in range(2000)]
    b = [rng.choice("abcd") for _ in range(2000)]
    c = [rng.choice("aabcd") for _ in range(2000)]
    assert chi2_two_sample(a, b)[2] > 0.001
    assert chi2_two_sample(a, c)[2] < 1e-6


def test_trimmed_says_what_a_short_run_leaves_out(tmp_path):
    from pipeline import spec as specmod
    from pipeline.validate import trimmed

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"prompt {i}" for i in range(11)) + "\n")
    s = specmod.parse({"name": "t", "validate": {"prompts": str(prompts), "max_prompts": 4, "max_new_tokens": 64,
                                                  "distribution_samples": 60, "concurrency": [1, 2],
                                                  "temperatures": [0.7]}}, root=tmp_path)
    out = trimmed(s)
    assert out[0] == "4 of 10 prompts (validate.max_prompts)"
    assert any(x.startswith("64 new tokens per request (full run: 128") for x in out)
    assert any(x.startswith("60 distribution samples (full run: 200") for x in out)
    assert any("concurrency curve to 2 (full run: to 16" in x for x in out)
    assert any(x.startswith("temperatures [0.7]") for x in out)
    assert not any("curve_tokens" in x for x in out)  # the curve's requests are the run's own 64 tokens
    full = specmod.parse({"name": "t", "validate": {"prompts": str(prompts)}}, root=tmp_path)
    assert trimmed(full) == []


def test_curve_tokens_default_to_the_runs_answers_and_a_shorter_curve_is_named_as_trimmed(tmp_path):
    from pipeline import spec as specmod
    from pipeline.validate import curve_tokens, trimmed

    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")

    def parsed(**v):
        return specmod.parse({"name": "t", "validate": {"prompts": str(prompts), **v}}, root=tmp_path)

    assert curve_tokens(parsed().validate) == 128
    assert curve_tokens(parsed(max_new_tokens=48).validate) == 48
    assert curve_tokens(parsed(curve_tokens=32).validate) == 32
    assert curve_tokens(parsed(max_new_tokens=16, curve_tokens=32).validate) == 16  # never past the answers
    assert trimmed(parsed(curve_tokens=32)) == [
        "concurrency-curve requests of 32 new tokens (full run: 128; validate.curve_tokens)"]
    assert trimmed(parsed(curve_tokens=128)) == []
    with pytest.raises(specmod.SpecError, match="validate.curve_tokens"):
        parsed(curve_tokens=-1)


def test_draft_summary_reads_the_built_draft(tmp_path):
    import json

    from pipeline import spec as specmod
    from pipeline.validate import _draft_line, draft_summary

    s = specmod.parse({"name": "d"}, root=tmp_path)
    assert draft_summary(s) == {}
    d = s.engine_dir / "draft"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "source": "qwen2.5-coder-0.5b-instruct",
        "pretrained_config": {"num_hidden_layers": 24, "vocab_size": 151936, "dtype": "bfloat16",
                              "quantization": {"quant_algo": "W8A16"}},
        "draft": {"vocab": 32768, "training": {"vocab_coverage": 0.991}},
        "speculation": {"num_draft_tokens": 5, "chosen_by": "measured", "draft_step_fraction": 0.118}}))
    got = draft_summary(s)
    assert got == {"source": "qwen2.5-coder-0.5b-instruct", "layers": 24, "vocab": 32768,
                   "vocab_coverage_tune": 0.991,
                   "dtype": "bfloat16", "quantization": "W8A16", "num_draft_tokens": 5, "chosen_by": "measured",
                   "step_fraction_of_target": 0.118}
    line = _draft_line({**got, "vocab_coverage": 0.975})
    assert "W8A16" in line and "32768 tokens (covers 97.5%" in line and "0.118 of a target step" in line


def test_prompt_budget_stops_new_prompts_once_spent_after_the_minimum():
    """A slower machine runs fewer prompts of the same spec instead of overrunning the main job's time."""
    from pipeline.validate import MIN_BUDGET_PROMPTS, over_budget

    assert not over_budget(50, 1e9, 0.0)  # no budget: every prompt runs
    assert not over_budget(MIN_BUDGET_PROMPTS - 1, 1e9, 10.0)  # the minimum runs whatever the time
    assert not over_budget(MIN_BUDGET_PROMPTS, 9.9, 10.0)
    assert over_budget(MIN_BUDGET_PROMPTS, 10.0, 10.0)


def test_a_negative_prompt_budget_is_refused_with_its_key(tmp_path):
    with pytest.raises(ValueError, match="validate.prompt_budget_s"):
        specmod.parse({"name": "t", "validate": {"prompt_budget_s": -1}}, root=tmp_path)
    with pytest.raises(ValueError, match="validate.budget_s"):
        specmod.parse({"name": "t", "validate": {"budget_s": -5}}, root=tmp_path)


def test_the_validate_budget_is_spent_only_once_its_seconds_have_passed():
    """validate.budget_s: 0 never runs out; otherwise the clock starts when validate does."""
    import time

    from pipeline.validate import Budget

    assert Budget(0.0)() == ""
    slow = Budget(3600.0)
    assert slow() == ""
    fast = Budget(0.01)
    time.sleep(0.02)
    assert fast() == "validate.budget_s (0.01 s) was spent"


def test_transformers_peers_run_a_quarter_of_the_prompts_and_at_most_32_tokens_each():
    from pipeline.validate import PEER_TOKENS, peer_budget

    assert PEER_TOKENS == 32
    assert peer_budget(8, 128) == (2, 32)
    assert peer_budget(16, 128) == (4, 32)
    assert peer_budget(1, 8) == (1, 8)  # never more prompts than ran, nor more tokens than asked
    assert peer_budget(5, 16) == (2, 16)


def test_the_curve_tables_latency_cells_show_what_the_bursts_measured():
    """validate.md's curve rows give each method's time to first token and inter-token latency p50/p99 from the keys
    the bursts write (the cells had looked for other keys and stayed empty in every run)."""
    from pipeline.validate import curve_latency

    by = {(4, "hybrid"): {"tokens_per_s": 45.0, "ttft_ms_p50": 516.2, "ttft_ms_p99": 1353.0, "itl_ms_p50": 64.0,
                          "itl_ms_p99": 486.4},
          (4, "llama-server"): {"tokens_per_s": 21.2, "ttft_ms_p50": 3103.0, "ttft_ms_p99": 3104.0,
                                "itl_ms_p50": 91.0, "itl_ms_p99": 91.0}}
    assert curve_latency(by, 4, ["hybrid", "llama-server"], "ttft") == "hybrid 516/1353, llama-server 3103/3104"
    assert curve_latency(by, 4, ["hybrid", "baseline"], "itl") == "hybrid 64/486"
    assert curve_latency(by, 2, ["hybrid"], "itl") == ""


def test_the_curve_reads_the_default_and_baseline_twice_around_the_other_methods():
    """Each curve level runs the default method and baseline before and after the others (their mean bursts at the
    same place in the level, as memory speed drifts); every method once where the default is baseline or absent."""
    from pipeline.validate import curve_order

    ms = ["baseline", "draft_target", "prompt_lookup", "suffix", "hybrid"]
    order = curve_order(ms, "hybrid")
    assert order == ["hybrid", "baseline", "draft_target", "prompt_lookup", "suffix", "baseline", "hybrid"]
    for m in ("hybrid", "baseline"):  # both read at mean position 3 of 0..6
        assert sum(i for i, x in enumerate(order) if x == m) / 2 == (len(order) - 1) / 2
    assert curve_order(ms, "baseline") == ms
    assert curve_order(ms, None) == ms
    assert curve_order(["draft_target", "medusa"], "draft_target") == ["draft_target", "medusa"]  # no baseline here
    assert curve_order(ms, "medusa") == ms  # not among the measured methods


def test_a_curve_point_of_two_bursts_pools_their_requests_and_keeps_each_bursts_speed():
    """Two bursts of one method and level make one point: tokens over the summed wall time, percentiles over every
    request and gap of both; one burst's point has no `bursts_tokens_per_s`."""
    from pipeline.figures import curve_point

    a = {"tokens": 100, "wall_s": 2.0, "latency_ms": [900.0, 1000.0], "ttft_ms": [100.0, 300.0],
         "itl_ms": [20.0] * 9 + [200.0], "steal_ms": 5.0}
    b = {"tokens": 100, "wall_s": 3.0, "latency_ms": [1500.0, 1600.0], "ttft_ms": [200.0, 400.0],
         "itl_ms": [30.0] * 10, "steal_ms": None}
    both = curve_point([a, b])
    assert both["tokens_per_s"] == pytest.approx(40.0)  # 200 tokens in 5 s, not the mean of 50 and 33.3
    assert both["bursts_tokens_per_s"] == pytest.approx([50.0, 100 / 3])
    assert both["latency_ms_p50"] == 1000.0 and both["ttft_ms_p50"] == 200.0 and both["ttft_ms_p99"] == 400.0
    assert both["itl_ms_p50"] == 30.0 and both["itl_ms_p99"] == 200.0  # the 200 ms gap is 1 of 20
    assert both["steal_ms"] is None  # one burst without the figure: no sum
    one = curve_point([a])
    assert one["tokens_per_s"] == 50.0 and "bursts_tokens_per_s" not in one and one["steal_ms"] == 5.0
    assert one["itl_ms_p50"] == 20.0 and one["itl_ms_p99"] == 200.0


def test_the_curve_note_says_the_load_policy_still_chooses_the_drafts_where_the_spec_sets_it():
    """validate.md had said the curve ran with speculation forced on, while under `draft_length: load` the load
    policy still drafts nothing from 2 rows on the flagship (its default read baseline's plain steps there)."""
    from pipeline.validate import curve_setting

    load = curve_setting(0, "load")
    assert "`speculation.disable_at_batch: 0`" in load and "load policy" in load and "forced" not in load
    fixed = curve_setting(2, "fixed")
    assert "`speculation.disable_at_batch: 2`" in fixed and "drafts the method's k" in fixed
    assert "load policy" not in fixed


def test_the_distribution_test_sends_its_requests_one_at_a_time_with_the_prompt_cache(monkeypatch):
    """Several at once, the server's load policy decodes plainly (the flagship drafts nothing at 8 rows) and every
    method answers with baseline's own samples: the test would pass without testing the speculative rule. So the
    requests go one at a time (the most in flight is 1), each seed once per method, and the report counts the draft
    tokens the answers were verified against. Each asks for the prompt cache (the same prompt every time: no prefill
    after the first, half the section's time)."""
    import threading
    import time

    from pipeline import validate

    lock, state, calls = threading.Lock(), {"now": 0, "most": 0}, []

    def request(url, text, max_tokens, method, temperature=0.0, seed=None, stream=True, **kw):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.002)
        with lock:
            state["now"] -= 1
            calls.append((method, seed, max_tokens, temperature, kw.get("cache_prompt")))
        return {"text": "ab" if seed % 2 else "ba", "total_draft_tokens": 0 if method == "baseline" else 5}

    monkeypatch.setattr(validate, "_request", request)
    tok = lambda text, add_special_tokens=False: {"input_ids": [ord(c) for c in text]}  # noqa: E731
    out = validate.distribution_test("url", "prompt", ["baseline", "draft_target", "hybrid"], 6, tok, lambda m: None)
    assert state["most"] == 1
    assert [c[:2] for c in calls] == [(m, s) for m in ("baseline", "draft_target", "hybrid") for s in range(1000, 1006)]
    assert all(c[2] == validate.DIST_TOKENS and c[3] == 1.0 and c[4] is True for c in calls)
    assert out["draft_target"]["draft_tokens"] == out["hybrid"]["draft_tokens"] == 30
    assert out["hybrid"]["same_seed_identical"] == 1.0 and out["hybrid"]["chi2"] == 0.0
    calls.clear()  # the default method's second temperature: baseline and it, sampled at that temperature
    low = validate.distribution_test("url", "prompt", ["baseline", "hybrid"], 6, tok, lambda m: None,
                                     validate.DIST_LOW_T)
    assert [c[0] for c in calls] == ["baseline"] * 6 + ["hybrid"] * 6
    assert all(c[3] == validate.DIST_LOW_T for c in calls) and low["hybrid"]["temperature"] == validate.DIST_LOW_T


def test_validate_names_the_methods_the_load_policy_keeps_plain_and_from_how_many_rows(tmp_path):
    """An acceptance of 0 in validate's table has a reason under `draft_length: load`: the method's drafts are not
    expected to pay on this machine. The report names each such method and the rows from which it steps plainly."""
    from pipeline.validate import plain_from_line, plain_from_rows
    from tests.test_loadpolicy import SMALL_TREE, _medusa_bundle

    low = _medusa_bundle(tmp_path, SMALL_TREE)  # its tree expects 1.14x at one row: plain from 1
    assert plain_from_rows(low, ["baseline", "medusa", "prompt_lookup"], 8) == {"medusa": 1}
    better = _medusa_bundle(tmp_path, {**SMALL_TREE, "expected_accept_len": 2.0})
    assert plain_from_rows(better, ["medusa"], 8) == {"medusa": 2} and plain_from_rows(better, ["medusa"], 1) == {}
    fixed = _medusa_bundle(tmp_path, SMALL_TREE, "fixed")
    assert plain_from_rows(fixed, ["medusa"], 8) == {}
    line = " ".join(plain_from_line({"medusa": 1, "draft_target": 2}))
    assert "medusa from 1 row," in line and "draft_target from 2 rows." in line
    assert plain_from_line({}) == []


def test_validate_flags_a_method_that_proposed_nothing_unless_the_load_policy_keeps_it_plain_from_one_row():
    """The small spec's validate called draft_target and Medusa suspicious for proposing nothing, two lines below the
    one saying the load policy keeps both plain from one row on this machine: expected, not a fault. A method that
    proposes nothing while the policy says it drafts at one row is still flagged, as are pinned acceptances."""
    from pipeline.validate import suspicious

    def entry(drafts: int, rate: float = 0.0, length: float = 1.0) -> dict:
        return {"total_draft_tokens": drafts, "acceptance_rate": rate, "mean_accepted_len": length}

    r = {"methods": {"baseline": entry(0), "draft_target": entry(0), "medusa": entry(0), "suffix": entry(0),
                     "hybrid": entry(40, 1.0, 2.5), "prompt_lookup": entry(10, 0.0)},
         "plain_from": {"draft_target": 1, "medusa": 1, "suffix": 2}}
    flags = suspicious(r)
    assert flags == ["suffix: no draft tokens were proposed",
                     "hybrid: acceptance exactly 1 (draft identical to target or acceptance not checked?)",
                     "prompt_lookup: acceptance exactly 0 (drafter broken or mismatched tokenizer?)",
                     "prompt_lookup: mean accepted length exactly 1 token"]
    assert suspicious({**r, "plain_from": {}})[:3] == [f"{m}: no draft tokens were proposed"
                                                       for m in ("draft_target", "medusa", "suffix")]


def _advice_report(crossover: dict, draft_length: str, plain_from: dict | None = None, edit: dict | None = None):
    m = {"baseline": (100.0, 1.0), "hybrid": (101.0, 1.01), "draft_target": (98.0, 0.98)}
    return {"methods": {k: {"tokens_per_s": t, "speedup": x, "divergences": []} for k, (t, x) in m.items()},
            "crossover": crossover, "draft_length": draft_length, "plain_from": plain_from or {},
            **({"edit": {"summary": {"systems": edit}}} if edit else {})}


def test_advice_never_switches_speculation_off_at_one_client_nor_under_the_load_policy():
    """The small spec's validate advised `speculation.disable_at_batch: 1` (speculation off for every request) from
    a one-client curve burst that read hybrid 0.94x baseline, while hybrid decoded its whole-file edits at 3.1x
    baseline in the same run and the load policy already stepped it plainly from 2 rows."""
    from pipeline.validate import advice

    methods = ["baseline", "hybrid", "draft_target"]
    edit = {"baseline": {"decode_tokens_per_s": 111.7}, "hybrid": {"decode_tokens_per_s": 344.6},
            "draft_target": {"decode_tokens_per_s": 113.6}}
    a = advice(_advice_report({"hybrid": 1}, "load", {"hybrid": 2}, edit), methods)
    assert a["recommended_method"] == "hybrid" and a["set"] is None
    assert a["switch_off_speculation_at_concurrency"] is None
    assert "steps plainly from 2 rows by itself" in a["why"] and "edits hybrid decoded 3.09x baseline" in a["why"]
    assert a["edit_gains"]["hybrid"] == pytest.approx(344.6 / 111.7)
    fixed_one = advice(_advice_report({"hybrid": 1}, "fixed"), methods)
    assert fixed_one["set"] is None and "no switch-off point" in fixed_one["why"]
    fixed_two = advice(_advice_report({"hybrid": 2}, "fixed"), methods)  # the old advice where it holds
    assert fixed_two["set"] == "speculation.disable_at_batch: 2" and "edits" not in fixed_two["why"]
    never = advice(_advice_report({}, "fixed"), methods)
    assert never["set"] is None and "stayed faster at every measured concurrency" in never["why"]


def test_validate_gives_each_methods_speed_over_llama_server_prompt_by_prompt_and_by_the_memorys_speed():
    """Issue 53 names draft_target over llama-server plain; the memory's speed moves within minutes here, so the
    figure is each prompt's pair (the peer's request between ours) and their median, not two totals."""
    from pipeline.validate import over_peer_by_prompt, over_peer_line

    r = {"methods": {"baseline": {"per_prompt_tokens_per_s": [30.0, 40.0, 30.0]},
                     "draft_target": {"per_prompt_tokens_per_s": [60.0, 64.0, 45.0]}},
         "peers": {"llama_cpp_server": {"plain": {"interleaved": True, "per_prompt_tokens_per_s": [25.0, 32.0, 30.0]}}}}
    got = over_peer_by_prompt(r)
    assert got["draft_target"] == {"median": 2.0, "min": 1.5, "max": 2.4, "prompts": 3}
    assert got["baseline"]["median"] == pytest.approx(1.2) and got["baseline"]["max"] == pytest.approx(1.25)
    assert "draft_target median 2.00x (1.50-2.40)" in over_peer_line(got)[1] and "3 prompts" in over_peer_line(got)[1]
    assert "slower_memory" not in got["draft_target"] and len(over_peer_line(got)) == 2  # no probes: no split
    # with the memory's speed probed around each prompt, each method's figure on the slower half of those minutes
    # and on the faster half (the probes' mean per prompt against their median, 31.0 here)
    r["memory_gbs_by_prompt"] = [[30.0, 32.0], [55.0, 57.0], [28.0, 30.0]]
    got = over_peer_by_prompt(r)
    assert got["draft_target"]["slower_memory"] == pytest.approx(1.95) and got["draft_target"]["faster_memory"] == 2.0
    assert got["draft_target"]["median"] == 2.0 and got["draft_target"]["memory_gbs_median"] == 31.0
    split = over_peer_line(got)[3]
    assert "median 31 GB/s" in split and "draft_target 1.95x where it read slower, 2.00x faster" in split, split
    r["memory_gbs_by_prompt"] = [[30.0, 32.0], [55.0, None], [28.0, 30.0]]  # a probe that failed: no split
    assert "slower_memory" not in over_peer_by_prompt(r)["draft_target"]
    r["memory_gbs_by_prompt"] = [[30.0, 32.0], [55.0, 57.0]]  # probes that do not pair with the prompts: no split
    assert "slower_memory" not in over_peer_by_prompt(r)["draft_target"]
    r["peers"]["llama_cpp_server"]["plain"]["interleaved"] = False  # totals from other minutes: no pairs to give
    assert over_peer_by_prompt(r) == {} and over_peer_line({}) == []
    assert over_peer_by_prompt({"methods": {}, "peers": {}}) == {}
