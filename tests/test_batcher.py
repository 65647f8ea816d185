"""Continuous batching: rows admitted at different steps, retired as they finish, each equal to its solo run."""

import pytest
import torch

from pipeline.runtime.batcher import ContinuousBatch
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.sampling import SamplingParams
from pipeline.runtime.specconfig import SpecDecodeConfig
from tests.test_speculative import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny(seed=0)


def _drive(pool: ContinuousBatch, arrivals: dict[int, list[tuple[int, Request]]], streamed: dict) -> dict:
    """Admit each request at its step (when rows are free, else later), step until all finish."""
    out, waiting, step = {}, [], 0
    emit = lambda tag, toks: streamed.setdefault(tag, []).extend(toks)  # noqa: E731
    while arrivals or waiting or pool.rows:
        waiting += arrivals.pop(step, [])
        while waiting and pool.free:
            tag, req = waiting.pop(0)
            out.update(pool.admit([req], [tag], emit))
        out.update(pool.step(emit))
        step += 1
    return out


def _speculative(target, method: str, emit):
    """`run(reqs, **options)` for `method` on the tiny target: a partly agreeing draft (k=3), prompt lookup, or
    random Medusa heads on a 4-node tree."""
    from pipeline.runtime.medusa import make_engine, medusa_generate
    from pipeline.runtime.speculative import draft_target, prompt_lookup
    from tests.test_medusa import random_heads

    if method == "draft_target":
        draft = tiny(base=target, noise=0.02, seed=7)
        return lambda reqs, **kw: draft_target(target, draft, reqs, 3, emit, **kw)
    if method == "prompt_lookup":
        return lambda reqs, **kw: prompt_lookup(target, reqs, 3, emit, max_ngram=2, **kw)
    if method in ("suffix", "hybrid"):  # pipeline/runtime/suffix.py through its Method, as decode runs it
        from pipeline.runtime.decode import Bundle, method_named
        from pipeline.runtime.specconfig import SpecDecodeConfig

        draft = tiny(base=target, noise=0.02, seed=7) if method == "hybrid" else None
        b = Bundle(target, None, {"build_config": {"max_draft_len": 8}}, draft,
                   spec=SpecDecodeConfig(max_draft_len=8, num_draft_tokens=3, suffix_min_match=2))
        return lambda reqs, **kw: method_named(method).run(b, reqs, 3, emit, **kw)
    engine = make_engine(random_heads(target), [[0], [1], [0, 0], [0, 0, 0]])
    return lambda reqs, **kw: medusa_generate(target, engine, reqs, emit, **kw)


def test_rows_joining_and_leaving_mid_flight_equal_their_solo_runs(target):
    ps = prompts(10, 48, seed=60)
    reqs = [Request(p, n, SamplingParams() if i % 3 else SamplingParams(0.9, seed=i), end_ids=(1,))
            for i, (p, n) in enumerate(zip(ps, [20, 5, 33, 12, 1, 40, 8, 17, 26, 3]))]
    arrivals = {0: [(0, reqs[0]), (1, reqs[1])], 2: [(2, reqs[2])], 3: [(3, reqs[3]), (4, reqs[4]), (5, reqs[5])],
                7: [(6, reqs[6]), (7, reqs[7]), (8, reqs[8]), (9, reqs[9])]}
    streamed: dict = {}
    got = _drive(ContinuousBatch(target, max_rows=4, length=64), arrivals, streamed)
    for i, req in enumerate(reqs):
        (solo,) = generate(target, [req])
        assert got[i].tokens == solo.tokens and got[i].finish_reason == solo.finish_reason, i
        assert streamed.get(i, []) == solo.tokens
        assert got[i].steps == len(solo.tokens)


def test_cache_grows_for_a_long_request_without_disturbing_running_rows(target):
    ps = prompts(2, 48, seed=61)
    short, long_ = Request(ps[0], 30), Request(ps[1], 150)
    pool = ContinuousBatch(target, max_rows=2, length=64)
    sizes = []
    step = pool.step
    pool.step = lambda emit=None: (sizes.append((pool.cache.batch, pool.cache.length)), step(emit))[1]
    got = _drive(pool, {0: [("a", short)], 4: [("b", long_)]}, {})
    assert max(s for _, s in sizes) >= len(ps[1]) + 149  # slots taken as the long row grew ...
    assert sizes[0] == (1, 64) and max(b for b, _ in sizes) == 2  # ... and rows as they joined
    assert (pool.cache.batch, pool.cache.length) == (1, 64)  # given back once the batch was empty
    assert got["a"].tokens == generate(target, [short])[0].tokens
    assert got["b"].tokens == generate(target, [long_])[0].tokens


def test_removed_rows_stop_and_the_others_run_on(target):
    ps = prompts(3, 48, seed=62)
    reqs = [Request(p, 25) for p in ps]
    pool = ContinuousBatch(target, max_rows=3, length=16)  # admit grows the cache (under inference mode)
    pool.admit(reqs, ["x", "y", "z"])
    for _ in range(5):
        pool.step()
    assert not torch.is_inference_mode_enabled()  # remove() runs outside inference mode too
    gone = pool.remove(lambda tag: tag == "x")
    assert [t for t, _ in gone] == ["x"] and len(gone[0][1].tokens) == 6
    out = {}
    while pool.rows:
        out.update(pool.step())
    assert out["y"].tokens == generate(target, [reqs[1]])[0].tokens
    assert out["z"].tokens == generate(target, [reqs[2]])[0].tokens


def test_admitting_more_rows_than_are_free_is_refused(target):
    pool = ContinuousBatch(target, max_rows=2)
    with pytest.raises(ValueError, match="3 rows do not fit: 2 of 2 are free"):
        pool.admit([Request([3, 4], 4)] * 3, [0, 1, 2])


@pytest.mark.parametrize("method", ["draft_target", "prompt_lookup", "medusa", "suffix", "hybrid"])
def test_rows_a_speculative_loop_hands_off_finish_plainly_with_their_solo_tokens(target, method):
    from pipeline.runtime.generate import Handoff
    ps = prompts(3, 48, seed=63)
    reqs = [Request(p, n, end_ids=e) for p, n, e in zip(ps, [30, 3, 40], [(), (1,), (1,)])]
    calls = []
    yield_to = lambda: calls.append(1) or len(calls) > 3  # noqa: E731 - three rounds, then the server is busy
    streamed: dict = {}
    emit = lambda tag, toks: streamed.setdefault(tag, []).extend(toks)  # noqa: E731
    out = _speculative(target, method, emit)(reqs, yield_to=yield_to)
    handed = {b: h for b, h in enumerate(out) if isinstance(h, Handoff)}
    assert sorted(handed) == [0, 2] and not isinstance(out[1], Handoff)
    assert all(h.stats["steps"] == 4 for h in handed.values())  # prefill + three rounds
    pool = ContinuousBatch(target, max_rows=3, length=16)  # too short: adopting grows it
    extra = Request(ps[1], 12)
    got = dict(pool.admit([extra], ["new"], emit))
    at = {b: len(h.seq.tokens) for b, h in handed.items()}
    pool.adopt(list(handed.values()), list(handed))
    got.update({b: r for b, r in enumerate(out) if b not in handed})
    while pool.rows:
        got.update(pool.step(emit))
    for b, req in enumerate(reqs):
        (solo,) = generate(target, [req])
        assert got[b].tokens == solo.tokens and got[b].finish_reason == solo.finish_reason, b
        assert streamed[b] == solo.tokens
    for b, h in handed.items():
        assert got[b].steps == 4 + len(got[b].tokens) - at[b]  # the plain steps add one each
        assert got[b].draft_proposed == h.stats["draft_proposed"]  # the speculative part's statistics are kept
    if method not in ("prompt_lookup", "suffix"):  # the model-free drafters may find no match in random prompts
        assert all(h.stats["draft_proposed"] > 0 for h in handed.values())
    assert got["new"].tokens == generate(target, [extra])[0].tokens


@pytest.mark.parametrize("method", ["draft_target", "prompt_lookup", "medusa", "suffix", "hybrid"])
def test_rows_go_speculative_plain_and_speculative_again_with_their_solo_tokens(target, method):
    """Speculation switched off (handoff into the continuous batch) and back on (release, resume) mid-request."""
    from pipeline.runtime.generate import Handoff

    ps = prompts(2, 48, seed=64)
    reqs = [Request(p, n) for p, n in zip(ps, [45, 38])]
    streamed: dict = {}
    emit = lambda tag, toks: streamed.setdefault(tag, []).extend(toks)  # noqa: E731
    run = _speculative(target, method, emit)
    calls = []
    out = run(reqs, yield_to=lambda: calls.append(1) or len(calls) > 2)
    assert all(isinstance(h, Handoff) for h in out)
    pool = ContinuousBatch(target, max_rows=3, length=32)
    pool.adopt(out, [0, 1])
    for _ in range(6):
        pool.step(emit)
    back = pool.release(lambda tag: True)
    assert [t for t, _ in back] == [0, 1] and not pool.rows
    before = [h.stats["draft_proposed"] for _, h in back]
    done = run([h.seq.req for _, h in back], resume=[h for _, h in back])
    for b, req in enumerate(reqs):
        (solo,) = generate(target, [req])
        assert done[b].tokens == solo.tokens and streamed[b] == solo.tokens, b
        assert done[b].steps >= 3 + 6 + 1 and done[b].draft_proposed >= before[b]
    if method != "prompt_lookup":
        assert all(d.draft_proposed > p for d, p in zip(done, before))  # it speculated again


def test_resume_is_refused_where_it_cannot_continue_the_rows(target):
    from pipeline.runtime.decode import Bundle, decode

    b = Bundle(target, None, {"build_config": {"max_draft_len": 4}},
               spec=SpecDecodeConfig(max_draft_len=4, disable_at_batch=1))
    with pytest.raises(ValueError, match="resume: 'baseline' cannot continue handed-off rows"):
        decode(b, "baseline", [Request([3, 4], 4)], resume=[object()])
    with pytest.raises(ValueError, match="resume: 'prompt_lookup' cannot continue"):
        decode(b, "prompt_lookup", [Request([3, 4], 4)], resume=[object()])  # at disable_at_batch


@pytest.mark.parametrize("method", ["draft_target", "prompt_lookup", "medusa"])
def test_a_speculative_batch_reports_each_row_as_it_finishes(target, method):
    """on_finish hears of a short row while its long batch-mate still runs, once, with the Result the batch
    returns at the end (a server answers it then, not when the batch ends)."""
    ps = prompts(3, 48, seed=65)
    reqs = [Request(p, n) for p, n in zip(ps, [40, 4, 1])]
    events: list = []
    emit = lambda b, toks: events.append(("emit", b, len(toks)))  # noqa: E731
    on_finish = lambda b, r: events.append(("finish", b, list(r.tokens), r.draft_proposed))  # noqa: E731
    out = _speculative(target, method, emit)(reqs, on_finish=on_finish)
    finished = [e for e in events if e[0] == "finish"]
    assert sorted(e[1] for e in finished) == [0, 1, 2]
    for _, b, toks, proposed in finished:
        assert toks == out[b].tokens and proposed == out[b].draft_proposed
    order = [e[:2] for e in events]
    assert order.index(("finish", 2)) < order.index(("finish", 1)) < order.index(("finish", 0))
    assert any(e[:2] == ("emit", 0) for e in events[order.index(("finish", 1)) + 1:])  # row 0 ran on after


def test_a_resumed_draft_keeps_its_cache_and_feeds_only_the_tokens_decoded_plainly(target):
    """The draft's K/V travel with a handoff: after resume its first forward covers the few tokens decoded
    plainly meanwhile, not the whole context; a request that joined through the continuous batch gets its
    own draft prefill (batch 1, not padding the others); and a draft identical to the target still has every
    token accepted (the carried and prefilled K/V are right)."""
    from pipeline.runtime.speculative import draft_target

    draft = tiny(base=target, noise=0.0)
    fed: list = []
    draft.register_forward_hook(lambda m, args, out: fed.append(tuple(args[0].shape)))
    reqs = [Request(p, n) for p, n in zip(prompts(3, 48, seed=66, lo=40, hi=48), [40, 36, 20])]
    calls = []
    out = draft_target(target, draft, reqs[:2], 3, yield_to=lambda: calls.append(1) or len(calls) > 2)
    pool = ContinuousBatch(target, max_rows=3, length=32)
    pool.adopt(out, [0, 1])
    pool.admit([reqs[2]], [2])
    for _ in range(5):
        pool.step()
    back = pool.release(lambda tag: True)
    fed.clear()
    done = draft_target(target, draft, [h.seq.req for _, h in back], 3, resume=[h for _, h in back])
    joined = back[2][1].cur
    assert fed[0] == (1, joined) and joined >= 40  # the joined request's own draft prefill
    assert fed[1][1] <= 4 + 5 + 1  # then last round's accepted tokens + 5 plain ones + the pending one
    for b, req in enumerate(reqs):
        assert done[b].tokens == generate(target, [req])[0].tokens
        assert done[b].draft_accepted == done[b].draft_proposed > (out[b].stats["draft_proposed"] if b < 2 else 0)


def test_a_long_prompt_admitted_beside_running_rows_is_prefilled_a_chunk_per_step_and_answers_the_same(target):
    from pipeline.runtime.prompt_cache import PromptCache

    short, long_ = prompts(1, 48, seed=70, lo=4, hi=5)[0], prompts(1, 48, seed=71, lo=41, hi=42)[0]
    reqs = {"a": Request(short, 30), "b": Request(long_, 12, SamplingParams(0.9, seed=3))}
    pc = PromptCache(1 << 26, 8)
    pool = ContinuousBatch(target, max_rows=2, length=64, prompt_cache=pc, prefill_chunk=8)
    streamed: dict = {}
    emit = lambda tag, toks: streamed.setdefault(tag, []).extend(toks)  # noqa: E731
    out = dict(pool.admit([reqs["a"]], ["a"], emit))
    out.update(pool.step(emit))
    assert pool.admit([reqs["b"]], ["b"], emit) == [] and len(pool.pending) == 1 and pool.free == 0
    a_before = len(streamed["a"])
    for i in range(6):  # 41 tokens in chunks of 8: six steps, and the running row steps at each
        assert "b" not in streamed and pc.cached("target", long_) == 0  # nothing of b before its prefill is whole
        out.update(pool.step(emit))
        assert len(streamed["a"]) == a_before + i + 1
    assert not pool.pending and streamed["b"]  # joined at the sixth chunk with its first token
    assert pc.cached("target", long_ + [1]) == len(long_)
    while pool.busy:
        out.update(pool.step(emit))
    for tag, req in reqs.items():
        assert out[tag].tokens == generate(target, [req])[0].tokens == streamed[tag], tag


def test_a_pending_prompt_runs_its_rest_at_once_when_no_row_decodes_beside_it(target):
    short, long_ = prompts(1, 48, seed=75, lo=4, hi=5)[0], prompts(1, 48, seed=76, lo=41, hi=42)[0]
    pool = ContinuousBatch(target, max_rows=2, length=64, prefill_chunk=8)
    pool.admit([Request(short, 2)], ["a"])  # one more token, then it finishes
    pool.admit([Request(long_, 5)], ["b"])
    done = dict(pool.step())  # a chunk of b, then a's last token: a leaves
    assert "a" in done and pool.pending[0].done == 8
    pool.step()  # nothing decodes beside b: its 33 other tokens run now and it joins
    assert not pool.pending and len(pool.rows) == 1
    while pool.busy:
        done.update(pool.step())
    assert done["b"].tokens == generate(target, [Request(long_, 5)])[0].tokens


def test_a_cancelled_pending_prompt_leaves_no_cache_entry_and_frees_its_row(target):
    from pipeline.runtime.prompt_cache import PromptCache

    pc = PromptCache(1 << 26, 8)
    pool = ContinuousBatch(target, max_rows=2, length=64, prompt_cache=pc, prefill_chunk=8)
    pool.admit([Request(prompts(1, 48, seed=72, lo=4, hi=5)[0], 30)], ["a"])
    b = prompts(1, 48, seed=73, lo=41, hi=42)[0]
    pool.admit([Request(b, 8)], ["b"])
    pool.step()
    gone = pool.remove(lambda tag: tag == "b")
    assert [t for t, _ in gone] == ["b"] and not pool.pending and pool.free == 1
    while pool.busy:
        pool.step()
    assert pc.cached("target", b) == 0 and len(pc) > 0  # a's prompt and answer were kept; b left nothing


def test_the_batch_admits_by_kv_bytes_and_a_request_alone_always_runs(target):
    ps = prompts(3, 48, seed=74, lo=30, hi=31)
    pool = ContinuousBatch(target, max_rows=4, length=64)
    pool.kv_bytes = 2 * 64 * pool.token_bytes()  # two rows of 64 slots
    assert pool.fits([Request(ps[0], 4)] * 3)  # empty: anything runs
    pool.admit([Request(ps[0], 20)], ["x"])
    assert pool.fits([Request(ps[1], 20)]) and not pool.fits([Request(ps[1], 20)] * 2)
    assert not pool.fits([Request(ps[1] * 3, 20)])  # a 90-token prompt needs 92 slots a row


@pytest.mark.parametrize("cached", [True, False])
def test_rows_growing_past_the_kv_budget_step_out_and_rejoin_with_the_same_answers(target, cached):
    """kv_cache.bytes is a bound on what the rows hold, not only on admission: before the rows would grow past it,
    the youngest step out (their K/V into the prompt cache, when there is one) and rejoin once rows finish; their
    tokens, greedy and sampled, are those of their solo runs."""
    from pipeline.runtime.prompt_cache import PromptCache

    ps = prompts(3, 48, seed=77, lo=10, hi=14)
    reqs = [Request(p, n, SamplingParams() if i != 1 else SamplingParams(0.9, seed=5), end_ids=())
            for i, (p, n) in enumerate(zip(ps, [60, 90, 40]))]
    pool = ContinuousBatch(target, max_rows=3, length=64, prompt_cache=PromptCache(1 << 26, 8) if cached else None)
    pool.kv_bytes = 2 * 64 * pool.token_bytes()  # two rows of 64 slots
    out = dict(pool.admit(reqs, [0, 1, 2]))  # admitted together, past the budget: the first step parks one
    parked = 0
    while pool.busy:
        out.update(pool.step())
        parked += any(p.parked for p in pool.pending)
        assert pool.cache.nbytes <= pool.kv_bytes or len(pool.rows) == 1
    assert parked > 0  # rows did step out
    for i, req in enumerate(reqs):
        assert out[i].tokens == generate(target, [req])[0].tokens, i
