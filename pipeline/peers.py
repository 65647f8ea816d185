"""llama.cpp as a peer on the same GGUF file: what a person running a GGUF model on a CPU would pick.

`llama-cpp-python` builds llama.cpp from source (about 20 minutes on 2 cores), so it is an optional
install (`make peers`), never a test dependency. Its bindings offer prompt-lookup speculation
(`LlamaPromptLookupDecoding`), not a separate draft model, so the peer runs plain and with lookup.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_of(spec) -> Path | None:
    """The target's GGUF file, when the spec's target comes from one."""
    from pipeline import sources  # imports torch (via runtime.model)

    try:
        src = sources.resolve(spec.target.source, Path(spec.root))
    except sources.SourceError:
        return None
    return src.path if src.kind == "gguf" else None


def llama_cpp_peer(gguf: Path, prompts: list[list[int]], new: int, threads: int, lookup_tokens: int = 0,
                   log=print) -> dict:
    """Greedy tokens/s of llama.cpp on `gguf` for exactly `new` tokens per prompt (batch 1, prefill included),
    the median over prompts; with `lookup_tokens`, through the bindings' prompt-lookup decoding."""
    from llama_cpp import Llama  # optional (`make peers`) and heavy

    kw = {}
    if lookup_tokens:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # optional (`make peers`) and heavy

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
    ctx = max(len(p) for p in prompts) + new + 16
    llm = Llama(model_path=str(gguf), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                logits_all=bool(lookup_tokens), **kw)

    def once(p: list[int]) -> float:
        t = time.perf_counter()
        n = 0
        for _ in llm.generate(p, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if n == new:
                break
        return new / (time.perf_counter() - t)

    once(prompts[0][:8] or [0])
    tps = [once(p) for p in prompts]
    label = f"llama.cpp {LLAMA_CPP_VERSION}" + (f" + prompt lookup {lookup_tokens}" if lookup_tokens else "")
    log(f"  {label}: {statistics.median(tps):.1f} tokens/s")
    return {"tokens_per_s": statistics.median(tps), "prompts": len(prompts), "threads": threads,
            "gguf": gguf.name, "version": LLAMA_CPP_VERSION, **({"prompt_lookup_tokens": lookup_tokens}
                                                                  if lookup_tokens else {})}


def gguf_peers(spec, ids: list[list[int]], new: int, log=print, lookup: tuple[int, int] | None = None) -> dict:
    """`peers.llama_cpp` (and with `lookup` = (prompts, tokens), `peers.llama_cpp_prompt_lookup` on that many
    prompts and new tokens) on the target's own GGUF file, when the target comes from one; a note, not a
    figure, when `make peers` has not installed llama-cpp-python."""
    gguf = gguf_of(spec)
    if gguf is None:
        return {}
    if not llama_cpp_available():
        return {"llama_cpp": {"tokens_per_s": None, "note": "llama-cpp-python not installed (make peers)"}}
    threads = spec.threads or os.cpu_count() or 1
    out = {"llama_cpp": llama_cpp_peer(gguf, ids, new, threads, log=log)}
    if lookup:
        # The bindings' prompt lookup needs logits_all and ran under 1 token/s on the pair here: a short run.
        n, toks = lookup
        out["llama_cpp_prompt_lookup"] = llama_cpp_peer(gguf, ids[:n], toks, threads, lookup_tokens=4, log=log)
    return out
