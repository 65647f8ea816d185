"""Stand-in of Triton's llmapi `tensorrt_llm/1/model.py` (TensorRT-LLM 1.2.1), written from its documented I/O.

Installed by pipeline.trtllm.harness in place of the container's model.py (and helpers.py), so a generated
llmapi repository loads in the real tritonserver here; it imports `tensorrt_llm` from the CPU stand-in package.
What it does, as the pinned model.py does (era.LLMAPI_ERA sources [M], [H]):
- `auto_complete_config`: max_batch_size and the decoupled policy from model.yaml's `triton_config`;
- `initialize`: every model.yaml key but `triton_config` through `update_llm_args_with_extra_dict` into `LLM(...)`
  (model.yaml from `$LLM_CONFIG_PATH`, default `model.yaml` beside this file);
- a request: `text_input` (one prompt, 1-D), `streaming`, `sampling_param_*` into `SamplingParams` (best_of 1,
  exclude_input_from_output and return_perf_metrics false unless sent), `return_finish_reason` /
  `return_stop_reason` / `return_cumulative_logprob`; `stop` with a request id aborts that request;
- streaming needs decoupled mode ("Streaming is only supported in decoupled mode."); each streamed response
  carries the text so far; the perf outputs (kv cache, timing, acceptance) go out as strings when
  return_perf_metrics is set; errors come back with text_output "N/A".
"""

import json
import os
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SAMPLING = ("best_of", "temperature", "top_k", "top_p", "frequency_penalty", "presence_penalty", "max_tokens", "seed",
            "exclude_input_from_output", "return_perf_metrics")
SAMPLING_DEFAULTS = {"best_of": 1, "exclude_input_from_output": False, "return_perf_metrics": False}
OUTPUT_FLAGS = {"return_finish_reason": ("finish_reason", "finish_reason"),
                "return_stop_reason": ("stop_reason", "stop_reason"),
                "return_cumulative_logprob": ("cumulative_logprob", "cumulative_logprob")}


def _yaml(include=None, exclude=None) -> dict:
    path = os.path.join(pb_utils.get_model_dir(), os.environ.get("LLM_CONFIG_PATH", "model.yaml"))
    with open(path) as f:
        cfg = yaml.safe_load(f)
    if include:
        cfg = {k: v for k, v in cfg.items() if k in include}
    if exclude:
        cfg = {k: v for k, v in cfg.items() if k not in exclude}
    return cfg


def _scalar(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy()
    if a.size != 1:
        raise pb_utils.TritonModelException(f"Expected a scalar tensor for tensor {name}")
    return a.item(0)


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        tc = _yaml(include=["triton_config"])["triton_config"]
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(tc["decoupled"])))
        auto_complete_model_config.set_max_batch_size(int(tc["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        extra = cfg.get("parameters", {}).get("python_path", {}).get("string_value", "")
        sys.path[:0] = [x for x in extra.split(":") if x and x not in sys.path]
        # lazy: tensorrt_llm (the container's, or the stand-in) is on sys.path only after the line above
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

        self.decoupled = bool(_yaml(include=["triton_config"])["triton_config"]["decoupled"])
        if self.decoupled != pb_utils.using_decoupled_model_transaction_policy(cfg):
            raise pb_utils.TritonModelException("model.yaml triton_config.decoupled disagrees with config.pbtxt")
        self.llm = LLM(**update_llm_args_with_extra_dict({}, _yaml(exclude=["triton_config"])))
        self.lock = threading.Lock()
        self.by_user_id: dict[str, list] = {}

    def _convert(self, request):
        from tensorrt_llm import SamplingParams  # lazy: importable once initialize has set sys.path

        t = pb_utils.get_input_tensor_by_name(request, "text_input")
        if t is None:
            raise pb_utils.TritonModelException("text_input is missing from the request")
        a = t.as_numpy()
        if len(a.shape) > 1:
            raise pb_utils.TritonModelException(
                "The current implementation only supports text_input being a 1D tensor.")
        prompt = a[0].decode("utf-8") if isinstance(a[0], bytes) else str(a[0])
        kw = {}
        for arg in SAMPLING:
            v = _scalar(request, f"sampling_param_{arg}")
            if v is None and arg in SAMPLING_DEFAULTS:
                v = SAMPLING_DEFAULTS[arg]
            if v is not None:
                kw[arg] = v
        stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
        if stop is not None:
            kw["stop"] = [s.decode() if isinstance(s, bytes) else str(s) for s in stop.as_numpy().reshape(-1)]
        flags = {k: bool(_scalar(request, k) or False) for k in OUTPUT_FLAGS}
        return prompt, SamplingParams(**kw), bool(_scalar(request, "streaming") or False), flags

    def _response(self, out, flags):
        o = out.outputs[0]
        tensors = [pb_utils.Tensor("text_output", np.asarray([o.text.encode("utf-8")], dtype=np.object_))]
        for key, (name, attr) in OUTPUT_FLAGS.items():
            if flags[key]:
                tensors.append(pb_utils.Tensor(name, np.asarray([str(getattr(o, attr))], dtype=np.object_)))
        pm = o.request_perf_metrics
        if pm:
            kv, tm, sd = pm.kv_cache_metrics, pm.timing_metrics, pm.speculative_decoding
            values = {"kv_cache_reused_block": kv.num_reused_blocks, "kv_cache_hit_rate": kv.kv_cache_hit_rate,
                      "kv_cache_alloc_new_blocks": kv.num_new_allocated_blocks,
                      "kv_cache_alloc_total_blocks": kv.num_total_allocated_blocks,
                      "kv_cache_missed_block": kv.num_missed_blocks,
                      "arrival_time_ns": int(tm.arrival_time.total_seconds() * 1e9),
                      "first_scheduled_time_ns": int(tm.first_scheduled_time.total_seconds() * 1e9),
                      "first_token_time_ns": int(tm.first_token_time.total_seconds() * 1e9),
                      "last_token_time_ns": int(tm.last_token_time.total_seconds() * 1e9),
                      "acceptance_rate": sd.acceptance_rate,
                      "total_accepted_draft_tokens": sd.total_accepted_draft_tokens,
                      "total_draft_tokens": sd.total_draft_tokens}
            for name, v in values.items():  # as the pinned model.py: with text_output's dtype (strings)
                tensors.append(pb_utils.Tensor(name, np.asarray([str(v).encode()], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _serve(self, request):
        sender = request.get_response_sender()
        user_id = request.request_id()
        try:
            if _scalar(request, "stop"):
                if not user_id:
                    raise pb_utils.TritonModelException("A request id must be provided for request cancellation")
                with self.lock:
                    for out in self.by_user_id.pop(user_id, []):
                        out.abort()
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "Request cancelled by client", pb_utils.TritonError.CANCELLED)), flags=FINAL)
                return
            prompt, sp, streaming, flags = self._convert(request)
            if streaming and not self.decoupled:
                raise pb_utils.TritonModelException("Streaming is only supported in decoupled mode.")
            out = self.llm.generate_async(prompt, sp, streaming)
            if user_id:
                with self.lock:
                    self.by_user_id.setdefault(user_id, []).append(out)
            last = None
            for last in out:
                if request.is_cancelled():
                    out.abort()
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "Request cancelled by client", pb_utils.TritonError.CANCELLED)), flags=FINAL)
                    return
                if streaming:
                    sender.send(self._response(last, flags), flags=FINAL if last.finished else 0)
            if not streaming:
                sender.send(self._response(last, flags), flags=FINAL)
        except Exception as e:  # noqa: BLE001 (as the pinned model.py: the error with text_output "N/A")
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("text_output", np.asarray(["N/A"], dtype=np.object_))],
                error=pb_utils.TritonError(f"Error generating request: {e}")), flags=FINAL)
        finally:
            if user_id:
                with self.lock:
                    self.by_user_id.pop(user_id, None)

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def finalize(self):
        pass
