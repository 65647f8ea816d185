"""The load policy replayed on recorded draft runs: what each rule for the draft length would give one row, free of
the machine's noise (issue 53: on a 2-core Zen 3 the served draft_target stepped plainly on 5 of 8 prompts).

Greedy decoding is deterministic, so what a round drafts and what it keeps depends only on where the answer stands:
for each position t of the target's greedy answer the script records once what the draft proposes from there (its
k_max greedy tokens, each with the top probability that `draft_confidence` stops on) and how many of them the answer
has next. A rule is then replayed round by round on those records, each round costed from the draft engine's stored
costs (pick-k's, what the policy itself believes) plus the draft's catch-up on the tokens it has not seen, timed here:

    round of width w = catch_up(g) + (w - 1) * c_draft + c_verify(w + 1)      a plain round = c_verify(1)

    PYTHONPATH=. .venv/bin/python experiments/policy_replay.py build/qwen_coder.yaml [--prompts 8] [--tokens 128] \
        [--records FILE] [--confidence 0.5,0.7,0.9]

Each position's record keeps every proposed token's top probability too, so `--confidence` replays the policy with
other draft_confidence values than the spec's (records written before 2026-12-07 22:30 lack them: record again).

`--what-if 0.8:1,1:0.8` replays the spec's policy on scaled costs, each pair a factor on the draft step and one on
what a verification costs beyond its first token (the plain step unchanged): what a cheaper draft or cheaper extra
verify rows would give on the same positions, the policy deciding on the scaled costs.

Recording takes a draft step per proposed token (about a minute for 8 x 128 tokens on the flagship); the replay is
instant. It prints, per rule, the median over prompts of the replayed tokens/s over plain steps, and the prompts
where the rule stepped plainly for most of the answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from pipeline import spec as specmod
from pipeline.common import chat_ids, setup_threads
from pipeline.runtime import kernels, loadpolicy
from pipeline.runtime.decode import apply_spec, decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.sources import read_prompts


class Record(NamedTuple):
    """One prompt: the target's greedy answer, and at each position t the draft's proposal's run of tokens that the
    answer has next (`run[t]`) and how many it proposes before its confidence stops it (`conf[t]`)."""

    answer: list[int]
    run: list[int]
    conf: list[int]
    top: list[list[float]] = []  # each proposed token's top probability, position by position (`stops_at`)


@torch.inference_mode()
def record(b, prompt: list[int], new: int, k: int, confidence: float) -> Record:
    answer = decode(b, "baseline", [Request(prompt, new)])[0].tokens
    m = b.draft
    ids = getattr(m, "vocab_ids", None)
    cache = m.new_cache(1, len(prompt) + len(answer) + k + 2)
    P = len(prompt)
    m(torch.tensor([prompt[:-1]]), torch.arange(P - 1)[None], cache)
    ctx = prompt + answer
    run, tops = [], []
    for t in range(len(answer)):
        pos = P + t - 1  # the newest context token (answer[t - 1], or the prompt's last) and its position
        h = m(torch.tensor([[ctx[pos]]]), torch.tensor([[pos]]), cache)[:, 0]
        drafts, probs = [], []
        for i in range(k):
            d, top = kernels.argmax_prob(m.logits(h), with_prob=True)
            if ids is not None:
                d = ids[d]
            drafts.append(int(d[0]))
            probs.append(float(top[0]))
            if i + 1 < k:
                h = m(d[:, None], torch.tensor([[pos + 1 + i]]), cache)[:, 0]
        n = 0
        while n < k and t + n < len(answer) and drafts[n] == answer[t + n]:
            n += 1
        run.append(n)
        tops.append(probs)
    return stops_at(Record(answer, run, [], tops), confidence)


def stops_at(rec: Record, confidence: float) -> Record:
    """The record with `conf` as a drafter stopping after its first token below `confidence` proposes (0: never)."""
    if not rec.top:
        raise SystemExit("--confidence needs records with the draft's probabilities: record them again")
    conf = [next((i + 1 for i, p in enumerate(ps) if p < confidence), len(ps)) for ps in rec.top]
    return rec._replace(conf=conf)


def scaled(costs: loadpolicy.Costs, draft: float, verify_extra: float) -> loadpolicy.Costs:
    """`costs` with every draft step times `draft` and each verification's cost beyond its rows' plain step times
    `verify_extra` (`--what-if`)."""
    return loadpolicy.Costs({r: c * draft for r, c in costs.c_draft.items()},
                            {r: [v[0] + (x - v[0]) * verify_extra for x in v] for r, v in costs.c_verify.items()})


@torch.inference_mode()
def catch_up_costs(m, upto: int = 32) -> dict[int, float]:
    """Seconds of one draft forward of g tokens plus its logits at one position (g = 1, 2, 4, ... upto)."""
    out = {}
    cache = m.new_cache(1, 256 + upto)
    m(torch.randint(0, 1000, (1, 128)), torch.arange(128)[None], cache)
    g = 1
    while g <= upto:
        best = None
        for _ in range(5):
            t0 = time.perf_counter()
            h = m(torch.randint(0, 1000, (1, g)), (128 + torch.arange(g))[None], cache)
            m.logits(h[:, -1])
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        out[g] = best
        g *= 2
    return out


def replay(rec: Record, lengths, costs: loadpolicy.Costs, catch: dict[int, float], new: int) -> tuple[float, int]:
    """Seconds the answer takes under the rule `lengths(rows) -> [w]` (a DraftPolicy's), and its plain rounds."""
    stats_acc: list[int] = []
    stats_prop: list[int] = []
    t, fed, secs, plain = 1, 0, 0.0, 0  # the prefill emitted answer[0]; the draft holds `fed` answer tokens
    while t < len(rec.answer):
        w = lengths([(False, new - t, stats_acc, stats_prop)])[0]
        if w == 0:
            secs += costs.verify(1, 1)
            t += 1
            plain += 1
            continue
        g = t - fed  # tokens the draft has not seen: the newest always, more after plain rounds
        # timed here (piecewise linear in g, as Costs reads rows), scaled to the stored draft step
        cu = loadpolicy._interp(catch, g) * costs.draft(1) / catch[min(catch)]
        proposed = min(w, rec.conf[t], new - t - 1)
        n = min(rec.run[t], proposed)
        secs += cu - costs.draft(1) + proposed * costs.draft(1) + costs.verify(1, proposed + 1)
        for i in range(proposed):
            while len(stats_prop) <= i:
                stats_prop.append(0)
                stats_acc.append(0)
            stats_prop[i] += 1
            stats_acc[i] += int(i < n)
        fed = t + min(n, proposed - 1)
        t += n + 1
    return secs, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-file", help="prompts to record (default: the spec's validate prompts)")
    ap.add_argument("--records", help="a JSON file: read the records from it if it exists, else write them there")
    ap.add_argument("--confidence", help="draft_confidence values to replay the policy with (e.g. 0.5,0.7,0.9), "
                                         "from the recorded probabilities")
    ap.add_argument("--what-if", help="draft:verify_extra factor pairs to replay the policy on scaled costs "
                                      "(e.g. 0.8:1,1:0.8)")
    a = ap.parse_args()
    s = specmod.load(a.spec)
    setup_threads(s)
    b = apply_spec(load_bundle(s.engine_dir, s.device, methods=("baseline", "draft_target")), s)
    k = b.spec.k_for("draft_target")
    pol0 = loadpolicy.policy_for(b, "draft_target", k)
    if pol0 is None:
        raise SystemExit(f"{s.engine_dir}/draft stores no pick-k costs: build the draft with num_draft_tokens: auto")
    saved = Path(a.records) if a.records else None
    if saved is not None and saved.is_file():
        data = json.loads(saved.read_text())
        catch = {int(g): v for g, v in data["catch"].items()}
        recs = [Record(**r) for r in data["records"]]
    else:
        texts = read_prompts(s.path(a.prompt_file or s.validate.prompts))[:a.prompts]
        catch = catch_up_costs(b.draft)
        conf = float(s.speculation.draft_confidence or 0.0)
        recs = [record(b, chat_ids(b.tokenizer, text), a.tokens, k, conf) for text in texts]
        if saved is not None:
            saved.write_text(json.dumps({"catch": catch, "records": [r._asdict() for r in recs]}))
    print("draft forward + logits by tokens: " + ", ".join(f"{g}: {v * 1e3:.1f} ms" for g, v in catch.items()))
    for i, r in enumerate(recs):
        print(f"prompt {i}: {len(r.answer)} tokens, draft's run over positions: mean {statistics.mean(r.run):.2f}")
    def fixed(w: int):
        return lambda rows: [w]

    def on(costs: loadpolicy.Costs):  # a fresh policy (it counts per prompt) deciding on `costs`
        return lambda: dataclasses.replace(loadpolicy.policy_for(b, "draft_target", k), costs=costs, probe=0).lengths

    # (name, the rule, the records it drafts on, the costs it is charged): the spec's stop or another threshold's
    # from the probabilities; the stored costs or scaled ones (--what-if)
    stored = pol0.costs
    rules = [("policy", on(stored), recs, stored),
             ("fixed k", lambda: fixed(k), recs, stored)]
    rules += [(f"fixed {w}", lambda w=w: fixed(w), recs, stored) for w in range(1, k)]
    for c in [float(v) for v in a.confidence.split(",")] if a.confidence else []:
        rules.append((f"policy, confidence {c}", lambda c=c: loadpolicy.policy_for(b, "draft_target", k, c).lengths,
                      [stops_at(r, c) for r in recs], stored))
    for pair in a.what_if.split(",") if a.what_if else []:
        try:
            fd, fv = (float(v) for v in pair.split(":"))
        except ValueError:
            raise SystemExit(f"--what-if: {pair!r} is not DRAFT:VERIFY_EXTRA (two factors, e.g. 0.8:1)") from None
        if fd <= 0 or fv < 0:
            raise SystemExit(f"--what-if: {pair!r}: the draft's factor must be above 0 and the verify's at least 0")
        costs = scaled(stored, fd, fv)
        rules.append((f"policy, draft x{fd:g}, verify extra x{fv:g}", on(costs), recs, costs))
    plain_s = [stored.verify(1, 1) * (len(r.answer) - 1) for r in recs]
    for name, make, runs, costs in rules:
        gains, stuck = [], []
        for i, r in enumerate(runs):
            secs, plain = replay(r, make(), costs, catch, a.tokens)
            gains.append(plain_s[i] / secs)
            if plain > (len(r.answer) - 1) / 2:
                stuck.append(i)
        print(f"{name:24s} median {statistics.median(gains):.3f}x plain steps (per prompt "
              f"{', '.join(f'{g:.2f}' for g in gains)})" + (f"; mostly plain on prompts {stuck}" if stuck else ""))


if __name__ == "__main__":
    main()
