"""Triton python-backend model (the adapter): the torch runtime behind tensorrtllm_backend's client contract.

Copied into triton_repo/<name>/ensemble/1/model.py and tensorrt_llm_bls/1/model.py: both served models are
this model, each in its own stub process (mapping one shared copy of the weights, pipeline/runtime/shared.py)
with its own KV caches, its own scheduler and its own clients, so each sees its clients' cancellation,
deadline and disconnect itself (no model forwards requests to another). One instance serves every method
(`method` input; default from config). This file only translates between Triton and the Triton-free pieces it
imports from the project: `pipeline.triton.parse` turns a request's tensors into runtime Requests (or a
BadRequest naming the input), `pipeline.triton.scheduler` decodes them on one worker thread and answers
through a `Responder`, here one that wraps the request's response sender (posted to a thread of its own,
`replies.PostedResponder`, so decoding never waits on a client's round trip), and `pipeline.triton.gate` makes the
served models take turns at decoding steps (a file lock in the model repository). Decoupled (streaming) or not
follows the model's transaction policy (spec `triton.decoupled`); both answer through the response sender, so
`execute` never blocks on decoding.
"""

from __future__ import annotations

import json
import os
import site
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS = {
    "requests": ("spec_decode_requests_total", "Requests (batch rows) finished, per decoding method"),
    "proposed": ("spec_decode_draft_tokens_proposed_total", "Draft tokens proposed to the target"),
    "accepted": ("spec_decode_draft_tokens_accepted_total", "Draft tokens the target accepted"),
    "output": ("spec_decode_output_tokens_total", "Tokens generated"),
    "steps": ("spec_decode_target_steps_total", "Target forward passes (incl. prefill)"),
    "errors": ("spec_decode_request_errors_total", "Requests rejected or failed"),
    "cancelled": ("spec_decode_requests_cancelled_total",
                  "Requests cancelled by their client (gRPC cancel, deadline, disconnect, or a stop request)"),
    "cancelled_tokens": ("spec_decode_cancelled_tokens_total",
                         "Tokens decoded for requests that were then cancelled (the work spent on nobody)"),
    "plain": ("spec_decode_requests_speculation_off_total",
              "Requests decoded plainly (wholly or in part) because the requests in flight reached "
              "speculation.disable_at_batch"),
    "resumed": ("spec_decode_speculation_resumed_total",
                "Times a request switched to plain decoding went back to speculating as the load dropped"),
    # The prompt cache (pipeline/runtime/prompt_cache.py), named like TensorRT-LLM's trtllm_kv_cache_* metrics.
    "kv_reused_blocks": ("spec_decode_kv_cache_reused_blocks_total",
                         "Prompt blocks (prompt_cache.block_tokens) whose K/V came from the prompt cache"),
    "kv_missed_blocks": ("spec_decode_kv_cache_missed_blocks_total",
                         "Whole prompt blocks the prompt cache did not hold (computed)"),
    "prompt_reused": ("spec_decode_prompt_tokens_reused_total", "Prompt tokens whose K/V came from the prompt cache"),
    "prompt_computed": ("spec_decode_prompt_tokens_computed_total", "Prompt tokens prefilled (computed)"),
}
# Gauges of the prompt cache, labelled by model only (both models' K/V, target and draft, in one budget).
GAUGES = {
    "kv_cache_bytes": ("spec_decode_kv_cache_bytes", "Bytes of K/V the prompt cache holds (target and draft)"),
    "kv_cache_hit_rate": ("spec_decode_kv_cache_hit_rate",
                          "Reused / looked-up whole prompt blocks since the model started (target and draft)"),
}


def _param(cfg: dict, key: str, default: str = "") -> str:
    return cfg.get("parameters", {}).get(key, {}).get("string_value", default)


def _add_paths(paths: list[str]) -> None:
    """Put the venv's site-packages (with its .pth files) and the project ahead of the stub's own path."""
    before = list(sys.path)
    for p in paths:
        if p and os.path.isdir(p):
            site.addsitedir(p)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = [p for p in paths if p] + [p for p in added if p not in paths] + [p for p in before if p not in paths]


def kv_blocks(result, block_tokens: int) -> tuple[int, int, int]:
    """(reused, newly computed, total) blocks of `block_tokens` of a request's prompt and answer, as TensorRT-LLM
    reports them: the reused ones came from the prompt cache."""
    total = -(-(result.num_input_tokens + len(result.tokens)) // block_tokens)
    reused = result.cached_tokens // block_tokens
    return reused, total - reused, total


class TritonResponder:
    """The scheduler's Responder over one request's response sender."""

    def __init__(self, sender, block_tokens: int = 64):
        self.sender, self.block_tokens = sender, block_tokens

    def send(self, texts: list[str], results: list | None, final: bool) -> None:
        out = []
        if texts:
            out.append(pb_utils.Tensor("text_output", np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)))
        if results is not None:
            col = lambda vals, dt: np.array([[v] for v in vals], dtype=dt)  # noqa: E731
            out += [
                pb_utils.Tensor("acceptance_rate", col([r.acceptance_rate for r in results], np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", col([r.draft_accepted for r in results], np.int32)),
                pb_utils.Tensor("total_draft_tokens", col([r.draft_proposed for r in results], np.int32)),
                pb_utils.Tensor("num_input_tokens", col([r.num_input_tokens for r in results], np.int32)),
                pb_utils.Tensor("num_output_tokens", col([len(r.tokens) for r in results], np.int32)),
            ]
            blocks = [kv_blocks(r, self.block_tokens) for r in results]  # tensorrtllm_backend's KV-reuse outputs
            out += [pb_utils.Tensor(name, col([b[i] for b in blocks], np.int32)) for i, name in enumerate(
                ("kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks"))]
            out.append(pb_utils.Tensor("num_cached_tokens", col([r.cached_tokens for r in results], np.int32)))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=out), flags=FINAL if final else 0)

    def error(self, message: str, cancelled: bool = False) -> None:
        err = pb_utils.TritonError(message, pb_utils.TritonError.CANCELLED) if cancelled else pb_utils.TritonError(
            message)
        self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err), flags=FINAL)

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        cfg = json.loads(args["model_config"])
        _add_paths(_param(cfg, "python_path").split(":"))
        # Imported here, not at the top: the stub reaches the project and its venv only after _add_paths.
        from pipeline.runtime import kernels
        from pipeline.runtime.decode import load_bundle
        from pipeline.runtime.prompt_cache import PromptCache
        from pipeline.runtime.specconfig import SpecDecodeConfig
        from pipeline.triton.gate import NoGate, StepGate
        from pipeline.triton.parse import Limits, RequestParser
        from pipeline.triton.replies import STREAM_GAP_S, Outbox
        from pipeline.triton.scheduler import WARMUP_TOKENS, Scheduler, warmup_request

        self.model_name = args.get("model_name", cfg.get("name", "tensorrt_llm_bls"))
        # Both served models decode in their own stub process: they take turns at steps (pipeline/triton/gate.py).
        instance = args.get("model_instance_name") or self.model_name
        self.gate = StepGate(Path(args["model_repository"]).parent, instance) if _param(
            cfg, "step_lock", "true") == "true" and args.get("model_repository") else NoGate()
        threads: list[str] = []  # as the decode thread sees them (OpenMP thread counts are per thread)

        def setup() -> Scheduler:  # on the decode thread: it alone runs torch's OpenMP team and the kernels' pool
            kernels.configure_threads(int(_param(cfg, "threads", "0") or 0))  # spec `threads`
            import torch  # after _add_paths (the venv's torch)

            threads.append(f"threads: torch {torch.get_num_threads()}, kernels {kernels.threads()}")
            bundle = load_bundle(Path(_param(cfg, "engine_dir")), _param(cfg, "device", "cpu"))
            sched = Scheduler(bundle, self.max_batch_size, count=self._count_later, log=self._log, gate=self.gate)
            warm = int(_param(cfg, "warmup_tokens", str(WARMUP_TOKENS)) or 0)  # 0: none
            if warm > 0:  # ready means warm: the first request decodes as fast as the rest (docs/peers.md)
                prompt, new = warmup_request(bundle, warm)
                took = sched.warm_up(prompt, new, bundle.methods())
                threads.append("warm-up " + ", ".join(f"{m} {s:.1f} s" for m, s in took.items()))
            sched.configure_kv(int(_param(cfg, "kv_cache_bytes", "0") or 0),
                               int(_param(cfg, "prefill_chunk", "0") or 0))
            budget = int(_param(cfg, "prompt_cache_bytes", "0") or 0)  # after the warm-up: it leaves no entry
            if budget > 0:
                sched.use_prompt_cache(PromptCache(budget, self.block_tokens))
                threads.append(f"prompt cache {budget / 2**30:.2f} GiB")
            return sched

        self.block_tokens = int(_param(cfg, "prompt_cache_block_tokens", "64") or 64)
        self.stream_gap_s = float(_param(cfg, "stream_interval_ms", "") or STREAM_GAP_S * 1e3) / 1e3  # spec triton.
        self.max_batch_size = int(_param(cfg, "max_rows", "0") or 0) or int(cfg.get("max_batch_size", 0)) or 1
        # Both served models map one copy of the laid-out weights (pipeline/runtime/shared.py), not one copy each.
        os.environ["PIPELINE_SHARED_WEIGHTS"] = "1" if _param(cfg, "shared_weights", "true") == "true" else "0"
        # Responses, cancellation checks and the metrics' counts go out from one thread of their own, in the order the
        # decode thread made them (a request's counts before its final response): it never waits on those round trips.
        self.outbox = Outbox(self._log)
        self.scheduler = Scheduler.on_own_thread(setup)  # nothing is counted before a request arrives
        bundle = self.scheduler.bundle
        # The spec's speculation block, as the repository wrote it; 'auto' takes the k measured at build time.
        bundle.use(SpecDecodeConfig.from_params(lambda key, default: _param(cfg, key, default),
                                                bundle.max_draft_len, bundle.measured_k))
        self.methods = bundle.methods()
        self._metrics()
        if "medusa" in self.methods:
            self.methods.append("medusa_typical")  # Medusa's own (lossy) typical acceptance, for comparison
        prefer = _param(cfg, "default_method", "baseline").split(",")
        default_method = next((m for m in prefer if m in self.methods), "baseline")
        bc = bundle.config["build_config"]
        limits = Limits(
            max_batch_size=self.max_batch_size, max_input_len=int(bc["max_input_len"]),
            max_seq_len=int(bc["max_seq_len"]), vocab=int(bundle.target.cfg.vocab_size),
            end_ids=tuple(bundle.end_ids), methods=self.methods, default_method=default_method, spec=bundle.spec,
            default_exclude=_param(cfg, "exclude_input_in_output", "true") == "true",
            add_special_tokens=_param(cfg, "add_special_tokens", "true") == "true",
            decoupled=pb_utils.using_decoupled_model_transaction_policy(cfg))
        self.parser = RequestParser(bundle.tokenizer, limits)
        pb_utils.Logger.log_info(f"{self.model_name}: serving {self.methods} (default {default_method}; "
                                 f"{'decoupled' if limits.decoupled else 'not decoupled'}; {'; '.join(threads)}; "
                                 f"kernel path {kernels.path()})")

    @staticmethod
    def _log(level: str, msg: str) -> None:
        {"error": pb_utils.Logger.log_error, "warn": pb_utils.Logger.log_warn}.get(level, pb_utils.Logger.log_info)(msg)

    def _metrics(self) -> None:
        kind = pb_utils.MetricFamily.COUNTER
        self.families = {k: pb_utils.MetricFamily(name=n, description=d, kind=kind) for k, (n, d) in METRICS.items()}
        self.families.update({k: pb_utils.MetricFamily(name=n, description=d, kind=pb_utils.MetricFamily.GAUGE)
                              for k, (n, d) in GAUGES.items()})
        self.counters: dict = {}
        for what in ("requests", "proposed", "accepted", "output", "steps", "plain", "resumed", "errors",
                     "cancelled", "cancelled_tokens", "kv_reused_blocks", "kv_missed_blocks", "prompt_reused",
                     "prompt_computed"):
            for method in self.methods:
                self._count(what, method, 0)
        for what in GAUGES:
            self._count(what, "", 0)

    def _count_later(self, what: str, method: str, value: float) -> None:
        """The scheduler's counts: each is an IPC round trip to the server, made on the outbox's thread."""
        self.outbox.post(lambda: self._count(what, method, value),
                         lambda e: self._log("warn", f"metric {what}: {type(e).__name__}: {e}"))

    def _count(self, what: str, method: str, value: float) -> None:
        key = (what, method)
        if key not in self.counters:
            labels = {"model": self.model_name} if what in GAUGES else {"model": self.model_name, "method": method}
            self.counters[key] = self.families[what].Metric(labels=labels)
        if what in GAUGES:
            self.counters[key].set(float(value))
        elif value > 0:
            self.counters[key].increment(float(value))

    def execute(self, requests):
        from pipeline.triton.parse import BadRequest  # after _add_paths (initialize ran it); cached by now
        from pipeline.triton.replies import PostedResponder  # as above: the project is reachable after _add_paths

        for request in requests:
            out = PostedResponder(TritonResponder(request.get_response_sender(), self.block_tokens), self.outbox,
                                  self.stream_gap_s)
            get = lambda name, r=request: (lambda t: None if t is None else t.as_numpy())(  # noqa: E731
                pb_utils.get_input_tensor_by_name(r, name))
            try:
                parsed = self.parser.parse(get, request.request_id())
            except BadRequest as e:
                self._reject(out, str(e))
            except Exception as e:  # noqa: BLE001 - a bad request must never take the model down
                self._log("error", f"could not parse a request: {type(e).__name__}: {e}")
                self._reject(out, f"could not parse the request: {type(e).__name__}: {e}")
            else:
                self.scheduler.submit(parsed, out)
        return None

    def _reject(self, out, msg: str) -> None:
        self.scheduler.reject(out, msg)

    def finalize(self) -> None:
        self.scheduler.close()
        self.outbox.close()  # what the scheduler answered last (cancellations at shutdown) goes out first
        g = self.gate
        pb_utils.Logger.log_info(f"{self.model_name}: step lock taken {g.acquisitions} times, waited {g.waited_s:.1f}s "
                                 f"for it, handed it over {g.handoffs} times")
        g.close()
