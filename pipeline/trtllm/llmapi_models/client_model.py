"""The project's client contract over Triton's llmapi `tensorrt_llm` model (served as `ensemble` / `tensorrt_llm_bls`).

Takes the contract's request (pipeline/contract.py: text_input, max_tokens, stream, sampling inputs, method,
num_draft_tokens, return_perf_metrics, exclude_input_in_output, stop) and calls `tensorrt_llm` by BLS with the
pinned names (text_input, streaming, sampling_param_*). The llmapi model streams the text so far in each
response (`streamed_text: cumulative`), so this model sends the new part; it always asks for perf metrics, which
that model returns as strings, and answers acceptance_rate / total_accepted_draft_tokens / total_draft_tokens as
numbers, plus num_input_tokens / num_output_tokens counted with the target's tokenizer (the output count
re-tokenizes the text). One LLM holds one speculative_config: a request naming another method or draft length
is refused with the served one named. Runs in the container's python (numpy, transformers) and here.
"""

import json
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class BadRequest(ValueError):
    pass


def _param(params: dict, key: str, default: str = "") -> str:
    v = params.get(key, {}).get("string_value", "")
    return default if v == "" else v


def _scalar(ins: dict, name: str):
    a = ins.get(name)
    if a is None:
        return None
    if a.size != 1:
        raise BadRequest(f"{name}: expected one value per request (batch 1), got shape {list(a.shape)}")
    v = a.reshape(-1)[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v


def _number(v) -> float:
    if isinstance(v, (bytes, np.bytes_)):
        v = v.decode()
    return float(v)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = cfg.get("parameters", {})
        sys.path[:0] = [x for x in _param(p, "python_path").split(":") if x and x not in sys.path]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.llm = _param(p, "llm_model", "tensorrt_llm")
        self.method = _param(p, "method", "draft_target")
        self.k = int(_param(p, "num_draft_tokens", "0"))
        self.cumulative = _param(p, "streamed_text", "cumulative") == "cumulative"
        from transformers import AutoTokenizer  # lazy: the venv is on sys.path only after the python_path line

        self.tok = AutoTokenizer.from_pretrained(_param(p, "tokenizer_dir"))

    # -- request -> the llmapi model's inputs ---------------------------------------------------------

    def _parse(self, request) -> dict:
        ins = {t.name(): t.as_numpy() for t in request.inputs()}
        if _scalar(ins, "stop"):
            return {"stop": True}
        text = _scalar(ins, "text_input")
        if text is None:
            raise BadRequest("text_input is required (the prompt, one string)")
        max_tokens = _scalar(ins, "max_tokens")
        if max_tokens is None or int(max_tokens) < 1:
            raise BadRequest(f"max_tokens: got {max_tokens!r}; send a positive integer")
        method = _scalar(ins, "method")
        if method not in (None, "", self.method):
            raise BadRequest(f"method: got {method!r}; this deployment's LLM runs {self.method!r} (TensorRT-LLM's "
                             "speculative_config is fixed when the LLM loads: serve another spec for another method)")
        k = _scalar(ins, "num_draft_tokens")
        if k is not None and int(k) != self.k:
            raise BadRequest(f"num_draft_tokens: got {int(k)}; the LLM was loaded with max_draft_len {self.k} "
                             "(speculative_config), which every request uses")
        seed = _scalar(ins, "seed")
        if seed is None:
            seed = _scalar(ins, "random_seed")
        stop_words = ins.get("stop_words")
        exclude = _scalar(ins, "exclude_input_in_output")
        return {"text": text, "max_tokens": int(max_tokens), "stream": bool(_scalar(ins, "stream") or False),
                "temperature": _scalar(ins, "temperature"), "top_k": _scalar(ins, "top_k"),
                "top_p": _scalar(ins, "top_p"), "seed": seed,
                "stop_words": [w.decode() if isinstance(w, bytes) else str(w) for w in stop_words.reshape(-1)]
                if stop_words is not None else None,
                "perf": bool(_scalar(ins, "return_perf_metrics") or False),
                "exclude": True if exclude is None else bool(exclude), "request_id": request.request_id()}

    def _llm_request(self, r: dict, streaming: bool):
        def t(name, value, dtype):
            return pb_utils.Tensor(name, np.asarray(value, dtype=dtype))

        ins = [t("text_input", [r["text"].encode()], np.object_), t("streaming", [streaming], bool),
               t("sampling_param_max_tokens", [r["max_tokens"]], np.int32),
               t("sampling_param_return_perf_metrics", [True], bool),
               t("sampling_param_exclude_input_from_output", [True], bool)]
        for key, dtype in (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
                           ("seed", np.uint64)):
            if r.get(key) is not None:
                ins.append(t(f"sampling_param_{key}", [r[key]], dtype))
        if r.get("stop_words"):
            ins.append(t("sampling_param_stop", [w.encode() for w in r["stop_words"]], np.object_))
        return pb_utils.InferenceRequest(model_name=self.llm, inputs=ins, requested_output_names=[
            "text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"],
            request_id=r.get("request_id") or "")

    # -- responses -------------------------------------------------------------------------------------

    def _response(self, text: str, perf: dict | None, r: dict, final_text: str | None):
        out = [pb_utils.Tensor("text_output", np.asarray([[text.encode("utf-8")]], dtype=np.object_))]
        if perf is not None and final_text is not None:
            n_in = len(self.tok.encode(r["text"], add_special_tokens=True))
            n_out = len(self.tok.encode(final_text, add_special_tokens=False)) if final_text else 0
            out += [pb_utils.Tensor("acceptance_rate", np.asarray([[perf.get("acceptance_rate", 0.0)]], np.float32)),
                    pb_utils.Tensor("total_accepted_draft_tokens",
                                    np.asarray([[int(perf.get("total_accepted_draft_tokens", 0))]], np.int32)),
                    pb_utils.Tensor("total_draft_tokens", np.asarray([[int(perf.get("total_draft_tokens", 0))]],
                                                                     np.int32)),
                    pb_utils.Tensor("num_input_tokens", np.asarray([[n_in]], np.int32)),
                    pb_utils.Tensor("num_output_tokens", np.asarray([[n_out]], np.int32))]
        return pb_utils.InferenceResponse(output_tensors=out)

    def _run(self, request, sender=None):
        """One request: the BLS call, each piece sent (decoupled) or the whole answer returned."""
        r = self._parse(request)
        if r.get("stop"):
            stop = pb_utils.InferenceRequest(model_name=self.llm, inputs=[
                pb_utils.Tensor("stop", np.asarray([True]))], requested_output_names=["text_output"],
                request_id=request.request_id())
            for _ in stop.exec(decoupled=True):
                pass
            return pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.asarray([[b""]], dtype=np.object_))])
        streaming = bool(r["stream"] and sender is not None)
        prefix = "" if r["exclude"] else r["text"]
        text, perf, sent = "", None, 0
        responses = self._llm_request(r, streaming).exec(decoupled=True)
        for resp in responses:
            if resp.has_error():
                raise RuntimeError(f"{self.llm}: {resp.error().message()}")
            t = pb_utils.get_output_tensor_by_name(resp, "text_output")
            if t is not None:
                piece = b"".join(v if isinstance(v, bytes) else str(v).encode() for v in t.as_numpy().reshape(-1))
                piece = piece.decode("utf-8", errors="replace")
                text = piece if self.cumulative else text + piece
            got = {}
            for name in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"):
                a = pb_utils.get_output_tensor_by_name(resp, name)
                if a is not None:
                    got[name] = _number(a.as_numpy().reshape(-1)[0])
            if got:
                perf = got
            if streaming and len(text) > sent:
                if sender.is_cancelled():
                    if hasattr(responses, "cancel"):
                        responses.cancel()
                    return None
                sender.send(self._response((prefix if sent == 0 else "") + text[sent:], None, r, None))
                sent = len(text)
        perf = perf or {}
        if streaming:
            return self._response("", perf, r, text)
        return self._response(prefix + text, perf, r, text)

    def _serve(self, request):
        sender = request.get_response_sender()
        try:
            resp = self._run(request, sender)
            if resp is None:
                sender.send(flags=FINAL)
            else:
                sender.send(resp, flags=FINAL)
        except Exception as e:  # noqa: BLE001 (every failure goes back to its own client)
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)

    def execute(self, requests):
        if self.decoupled:
            for req in requests:
                threading.Thread(target=self._serve, args=(req,), daemon=True).start()
            return None
        out = []
        for req in requests:
            try:
                out.append(self._run(req))
            except Exception as e:  # noqa: BLE001
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        return out

    def finalize(self):
        pass
