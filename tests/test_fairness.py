"""Fair under load (issue 51): the served scheduler in-process with fake responders (tests/test_scheduler.py's). A long
speculative generation does not make short requests of another kind wait for its end, and a burst of long prompts
joins a running speculative stream without stalling it."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.triton.scheduler import Scheduler
from tests import test_scheduler
from tests.test_scheduler import PROMPTS, Fake, _drain, _parse, _solo

bundle, parser = test_scheduler.bundle, test_scheduler.parser  # its fixtures: the tiny engine and its parser

pytestmark = pytest.mark.usefixtures("one_thread")


class Trigger(Fake):
    """A streamed answer that, on its `after`-th piece, calls `then()` (requests arriving mid-generation) and notes
    the order in which answers end."""

    def __init__(self, after: int, then, order: list):
        super().__init__()
        self.after, self.then, self.order, self.fired = after, then, order, False

    def send(self, texts, results, final):
        super().send(texts, results, final)
        if final:
            self.order.append(self)
        if not self.fired and len(self.pieces) >= self.after:
            self.fired = True
            self.then()


class Noted(Fake):
    def __init__(self, order: list):
        super().__init__()
        self.order = order

    def send(self, texts, results, final):
        super().send(texts, results, final)
        if final:
            self.order.append(self)


@pytest.mark.parametrize("other", [{"method": "baseline"}, {"method": "prompt_lookup", "num_draft_tokens": 1}])
def test_a_long_speculative_generation_does_not_make_a_short_request_of_another_kind_wait(bundle, parser, other):
    opts = {k: (np.int32(v) if isinstance(v, int) else v) for k, v in other.items()}
    want_long = _solo(bundle, parser, PROMPTS[0], 120, method="prompt_lookup")
    want_short = _solo(bundle, parser, PROMPTS[1], 4, **opts)
    sched, order = Scheduler(bundle, 4), []
    short = Noted(order)
    long = Trigger(3, lambda: sched.submit(_parse(parser, PROMPTS[1], 4, **opts), short), order)
    sched.submit(_parse(parser, PROMPTS[0], 120, method="prompt_lookup", stream=True), long)
    _drain(sched, [long, short])
    assert long.err is None and short.err is None
    assert order == [short, long]  # the 4-token request ends first, not after the 120-token one
    assert short.final == [want_short] and "".join(long.pieces) == want_long


def test_a_burst_of_long_prompts_joins_a_running_stream_in_chunks_without_stalling_it(bundle, parser):
    long_prompt = " ".join(PROMPTS[:3])
    want = _solo(bundle, parser, long_prompt, 6, method="prompt_lookup")
    want_stream = _solo(bundle, parser, PROMPTS[4], 80, method="prompt_lookup")
    sched, order = Scheduler(bundle, 4), []
    sched.configure_kv(0, 8)
    burst = [Noted(order) for _ in range(3)]

    def arrive():
        for f in burst:
            sched.submit(_parse(parser, long_prompt, 6, method="prompt_lookup"), f)

    stream = Trigger(3, arrive, order)
    sched.submit(_parse(parser, PROMPTS[4], 80, method="prompt_lookup", stream=True), stream)
    pending_ticks = 0
    while not stream.fired:
        sched.tick()
    for _ in range(5000):
        if all(f.answered for f in [stream, *burst]):
            break
        before, was_pending = len(stream.pieces), bool(sched.pool.pending)
        sched.tick()
        if was_pending:
            pending_ticks += 1
            assert len(stream.pieces) > before  # the stream flows while the burst's prompts are prefilled
    assert pending_ticks >= 2  # the burst was prefilled in chunks beside the stream, not in one stall
    assert [f.final for f in burst] == [[want]] * 3 and "".join(stream.pieces) == want_stream
