"""Verbs `repo`, `serve`, `stop` and `client` for `python -m pipeline` (registered by pipeline.cli)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from pipeline import spec as specmod
from pipeline.client import chat_text, generate
from pipeline.triton import keeper, openai_api, server
from pipeline.triton.repo import client_model, write_repo
from pipeline.triton.server import grpc_url
from pipeline.trtllm.planning import source
from pipeline.trtllm.runner import repo_command, serve_command


def cmd_repo(args) -> int:
    s = specmod.load(args.spec)
    if s.backend == "tensorrt_llm":
        return repo_command(s)

    write_repo(s)
    return 0


def cmd_serve(args) -> int:
    s = specmod.load(args.spec)
    if s.backend == "tensorrt_llm":
        return serve_command(s, args.dry_run)

    if args.dry_run:
        print(" ".join(server.command(s, s.repo_dir.parent / ".backends")))
        return 0
    if s.openai.enabled and not server.port_free(s.triton.host, s.openai.port) and not openai_api.running_pid(s):
        raise server.ServerError(f"openai.port: port {s.openai.port} on {s.triton.host} is already in use; stop "
                                 "whatever holds it or set openai.port (or openai.enabled: false) in the spec")
    if not all((s.repo_dir / m / "config.pbtxt").is_file() for m in s.triton.models):
        write_repo(s)
    srv = server.start(s, timeout=args.timeout)
    if s.openai.enabled:
        try:
            openai_api.start(s)
        except BaseException:
            server.stop(s)  # all or nothing: `make serve` never leaves half a deployment up
            raise
    if not args.foreground and not args.no_keep and not keeper.running_pid(s):
        keeper.start(args.spec, s, srv.pid)  # starts the server again if it dies (tritonserver 2.51's gRPC race)
    print(f"serving {s.name}: gRPC {srv.grpc_url}"
          + (f", OpenAI {openai_api.base_url(s)} (model {s.name!r})" if s.openai.enabled else "")
          + f"; try `python -m pipeline client {args.spec} --prompt \"Hi\" --stream`; stop with `make stop`")
    if not args.foreground:
        return 0
    try:
        while server.running_pid(s) == srv.pid:
            time.sleep(1.0)
        print("tritonserver exited; see " + str(server.log_file(s)), file=sys.stderr)
        openai_api.stop(s)
        return 1
    except KeyboardInterrupt:
        openai_api.stop(s)
        server.stop(s)
        return 0


def cmd_stop(args) -> int:
    s = specmod.load(args.spec)
    keeper.stop(s)  # first: a stopped server is never started again
    if openai_api.stop(s):
        print(f"stopped the {s.name} OpenAI endpoint")
    if server.stop(s, log=print):
        print(f"stopped the {s.name} server")
    else:
        print(f"no {s.name} server was running")
    return 0


def cmd_openai(args) -> int:
    """The OpenAI endpoint alone, in the foreground, in front of a deployment already serving (any backend)."""
    s = specmod.load(args.spec)
    if args.port:
        s.openai.port = args.port
    cfg = openai_api.front_config(s)
    s.report_dir.mkdir(parents=True, exist_ok=True)
    openai_api.config_file(s).write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    openai_api.serve(str(openai_api.config_file(s)))
    return 0


def _tokenizer(s: specmod.Spec):
    from pipeline.runtime.engine_io import load_tokenizer  # lazy: torch and transformers (~3 s), only for this verb

    d = s.engine_dir / "target"
    if s.backend == "tensorrt_llm" and s.tensorrt_llm.era == "llmapi":  # no engine: the checkpoint's tokenizer
        d = Path(source(s, "target"))
    if not (d / "tokenizer_config.json").is_file():
        return None
    return load_tokenizer(d)


def cmd_client(args) -> int:
    s = specmod.load(args.spec)

    prompt = args.prompt
    if not args.raw:
        tok = _tokenizer(s)
        if tok is None:
            print(f"note: no tokenizer in {s.engine_dir / 'target'}; sending the prompt without a chat template",
                  file=sys.stderr)
        else:
            prompt = chat_text(tok, prompt)
    opts = {k: v for k, v in {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                              "seed": args.seed, "num_draft_tokens": args.num_draft_tokens}.items() if v is not None}

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if not args.model:
        args.model = client_model(s)
    r = generate(args.url or grpc_url(s), args.model, prompt, args.max_tokens, method=args.method,
                 stream=args.stream, on_piece=show if args.stream else None,
                 return_perf_metrics=not args.no_perf, exclude_input_in_output=True, timeout=args.timeout, **opts)
    if not args.stream:
        sys.stdout.write(r["text"])
    print()
    n = r.get("num_output_tokens")
    line = f"[{args.model}{'/' + args.method if args.method else ''}] latency {r['latency_s']:.2f}s, " \
           f"first token {r['ttft_s'] * 1000:.0f} ms"
    if n is not None:
        line += f", {n} tokens, {n / r['latency_s']:.1f} tokens/s"
    print(line)
    if not args.no_perf and n is not None:
        print(f"acceptance_rate {r['acceptance_rate']:.3f}, total_accepted_draft_tokens "
              f"{r['total_accepted_draft_tokens']}, total_draft_tokens {r['total_draft_tokens']}, "
              f"num_input_tokens {r['num_input_tokens']}, num_output_tokens {n}")
    return 0


def register(verb) -> None:
    verb("repo", cmd_repo, "write triton_repo/<name>/ (Triton model repository)")
    sp = verb("serve", cmd_serve, "start tritonserver on the spec's host/ports and wait until the models are ready")
    sp.add_argument("--timeout", type=float, default=None, help="seconds to wait (default triton.startup_timeout_s)")
    sp.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the server")
    sp.add_argument("--no-keep", action="store_true", help="start no keeper (pipeline/triton/keeper.py), which starts "
                    "a detached server again if it dies")
    sp.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    verb("stop", cmd_stop, "stop the server (and its OpenAI endpoint) started by `serve`")
    sp = verb("openai", cmd_openai, "run the OpenAI-compatible endpoint in the foreground in front of a running "
                                    "deployment (`serve` starts it by itself; docs/openai.md)")
    sp.add_argument("--port", type=int, default=0, help="port (default: openai.port of the spec)")
    sp = verb("client", cmd_client, "send one request over gRPC and print the answer and its perf metrics")
    sp.add_argument("--prompt", required=True)
    sp.add_argument("--stream", action="store_true", help="print the text as it streams")
    sp.add_argument("--method", default=None, help="baseline | draft_target | prompt_lookup | medusa "
                                                   "(default: the server's)")
    sp.add_argument("--model", default="", help="ensemble (default, when served) or tensorrt_llm_bls")
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--temperature", type=float, default=None)
    sp.add_argument("--top-k", type=int, default=None)
    sp.add_argument("--top-p", type=float, default=None)
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--num-draft-tokens", type=int, default=None)
    sp.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    sp.add_argument("--no-perf", action="store_true", help="do not ask for return_perf_metrics")
    sp.add_argument("--url", default=None, help="gRPC host:port (default: the spec's)")
    sp.add_argument("--timeout", type=float, default=600.0)
