"""Stand-in for tensorrtllm_backend v0.18's `tensorrt_llm_bls` (lib/decode.py, lib/triton_decoder.py, model.py).

Written from reading those sources, for the harness of `tensorrt_llm.bls: nvidia` repositories. What
it shares with the original, because that is what a repository must survive:

- it reads the request tensors of v0.18's `input_names` (min_length, random_seed, ...) and nothing else;
- it asks `preprocessing` for all 13 `_preproc_outputs` (IS_VIDEO_INPUT included: a preprocessing
  config without it fails every request with "unexpected inference output");
- it sends the LLM models what `_get_llm_tensors` sends: the preprocessing tensors, the mapped
  request tensors (exclude_input_in_output passed through when the client sends it),
  `request_output_len`, `draft_input_ids` / `draft_logits`, `return_context_logits` and
  `return_generation_logits`, and requests the 11 `_llm_outputs`;
- draft-target (`num_draft_tokens` > 0): refuses `stream`, context logits and batch > 1, then loops
  as `_spec_generate` does: the draft gets `request_output_len = min_length = k` with
  k = min(num_draft_tokens, prompt + max_tokens - current - 1), the target the draft tokens and
  k + 1; output_ids are taken to hold the prompt; it stops at the length, when target and draft
  agree in full, when nothing changes, or at a stop word; text_output is the whole target output
  (prompt included);
- `postprocessing` gets TOKENS_BATCH = output_ids and SEQUENCE_LENGTH.
"""

import json
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
INPUT_NAMES = ["text_input", "decoder_text_input", "image_input", "image_bytes_input", "image_url_input",
               "video_bytes_input", "max_tokens", "bad_words", "stop_words", "end_id", "pad_id", "top_k", "top_p",
               "temperature", "length_penalty", "repetition_penalty", "min_length", "presence_penalty",
               "frequency_penalty", "random_seed", "return_log_probs", "return_context_logits",
               "return_generation_logits", "beam_width", "stream", "prompt_embedding_table", "prompt_vocab_size",
               "prompt_table_extra_id", "embedding_bias_words", "embedding_bias_weights", "num_draft_tokens",
               "use_draft_logits", "lora_task_id", "lora_weights", "lora_config", "exclude_input_in_output",
               "return_kv_cache_reuse_stats"]
PREPROC_OUTPUTS = ["INPUT_ID", "DECODER_INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_DECODER_INPUT_LEN", "BAD_WORDS_IDS",
                   "STOP_WORDS_IDS", "EMBEDDING_BIAS", "OUT_PAD_ID", "OUT_END_ID", "OUT_PROMPT_TABLE_EXTRA_IDS",
                   "PIXEL_VALUES", "IMAGE_SIZES", "IS_VIDEO_INPUT"]
PREPROC_TO_REQ = {"INPUT_ID": "input_ids", "DECODER_INPUT_ID": "decoder_input_ids",
                  "REQUEST_INPUT_LEN": "input_lengths", "BAD_WORDS_IDS": "bad_words_list",
                  "STOP_WORDS_IDS": "stop_words_list", "EMBEDDING_BIAS": "embedding_bias", "OUT_PAD_ID": "pad_id",
                  "OUT_END_ID": "end_id", "OUT_PROMPT_TABLE_EXTRA_IDS": "prompt_table_extra_ids"}
LLM_OUTPUTS = ["output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "context_logits",
               "generation_logits", "batch_index", "sequence_index", "kv_cache_alloc_new_blocks",
               "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks"]
REQ_TO_LLM = {"beam_width": "beam_width", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
              "temperature": "temperature", "length_penalty": "len_penalty",
              "repetition_penalty": "repetition_penalty", "min_length": "min_length",
              "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
              "random_seed": "random_seed", "return_log_probs": "return_log_probs", "stream": "streaming",
              "prompt_embedding_table": "prompt_embedding_table", "prompt_vocab_size": "prompt_vocab_size",
              "lora_task_id": "lora_task_id", "lora_weights": "lora_weights", "lora_config": "lora_config",
              "exclude_input_in_output": "exclude_input_in_output",
              "return_kv_cache_reuse_stats": "return_kv_cache_reuse_stats"}
SCALARS = {"max_tokens", "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty", "repetition_penalty",
           "min_length", "presence_penalty", "frequency_penalty", "random_seed", "return_log_probs",
           "return_context_logits", "return_generation_logits", "beam_width", "stream", "prompt_vocab_size",
           "num_draft_tokens", "use_draft_logits", "exclude_input_in_output", "return_kv_cache_reuse_stats"}
RESPONSE = ["cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index",
            "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks"]


def _param(params: dict, key: str, default=""):
    v = params.get(key, {}).get("string_value", "")
    return default if v.startswith("${") or v == "" else v


def _tensor(name: str, value: np.ndarray, scalar_name: str):
    # The original re-adds the batch dimension Triton's reshape removed (its __undo_reshape).
    if scalar_name in SCALARS and value.ndim == 1:
        value = np.expand_dims(value, 0)
    return pb_utils.Tensor(name, value)


def _exec(name: str, tensors: list, outputs: list[str]) -> dict:
    resp = pb_utils.InferenceRequest(model_name=name, inputs=tensors, requested_output_names=outputs).exec()
    if resp.has_error():
        raise pb_utils.TritonModelException(resp.error().message())
    return {t.name(): t.as_numpy() for t in resp.output_tensors()}


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = cfg["parameters"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.llm = _param(p, "tensorrt_llm_model_name", "tensorrt_llm")
        self.draft = _param(p, "tensorrt_llm_draft_model_name", None)

    def _preprocess(self, req: dict) -> dict:
        names = {"text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
                 "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
                 "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
                 "pad_id": "PAD_ID", "end_id": "END_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID"}
        tensors = [_tensor(n, req[k], k) for k, n in names.items() if req.get(k) is not None]
        out = _exec("preprocessing", tensors, PREPROC_OUTPUTS)
        return {PREPROC_TO_REQ[k]: v for k, v in out.items() if k in PREPROC_TO_REQ}

    def _llm(self, model: str, pre: dict, req: dict, out_len=None, draft=None, is_draft=False) -> dict:
        t = [pb_utils.Tensor(k, v) for k, v in pre.items()]
        t += [_tensor(REQ_TO_LLM[k], v, k) for k, v in req.items() if k in REQ_TO_LLM and v is not None]
        batch = req["text_input"].shape[0]
        if out_len is None and draft is not None:
            out_len = len(draft["ids"][0]) + 1 if draft.get("ids") is not None else 1
        lens = [[out_len]] * batch if out_len is not None else req["max_tokens"]
        t.append(pb_utils.Tensor("request_output_len", np.array(lens, np.int32)))
        use_logits = req.get("use_draft_logits") is not None and bool(req["use_draft_logits"].reshape(-1)[0])
        if draft and draft.get("ids") is not None:
            t.append(pb_utils.Tensor("draft_input_ids", draft["ids"]))
            if draft.get("logits") is not None and use_logits:
                t.append(pb_utils.Tensor("draft_logits", draft["logits"]))
        ctx, gen = [False], [False]
        if draft is None:
            if is_draft:
                gen = [use_logits]
            else:
                c, g = req.get("return_context_logits"), req.get("return_generation_logits")
                ctx = [False] if c is None else c.reshape(-1).tolist()
                gen = [False] if g is None else g.reshape(-1).tolist()
        t.append(pb_utils.Tensor("return_context_logits", np.array([ctx] * batch, dtype=bool)))
        t.append(pb_utils.Tensor("return_generation_logits", np.array([gen] * batch, dtype=bool)))
        return _exec(model, t, LLM_OUTPUTS)

    def _spec_generate(self, pre: dict, req: dict) -> dict:
        if pre["input_ids"].shape[0] > 1:
            raise Exception("Speculative decoding does not support batch size > 1.")
        prompt = pre["input_ids"][0][: int(pre["input_lengths"].reshape(-1)[0])]
        ids = prompt
        out_len = int(req["max_tokens"].reshape(-1)[0])
        k_req = int(req["num_draft_tokens"].reshape(-1)[0])
        draft_out, target = None, None
        cur = pre
        while True:
            k = min(k_req, len(prompt) + out_len - len(ids) - 1)
            draft = {}
            if k > 0:
                req["min_length"] = np.array([k], np.int32)
                d = self._llm(self.draft, cur, req, out_len=k, is_draft=True)
                seq = int(d["sequence_length"].reshape(-1)[0])
                draft_out = d["output_ids"][0][0]
                tokens = draft_out[len(ids):seq]
                if len(tokens):
                    draft["ids"] = np.expand_dims(tokens, 0)
                    logits = d.get("generation_logits")
                    if logits is not None:
                        draft["logits"] = np.expand_dims(logits[0][0][-len(tokens):], 0)
                req["min_length"] = None
            target = self._llm(self.llm, cur, req, draft=draft)
            last, ids = ids, target["output_ids"][0][0]
            cur = dict(pre, input_ids=np.expand_dims(ids, 0), input_lengths=np.array([[len(ids)]], np.int32))
            if len(ids) >= len(prompt) + out_len:
                break
            if draft_out is not None and np.array_equal(draft_out, ids):
                break
            if np.array_equal(last, ids):
                break
            stops = pre["stop_words_list"][0]
            if any(np.array_equal(ids[-len(s):], s) for s in stops if len(s)):
                break
        return target

    def _respond(self, gen: dict):
        text = _exec("postprocessing", [pb_utils.Tensor("TOKENS_BATCH", gen["output_ids"]),
                                        pb_utils.Tensor("SEQUENCE_LENGTH", gen["sequence_length"])],
                     ["OUTPUT"])["OUTPUT"]
        out = [pb_utils.Tensor("text_output", text)]
        out += [pb_utils.Tensor(n, gen[n]) for n in RESPONSE if gen.get(n) is not None]
        return pb_utils.InferenceResponse(output_tensors=out)

    def execute(self, requests):
        responses = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            try:
                req = {}
                for name in INPUT_NAMES:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        req[name] = t.as_numpy()
                if req.get("text_input") is None or req["text_input"].size == 0:
                    raise Exception("text_input is required")
                if req.get("max_tokens") is None or not req["max_tokens"].reshape(-1)[0] > 0:
                    raise Exception("max_tokens must be a single value > 0")
                k = req.get("num_draft_tokens")
                spec = k is not None and int(k.reshape(-1)[0]) > 0
                if spec:
                    if req.get("stream") is None:  # the original fails on `None.any()` here
                        raise Exception("'NoneType' object has no attribute 'any' (send stream with num_draft_tokens)")
                    if req["stream"].any():
                        raise Exception("streaming is not supported with speculative decoding")
                    ctx = req.get("return_context_logits")
                    if ctx is not None and bool(ctx.reshape(-1)[0]):
                        raise Exception("context logits are not supported with speculative decoding")
                    if not self.draft:
                        raise Exception("cannot perform speculative decoding without draft model")
                    if req["text_input"].shape[0] > 1:
                        raise Exception("speculative decoding is not supported with batch size > 1")
                pre = self._preprocess(req)
                gen = self._spec_generate(pre, req) if spec else self._llm(self.llm, pre, req)
                resp = self._respond(gen)
                if self.decoupled:
                    sender.send(resp)
                    sender.send(flags=FINAL)
                else:
                    responses.append(resp)
            except Exception:  # noqa: BLE001 - as the original: the traceback is the request's error
                err = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(traceback.format_exc()))
                if self.decoupled:
                    sender.send(err)
                    sender.send(flags=FINAL)
                else:
                    responses.append(err)
        return None if self.decoupled else responses
