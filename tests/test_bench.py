"""`bench` on a tiny deployment whose answers are known: the draft is the target itself (acceptance 1, k + 1
tokens per forward), prompt lookup's counters come from a replay written here, and every ratio in the report
is recomputed from the per-prompt figures the report carries."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from pipeline import spec as specmod
from tests.conftest import install_stand_in, make_model_dir, write_spec

K, LOOKUP_K, NGRAM = 3, 4, 3
LLAMA_REQUESTS: list[dict] = []  # what llama-server's stand-in was asked during the module's bench run


@pytest.fixture(scope="module")
def bench(tmp_path_factory, tiny_tokenizer):
    from pipeline.bench import run_bench
    from pipeline.engine import build_target
    from pipeline.train.draft import build_draft

    root = tmp_path_factory.mktemp("bench")
    make_model_dir(root / "models" / "target", tokenizer=tiny_tokenizer)
    # group_size 32: bench's int4 precision row needs a group that divides the tiny model's width (64)
    p = write_spec(root, name="bench", target={"source": "models/target", "group_size": 32},
                   draft={"source": "models/target"},
                   speculation={"num_draft_tokens": K, "prompt_lookup_num_tokens": LOOKUP_K,
                                "prompt_lookup_max_ngram": NGRAM})
    s = specmod.load(p)
    quiet = lambda *a, **k: None  # noqa: E731
    build_target(s, log=quiet)
    build_draft(s, log=quiet)
    with pytest.MonkeyPatch.context() as mp:  # llama-server's stand-in as the GGUF peer, for this run only
        llama = install_stand_in(root, mp)
        report = run_bench(s, quick=True, log=quiet)
        LLAMA_REQUESTS[:] = llama()
    return s, report


def _prompt_ids(spec) -> list[list[int]]:
    """What bench decodes in quick mode: prompts 2 and 3 of the set (the first warms up), chat template on."""
    from pipeline.common import chat_ids
    from pipeline.runtime.engine_io import load_engine
    from pipeline.sources import spec_prompts

    tok = load_engine(spec.engine_dir / "target").tokenizer
    return [chat_ids(tok, t) for t in spec_prompts(spec, 3)[1:]]


def _lookup(ctx: list[int]) -> list[int]:
    """Prompt lookup written out: the tokens after the latest earlier occurrence of the longest recurring tail."""
    for n in range(min(NGRAM, len(ctx) - 1), 0, -1):
        tail = ctx[-n:]
        starts = [s for s in range(len(ctx) - n) if ctx[s:s + n] == tail]
        if starts:
            s = starts[-1]
            return ctx[s + n:s + n + LOOKUP_K]
    return []


def _lookup_replay(base: list[int], prompt: list[int], new: int) -> tuple[int, int, int]:
    """(proposed, accepted, forwards) of greedy prompt lookup, from the target's own greedy tokens; no more drafts
    than the row's room (a round emits at most its drafts and one token, the row at most `new`)."""
    proposed = accepted = 0
    forwards, i = 1, 1
    while i < new:
        d = _lookup(prompt + base[:i])[:new - i - 1]
        n = 0
        while n < len(d) and d[n] == base[i + n]:
            n += 1
        proposed, accepted, forwards = proposed + len(d), accepted + n, forwards + 1
        i += n + 1
    return proposed, accepted, forwards


def test_bench_figures_have_their_known_answers(bench):
    from pipeline.runtime.engine_io import load_engine
    from pipeline.runtime.generate import Request, generate

    spec, r = bench
    new, m = r["new_tokens"], r["methods"]
    assert r["prompts"] == 2 and set(m) == {"baseline", "draft_target", "prompt_lookup", "suffix", "hybrid"}
    for e in m.values():
        assert (e["greedy_identical"], e["greedy_total"]) == (2, 2)
        assert e["num_output_tokens"] == 2 * new
    assert (m["baseline"]["acceptance_rate"], m["baseline"]["mean_accepted_len"]) == (0.0, 1.0)
    # the target as its own draft: every draft accepted, k + 1 tokens per forward after the prefill's one (the last
    # round only as many as are left), so every token after the first is a draft but one per round
    forwards = 1 + math.ceil((new - 1) / (K + 1))
    dt = m["draft_target"]
    assert dt["num_draft_tokens"] == K and dt["acceptance_rate"] == 1.0
    assert dt["total_draft_tokens"] == 2 * (new - 1 - (forwards - 1))
    assert dt["mean_accepted_len"] == pytest.approx(new / forwards)
    # prompt lookup: counters from the replay
    target = load_engine(spec.engine_dir / "target").model
    prop = acc = fwd = 0
    for ids in _prompt_ids(spec):
        (ref,) = generate(target, [Request(ids, new + LOOKUP_K + 1)])
        p, a, f = _lookup_replay(ref.tokens, ids, new)
        prop, acc, fwd = prop + p, acc + a, fwd + f
    pl = m["prompt_lookup"]
    assert (pl["total_draft_tokens"], pl["total_accepted_draft_tokens"]) == (prop, acc)
    assert pl["acceptance_rate"] == pytest.approx(acc / prop if prop else 0.0)
    assert pl["mean_accepted_len"] == pytest.approx(2 * new / fwd)


def test_bench_ratios_are_recomputed_from_its_per_prompt_figures(bench):
    spec, r = bench
    m, peers = r["methods"], r["peers"]
    base = m["baseline"]["per_prompt_tokens_per_s"]
    for name, e in m.items():
        tps = e["per_prompt_tokens_per_s"]
        assert len(tps) == 2 and min(tps) > 0
        assert e["tokens_per_s"] == pytest.approx(statistics.median(tps))
        assert e["speedup"] == pytest.approx(statistics.median([a / b for a, b in zip(tps, base)])), name
    assert m["baseline"]["speedup"] == 1.0
    hf = peers["hf_generate"]["per_prompt_tokens_per_s"]
    assert peers["hf_generate"]["tokens_per_s"] == pytest.approx(statistics.median(hf))
    assert m["baseline"]["vs_hf_generate"] == pytest.approx(statistics.median([a / h for a, h in zip(base, hf)]))
    assert m["draft_target"]["vs_hf_assisted"] == pytest.approx(
        m["draft_target"]["tokens_per_s"] / statistics.median(peers["hf_assisted"]["per_prompt_tokens_per_s"]))
    rf = r["roofline"]
    from pipeline.runtime.engine_io import load_engine

    target = load_engine(spec.engine_dir / "target").model
    weights = {id(p): p.numel() * p.element_size() for p in target.parameters()}
    assert rf["weight_bytes_read_per_token"] == sum(weights.values())  # tied embeddings: the head is the table
    assert rf["limit_tokens_per_s"] == pytest.approx(rf["bandwidth_gbs"] * 1e9 / rf["weight_bytes_read_per_token"])
    assert len(rf["bandwidth_probes_gbs"]) == len(base) + 1  # before the first prompt and after each
    assert rf["fraction_at_median_bandwidth"] == pytest.approx(m["baseline"]["tokens_per_s"] / rf["limit_tokens_per_s"])
    hot = r["temperature_0.7"]
    assert hot["baseline"]["speedup"] == 1.0
    for e in hot.values():
        assert e["speedup"] == pytest.approx(e["tokens_per_s"] / hot["baseline"]["tokens_per_s"])
    cost = r["verify_cost_ms"]
    assert [c["tokens"] for c in cost] == list(range(1, 9))
    assert "verify_cost_amx" in r and r["verify_cost_amx"] is None  # no GGUF weights here: no AMX tiles to time
    rounds = len(cost[0]["rounds_ms"])
    assert rounds == 9 and all(len(c["rounds_ms"]) == rounds for c in cost)
    for i, c in enumerate(cost):  # each round's S-token time over the same round's one-token time, the median
        assert c["relative"] == pytest.approx(statistics.median(
            [c["rounds_ms"][j] / cost[0]["rounds_ms"][j] for j in range(rounds)]))
        # ms: the best round, made non-decreasing (more tokens never cost less)
        assert c["ms"] == pytest.approx(max(min(e["rounds_ms"]) for e in cost[:i + 1]))
    for block in (r["bf16"], r["batch8"]):
        assert block["ratio"] == pytest.approx(block["baseline_tokens_per_s"] / block["hf_generate_tokens_per_s"])


def test_bench_roofline_sets_each_baseline_decode_against_the_probes_just_before_and_after_it(bench):
    _, r = bench
    rf, base = r["roofline"], r["methods"]["baseline"]["per_prompt_tokens_per_s"]
    before, after = rf["bandwidth_probes_gbs"][:-1], rf["bandwidth_after_baseline_gbs"]
    assert len(after) == len(before) == len(base) == 2
    want = statistics.median(t * rf["weight_bytes_read_per_token"] / ((a + c) / 2 * 1e9)
                             for t, a, c in zip(base, before, after))
    assert rf["fraction_of_limit"] == pytest.approx(want)


def test_bench_writes_what_it_returns(bench):
    spec, r = bench
    assert json.loads((spec.report_dir / "bench.json").read_text()) == json.loads(json.dumps(r))
    md = (spec.report_dir / "bench.md").read_text()
    dt = r["methods"]["draft_target"]
    row = f"| draft_target | {dt['tokens_per_s']:.1f} | {dt['speedup']:.2f}x | 1.00 | {dt['mean_accepted_len']:.2f} |"
    assert row in md


def test_bench_stores_the_verify_curve_where_the_suffix_drafter_reads_it(bench):
    from pipeline.runtime.decode import load_verify_cost

    spec, r = bench
    stored = json.loads((spec.engine_dir / "target" / "verify_cost.json").read_text())
    rel = [c["relative"] for c in r["verify_cost_ms"]]
    assert stored["tokens"] == [c["tokens"] for c in r["verify_cost_ms"]] and stored["relative"][0] == rel[0] == 1.0
    assert all(a <= b for a, b in zip(stored["relative"], stored["relative"][1:]))  # never cheaper with more tokens
    assert stored["relative"] == [max(rel[:i + 1]) for i in range(len(rel))]
    assert load_verify_cost(spec.engine_dir / "target") == tuple(stored["relative"])


def test_bench_md_has_the_precision_table_and_the_groups_it_ran_in(bench):
    from pipeline.bench import precision_lines

    spec, r = bench
    md = (spec.report_dir / "bench.md").read_text()
    t = r["precision"]
    assert t["groups"] and t["groups"][0][0] == t["reference"]  # every group decodes beside the reference
    for p in ("bfloat16", "int8", "int4"):
        e = t[p]
        assert f"| {p} | {e['tokens_per_s']:.1f} | {e['speedup_vs_reference']:.2f}x | " in md
    first = t[t["reference"]]  # quick mode decodes one prompt and adds none for agreement
    assert first["agreement_prompts"] == 1 and first["agreement_positions"] > 0
    assert f"agreement and log-prob over 1 prompt, {first['agreement_positions']} positions)" in md
    grouped = precision_lines({**t, "groups": [[t["reference"], "int8"], [t["reference"], "int4"]],
                               "skipped": "['gguf']: not one fits"})
    assert "each beside the reference: " + t["reference"] + ", int8; " in "\n".join(grouped)
    assert "Left out: ['gguf']: not one fits." in grouped


def test_bench_verify_floor_is_the_model_multiply_adds_at_the_measured_int8_peak(bench):
    """The floor under an 8-token verification: the target's multiply-adds per token, counted here from the
    transformers model's Linear layers and head, times 8, at the int8 peak bench measured; related to the measured
    one-token and 8-token forwards of the same report."""
    import transformers

    from pipeline.bench import verify_floor_lines
    from pipeline.runtime import kernels

    spec, r = bench
    f = r["verify_floor"]
    if not kernels.available():
        assert "torch path" in f["note"]
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(Path(spec.root) / spec.target.source)
    linear = [m for m in hf.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    macs = sum(m.in_features * m.out_features for m in linear) + hf.config.vocab_size * hf.config.hidden_size
    assert f["macs_per_token"] == macs
    cost = r["verify_cost_ms"]
    assert f["tokens"] == 8 and f["kernel_path"] == kernels.path()
    assert f["floor_ms"] == pytest.approx(1000 * 8 * macs / f["int8_macs_per_s"])
    assert f["floor_relative"] == pytest.approx(f["floor_ms"] / cost[0]["ms"])
    assert f["measured_relative"] == cost[7]["relative"]
    assert f["fraction_of_peak"] == pytest.approx(f["floor_ms"] / cost[7]["ms"])
    md = (spec.report_dir / "bench.md").read_text()
    assert verify_floor_lines(f)[0] in md and f"{f['floor_relative']:.2f} one-token steps" in md


def test_bench_asks_llama_server_each_prompt_right_after_ours(bench):
    """The GGUF peer (a stand-in here) decodes plainly between our prompts: its warm-up prompt, then each measured
    prompt once, and the report's plain figures are those runs."""
    from pipeline.sources import spec_prompts

    spec, r = bench
    texts = spec_prompts(spec, 3)
    asked = LLAMA_REQUESTS
    assert [q["prompt"] for q in asked] == texts and [q["max_tokens"] for q in asked] == [8] + [r["new_tokens"]] * 2
    plain = r["peers"]["llama_cpp_server"]["plain"]
    assert plain["interleaved"] is True and plain["per_prompt_decode_tokens_per_s"] == [100.0 + r["new_tokens"]] * 2
