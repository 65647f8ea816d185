"""bench.json's precision table on a tiny model with known answers: bytes per token from the shapes,
the reference agreeing with itself exactly, quality ordered float32 >= int8 >= int4 in log-likelihood."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.precision import (
    RESIDENT_OVER_WEIGHTS,
    group_plan,
    mem_available,
    precision_table,
    teacher_forced,
    variant,
)
from pipeline.runtime.model import ModelConfig, Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, tie_embeddings=True, max_position_embeddings=256)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(CFG).state_dict().items() if k != "lm_head.weight"}
    return {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.5 for k, s in shapes.items()}


def _linears() -> list[tuple[int, int]]:
    """(N, K) of every matmul a step reads, from the config alone (the tied head included)."""
    h, f, q, kv = CFG.hidden_size, CFG.intermediate_size, CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
    per_layer = [(q + 2 * kv, h), (h, q), (2 * f, h), (h, f)]
    return per_layer * CFG.num_layers + [(CFG.vocab_size, h)]


@pytest.fixture(scope="module")
def table():
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9)]
    return precision_table(CFG, _state(), ids, 12, bandwidth_gbs=10.0, group_size=32, log=lambda *a: None)


def test_bytes_per_token_follow_from_the_shapes(table):
    norms = 4 * CFG.hidden_size * (2 * CFG.num_layers + 1)
    lin = _linears()
    want = {
        "float32": sum(4 * n * k for n, k in lin) + norms,
        "bfloat16": sum(2 * n * k for n, k in lin) + norms,
        "int8": sum(n * k + 4 * n for n, k in lin) + norms,
        "int4": sum(n * k // 2 + 2 * n * k // 32 for n, k in lin) + norms,  # bf16 scales
    }
    want["int4_a8"] = want["int4"]  # the same weights; every width here fills whole W4A8 blocks of 16 rows
    for prec, b in want.items():
        assert table[prec]["bytes_per_token"] == b, prec


def test_roofline_fraction_is_speed_over_the_bandwidth_limit(table):
    for prec in ("float32", "bfloat16", "int8", "int4", "int4_a8"):
        e = table[prec]
        assert e["roofline_fraction"] == pytest.approx(e["tokens_per_s"] * e["bytes_per_token"] / 10e9)


def test_speed_is_decode_steps_after_the_first_token_and_end_to_end_is_kept(table):
    for prec in ("float32", "bfloat16", "int8", "int4", "int4_a8"):
        e = table[prec]
        assert e["tokens_per_s"] > 0 and e["end_to_end_tokens_per_s"] > 0
        assert e["tokens_per_s"] != e["end_to_end_tokens_per_s"]  # the prefill is out of the decode rate


def test_reference_agrees_with_itself_and_quality_degrades_with_bits(table):
    assert table["reference"] == "float32" and table["float32"]["agreement_vs_reference"] == 1.0
    lp = {p: table[p]["mean_logprob"] for p in ("float32", "bfloat16", "int8", "int4", "int4_a8")}
    assert all(v <= 0 for v in lp.values())
    # float32, bfloat16 and int8 sit within about 0.01 of each other on this tiny random model (bfloat16 above float32
    # with fp32 attention and with bf16 attention alike): the loss the table shows is int4's, tens of times larger.
    noise = 0.02
    assert lp["float32"] >= lp["int8"] - noise
    assert lp["int8"] >= lp["int4"] - noise and lp["int8"] >= lp["int4_a8"] - noise
    assert table["int8"]["agreement_vs_reference"] >= 0.5
    assert table["kernel_path"] in ("avx512+amx", "avx512", "avx2", "torch")


def test_teacher_forced_scores_match_a_direct_computation():
    model = variant(CFG, _state(), "int8", 32)
    prompt, cont = [3, 7, 11], [5, 2, 9, 9]
    agree, logp = teacher_forced(model, prompt, cont)
    seq = prompt + cont
    with torch.inference_mode():
        tot, hits = 0.0, 0
        cache = model.new_cache(1, len(seq))
        for i, t in enumerate(seq[:-1]):
            lg = model.logits(model(torch.tensor([[t]]), torch.tensor([[i]]), cache))[0, -1].double()
            if i >= len(prompt) - 1:
                nxt = seq[i + 1]
                tot += float(torch.log_softmax(lg, -1)[nxt])
                hits += int(lg.argmax()) == nxt
    assert agree == hits and math.isclose(logp, tot, rel_tol=1e-9, abs_tol=1e-9)


def test_agreement_prompts_count_toward_agreement_and_log_prob_but_not_speed():
    """`agreement_ids` add positions to agreement and log-probability (the reference's own greedy continuation of
    each, teacher-forced) and leave the speed figures to the decoded prompts: bench's 4 x 64 tokens were too few
    positions to tell 0.99 from 0.995."""
    from pipeline.runtime.generate import Request, generate

    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9)]
    more = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 4)]
    t = precision_table(CFG, _state(), ids, 12, bandwidth_gbs=10.0, group_size=32, log=lambda *a: None,
                        precisions=("float32", "int8"), agreement_ids=more)
    ref, q = variant(CFG, _state(), "float32", 32), variant(CFG, _state(), "int8", 32)
    hits = positions = 0
    logp = 0.0
    for p in ids + more:
        (res,) = generate(ref, [Request(p, 12)])
        a, lp = teacher_forced(q, p, res.tokens)
        hits, positions, logp = hits + a, positions + len(res.tokens), logp + lp
    e = t["int8"]
    assert (e["agreement_prompts"], e["agreement_positions"]) == (4, positions) and positions == 48
    assert e["agreement_vs_reference"] == hits / positions
    assert e["mean_logprob"] == pytest.approx(logp / positions, rel=1e-9)
    assert len(e["per_prompt_tokens_per_s"]) == 2 and t["prompts"] == 2
    assert t["float32"]["agreement_vs_reference"] == 1.0 and t["float32"]["agreement_positions"] == 48


def test_int4_falls_back_to_a_group_size_that_divides_the_widths():
    cfg = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=192, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=24, tie_embeddings=True, max_position_embeddings=64)
    g = torch.Generator().manual_seed(2)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items() if k != "lm_head.weight"}
    st = {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.5 for k, s in shapes.items()}
    t = precision_table(cfg, st, [[1, 2, 3]], 4, bandwidth_gbs=10.0, group_size=128, precisions=("float32", "int4"),
                        log=lambda *a: None)
    assert t["int4"]["group_size"] == 32 and "int4_skipped" not in t


def test_precisions_are_timed_round_robin_and_their_ratio_is_a_median_of_paired_prompts(table, monkeypatch):
    """Each prompt runs at every precision in turn, so drift hits all alike; the ratio pairs them up."""
    from pipeline import precision

    assert table["float32"]["speedup_vs_reference"] == 1.0
    for prec in ("bfloat16", "int8", "int4"):
        assert table[prec]["speedup_vs_reference"] > 0
    timed: list = []
    real = precision.generate

    def spy(model, reqs, **kw):
        if reqs[0].max_new_tokens == 4:  # the timed runs (warm-ups ask for 2 tokens)
            timed.append((id(model), tuple(reqs[0].prompt)))
        return real(model, reqs, **kw)

    monkeypatch.setattr(precision, "generate", spy)
    precision_table(CFG, _state(), [[1, 2, 3], [4, 5, 6, 7]], 4, bandwidth_gbs=10.0, group_size=32,
                    precisions=("float32", "int8"), log=lambda *a: None)
    assert [p for _, p in timed] == [(1, 2, 3), (1, 2, 3), (4, 5, 6, 7), (4, 5, 6, 7)]
    assert timed[0][0] == timed[2][0] != timed[1][0] == timed[3][0]  # model A, B, A, B


def test_each_decodes_roofline_uses_the_bandwidth_read_just_before_and_after_it():
    """A probe runs before each decode and after the last, so a decode is set against the memory of its own seconds."""
    readings = iter([40.0, 10.0, 30.0, 20.0, 60.0])  # decodes: (prompt 1: float32, int8), (prompt 2: float32, int8)
    t = precision_table(CFG, _state(), [[1, 2, 3], [4, 5, 6, 7]], 4, bandwidth_gbs=lambda: next(readings),
                        group_size=32, precisions=("float32", "int8"), log=lambda *a: None)
    assert t["bandwidth_probes_gbs"] == [40.0, 10.0, 30.0, 20.0, 60.0] and t["bandwidth_gbs"] == 30.0
    assert t["float32"]["per_prompt_bandwidth_gbs"] == [25.0, 25.0]
    assert t["int8"]["per_prompt_bandwidth_gbs"] == [20.0, 40.0]
    for prec in ("float32", "int8"):
        r = t[prec]
        b = r["bytes_per_token"]
        fr = [s * b / (g * 1e9) for s, g in zip(r["per_prompt_tokens_per_s"], r["per_prompt_bandwidth_gbs"])]
        assert r["roofline_fraction"] == pytest.approx(sum(fr) / 2)
        assert r["roofline_fraction_at_median_bandwidth"] == pytest.approx(r["tokens_per_s"] * b / 30e9)


def test_each_precisions_weights_on_huge_pages_are_reported():
    """A variant left on 4 KB pages reads slower for no reason the table shows; the bench names the bytes."""
    from pipeline.runtime import quant

    if quant.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {quant.thp_mode() or 'unknown'} on this kernel")
    cfg = ModelConfig(vocab_size=96, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=64, tie_embeddings=True, max_position_embeddings=64)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items() if k != "lm_head.weight"}
    st = {k: torch.ones(s) if len(s) == 1 else torch.randn(s) * 0.05 for k, s in shapes.items()}
    t = precision_table(cfg, st, [[1, 2, 3]], 2, bandwidth_gbs=10.0, group_size=128,
                        precisions=("bfloat16", "int8"), reference="bfloat16", log=lambda *a: None)
    for prec in ("bfloat16", "int8"):
        assert 2 << 20 <= t[prec]["hugepage_bytes"] <= t[prec]["bytes_per_token"] + (4 << 20), prec
    assert t["bfloat16"]["hugepage_bytes"] > t["int8"]["hugepage_bytes"]


def test_a_bfloat16_reference_keeps_its_layer_matrices_in_bfloat16_and_the_rest_in_float32():
    from pipeline.precision import narrow_layers

    st = {"embed.weight": torch.randn(8, 4), "norm.weight": torch.randn(4), "layers.0.wqkv.weight": torch.randn(12, 4),
          "layers.0.wqkv.bias": torch.randn(12), "lm_head.weight": torch.randn(8, 4)}
    want = {k: v.clone() for k, v in st.items()}
    narrow_layers(st)
    assert {k for k, v in st.items() if v.dtype == torch.bfloat16} == {"layers.0.wqkv.weight", "lm_head.weight"}
    assert torch.equal(st["layers.0.wqkv.weight"], want["layers.0.wqkv.weight"].to(torch.bfloat16))
    assert torch.equal(st["embed.weight"], want["embed.weight"]) and torch.equal(st["norm.weight"], want["norm.weight"])


def test_group_plan_fits_as_many_as_the_budget_holds_beside_the_reference():
    others = ["int8", "int4", "int4_a8", "gguf"]
    assert group_plan(others, 100, 10) == ([others], 9)  # room for all: one group, as before
    assert group_plan(others, 35, 10) == ([["int8", "int4"], ["int4_a8", "gguf"]], 2)
    assert group_plan(others, 29, 10) == ([["int8"], ["int4"], ["int4_a8"], ["gguf"]], 1)
    assert group_plan(others, 19, 10) == ([], 0)  # the reference alone fits
    assert group_plan(others, -5, 10) == ([], 0)


def test_mem_available_reads_the_kernels_figure():
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert 0 < mem_available() <= total


def _cost() -> int:
    from pipeline.runtime import quant

    return int(quant.weight_bytes(variant(CFG, _state(), "float32", 32)) * RESIDENT_OVER_WEIGHTS)


def test_a_small_memory_budget_decodes_the_precisions_in_groups_each_beside_the_reference(monkeypatch):
    """make bench on the 1.5B was killed for memory with every precision built at once: within a budget that holds
    one variant beside the reference, each decodes round-robin with the reference and its ratio pairs with those
    reference runs."""
    from pipeline import precision

    timed: list = []
    real = precision.generate

    def spy(model, reqs, **kw):
        if reqs[0].max_new_tokens == 4:
            timed.append(id(model))
        return real(model, reqs, **kw)

    monkeypatch.setattr(precision, "generate", spy)
    ids = [[1, 2, 3], [4, 5, 6, 7]]
    t = precision_table(CFG, _state(), ids, 4, bandwidth_gbs=10.0, group_size=32,
                        precisions=("float32", "int8", "int4"), log=lambda *a: None, memory_bytes=2 * _cost() + 1)
    assert t["groups"] == [["float32", "int8"], ["float32", "int4"]] and t["memory"]["per_group"] == 1
    assert len(timed) == 8 and timed[0] == timed[2] == timed[4] == timed[6]  # the reference in both groups
    assert timed[1] == timed[3] != timed[5] == timed[7] and timed[1] != timed[0]
    assert len(t["float32"]["per_prompt_tokens_per_s"]) == 2 and t["float32"]["agreement_vs_reference"] == 1.0
    for prec in ("int8", "int4"):
        assert len(t[prec]["per_prompt_tokens_per_s"]) == 2 and t[prec]["speedup_vs_reference"] > 0
    whole = precision_table(CFG, _state(), ids, 4, bandwidth_gbs=10.0, group_size=32,
                            precisions=("float32", "int8", "int4"), log=lambda *a: None, memory_bytes=10 * _cost())
    assert whole["groups"] == [["float32", "int8", "int4"]]
    for prec in ("int8", "int4"):  # greedy decoding: the same continuations, so the same quality either way
        assert whole[prec]["agreement_vs_reference"] == t[prec]["agreement_vs_reference"]
        assert whole[prec]["mean_logprob"] == pytest.approx(t[prec]["mean_logprob"], abs=1e-9)


def test_a_budget_that_holds_no_variant_keeps_the_reference_and_says_what_was_left_out():
    logs: list[str] = []
    t = precision_table(CFG, _state(), [[1, 2, 3]], 4, bandwidth_gbs=10.0, group_size=32,
                        precisions=("float32", "int8"), log=logs.append, memory_bytes=_cost() + 1)
    assert t["groups"] == [["float32"]] and "int8" not in t and t["float32"]["agreement_vs_reference"] == 1.0
    assert "int8" in t["skipped"] and "larger machine" in t["skipped"] and any("not one fits" in m for m in logs)


def test_each_precision_is_timed_at_1_to_32_token_rows_against_the_larger_of_its_two_limits(table):
    """Issue 51: the table's rows-per-step columns. Every precision has a step time per row count; each limit is
    the weights read once at the table's bandwidth or the rows' multiply-adds at the measured int8 peak."""
    from pipeline.bench import macs_per_token, precision_lines

    peak = table["int8_macs_per_s"]
    assert peak is None or peak > 0
    for prec in ("float32", "int8", "int4_a8"):
        steps = table[prec]["rows_per_step"]
        assert list(steps) == ["1", "4", "8", "16", "32"]
        for s, c in steps.items():
            bw = 1000 * table[prec]["bytes_per_token"] / (table["bandwidth_gbs"] * 1e9)
            i8 = 1000 * int(s) * macs_per_token(CFG) / peak if peak else None
            assert c["ms"] > 0 and c["bandwidth_ms"] == pytest.approx(bw) and c["int8_ms"] == pytest.approx(i8)
            assert c["of_limit"] == pytest.approx(max(bw, i8 or 0) / c["ms"])
    md = "\n".join(precision_lines(table))
    assert "Token rows per step" in md and "| 1 rows: ms (of limit) |" in md and "| 32 rows: ms (of limit) |" in md


def test_the_rows_per_step_limit_switches_from_bandwidth_to_int8_as_rows_grow():
    from pipeline.rows_per_step import limits

    # 1 GB of weights at 10 GB/s: 100 ms; 1 G multiply-adds a token at 100 G/s: 10 ms a row
    got = limits({"1": 200.0, "8": 100.0, "32": 400.0}, 1e9, 1e9, 10.0, 1e11)
    assert [got[s]["limit"] for s in ("1", "8", "32")] == ["bandwidth", "bandwidth", "int8"]
    assert [got[s]["of_limit"] for s in ("1", "8", "32")] == pytest.approx([0.5, 1.0, 0.8])
    assert limits({"4": 50.0}, 1e9, 1e9, 10.0, None)["4"] == {
        "ms": 50.0, "bandwidth_ms": 100.0, "int8_ms": None, "limit": "bandwidth", "of_limit": 2.0}
