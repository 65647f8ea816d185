"""hybrid with the draft model's prefill deferred on long prompts (speculative.DEFER_MIN) against the same with no
allowance ("eager"), on the edit set's cases, in-process: time after the first token (where the draft's prefill
lands), rounds and the draft model's forwards. Greedy output is the same for both (asserted). Since 13c04b5 "eager"
prefills in the first round the suffix drafter finds nothing; docs/speculation-config.md's 0.66x was measured at
bd10900, where it prefilled before the first round.

    PYTHONPATH=. .venv/bin/python experiments/deferred_draft.py build/qwen_coder.yaml --cases 4 --new 192 \
        [--engines /tmp/ma2/engines/qwen_coder]

Each case runs both settings in turn (interleaved, so the machine's drifts hit both alike); no suffix store and no
prompt cache (each request as a fresh one).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from pipeline import spec as specmod
from pipeline.common import setup_threads
from pipeline.edit_run import load_cases, messages
from pipeline.runtime import speculative
from pipeline.runtime.decode import apply_spec, decode, load_bundle
from pipeline.runtime.generate import Request


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--new", type=int, default=192)
    ap.add_argument("--engines", type=Path, default=None, help="engine dir (default: the spec's)")
    a = ap.parse_args(argv)
    s = specmod.load(a.spec)
    setup_threads(s)
    b = apply_spec(load_bundle(a.engines or s.engine_dir, s.device, methods=("hybrid",)), s)
    b.use(dataclasses.replace(b.spec, suffix_store_bytes=0))
    cases = load_cases(s.path(s.validate.edit_set), a.cases)
    eager = (10 ** 9, speculative.DEFER_RATE)
    deferred = (speculative.DEFER_MIN, speculative.DEFER_RATE)
    seen: list[int] = []
    hook = b.draft.register_forward_hook(lambda _m, args, _o: seen.append(args[0].numel()))
    totals = {"eager": [0.0, 0, 0], "deferred": [0.0, 0, 0]}
    for c in cases:
        enc = b.tokenizer.apply_chat_template(messages(c), add_generation_prompt=True)
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        outs = []
        for name, (lo, rate) in (("eager", eager), ("deferred", deferred)):
            speculative.DEFER_MIN, speculative.DEFER_RATE = lo, rate
            seen.clear()
            first: list[float] = []
            t0 = time.perf_counter()
            (r,) = decode(b, "hybrid", [Request(ids, a.new)],
                          on_emit=lambda _b, _t, first=first: first.append(time.perf_counter()) if not first else None)
            after = time.perf_counter() - first[0]
            outs.append(r.tokens)
            tot = totals[name]
            tot[0] += after
            tot[1] += r.steps
            tot[2] += sum(seen)
            print(f"{c['id']:28s} {name:8s} prompt {len(ids):5d}  after first token {after:6.2f} s  rounds "
                  f"{r.steps:4d}  draft tokens run {sum(seen):6d}  total {time.perf_counter() - t0:6.2f} s", flush=True)
        assert outs[0] == outs[1], f"{c['id']}: deferral changed the greedy output"
    hook.remove()
    for name, (sec, rounds, fed) in totals.items():
        print(f"{name:8s}: {sec:6.2f} s after the first tokens, {rounds} rounds, {fed} draft tokens run")
    print(f"deferred / eager time after the first token: {totals['deferred'][0] / totals['eager'][0]:.2f}")


if __name__ == "__main__":
    main()
