"""Per-row acceptance bookkeeping when the rows of one batch draft different numbers of tokens.

Rows stop drafting at different lengths (draft_confidence cuts a row's draft at its first doubtful token;
prompt lookup proposes as many tokens as its match has; lookup rows sit beside draft rows), so a round's
draft tensor is padded past the shorter rows' drafts. Padding is never a proposal: each row's counters read
what that row proposed and accepted, and accepted never exceeds proposed, per row, per position and in the
totals a server reports.

The padding is made dangerous on purpose: with the target as its own draft, the positions past a row's cut
hold the target's own next tokens (the draft keeps stepping every row until all have stopped), so matching
them would "accept" tokens nobody proposed.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.generate import Request, generate
from pipeline.runtime.sampling import SamplingParams
from pipeline.runtime.speculative import draft_target, prompt_lookup
from tests.test_speculative import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

K, NEW, CONF = 4, 20, 0.3  # at 0.3 the tiny pair's rows stop after 1, 2, 3 or 4 drafts, round by round


@pytest.fixture(scope="module")
def pair():
    t = tiny(seed=0)
    return t, {"self": t, "noisy": tiny(base=t, noise=0.02, seed=7)}


@torch.inference_mode()
def _draft_probs(draft, ctx: list[int]) -> torch.Tensor:
    """The draft's next-token distribution after ctx, from a fresh full forward (no speculative state)."""
    h = draft(torch.tensor([ctx]), torch.arange(len(ctx))[None], draft.new_cache(1, len(ctx) + 8))
    return torch.softmax(draft.logits(h[0, -1]).float(), -1)


def confidence_replay(target, draft, prompt: list[int], k: int, conf: float, new: int) -> list[tuple[int, int]]:
    """(proposed, accepted) of each round of a greedy row, rebuilt from plain decoding: the draft proposes its
    greedy tokens until (and including) the first whose probability is below conf, at most k; the target's
    greedy continuation accepts the matching prefix; no more than the row's room (a round emits at most its drafts
    and one token, and the row at most `new`)."""
    (ref,) = generate(target, [Request(prompt, new + k + 1)])
    base, rounds, i = ref.tokens, [], 1  # prefill emitted the first token
    while i < new:
        ctx, d = prompt + base[:i], []
        for _ in range(k):
            probs = _draft_probs(draft, ctx + d)
            top = float(probs.max())
            assert abs(top - conf) > 1e-4, "a draft probability this close to the threshold makes the replay moot"
            d.append(int(probs.argmax()))
            if top < conf:
                break
        d = d[:max(0, new - i - 1)]
        n = 0
        while n < len(d) and d[n] == base[i + n]:
            n += 1
        rounds.append((len(d), n))
        i += n + 1
    return rounds


def _counters(rounds: list[tuple[int, int]], k: int) -> dict:
    return {"steps": 1 + len(rounds), "draft_proposed": sum(p for p, _ in rounds),
            "draft_accepted": sum(n for _, n in rounds),
            "proposed_per_position": [sum(p > j for p, _ in rounds) for j in range(k)],
            "accepted_per_position": [sum(n > j for _, n in rounds) for j in range(k)]}


def assert_bookkeeping_holds(results) -> None:
    """accepted <= proposed per row and per position; the per-position lists add up to the totals and only
    fall with the position (a row that reached position j+1 also reached j); a row emits at most its accepted
    drafts plus one token per step."""
    for r in results:
        assert 0 <= r.draft_accepted <= r.draft_proposed, (r.draft_accepted, r.draft_proposed)
        assert all(0 <= a <= p for a, p in zip(r.accepted_per_position, r.proposed_per_position, strict=True))
        assert sum(r.proposed_per_position) == r.draft_proposed
        assert sum(r.accepted_per_position) == r.draft_accepted
        for per in (r.proposed_per_position, r.accepted_per_position):
            assert per == sorted(per, reverse=True), per
        assert len(r.tokens) <= r.draft_accepted + r.steps
        assert 0.0 <= r.acceptance_rate <= 1.0
    assert sum(r.draft_accepted for r in results) <= sum(r.draft_proposed for r in results)


@pytest.mark.parametrize("which", ["self", "noisy"])
def test_ragged_greedy_rows_count_what_each_proposed_and_accepted(pair, which):
    """Rows cut by draft_confidence at different lengths in the same rounds: each row's counters equal its
    replay from plain decoding, and a self-draft (which agrees with the target everywhere) accepts exactly what
    it proposed, never the padding past its cut."""
    target, drafts = pair
    ps = prompts(4, 48, seed=52)
    out = draft_target(target, drafts[which], [Request(p, NEW) for p in ps], K, draft_confidence=CONF)
    replays = [confidence_replay(target, drafts[which], p, K, CONF, NEW) for p in ps]
    ragged = [r for r in range(min(map(len, replays))) if len({rounds[r][0] for rounds in replays}) > 1]
    assert ragged, "no round where the rows proposed different numbers of drafts: the test lost its point"
    for p, r, rounds in zip(ps, out, replays, strict=True):
        assert {key: getattr(r, key) for key in _counters(rounds, K)} == _counters(rounds, K), p
    assert_bookkeeping_holds(out)
    if which == "self":
        assert all(r.draft_accepted == r.draft_proposed > 0 for r in out)
        assert all(r.accepted_per_position == r.proposed_per_position for r in out)


@pytest.mark.parametrize("use_draft_logits", [True, False], ids=["leviathan", "match"])
def test_ragged_sampled_rows_never_accept_more_than_they_proposed(pair, use_draft_logits):
    """Sampled rows (Leviathan's rule with the draft's q, or matching the target's own samples) beside greedy
    ones, cut at different lengths: the bookkeeping holds per row and in total. At a low temperature a
    self-draft's samples mostly equal the target's, so a padded position matched by mistake would show."""
    target, _ = pair
    ps = prompts(6, 48, seed=53)
    reqs = [Request(p, NEW, SamplingParams(0.3, seed=i) if i % 3 else SamplingParams()) for i, p in enumerate(ps)]
    out = draft_target(target, target, reqs, K, draft_confidence=CONF, use_draft_logits=use_draft_logits)
    assert_bookkeeping_holds(out)
    assert len({tuple(r.proposed_per_position) for r in out}) > 1, "the rows were not ragged"
    assert sum(r.draft_accepted for r in out) > 0


def test_lookup_rows_beside_draft_rows_count_their_own_proposals(pair):
    """draft_target with lookup: rows whose context repeats propose the lookup's continuation (its own length),
    the others the draft's k; the widest row sets the padded width."""
    target, drafts = pair
    rep = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]  # ends in an n-gram seen before: a lookup row
    ps = [rep, [13, 14, 15], rep[:9], [20, 21, 22, 23]]
    for which in ("self", "noisy"):
        out = draft_target(target, drafts[which], [Request(p, NEW) for p in ps], 2, lookup_min_ngram=1,
                           lookup_num_tokens=5, lookup_max_ngram=3)
        assert_bookkeeping_holds(out)
        assert max(len(r.proposed_per_position) for r in out) == 5


def test_prompt_lookup_rows_with_and_without_a_match_count_only_their_own(pair):
    """Prompt lookup in one batch: rows with long, short and no matches. A row with no match proposes nothing
    that round, and its counters never show an accepted token it did not propose."""
    target, _ = pair
    rep = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]
    ps = [rep, [30, 31, 32, 33], rep[:10], [2, 3, 4, 2, 3]]
    out = prompt_lookup(target, [Request(p, NEW) for p in ps], K)
    base = generate(target, [Request(p, NEW) for p in ps])
    assert [r.tokens for r in out] == [r.tokens for r in base]
    assert_bookkeeping_holds(out)
    assert len({r.draft_proposed for r in out}) > 1, "the rows were not ragged"
