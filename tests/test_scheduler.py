"""The served model's parser and scheduler in-process, with a fake response sender (no Triton).

Faults are injected where the server cannot be made to produce them: a row whose sampling raises, a
speculative batch that raises, a continuous-batch step that raises. Each must answer the rows it
hits with an error and leave every other row's answer equal to its solo run.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pipeline.runtime.sampling import SamplingParams
from pipeline.triton.parse import MIN_TEMPERATURE, BadRequest, Limits, RequestParser
from pipeline.triton.scheduler import QUEUED_CHECK_S, Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")
UNUSED_END = 0
PROMPTS = [f"Tell me a story about the number {i}." for i in range(6)]


class Fake:
    """A Responder that records what the scheduler sent; `cancel_after` pieces, it says the client is gone."""

    def __init__(self, cancel_after: int | None = None):
        self.pieces: list[str] = []
        self.final: list[str] | None = None
        self.results = None
        self.err: str | None = None
        self.was_cancelled = False
        self.cancel_after = cancel_after
        self.polls = 0

    def send(self, texts, results, final):
        assert self.final is None and self.err is None, "a response after the final one"
        if final:
            self.final, self.results = list(texts), results
        else:
            self.pieces += texts

    def error(self, message, cancelled=False):
        assert self.final is None and self.err is None, "an error after the final response"
        self.err, self.was_cancelled = message, cancelled

    def cancelled(self):
        self.polls += 1
        return self.cancel_after is not None and len(self.pieces) >= self.cancel_after

    @property
    def answered(self) -> bool:
        return self.final is not None or self.err is not None


class BrokenParams(SamplingParams):
    """Sampling past the parser's checks: torch.multinomial raises on the NaN probabilities, as in issue 18."""

    @property
    def greedy(self) -> bool:
        return False


@pytest.fixture(scope="module")
def bundle(tiny_engine):
    from pipeline.runtime.decode import load_bundle

    b = load_bundle(tiny_engine.parent, "cpu")
    assert b.spec.disable_at_batch == 0
    return b


@pytest.fixture(scope="module")
def parser(bundle):
    bc = bundle.config["build_config"]
    lim = Limits(max_batch_size=4, max_input_len=int(bc["max_input_len"]), max_seq_len=int(bc["max_seq_len"]),
                 vocab=int(bundle.target.cfg.vocab_size), end_ids=tuple(bundle.end_ids), methods=bundle.methods(),
                 default_method="baseline", spec=bundle.spec)
    return RequestParser(bundle.tokenizer, lim)


def _inputs(prompt: str, n: int, **opts) -> dict:
    d = {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": np.array([[n]], np.int32),
         "end_id": np.array([[UNUSED_END]], np.int32)}
    for k, v in opts.items():
        d[k] = np.array([[v.encode() if isinstance(v, str) else v]], dtype=object if isinstance(v, str) else None)
    return d


def _parse(parser, prompt: str, n: int, request_id: str = "", **opts):
    d = _inputs(prompt, n, **opts)
    return parser.parse(d.get, request_id)


def _drain(sched: Scheduler, fakes: list[Fake], limit: int = 5000) -> None:
    for _ in range(limit):
        if all(f.answered for f in fakes):
            return
        sched.tick()
    raise AssertionError("the scheduler did not answer every request")


def _solo(bundle, parser, prompt: str, n: int, **opts) -> str:
    sched, f = Scheduler(bundle, 4), Fake()
    sched.submit(_parse(parser, prompt, n, **opts), f)
    _drain(sched, [f])
    assert f.err is None, f.err
    return f.final[0]


# ---- parsing ----------------------------------------------------------------------------------------


def test_sampling_values_without_a_distribution_are_defined_or_refused(parser):
    p = lambda **o: _parse(parser, "hello", 4, **o).reqs[0].params  # noqa: E731
    assert p(temperature=np.float32(1e-38)).temperature == 0.0, "a tiny temperature is greedy"
    assert p(temperature=np.float32(MIN_TEMPERATURE * 2)).temperature > 0
    assert p(temperature=np.float32(3e38)).temperature == pytest.approx(3e38, rel=1e-6)
    assert p(top_k=np.int32(2**31 - 1)).top_k == 0, "top_k at or above the vocabulary means off"
    tiny = p(top_p=np.float32(1e-45), temperature=np.float32(1.0))
    assert tiny.top_k == 1 and tiny.top_p == 1.0, "a tiny top_p keeps the most likely token"
    for name, value, pattern in [("temperature", np.float32("nan"), "temperature: got nan"),
                                 ("temperature", np.float32("inf"), "temperature: got inf"),
                                 ("temperature", np.float32(-1), "temperature: got -1"),
                                 ("top_p", np.float32("nan"), "top_p: got nan"),
                                 ("top_k", np.int32(-3), "top_k: got -3")]:
        with pytest.raises(BadRequest, match=pattern):
            p(**{name: value})


def test_extreme_sampling_values_decode_a_proper_distribution(bundle, parser):
    from pipeline.runtime.sampling import warp

    logits = bundle.target.logits(torch.randn(1, bundle.target.cfg.hidden_size))[0] * 50
    for opts in ({"temperature": np.float32(1e-38)}, {"temperature": np.float32(3e38)},
                 {"temperature": np.float32(1.0), "top_k": np.int32(2**31 - 1)},
                 {"temperature": np.float32(1.0), "top_p": np.float32(1e-45)}):
        probs = warp(logits, _parse(parser, "hello", 4, **opts).reqs[0].params)
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-4, opts


@pytest.mark.parametrize("name, value, pattern", [
    ("beam_width", np.int32(4), r"beam_width: got 4; beam search is not implemented.*send 1"),
    ("repetition_penalty", np.float32(1.2), r"repetition_penalty: got 1.2.*send 1.0"),
    ("presence_penalty", np.float32(0.5), r"presence_penalty: got 0.5.*send 0.0"),
    ("frequency_penalty", np.float32(0.5), r"frequency_penalty: got 0.5.*send 0.0"),
    ("return_log_probs", True, r"return_log_probs: got True.*send false"),
    ("return_generation_logits", True, r"return_generation_logits: got True"),
    ("num_return_sequences", np.int32(2), r"num_return_sequences: got 2"),
    ("min_length", np.int32(8), r"min_length: got 8; a minimum length is not implemented.*send 0 or 1"),
    ("length_penalty", np.float32("inf"), r"length_penalty: got inf; must be finite"),
])
def test_nvidia_inputs_that_cannot_be_honoured_are_refused_by_name(parser, name, value, pattern):
    with pytest.raises(BadRequest, match=pattern):
        _parse(parser, "hello", 4, **{name: value})


def test_nvidia_inputs_at_their_neutral_values_are_served(parser):
    job = _parse(parser, "hello", 4, beam_width=np.int32(1), repetition_penalty=np.float32(1.0),
                 presence_penalty=np.float32(0.0), frequency_penalty=np.float32(0.0),
                 length_penalty=np.float32(1.3), return_log_probs=False, min_length=np.int32(1),
                 random_seed=np.uint64(7), return_num_output_tokens=True)
    assert job.reqs[0].params.seed == 7 and job.perf
    with pytest.raises(BadRequest, match="random_seed: got 7 next to seed 8"):
        _parse(parser, "hello", 4, random_seed=np.uint64(7), seed=np.uint64(8))


def test_batch_size_zero_and_a_stop_without_id_are_refused_in_our_words(parser):
    d = {"text_input": np.zeros((0, 1), dtype=object), "max_tokens": np.zeros((0, 1), np.int32)}
    with pytest.raises(BadRequest, match=r"text_input: batch size 0 .*accepts 1 to 4 rows"):
        parser.parse(d.get)
    with pytest.raises(BadRequest, match="stop: true needs the request_id"):
        parser.parse({"stop": np.array([[True]])}.get, "")
    assert parser.parse({"stop": np.array([[True]])}.get, "abc").stop


# ---- scheduling and faults ------------------------------------------------------------------------------


def test_plain_and_streamed_answers_equal_their_solo_runs(bundle, parser):
    prompts = [PROMPTS[0], "Explain how rain forms over the ocean.", PROMPTS[2]]  # the middle one streams text
    solo = [_solo(bundle, parser, p, 16) for p in prompts]
    sched = Scheduler(bundle, 4)
    fakes = [Fake() for _ in range(3)]
    for i, f in enumerate(fakes):
        sched.submit(_parse(parser, prompts[i], 16, stream=i == 1), f)
    _drain(sched, fakes)
    assert [f.final[0] if i != 1 else "".join(f.pieces) + f.final[0] for i, f in enumerate(fakes)] == solo
    assert len(fakes[1].pieces) > 1


class _SlowTokenizer:
    """The tiny tokenizer without its fast half (`_tokenizer`): Replies.stream decodes windows of tokens instead."""

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.mark.parametrize("incremental", [True, False])
def test_a_streamed_rows_pieces_hold_back_partial_characters_and_join_to_its_whole_text(bundle, incremental):
    from pipeline.triton.replies import Job, Replies, Row

    tok = bundle.tokenizer
    # byte-level tokens of characters the tiny tokenizer never merged: most of them end inside a character
    text = "Rain — naïve café, 中文 and 😀 emoji; then plain words again."
    ids = tok.encode(text, add_special_tokens=False)
    replies = Replies(tok if incremental else _SlowTokenizer(tok), lambda *a: None, lambda *a: None)
    f = Fake()
    job = Job(None, f)
    row = Row(job, 0)
    for i, t in enumerate(ids):
        row.tokens.append(t)
        replies.stream(job, row)
        assert (row.decoder is not False) == incremental  # the fast tokenizer steps its own decoder throughout
        assert "".join(f.pieces) == row.sent and "\ufffd" not in row.sent
        assert text.startswith(row.sent) and len(row.sent) >= len(tok.decode(ids[:i + 1])) - 1  # at most a char held
    assert row.sent == text == replies.decode_text(ids)
    assert len(f.pieces) < len(ids), "tokens that end inside a character are held, not sent as U+FFFD"


class _BrokenDecoder:
    def step(self, tokenizer, token):
        raise RuntimeError("cannot step")


def test_a_streamed_row_whose_incremental_decoder_fails_goes_on_by_the_window_and_joins_to_its_text(bundle):
    from pipeline.triton.replies import Job, Replies, Row

    tok = bundle.tokenizer
    replies, f = Replies(tok, lambda *a: None, lambda *a: None), Fake()
    job = Job(None, f)
    row = Row(job, 0)
    first, rest = tok.encode("plain words", add_special_tokens=False), tok.encode(" and more", add_special_tokens=False)
    row.tokens += first
    replies.stream(job, row)
    assert row.sent == "plain words" and row.decoder not in (None, False)
    row.decoder = _BrokenDecoder()
    for t in rest:
        row.tokens.append(t)
        replies.stream(job, row)
    assert row.decoder is False and "".join(f.pieces) == row.sent == "plain words and more"
    # an id past the vocabulary is skipped alike by both ways of decoding
    assert replies.decode_text([*first, 10**6]) == "plain words"


def _with_broken_row(job, row: int = 0):
    job.reqs[row].params = BrokenParams(temperature=float("nan"))  # logits / nan: no distribution
    return job


@pytest.mark.parametrize("method", ["baseline", "prompt_lookup"])
def test_a_failing_row_answers_itself_with_an_error_and_its_batch_mates_go_on(bundle, parser, method):
    """The issue-18 scenario in-process: one row whose distribution is broken (logits / 1e-38) in a batch of
    good streams, plain (continuous batch) or speculative (the batch fails, its rows continue one by one)."""
    solo = [_solo(bundle, parser, p, 12, method=method) for p in PROMPTS[:3]]
    counts: dict = {}
    sched = Scheduler(bundle, 4, count=lambda w, m, v: counts.__setitem__((w, m), counts.get((w, m), 0) + v),
                      log=lambda *a: None)
    fakes = [Fake() for _ in range(4)]
    for i in range(3):
        sched.submit(_parse(parser, PROMPTS[i], 12, method=method, stream=i == 0), fakes[i])
    sched.submit(_with_broken_row(_parse(parser, PROMPTS[3], 12, method=method)), fakes[3])
    _drain(sched, fakes)
    assert fakes[3].err and "decoding failed" in fakes[3].err and not fakes[3].was_cancelled
    got = ["".join(fakes[0].pieces) + fakes[0].final[0]] + [f.final[0] for f in fakes[1:3]]
    assert got == solo
    assert counts.get(("errors", method)) == 1 and counts.get(("requests", method)) == 3
    # and the scheduler keeps serving
    f = Fake()
    sched.submit(_parse(parser, PROMPTS[0], 12, method=method), f)
    _drain(sched, [f])
    assert f.final == [solo[0]]


def test_a_failed_step_answers_its_rows_with_an_error_and_serving_continues(bundle, parser, monkeypatch):
    """_abort_pool: a forward step of the continuous batch raises; every row in it gets the error (none is left
    waiting), queued requests are untouched, and the next request decodes as before."""
    want = _solo(bundle, parser, PROMPTS[0], 6)
    sched = Scheduler(bundle, 4, log=lambda *a: None)
    fakes = [Fake() for _ in range(3)]
    for i in range(2):
        sched.submit(_parse(parser, PROMPTS[i], 30), fakes[i])
    sched.tick()  # admitted, first tokens
    monkeypatch.setattr(sched.pool, "step", lambda emit=None: (_ for _ in ()).throw(RuntimeError("injected")))
    sched.submit(_parse(parser, PROMPTS[2], 30), fakes[2])
    sched.tick()  # admits the third, then the step fails
    assert all(f.err and "decoding failed: RuntimeError: injected" in f.err for f in fakes)
    assert not sched.pool.rows, "the failed batch was replaced by an empty one"
    f = Fake()
    sched.submit(_parse(parser, PROMPTS[0], 6), f)
    _drain(sched, [f])
    assert f.final == [want]


@pytest.mark.parametrize("method", ["baseline", "prompt_lookup"])
def test_a_cancelled_row_stops_within_two_steps_and_is_counted(bundle, parser, method):
    counts: dict = {}
    sched = Scheduler(bundle, 4, count=lambda w, m, v: counts.__setitem__((w, m), counts.get((w, m), 0) + v))
    keep, gone = Fake(), Fake(cancel_after=3)
    want = _solo(bundle, parser, PROMPTS[0], 40, method=method)
    sched.submit(_parse(parser, PROMPTS[0], 40, method=method), keep)
    sched.submit(_parse(parser, PROMPTS[1], 200, method=method, stream=True), gone)
    sched.cancel_check_s = 0.0  # ask at every step: the tiny model's steps take about a millisecond
    _drain(sched, [keep, gone])
    assert gone.was_cancelled and counts.get(("cancelled", method)) == 1
    assert len(gone.pieces) <= 3 + 2 * (bundle.max_draft_len + 1), "the cancelled row ran on"
    assert keep.final == [want]


def test_a_stop_request_cancels_the_request_it_names(bundle, parser):
    sched = Scheduler(bundle, 4)
    sched.cancel_check_s = 0.0
    running, stopper = Fake(), Fake()
    sched.submit(_parse(parser, PROMPTS[0], 200, request_id="r-1", stream=True), running)
    for _ in range(3):
        sched.tick()
    sched.submit(parser.parse({"stop": np.array([[True]])}.get, "r-1"), stopper)
    sched.tick()
    assert stopper.final == [] and stopper.err is None, "a stop request is answered at the next round"
    _drain(sched, [running], limit=20)
    assert running.was_cancelled and len(running.pieces) < 20


def test_queued_requests_are_polled_for_cancellation_rarely(bundle, parser):
    """Every poll is a round trip to Triton: queued requests (beyond max_batch_size) are asked every
    QUEUED_CHECK_S, not at every step, so a long queue does not slow the running batch down."""
    import time

    sched = Scheduler(bundle, 2)
    fakes = [Fake() for _ in range(10)]
    for i, f in enumerate(fakes):
        sched.submit(_parse(parser, PROMPTS[i % len(PROMPTS)], 40), f)
    t0 = time.monotonic()
    steps = 0
    while not fakes[0].answered:
        sched.tick()
        steps += 1
    elapsed = time.monotonic() - t0
    queued_polls = sum(f.polls for f in fakes[2:])
    assert queued_polls <= 8 * (elapsed / QUEUED_CHECK_S + 2), (queued_polls, steps, elapsed)
    _drain(sched, fakes)


def test_a_long_queue_is_polled_at_a_bounded_rate_in_all(bundle, parser):
    """128 queued requests are not 128 round trips a second: the queue's polls are spread to at most
    QUEUED_POLLS_PER_S in all (each request still asked at least every len(queue) / QUEUED_POLLS_PER_S s)."""
    import time

    from pipeline.triton.scheduler import QUEUED_POLLS_PER_S

    sched = Scheduler(bundle, 1)
    fakes = [Fake() for _ in range(129)]
    for i, f in enumerate(fakes):
        sched.submit(_parse(parser, PROMPTS[i % len(PROMPTS)], 200), f)
    sched.queued_check_s = 0.05  # so that the rate bound, not the per-request interval, decides here
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        sched.tick()
    elapsed = time.monotonic() - t0
    queued_polls = sum(f.polls for f in fakes[1:])
    running = elapsed / sched.cancel_check_s + 8  # the rows that got the one decoding slot are polled per step
    assert 0 < queued_polls <= QUEUED_POLLS_PER_S * elapsed + 128 + running, (queued_polls, elapsed)
    done = [f.final is not None for f in fakes]
    for f in fakes:
        f.cancel_after = 0  # every client leaves: each one still waiting is answered as cancelled
    _drain(sched, fakes)
    waiting = [f for d, f in zip(done, fakes) if not d]
    # all but the one running row (which may end before its next check) are answered as cancelled
    assert waiting and sum(f.was_cancelled for f in waiting) >= len(waiting) - 1
    assert all(f.answered for f in fakes)


def test_the_models_load_and_decode_on_one_thread_that_is_not_the_callers(bundle, parser):
    """Scheduler.on_own_thread: setup and every decoding step run on the decode thread (one thread owns all
    OpenMP teams: libgomp stops spinning between regions once two threads own teams on a small CPU), and a
    setup that fails raises on the caller's thread."""
    import threading
    import time

    seen: dict = {"decode": set()}

    def setup() -> Scheduler:
        seen["setup"] = threading.get_ident()
        return Scheduler(bundle, 4)

    hook = bundle.target.register_forward_hook(lambda *a: seen["decode"].add(threading.get_ident()))
    try:
        sched = Scheduler.on_own_thread(setup)
        f = Fake()
        sched.submit(_parse(parser, PROMPTS[0], 8), f)
        until = time.monotonic() + 60
        while not f.answered and time.monotonic() < until:
            time.sleep(0.01)
        sched.close()
    finally:
        hook.remove()
    assert f.err is None and f.final is not None
    assert seen["decode"] == {seen["setup"]} and seen["setup"] != threading.get_ident()
    assert sched.worker is not None and sched.worker.ident == seen["setup"] and not sched.worker.is_alive()

    def broken() -> Scheduler:
        raise ValueError("engine_dir does not exist")

    with pytest.raises(ValueError, match="engine_dir"):
        Scheduler.on_own_thread(broken)


# ---- warm-up --------------------------------------------------------------------------------------


def test_the_warm_up_decodes_every_method_answers_nobody_counts_nothing_and_leaves_the_scheduler_idle(bundle, parser):
    from pipeline.triton.scheduler import warmup_request

    counted = []
    sched = Scheduler(bundle, 4, count=lambda what, method, value: counted.append((what, method, value)))
    prompt, new = warmup_request(bundle, 8)
    assert 0 < len(prompt) <= int(bundle.config["build_config"]["max_input_len"]) and new == 8
    steps_before = sched.pool.model is bundle.target
    took = sched.warm_up(prompt, new, bundle.methods())
    assert set(took) == set(bundle.methods()) and all(s > 0 for s in took.values())
    assert counted == [] and not sched.waiting and sched.inbox.empty() and not sched.pool.rows and steps_before
    # and it serves as before: a greedy request after the warm-up gives the same text as on a fresh scheduler
    f = Fake()
    sched.submit(_parse(parser, "hello there", 6), f)
    _drain(sched, [f])
    assert f.err is None and f.final[0] == _solo(bundle, parser, "hello there", 6)
    assert [c for c in counted if c[0] == "requests" and c[2] > 0] == [("requests", "baseline", 1)]


def test_a_ragged_speculative_batch_reports_per_row_and_total_acceptance_it_can_have(bundle, parser):
    """Prompt-lookup rows in one batch: greedy ones and sampled ones (whose varied text gives matches of
    different lengths, or none, round by round). Accepted never exceeds drafted per row and per position, a
    greedy row's perf outputs equal its solo run's (padding is nobody's proposal), and the served totals (the
    scheduler's counters) are the sums of the rows'."""
    rows = [(PROMPTS[0], {}), (PROMPTS[1], {"temperature": np.float32(1.0), "seed": np.uint64(3)}),
            ("one two three one two three one two", {}),
            (PROMPTS[2], {"temperature": np.float32(1.0), "seed": np.uint64(4)}),
            (PROMPTS[3], {"temperature": np.float32(1.5), "seed": np.uint64(5)})]

    def run(group: list) -> tuple[list, dict]:
        counts: dict = {}
        sched = Scheduler(bundle, 8, count=lambda w, m, v: counts.__setitem__((w, m), counts.get((w, m), 0) + v))
        fakes = [Fake() for _ in group]
        for (p, opts), f in zip(group, fakes, strict=True):
            sched.submit(_parse(parser, p, 40, method="prompt_lookup", num_draft_tokens=4, return_perf_metrics=True,
                                **opts), f)
        _drain(sched, fakes)
        assert all(f.err is None for f in fakes), [f.err for f in fakes]
        return [f.results[0] for f in fakes], counts

    batch, counts = run(rows)
    for r in batch:
        assert 0 <= r.draft_accepted <= r.draft_proposed
        assert all(a <= p for a, p in zip(r.accepted_per_position, r.proposed_per_position, strict=True))
    assert len({tuple(r.proposed_per_position) for r in batch}) > 1, "the rows were not ragged"
    keys = ("tokens", "steps", "draft_proposed", "draft_accepted", "proposed_per_position", "accepted_per_position")
    for row, r in zip(rows, batch, strict=True):
        if not row[1]:
            (one,), _ = run([row])
            assert {k: getattr(r, k) for k in keys} == {k: getattr(one, k) for k in keys}
    assert counts[("proposed", "prompt_lookup")] == sum(r.draft_proposed for r in batch)
    assert counts[("accepted", "prompt_lookup")] == sum(r.draft_accepted for r in batch)
    assert 0 < counts[("accepted", "prompt_lookup")] <= counts[("proposed", "prompt_lookup")]


@pytest.mark.parametrize("method", ["baseline", "prompt_lookup"])
def test_a_repeated_prompt_reuses_the_prompt_cache_answers_the_same_and_is_counted(bundle, parser, method):
    from pipeline.runtime.prompt_cache import PromptCache

    prompt = " ".join(PROMPTS[:3])  # long enough for several 8-token blocks
    solo = _solo(bundle, parser, prompt, 10, method=method, return_perf_metrics=True)
    counts: dict = {}

    def count(what: str, m: str, v: float) -> None:  # gauges (kv_cache_*) are set, counters added to
        counts[(what, m)] = v if what.startswith("kv_cache_") else counts.get((what, m), 0) + v

    sched = Scheduler(bundle, 4, count=count)
    sched.use_prompt_cache(PromptCache(1 << 26, 8))
    try:
        fakes = [Fake(), Fake(), Fake()]
        for f, opts in zip(fakes, [{}, {}, {"cache_prompt": False}]):
            sched.submit(_parse(parser, prompt, 10, method=method, return_kv_cache_reuse_stats=True, **opts), f)
            _drain(sched, [f])
        assert [f.final[0] for f in fakes] == [solo] * 3
        first, again, off = (f.results[0] for f in fakes)
        n = first.num_input_tokens
        assert first.cached_tokens == 0 and off.cached_tokens == 0
        assert again.cached_tokens == n - 1 > 0  # all but the last prompt token
        assert counts[("kv_reused_blocks", method)] == again.cached_tokens // 8
        assert counts[("prompt_computed", method)] == 3 * n - again.cached_tokens
        assert counts[("kv_cache_bytes", "")] == sched.bundle.prompt_cache.bytes > 0
    finally:
        sched.use_prompt_cache(None)


def test_a_long_prompt_is_prefilled_in_chunks_beside_a_stream_and_can_be_cancelled_meanwhile(bundle, parser):
    """kv_cache.prefill_chunk through the scheduler: while a long prompt is pending, the running stream gets a piece
    at every tick; the long request answers as it would alone; a long request cancelled mid-prefill is answered as
    cancelled and leaves nothing in the prompt cache."""
    from pipeline.runtime.prompt_cache import PromptCache

    long_prompt = " ".join(PROMPTS[:3])
    solo_long = _solo(bundle, parser, long_prompt, 6)
    sched = Scheduler(bundle, 4)
    sched.configure_kv(0, 8)
    sched.use_prompt_cache(PromptCache(1 << 26, 8))
    try:
        stream, long_job, gone = Fake(), Fake(), Fake()
        sched.submit(_parse(parser, PROMPTS[4], 60, stream=True), stream)
        for _ in range(3):
            sched.tick()
        sched.submit(_parse(parser, long_prompt, 6), long_job)
        sched.tick()
        assert len(sched.pool.pending) == 1
        (row,) = [t for t in sched.pool.tags() if t.job.out is stream]
        while sched.pool.pending:
            before = len(row.tokens)
            sched.tick()
            assert len(row.tokens) == before + 1  # the stream flows, a token a tick, while the prompt is prefilled
        _drain(sched, [stream, long_job])
        assert long_job.final == [solo_long]
        other = " ".join(PROMPTS[3:6])
        sched.submit(_parse(parser, PROMPTS[2], 60, stream=True), Fake())
        sched.tick()
        sched.submit(_parse(parser, other, 6), gone)
        sched.tick()
        assert [p.row.tag.job.out for p in sched.pool.pending] == [gone]
        gone.cancel_after = 0  # its client leaves while its prompt is pending
        time.sleep(sched.cancel_check_s)
        sched.tick()
        assert gone.was_cancelled and not sched.pool.pending
        ids = parser.encode(other)
        assert sched.bundle.prompt_cache.cached("target", ids + [1]) < len(ids) // 2
    finally:
        sched.use_prompt_cache(None)


def test_medusa_typical_is_placed_as_medusa_under_the_load_policy(bundle):
    """`medusa_typical` (Medusa's lossy rule, validate's comparison) is no runtime method of its own: with
    `draft_length: load` the scheduler asked the runtime for it by that name, raised, and every such request went
    unanswered while the worker retried (the small spec's validate, 2026-12-06). It is placed as Medusa: plain from
    the rows where the tree its build timed is not expected to pay, speculating below them."""
    import copy
    import dataclasses

    from pipeline.runtime.medusa import make_engine
    from tests.test_medusa import random_heads

    b = copy.copy(bundle)
    b.use(dataclasses.replace(bundle.spec, draft_length="load"))
    tree = {"expected_accept_len": 2.0, "verify_cost_ms": [4.24, 4.41, 4.48, 4.9, 5.9, 7.06, 7.83], "heads_ms": 0.3}
    b.medusa = make_engine(random_heads(b.target), [[0], [1]], config={"medusa": {"tree": tree}})
    sched = Scheduler(b, 4)
    assert not sched.off("medusa_typical", 1, 0) and not sched.off("medusa", 1, 0)
    assert sched.off("medusa_typical", 2, 0) and sched.off("medusa", 3, 0)  # 1.2x at 2 rows: under MIN_GAIN_ROWS


def test_a_request_the_scheduler_cannot_place_fails_alone_and_the_others_are_answered(bundle, parser, monkeypatch):
    """Whatever goes wrong placing one waiting request (here an error injected into `Scheduler.off` for one method)
    answers that request with an error naming its method; the worker keeps serving and the other requests get the
    answers they get alone."""
    solo = _solo(bundle, parser, PROMPTS[0], 8)
    real_off = Scheduler.off

    def off(self, method, rows, disable_at_batch, resuming=False):
        if method == "prompt_lookup":
            raise RuntimeError("injected")
        return real_off(self, method, rows, disable_at_batch, resuming)

    monkeypatch.setattr(Scheduler, "off", off)
    sched, bad, good = Scheduler(bundle, 4), Fake(), Fake()
    sched.submit(_parse(parser, PROMPTS[1], 8, method="prompt_lookup"), bad)
    sched.submit(_parse(parser, PROMPTS[0], 8), good)
    _drain(sched, [bad, good], limit=200)
    assert bad.final is None and "could not schedule method 'prompt_lookup'" in bad.err and "injected" in bad.err
    assert good.err is None and good.final == [solo]
    assert not sched.waiting and not sched.pool.busy


def test_requests_go_plain_from_the_rows_where_the_load_policy_would_draft_nothing(bundle, parser):
    """With `draft_length: load`, a speculative batch at a load where the policy drafts nothing would only step
    plainly, without the continuous batch's admitting and retiring at every step: the scheduler gives such requests
    to the continuous batch instead (`Scheduler.off`), whatever disable_at_batch says, and their answers are the
    solo runs'. One row here drafts (a verify of several tokens costs what one does), two do not (it costs n times
    as much). Prompt lookup: the tiny deployment's adaptive method (no draft model; its prior is the generic one)."""
    import copy
    import dataclasses

    b = copy.copy(bundle)
    b.use(dataclasses.replace(bundle.spec, draft_length="load"))
    b.draft_config = {**(bundle.draft_config or {}), "speculation": {
        "costs_by_rows": {"1": {"c_draft": 0.001, "c_verify": [0.010] * 9},
                          "2": {"c_draft": 0.001, "c_verify": [0.020 * n for n in range(1, 10)]}},
        "table": [{"k": i + 1, "accept_pos": p} for i, p in enumerate([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])]}}
    sched = Scheduler(b, 4)
    assert not sched.off("prompt_lookup", 1, 0)
    assert sched.off("prompt_lookup", 2, 0) and sched.off("prompt_lookup", 2, None)
    assert not sched.off("baseline", 4, 0)
    assert not sched.off("prompt_lookup", 1, 0, resuming=True)  # a lone row left speculates again
    # resuming, the policy's point counts from above half of it (a band against flapping as clients come and go)
    band = Scheduler(b, 8)
    band._plain_from["prompt_lookup"] = 4
    assert not band.off("prompt_lookup", 3, 0) and band.off("prompt_lookup", 3, 0, resuming=True)
    assert not band.off("prompt_lookup", 2, 0, resuming=True)
    fixed = copy.copy(b)
    fixed.use(dataclasses.replace(bundle.spec, draft_length="fixed"))
    assert not Scheduler(fixed, 4).off("prompt_lookup", 4, 0)

    solo = [_solo(bundle, parser, p, 12) for p in PROMPTS[:2]]
    fakes = [Fake(), Fake()]
    for i in range(2):
        sched.submit(_parse(parser, PROMPTS[i], 12, method="prompt_lookup", return_perf_metrics=True), fakes[i])
    _drain(sched, fakes)
    assert [f.final[0] for f in fakes] == solo
    assert all(f.results[0].speculation_off or f.results[0].draft_proposed == 0 for f in fakes)


@pytest.mark.parametrize("new,resumed", [(20, False), (80, True)])
def test_rows_resume_speculation_only_with_tokens_enough_left_to_pay_for_it(bundle, parser, new, resumed):
    """A speculative request turned plain by a newcomer (disable_at_batch 2) speculates again once the newcomer has
    left only if it still has RESUME_MIN_LEFT tokens to go: a resume copies the rows' K/V and has the draft catch up
    on them, which the last few tokens of a request do not pay back. The answer is its solo run's either way."""
    from pipeline.triton.scheduler import RESUME_MIN_LEFT

    assert (RESUME_MIN_LEFT <= new - 8) if resumed else (new < RESUME_MIN_LEFT)
    counts: list[tuple] = []
    sched = Scheduler(bundle, 4, count=lambda what, method, value: counts.append((what, method, value)))
    want = _solo(bundle, parser, PROMPTS[0], new, method="prompt_lookup")
    a, b = Fake(), Fake()
    sched.submit(_parse(parser, PROMPTS[0], new, method="prompt_lookup", disable_at_batch=np.int32(2)), a)
    sched.submit(_parse(parser, PROMPTS[1], 3), b)
    _drain(sched, [a, b])
    assert a.final[0] == want and b.err is None
    assert any(what == "resumed" and value for what, _, value in counts) is resumed


class SlowFake(Fake):
    """A Fake whose every round trip (send, error, cancellation check) takes `delay` seconds, as Triton's IPC does;
    `fail_sends`: its sends raise, as when the client has gone."""

    def __init__(self, delay: float, fail_sends: bool = False, **kw):
        super().__init__(**kw)
        self.delay, self.fail_sends = delay, fail_sends

    def send(self, texts, results, final):
        time.sleep(self.delay)
        if self.fail_sends:
            raise RuntimeError("the client is gone")
        super().send(texts, results, final)

    def error(self, message, cancelled=False):
        time.sleep(self.delay)
        super().error(message, cancelled)

    def cancelled(self):
        time.sleep(self.delay)
        return super().cancelled()


def _drain_posted(sched: Scheduler, fakes: list[Fake], timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not all(f.answered for f in fakes):
        assert time.monotonic() - t0 < timeout, "the scheduler did not answer every request"
        sched.tick(0.001)


def test_posted_responses_arrive_in_order_and_decoding_never_waits_for_them(bundle, parser):
    """Through an Outbox, a client's slow round trips (50 ms a send or check here) leave the decode thread: the
    scheduler decodes 24 tokens of two streams, checking both clients at every step, in far less than those 48
    checks would take, and each client still gets every piece in order, then the final response, as an unposted
    run sends them."""
    from pipeline.triton.replies import Outbox, PostedResponder

    prompts = ["Explain how rain forms over the ocean.", PROMPTS[2]]  # the first streams text (others: no piece)
    ref = [Fake(), Fake()]
    sched = Scheduler(bundle, 2)
    for f, p in zip(ref, prompts):
        sched.submit(_parse(parser, p, 24, stream=True), f)
    _drain(sched, ref)

    outbox, slow = Outbox(), [SlowFake(0.05), SlowFake(0.05)]
    sched = Scheduler(bundle, 2)
    sched.cancel_check_s = 0.0  # a check at every step too: 50 ms each, were it made on the decode thread
    for f, p in zip(slow, prompts):
        sched.submit(_parse(parser, p, 24, stream=True), PostedResponder(f, outbox, gap_s=0.0))  # every piece alone
    t0 = time.monotonic()
    sched.tick()  # takes both requests in
    while sched.waiting or sched.pool.busy:
        sched.tick()
    decoding = time.monotonic() - t0
    _drain_posted(sched, slow)
    outbox.close()
    assert decoding < 0.05 * 24, decoding  # the checks alone would take 2 x 24 x 50 ms on the decode thread
    assert len(ref[0].pieces) > 1 and slow[0].pieces == ref[0].pieces  # every piece, in order
    for f, r in zip(slow, ref):
        assert f.err is None and f.final == r.final


class TimedFake(Fake):
    """A Fake that notes when each send reached it."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[float, list[str], bool]] = []

    def send(self, texts, results, final):
        self.calls.append((time.monotonic(), list(texts), final))
        super().send(texts, results, final)


def test_streamed_pieces_closer_than_the_gap_go_out_joined_in_order_and_the_final_takes_what_is_held():
    from pipeline.triton.replies import Outbox, PostedResponder

    outbox, f = Outbox(), TimedFake()
    p = PostedResponder(f, outbox, gap_s=0.5)
    for t in "abc":
        p.send([t], None, final=False)
    p.send(["d"], ["perf"], final=True)
    outbox.close()
    assert [(c[1], c[2]) for c in f.calls] == [(["a"], False), (["bcd"], True)] and f.results == ["perf"]


def test_a_held_piece_goes_out_a_gap_after_the_last_send_with_nothing_sent_after_it():
    from pipeline.triton.replies import Outbox, PostedResponder

    outbox, f = Outbox(), TimedFake()
    p = PostedResponder(f, outbox, gap_s=0.1)
    p.send(["a"], None, final=False)
    p.send(["b"], None, final=False)
    time.sleep(0.5)
    assert [c[1] for c in f.calls] == [["a"], ["b"]] and 0.09 <= f.calls[1][0] - f.calls[0][0] < 0.4
    p.send(["c"], None, final=False)  # a gap after the held one went: at once
    time.sleep(0.05)
    assert [c[1] for c in f.calls] == [["a"], ["b"], ["c"]]
    p.send([], None, final=True)  # a final without text (a row that ends on a held-back character)
    outbox.close()
    assert f.final == [] and f.pieces == ["a", "b", "c"]


def test_an_error_or_a_closing_outbox_sends_the_held_piece_first():
    from pipeline.triton.replies import Outbox, PostedResponder

    outbox, f, g = Outbox(), TimedFake(), TimedFake()
    p, q = PostedResponder(f, outbox, gap_s=5.0), PostedResponder(g, outbox, gap_s=5.0)
    for r in (p, q):
        r.send(["a"], None, final=False)
        r.send(["b"], None, final=False)
    p.error("cancelled", cancelled=True)
    outbox.close()  # q's held piece goes out now, not 5 s on
    assert f.pieces == ["a", "b"] and f.was_cancelled and g.pieces == ["a", "b"] and g.final is None


def test_streams_through_the_outbox_join_to_their_solo_text_at_the_default_gap(bundle, parser):
    from pipeline.triton.replies import Outbox, PostedResponder

    prompt = "Explain how rain forms over the ocean."
    ref = Fake()
    sched = Scheduler(bundle, 1)
    sched.submit(_parse(parser, prompt, 32, stream=True), ref)
    _drain(sched, [ref])
    outbox, f = Outbox(), TimedFake()
    sched = Scheduler(bundle, 1)
    sched.submit(_parse(parser, prompt, 32, stream=True), PostedResponder(f, outbox))
    _drain_posted(sched, [f])
    outbox.close()
    assert len(ref.pieces) > 1 and f.err is None
    assert "".join(f.pieces + f.final) == "".join(ref.pieces + ref.final)
    assert len(f.calls) < len(ref.pieces) + 1  # a tiny model's steps take ms: pieces were joined
    gaps = [b[0] - a[0] for a, b in zip(f.calls, f.calls[1:-1])]  # between pieces (the final goes when it comes)
    assert all(g >= 0.019 for g in gaps), gaps


def test_a_posted_send_that_fails_counts_as_a_client_gone_and_stops_its_row(bundle, parser):
    """A send that raises on the outbox's thread (the client left) marks its responder gone: the scheduler sees it
    at its next check and stops the row; the other request is answered in full."""
    from pipeline.triton.replies import Outbox, PostedResponder

    outbox = Outbox()
    bad, good = SlowFake(0.0, fail_sends=True), SlowFake(0.0)
    sched = Scheduler(bundle, 2)
    sched.cancel_check_s = 0.0
    posted = PostedResponder(bad, outbox)
    sched.submit(_parse(parser, "Explain how rain forms over the ocean.", 200, stream=True), posted)  # streams text
    sched.submit(_parse(parser, PROMPTS[1], 24, stream=True), PostedResponder(good, outbox))
    _drain_posted(sched, [good])
    t0 = time.monotonic()
    while sched.pool.busy or sched.waiting:
        assert time.monotonic() - t0 < 30, "the row of the client that left kept decoding"
        sched.tick(0.001)
    outbox.close()
    assert posted.gone and good.final is not None and good.err is None
    assert bad.pieces == [] and bad.final is None  # every send of the gone client failed; nothing was recorded
    assert bad.was_cancelled  # answered as cancelled (that error reached its responder)


def test_a_posted_cancellation_check_answers_at_once_and_sees_the_client_leave(bundle, parser):
    """`cancelled()` through an Outbox returns the last check's answer without waiting (a check takes 200 ms here),
    posts a check only when none is under way, and sees a client that left a check later."""
    from pipeline.triton.replies import Outbox, PostedResponder

    outbox = Outbox()
    f = SlowFake(0.2)
    p = PostedResponder(f, outbox)
    t0 = time.monotonic()
    assert not any(p.cancelled() for _ in range(5))  # the first check is still under way: no more are posted
    assert time.monotonic() - t0 < 0.1
    time.sleep(0.5)
    assert f.polls == 1
    f.cancel_after = 0  # the client leaves
    deadline = time.monotonic() + 5
    while not p.cancelled():
        assert time.monotonic() < deadline, "the posted check never came back"
        time.sleep(0.01)
    outbox.close()
    assert f.polls == 2
