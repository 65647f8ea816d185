"""Would a draft tree (the draft's second choice beside a doubted token) or another stop rule pay on this CPU?

    PYTHONPATH=. .venv/bin/python experiments/draft_tree.py build/qwen_coder.yaml [--prompts 40] [--new 128]
        [--profile 6]

Three parts, in one process on the built engines:
1. The target's greedy answers to the evaluation prompts, decoded once; the draft then runs prompt + answer in one
   forward (teacher-forced) and keeps, at every answer position, its top-4 ids and probabilities over its reduced
   head (the confidence `kernels.argmax_prob` gives the drafting loop) beside the target's token.
2. `--profile N`: N of those prompts decoded by baseline and by draft_target (k and the confidence rule of the spec,
   no load policy) with timers around the drafter's `propose`, both models' forwards and heads (prompts' prefills
   left out), and a bandwidth probe before; it prints ms a round for each and the one-token step, so the costs
   below can be read in the memory's current mode.
3. Stop rules simulated on part 1's positions (a round drafts along the draft's top-1 until it doubts a token or
   reaches k; it commits the agreeing run + 1): the chain as built, other k and thresholds, the draft's top-2 (and
   top-3) placed as siblings of the doubted token (no draft step more: the same logits; one target row more each),
   siblings at every doubted position, and an oracle that drafts exactly the agreeing run. Each round costs
   P draft steps and one verification of its rows, in one-token steps: `--draft-step` and `--verify` (the verify
   curve by rows, as bench.md prints it). Along a rejected branch the draft's confidences are the teacher-forced
   ones, which only moves where a wasted round stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PREFILL_FROM = 16  # a forward of more tokens than a round verifies (k + 1) or the draft catches up on is a prefill
USUAL = "1.0,1.04,1.08,1.10,1.14,1.34,1.46,1.68,1.97,2.10,2.38,2.47"  # bench.md's curve, run Z8, probes 35 GB/s


def curve(text: str = USUAL):
    """A verify curve given by rows ("1.0,1.04,...", one-token steps) as a function of rows; linear past its end."""
    vc = [float(x) for x in text.split(",")]
    return lambda n: vc[n - 1] if n <= len(vc) else vc[-1] * n / len(vc)


def collect(b, prompts: list[list[int]], new: int) -> list[dict]:
    """Per answer: the target's tokens, the draft's top-4 ids (target vocabulary) and probabilities, teacher-forced."""
    from pipeline.runtime.decode import decode
    from pipeline.runtime.generate import Request

    m, out = b.draft, []
    for pr in prompts:
        ans = list(decode(b, "baseline", [Request(prompt=pr, max_new_tokens=new, end_ids=b.end_ids)])[0].tokens)
        toks = pr + ans
        with torch.inference_mode():
            cache = m.new_cache(1, (len(toks) + 64) // 64 * 64)
            h = m(torch.tensor([toks]), torch.arange(len(toks))[None], cache)
            top = torch.softmax(m.logits(h[0, len(pr) - 1:len(toks) - 1]).float(), -1).topk(4, -1)
        out.append({"target": ans, "top": m.vocab_ids[top.indices].tolist(), "prob": top.values.tolist()})
    return out


def profile(b, prompts: list[list[int]], new: int) -> None:
    """ms a round of draft_target (spec k and confidence, no load policy) by part, beside the baseline's step."""
    from pipeline.bench import measure_bandwidth_gbs
    from pipeline.runtime import speculative as sp
    from pipeline.runtime.decode import decode
    from pipeline.runtime.generate import Request

    T: dict[str, float] = {}
    N: dict[str, int] = {}

    def timed(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def g(*a, **kw):
            t0 = time.perf_counter()
            r = f(*a, **kw)
            if not (name == "forward" and a[0].shape[-1] > PREFILL_FROM):  # a prompt's prefill is no round's part
                T[key] = T.get(key, 0.0) + time.perf_counter() - t0
                N[key] = N.get(key, 0) + 1
            return r
        setattr(obj, name, g)

    timed(sp._ModelDrafter, "propose", "drafting (propose)")
    timed(b.draft, "forward", "  draft forwards")
    timed(b.draft, "logits", "  draft head")
    timed(b.target, "forward", "target forward")
    timed(b.target, "logits", "target head")
    bw = measure_bandwidth_gbs(256, reps=3)
    T.clear()
    N.clear()
    t0, n = time.perf_counter(), 0
    for pr in prompts:
        n += len(decode(b, "baseline", [Request(prompt=pr, max_new_tokens=new, end_ids=b.end_ids,
                                                cache_prompt=False)])[0].tokens)
    base_s = time.perf_counter() - t0
    step = (T["target forward"] + T["target head"]) / N["target forward"]
    T.clear()
    N.clear()
    t0, toks, rounds = time.perf_counter(), 0, 0
    for pr in prompts:
        r = decode(b, "draft_target", [Request(prompt=pr, max_new_tokens=new, end_ids=b.end_ids, cache_prompt=False)],
                   policy=None)[0]
        toks, rounds = toks + len(r.tokens), rounds + r.steps - 1  # steps counts the prefill's forward too
    wall = time.perf_counter() - t0
    print(f"probe {bw:.1f} GB/s; baseline {n / base_s:.1f} tokens/s, one-token step {1e3 * step:.2f} ms; draft_target "
          f"{toks / wall:.1f} tokens/s, {toks / rounds:.2f} tokens a round, {1e3 * wall / rounds:.1f} ms a round "
          "(prefills in the wall time, not in the parts)")
    for key in T:
        print(f"  {key}: {1e3 * T[key] / rounds:.2f} ms a round ({N[key] / rounds:.2f} calls, "
              f"{1e3 * T[key] / N[key]:.2f} ms each, {T[key] / rounds / step:.2f} steps)")


def simulate(data: list[dict], c: float, V, k: int, theta: float, siblings: int = 0,
             anywhere: float | None = None, most: int = 1) -> tuple[float, float]:
    """(tokens a one-token step, tokens a round) of a stop rule over the teacher-forced positions. `siblings`: the
    draft's next `siblings` choices beside the token it doubted (below theta) where it stopped; `anywhere`: beside
    every token below that probability instead (at most `most` places), drafting on along top-1."""
    toks = steps = rounds = 0.0
    for d in data:
        tgt, top, prob = d["target"], d["top"], d["prob"]
        n, t = len(tgt), 0
        while t < n:
            P, sibs, doubted = 0, [], False
            while P < k and t + P < n:
                j = t + P
                P += 1
                if anywhere is not None and prob[j][0] < anywhere and len(sibs) < most:
                    sibs.append((P - 1, top[j][1:1 + max(1, siblings)]))
                if prob[j][0] < theta:
                    doubted = True
                    break
            if anywhere is None and siblings and doubted:
                sibs.append((P - 1, top[t + P - 1][1:1 + siblings]))
            a = 0
            while a < P and top[t + a][0] == tgt[t + a]:
                a += 1
            emitted = a + 1
            if a < P and any(i == a and tgt[t + a] in cands for i, cands in sibs):
                emitted = a + 2  # the sibling is the target's token: it and the target's next one commit
            steps += P * c + V(P + 1 + sum(len(cands) for _, cands in sibs))
            toks += min(emitted, n - t)
            t += emitted
            rounds += 1
    return toks / steps, toks / rounds


def oracle(data: list[dict], c: float, V, k: int) -> float:
    """Tokens a step when every round drafts exactly the agreeing run (at most k): what no stop rule can beat."""
    toks = steps = 0.0
    for d in data:
        tgt, top = d["target"], d["top"]
        n, t = len(tgt), 0
        while t < n:
            a = 0
            while a < k and t + a < n and top[t + a][0] == tgt[t + a]:
                a += 1
            steps += a * c + V(a + 1)
            toks += min(a + 1, n - t)
            t += a + 1
    return toks / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--prompts", type=int, default=0, help="evaluation prompts (0: all)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--profile", type=int, default=0, help="prompts to time draft_target's rounds on (0: none)")
    ap.add_argument("--draft-step", type=float, default=0.234, help="a draft step in one-token target steps")
    ap.add_argument("--verify", action="append", default=[],
                    help=f"a verify curve by rows, in one-token steps (repeatable; default bench's: {USUAL})")
    args = ap.parse_args()

    from pipeline import spec as specmod
    from pipeline.client import chat_text
    from pipeline.common import setup_threads
    from pipeline.runtime.decode import apply_spec, load_bundle
    from pipeline.sources import spec_prompts

    s = specmod.load(args.spec)
    setup_threads(s)
    b = apply_spec(load_bundle(s.engine_dir, s.device, methods=("baseline", "draft_target")), s)
    prompts = [b.tokenizer.encode(chat_text(b.tokenizer, p)) for p in spec_prompts(s, args.prompts)]
    k, theta = b.spec.k_for("draft_target"), b.spec.draft_confidence
    if args.profile:
        profile(b, prompts[:args.profile], args.new)
    t0 = time.perf_counter()
    data = collect(b, prompts, args.new)
    agree = [p[0] == t for d in data for p, t in zip(d["top"], d["target"])]
    print(f"{len(data)} answers, {len(agree)} positions, draft top-1 agreement {statistics.mean(agree):.4f} "
          f"({time.perf_counter() - t0:.0f} s); spec k {k}, confidence {theta}")
    for text in args.verify or [USUAL]:
        V = curve(text)
        c = args.draft_step
        built, _ = simulate(data, c, V, k, theta)
        print(f"\nverify curve {text}, draft step {c}: the built rule (k {k}, confidence {theta}) {built:.3f} "
              f"tokens a step; oracle {oracle(data, c, V, 8):.3f}")
        print("| rule | tokens a step | vs built | tokens a round |\n|---|---|---|---|")
        rules = [(f"k {kk}, confidence {th}", dict(k=kk, theta=th))
                 for kk, th in [(3, theta), (4, theta), (8, theta), (k, 0.6), (k, 0.8), (k, 0.0), (4, 0.0)]]
        rules += [(f"k {k}, {th}, top-2..{1 + n} beside the doubted token", dict(k=k, theta=th, siblings=n))
                  for th, n in [(theta, 1), (theta, 2), (0.8, 1), (0.9, 1)]]
        rules += [(f"k {k}, {theta}, top-2 beside every token below {a} (at most {m})",
                   dict(k=k, theta=theta, anywhere=a, most=m)) for a, m in [(0.8, 3), (0.9, 2)]]
        for name, kw in rules:
            rate, per = simulate(data, c, V, **kw)
            print(f"| {name} | {rate:.3f} | {rate / built:.3f} | {per:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
