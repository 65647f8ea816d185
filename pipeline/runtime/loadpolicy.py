"""Draft length chosen per round from the load: how many tokens each row of a speculative batch drafts.

A fixed k pays for one user and loses under load: the target's step of a few rows is still bound by memory, so a
short draft per row still pays at 2-8 rows, while k = 6 for every row does not. Each round `DraftPolicy` picks, for
the rows in the batch, the draft lengths (0 included: a plain step) that maximise the batch's expected tokens per
second:

    E(ks) = sum over unfinished rows b of 1 + sum_{i < k_b} P_b(first i+1 drafts accepted)
    T(ks) = w * c_draft(B) + c_verify(B, w + 1),  w = max(ks), B = the rows of the batch

with P_b each row's running acceptance (its own accepted/proposed per position so far, starting from the measured
rates of pick-k as a prior worth `PRIOR_WEIGHT` rounds) and the costs measured by pick-k at 1, 2, 4, 8 rows
(`costs_by_rows`, stored in the draft engine's config next to the measured k). Verification is padded to the widest
row and every row of the batch (finished ones too) takes part in both forwards, so the cost depends on (B, w);
rows then differ only where a row's own draft cannot pay: its budget of new tokens ends sooner (it drafts at most
what it can still emit, less the bonus token). It is one function the shared loop (`speculative.speculate`) calls
between rounds, so it applies to every drafter that runs through that loop. `speculation.disable_at_batch` stays
as an override: at that many rows the request decodes plainly without asking the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A round drafts only when the model expects at least this much over a plain step. The model leaves out what a round
# costs beside the draft steps and the verify (the draft's catch-up on the tokens it has not seen, its prefill, the
# round's bookkeeping over every row): on the flagship at 4 rows it expected width 1 at 1.16x plain while the served
# default ran 0.88x baseline (16 requests x 3, closed loop, 2026-12-04), and at 1-2 rows it expects 1.8-2.2x.
MIN_GAIN = 1.2
# At two rows and more the model's miss is larger: what it leaves out grows with the rows (each request's draft
# prefill, the catch-up at every admission and hand-off, finished rows padded into both forwards), and its stored
# costs are one snapshot of a machine whose plain step moves between about 24 and 32 ms within minutes while the
# compute-bound multi-token verify moves less. On the flagship the model expected 1.7x at 2 rows (width 2) where
# closed-loop clients measured 0.82-0.97x baseline (32-128 tokens, in process, 2026-12-04; 1.0x with plain steps)
# and validate's curve read 0.81x at 2 clients; at 1 row it expects 2.2x where 1.3-1.5x is measured. So from two
# rows a width must expect MIN_GAIN_ROWS times a plain step's tokens/s.
MIN_GAIN_ROWS = 1.8
PRIOR_WEIGHT = 4  # rounds of pick-k's measured acceptance a row starts from before its own counts take over
# Each round a row steps plainly, the counts it has so far weigh this much less against the prior (what it drafts
# afterwards counts in full). Without it a plain row was plain for good: it proposes nothing, so its counts never
# move again, and a row whose first few drafts missed (4 misses at the first position from the flagship's prior 0.88)
# decoded its whole answer plainly however predictable the rest was. With it the row drafts again after a few plain
# rounds, a probe of at most PROBE_WIDTH drafts, and after ever more plain rounds while its probes keep missing.
IDLE_DECAY = 0.95
PROBE_WIDTH = 1  # a row that stepped plainly last round drafts at most this many: a missed probe costs little
# ... unless that many can never pay: where a 2-token verify costs much more than a plain step, one draft at the
# prior's rate expects less than MIN_GAIN, and a row that went plain never probed again. On a 2-core Zen 3 (AVX2) a
# 2-token verify cost 1.30 one-token steps, one draft at the prior's 0.851 expected 1.18x, and the served draft_target
# stepped plainly for most of 5 of validate's 8 answers, which fixed drafts of 2-4 ran at 1.19-1.51x the baseline
# (in process; experiments/policy_replay.py replays it). The probe is then the narrowest width that pays at the
# prior (`probe_width`), by PROBE_SLACK more than the margin: a row that went plain comes back to the prior's rates
# only as its counts fade, from below, so a width that pays just at the prior waits long (stored costs from a slow
# minute of the same Zen 3, where one draft expected 1.22x: one tuning prompt of 12 stayed plain, 1.03x plain steps
# in the replay, 1.48x with probes of two).
PROBE_SLACK = 1.05
# One row whose drafter stops at its first doubted token (draft_confidence): the widest width that expects within this
# fraction of the best width's rate is taken. The model charges a width w drafts and a (w + 1)-token verify, but such
# a round drafts only as far as the draft is sure, and the rates are per position averages that miss how acceptance
# comes in runs (a predictable stretch is predictable deep): replayed on the flagship's recorded draft runs
# (experiments/policy_replay.py, validate's 8 prompts and 12 tuning prompts), at Zen 4-like costs the policy ran
# 1.79x plain steps where drafting k = 6 every round ran 1.89-1.95x, and with this 1.87-1.88x; at Zen 3's stored
# costs 1.25-1.30x, with it 1.29-1.31x (a fixed k 1.35-1.38x). A row the draft never predicts: 0.89-0.90x plain
# steps, as without it.
WIDER_WITHIN = 0.05
# ... and such a row drafts where a width expects MIN_GAIN_CONFIDENT times a plain step's rate, not MIN_GAIN: the model
# charges every round its full width where the confidence stop drafts less when the draft is unsure, so it
# underrates such a drafter. On a 2-core Zen 3 in its fast memory minutes (run zg3, 2026-12-07) pick-k's best width
# expected 1.19x, under MIN_GAIN, and the served draft_target stepped plainly through all 8 of validate's answers
# (1.57x llama-server plain against the baseline's 1.51x); replayed on zg2's stored costs (same CPU), k = 6 with the
# stop ran 1.44-1.48x plain steps where the model expected 1.24x for k = 6 (experiments/serving_log.md); in process
# on zg3's engines draft_target ran 0.988x the baseline with MIN_GAIN and 1.231x with this margin.
MIN_GAIN_CONFIDENT = 1.1
FALLBACK_RATES = (0.7, 0.5, 0.35, 0.25, 0.18, 0.13, 0.09, 0.07)  # prior when nothing was measured (no pick-k run)
ROWS_MEASURED = (1, 2, 4, 8)  # batch sizes pick-k times (`speedpick.measure_costs_by_rows`)


def _interp(points: dict[int, float], x: int) -> float:
    """Piecewise linear in x through the measured points; beyond the largest, linear from the origin (the step
    grows with the rows as the work does)."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return points[a] + (points[b] - points[a]) * (x - a) / (b - a)
    return points[xs[-1]] * x / xs[-1]


@dataclass(frozen=True)
class Costs:
    """Seconds one round costs on this machine: a draft step of `rows` rows, and a target verify of n tokens per row
    (n = 1: a plain step), by rows in the batch. Read from the draft engine's stored `speculation` block."""

    c_draft: dict[int, float]  # rows -> seconds of one draft step
    c_verify: dict[int, list[float]]  # rows -> seconds of one verify of n = 1.. tokens per row

    def draft(self, rows: int) -> float:
        return _interp(self.c_draft, rows)

    def verify(self, rows: int, n: int) -> float:
        per = {r: (c[n - 1] if n <= len(c) else c[-1] * n / len(c)) for r, c in self.c_verify.items()}
        return _interp(per, rows)

    @classmethod
    def from_stored(cls, speculation: dict | None) -> Costs | None:
        """`costs_by_rows` when pick-k measured them; else the one-row curve read as a model of rows (a step of B
        rows of n tokens costs what one row of B*n tokens does: one read of the weights, the work of B*n tokens);
        None when nothing was measured."""
        sp = speculation or {}
        by = sp.get("costs_by_rows")
        if by:
            return cls({int(r): float(c["c_draft"]) for r, c in by.items()},
                       {int(r): [float(x) for x in c["c_verify"]] for r, c in by.items()})
        one = sp.get("costs_s")
        if not one or not one.get("c_verify"):
            return None
        cv = [float(x) for x in one["c_verify"]]

        def tokens(t: int) -> float:
            return cv[t - 1] if t <= len(cv) else cv[-1] * t / len(cv)

        width = len(cv)
        rows = sorted({1, *ROWS_MEASURED, 16, 32})
        return cls({r: float(one["c_draft"]) * tokens(r) / cv[0] for r in rows},
                   {r: [tokens(r * n) for n in range(1, width + 1)] for r in rows})


def row_rates(prior: list[float], accepted: list[int], proposed: list[int], k: int) -> list[float]:
    """P(the first i+1 drafts are accepted) for i < k for one row: the product of its rates at each position given
    the ones before, each its own (accepted at i over tried at i: proposed there with the first i accepted) blended
    with the prior's (P_i / P_(i-1)) worth `PRIOR_WEIGHT` rounds. A position the row has not reached takes the prior's
    rate there on top of the row's own so far: a row that accepts every draft is expected to go on deeper than the
    prior's average row (blended position by position, a row taking all its drafts of 4 kept drafting 4 where k was 6:
    its 5th position stayed at the prior's 0.5 for want of a round that drafted it)."""
    out, last, p_before, acc_before = [], 1.0, 1.0, 0.0
    for i in range(k):
        p = prior[i] if i < len(prior) else (prior[-1] if prior else 0.0)
        given = min(1.0, p / p_before) if p_before > 0 else 0.0
        a = accepted[i] if i < len(accepted) else 0
        n = proposed[i] if i < len(proposed) else 0
        tried = n if i == 0 else min(n, acc_before)
        last *= min(1.0, (a + PRIOR_WEIGHT * given) / (tried + PRIOR_WEIGHT))
        out.append(last)
        p_before, acc_before = p, a
    return out


def choose(rates: list[list[float] | None], remaining: list[int], k_max: int, costs: Costs,
           rows: int | None = None, gain: float | None = None, wider: float = 0.0) -> tuple[list[int], float]:
    """Per-row draft lengths for one round and the expected tokens/s they give. `rates[b]` is row b's acceptance
    by position (None: the row is finished), `remaining[b]` the tokens it may still emit, `rows` the batch's
    physical rows (default len(rates)). Ties go to the shorter draft, and a width that drafts must expect `gain`
    times the plain step's rate (default `MIN_GAIN`, `MIN_GAIN_ROWS` from two rows). `wider` > 0: where the best
    width drafts, the widest that expects within that fraction of its rate is taken instead (`WIDER_WITHIN`)."""
    B = rows or len(rates)
    best: tuple[float, int, list[int]] = (-1.0, 0, [0] * len(rates))
    plain = sum(1.0 for r in rates if r is not None) / costs.verify(B, 1)
    gain = (MIN_GAIN if B < 2 else MIN_GAIN_ROWS) if gain is None else gain
    drafting: list[tuple[float, int, list[int]]] = []
    for w in range(k_max + 1):
        ks = [0 if r is None else max(0, min(w, rem - 1)) for r, rem in zip(rates, remaining)]
        top = max(ks, default=0)
        if top < w:
            continue  # no row can use this width: the same as a narrower one
        e = sum(1.0 + sum(r[:kb]) for r, kb in zip(rates, ks) if r is not None)
        t = top * costs.draft(B) + costs.verify(B, top + 1)
        rate = e / t
        if top and rate < gain * plain:
            continue
        if top and wider > 0:
            drafting.append((rate, w, ks))
        if rate > best[0] * (1 + 1e-9):
            best = (rate, w, ks)
    if wider > 0 and best[1]:
        best = max((c for c in drafting if c[0] >= (1 - wider) * best[0]), key=lambda c: c[1])
    return best[2], best[0]


def probe_width(costs: Costs, prior: list[float], k_max: int, margin: float = MIN_GAIN) -> int:
    """How many drafts a row that stepped plainly may probe with: the narrowest width from PROBE_WIDTH up that
    `choose` drafts at one row at the prior's rates by PROBE_SLACK times `margin` (the lone row's: MIN_GAIN, or
    MIN_GAIN_CONFIDENT), else by `margin`, else PROBE_WIDTH (nothing pays: the policy drafts nothing from its prior,
    `plain_from`)."""
    rates = row_rates(prior, [], [], k_max)
    for gain in (margin * PROBE_SLACK, margin):
        for w in range(PROBE_WIDTH, k_max + 1):
            ks, _ = choose([rates], [w + 1], k_max, costs, gain=gain)
            if ks[0]:
                return ks[0]
    return PROBE_WIDTH


@dataclass
class DraftPolicy:
    """The per-round choice for one speculative batch (`speculate(..., policy=)`): `lengths` is called between
    rounds with each row's state; `decisions` counts the widths it chose (reported in the results' stats)."""

    costs: Costs
    k_max: int
    prior: list[float]
    decisions: dict[int, int] = field(default_factory=dict)
    widths: dict[int, int] = field(default_factory=dict)  # batch row -> the draft length it was given last round
    # per batch row: its counts (accepted, proposed per position) as last seen, and as the policy weighs them
    seen: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    weighed: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    probe: int = 0  # drafts a row that stepped plainly may probe with (`probe_width`; 0: from the costs and prior)
    stops_early: bool = False  # the drafter stops a row at its first doubted token (draft_confidence): WIDER_WITHIN

    def __post_init__(self) -> None:
        if self.probe < 1:
            self.probe = probe_width(self.costs, self.prior, self.k_max, self.margin(1))

    def margin(self, rows: int) -> float:
        """What a width must expect over a plain step's rate at `rows` rows: MIN_GAIN_CONFIDENT for a lone row whose
        drafter stops on its confidence, else MIN_GAIN at one row and MIN_GAIN_ROWS from two."""
        if rows >= 2:
            return MIN_GAIN_ROWS
        return MIN_GAIN_CONFIDENT if self.stops_early else MIN_GAIN

    def _weigh(self, b: int, acc: list[int], prop: list[int]) -> tuple[list[float], list[float]]:
        """Row b's counts as the policy weighs them: at each position it was not given a draft for last round they
        fade by IDLE_DECAY, and what it counted since adds in full (a resumed row starts from its carried counts)."""
        n = max(len(acc), len(prop), len(self.weighed.get(b, ([], []))[0]))
        pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
        (old_acc, old_prop), (w_acc, w_prop) = self.seen.get(b, ([], [])), self.weighed.get(b, ([], []))
        acc, prop, old_acc, old_prop, w_acc, w_prop = map(pad, (acc, prop, old_acc, old_prop, w_acc, w_prop))
        k = self.widths.get(b)
        fade = [1.0 if k is None or i < k else IDLE_DECAY for i in range(n)]
        w = ([f * x + a - o for f, x, a, o in zip(fade, w_acc, acc, old_acc)],
             [f * x + p - o for f, x, p, o in zip(fade, w_prop, prop, old_prop)])
        self.seen[b], self.weighed[b] = (acc, prop), w
        return w

    def lengths(self, rows: list[tuple[bool, int, list[int], list[int]]]) -> list[int]:
        """rows: (done, tokens it may still emit, accepted per position, proposed per position) per batch row."""
        rates: list[list[float] | None] = []
        for b, (done, _, acc, prop) in enumerate(rows):
            rates.append(None if done else row_rates(self.prior, *self._weigh(b, acc, prop), self.k_max))
        room = [min(rem, self.probe + 1) if self.widths.get(b) == 0 else rem for b, (_, rem, _, _) in enumerate(rows)]
        wider = WIDER_WITHIN if self.stops_early and len(rows) == 1 else 0.0
        ks, _ = choose(rates, room, self.k_max, self.costs, gain=self.margin(len(rows)), wider=wider)
        self.widths = dict(enumerate(ks))
        w = max(ks, default=0)
        self.decisions[w] = self.decisions.get(w, 0) + 1
        return ks


def plain_from(policy: DraftPolicy | None, max_rows: int, start: int = 1) -> int | None:
    """The fewest rows (up to `max_rows`) at which the policy, from its prior alone, drafts nothing: from there a
    speculative batch would only take plain steps, so the scheduler gives such requests to the continuous batch,
    which admits and retires rows at every step (a speculative batch does not). None: it drafts at every row count
    up to `max_rows`. `start`: the fewest rows at which the method's rounds take the policy at all (2 for suffix and
    hybrid, whose lone row drafts by its own rule)."""
    if policy is None:
        return None
    rates = row_rates(policy.prior, [], [], policy.k_max)
    for b in range(start, max_rows + 1):
        ks, _ = choose([rates] * b, [1 << 30] * b, policy.k_max, policy.costs, gain=policy.margin(b))
        if max(ks, default=0) == 0:
            return b
    return None


def ceiling(policy: DraftPolicy | None, rows: int) -> tuple[int, float] | None:
    """What the cost model allows at `rows` busy rows, before anything it leaves out: the width with the best expected
    tokens/s from the stored costs and the prior acceptance, with no margin (`gain` 1), and that rate over a plain
    step's. Every round's real overheads only lower it, so a concurrency whose target lies above it needs cheaper
    many-row verification (the kernels), not another policy. None without stored costs."""
    if policy is None:
        return None
    rates = row_rates(policy.prior, [], [], policy.k_max)
    ks, rate = choose([rates] * rows, [1 << 30] * rows, policy.k_max, policy.costs, gain=1.0)
    return max(ks, default=0), rate * policy.costs.verify(rows, 1) / rows


def policy_from(speculation: dict | None, k_max: int, model_draft: bool = True,
                stops_early: bool = False) -> DraftPolicy | None:
    """The policy from the draft engine's stored `speculation` block (pick-k's costs and acceptance); None when
    pick-k stored no costs (the fixed k then runs every round, as before). `model_draft=False` (a model-free drafter:
    prompt lookup, suffix): drafting costs nothing beside the target's step, and pick-k's acceptance (the draft
    model's) is no prior for it."""
    costs = Costs.from_stored(speculation)
    if costs is None or k_max < 1:
        return None
    table = (speculation or {}).get("table") or []
    prior = [float(r["accept_pos"]) for r in table] if model_draft and table else list(FALLBACK_RATES)
    if not model_draft:
        costs = Costs({r: 0.0 for r in costs.c_verify}, costs.c_verify)
    return DraftPolicy(costs, k_max, prior, stops_early=stops_early)


def tree_gain(tree: dict | None, nodes: int, rows: int) -> float | None:
    """Medusa's expected tokens/s over plain steps at `rows` rows: each row `expected_accept_len` tokens (the build's,
    from the heads' held-out accuracy) for one verify of `nodes` tokens a row (the root included) plus a run of the
    heads, against one token a row for a one-token step. The costs are the one-row curve the build timed
    (`verify_cost_ms`, 1.. tokens, and `heads_ms` in the medusa engine's `tree` block) read as a model of rows, as
    `Costs.from_stored` reads pick-k's: B rows of n tokens cost one row of B x n. None: the build stored no such
    measurements (a spec's own `choices`)."""
    t = tree or {}
    cv, e = t.get("verify_cost_ms"), t.get("expected_accept_len")
    if not cv or e is None or nodes < 1 or rows < 1:
        return None

    def cost(n: int) -> float:
        return float(cv[n - 1]) if n <= len(cv) else float(cv[-1]) * n / len(cv)

    return float(e) * cost(rows) / (cost(rows * nodes) + float(t.get("heads_ms", 0.0)))


def tree_plain_from(tree: dict | None, nodes: int, max_rows: int) -> int | None:
    """The fewest rows (up to `max_rows`) at which Medusa's tree is not expected to pay by the load policy's margins
    (`MIN_GAIN` at one row, `MIN_GAIN_ROWS` from two): from there its requests step plainly. None: it pays at every
    row count up to `max_rows`, or the build stored no measurements to judge by."""
    for b in range(1, max_rows + 1):
        g = tree_gain(tree, nodes, b)
        if g is None:
            return None
        if g < (MIN_GAIN if b < 2 else MIN_GAIN_ROWS):
            return b
    return None


MODEL_DRAFTERS = ("draft_target", "hybrid")  # methods whose rounds run a draft model (the others draft for free)


def policy_for(b, method: str, k: int, confidence: float | None = None) -> DraftPolicy | None:
    """`decode`'s policy for a batch of `method` on the loaded bundle `b` (its draft engine's stored costs);
    `confidence`: the batch's draft_confidence (default the spec's), whose stop a model drafter's rows make."""
    c = getattr(b.spec, "draft_confidence", 0.0) if confidence is None else confidence
    return policy_from((b.draft_config or {}).get("speculation"), k, method in MODEL_DRAFTERS,
                       stops_early=method in MODEL_DRAFTERS and float(c or 0.0) > 0)
