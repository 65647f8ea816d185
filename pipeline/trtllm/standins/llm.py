"""Stand-in for tensorrtllm_backend's `tensorrt_llm` / `tensorrt_llm_draft` model, backed by the torch runtime.

Installed by pipeline.trtllm.harness into a generated repository in place of the C++
backend (only `backend:` changes in its config.pbtxt, plus `standin_*` parameters), so the
repository's own I/O declarations are what tritonserver enforces. It honours what the v0.18
backend does with them (inflight_batcher_llm/src/utils.cc, model_instance_state.cc):

- inputs `input_ids` [B, L] (padded; `input_lengths` gives each row's length), `request_output_len`,
  `end_id`, `pad_id`, `draft_input_ids`, `draft_logits` [B, K, vocab], `streaming`,
  `exclude_input_in_output` (the request overrides the config parameter),
  `return_generation_logits`, sampling inputs (`temperature`, `runtime_top_k`, `runtime_top_p`,
  `random_seed`), `stop_words_list` [B, 2, n];
- outputs `output_ids` [B, 1, L] and `sequence_length` [B, 1] (prompt included unless excluded),
  `cum_log_probs`, `output_log_probs`, `generation_logits` [B, 1, new, vocab] when requested;
- a request of batch > 1, or with `streaming`, needs decoupled mode (an error otherwise);
  streaming sends one response per token carrying that token only;
- `draft_input_ids` needs an engine built with draft_tokens_external (`standin_mode`); the target
  returns the accepted draft tokens plus its own next token (greedy token matching; with
  `draft_logits` the shape is checked, acceptance stays greedy here);
- a Medusa engine (`decoding_mode: medusa`) decodes with the torch runtime's Medusa tree built
  from the config's `medusa_choices` string ("{0}, {0, 0}, ..."), greedy as TensorRT-LLM's.
Requests that arrive together are decoded as one batch (in-flight batching's effect on a CPU).
"""

import ast
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _param(params: dict, key: str, default: str = "") -> str:
    v = params.get(key, {}).get("string_value", "")
    return default if v == "" or v.startswith("${") else v


def parse_choices(text: str) -> list[list[int]]:
    """medusa_choices in the backend's brace format, "{0}, {0, 0}", as the python backend reads it."""
    return [list(p) for p in ast.literal_eval("[" + text.replace("{", "[").replace("}", "]") + "]")]


class BadRequest(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = cfg.get("parameters", {})
        sys.path[:0] = [x for x in _param(p, "python_path").split(":") if x and x not in sys.path]
        # lazy: the project and its venv are on sys.path only after the line above (inside tritonserver)
        import torch

        from pipeline.runtime.engine_io import load_engine

        torch.set_num_threads(1)
        self.torch = torch
        self.name = cfg["name"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.exclude_default = _param(p, "exclude_input_in_output", "false").lower() in ("true", "1", "yes")
        self.mode = _param(p, "standin_mode", "none")
        eng = load_engine(Path(_param(p, "standin_engine_dir")))
        self.model = eng.model
        self.vocab = self.model.cfg.vocab_size
        self.medusa = None
        if _param(p, "decoding_mode") == "medusa":
            from pipeline.runtime.medusa import load_heads_dir, make_engine  # lazy: after sys.path, as above

            heads = load_heads_dir(Path(_param(p, "standin_medusa_dir")), self.model,
                                   log=lambda *a: None)
            choices = parse_choices(_param(p, "medusa_choices"))
            self.medusa = make_engine(heads, choices, len(choices))
        self.calls = 0

    # -- parsing -------------------------------------------------------------------------------------

    def _rows(self, request) -> list[dict]:
        ins = {t.name(): t.as_numpy() for t in request.inputs()}
        ids, lens = ins["input_ids"], ins["input_lengths"].reshape(-1)
        B = ids.shape[0]
        streaming = bool(ins.get("streaming", np.zeros(1, bool)).reshape(-1)[0])
        if B > 1 and not self.decoupled:
            raise BadRequest(f"{self.name}: a request with batch size {B} > 1 needs decoupled mode "
                             "(tensorrtllm_backend utils.cc); send one row per request")
        if streaming and not self.decoupled:
            raise BadRequest(f"{self.name}: streaming requires decoupled mode (decoupled_mode: true)")
        draft = ins.get("draft_input_ids")
        if draft is not None and draft.size and self.mode != "draft_tokens_external":
            raise BadRequest(f"{self.name}: draft_input_ids sent to an engine built without "
                             "--speculative_decoding_mode draft_tokens_external")
        logits = ins.get("draft_logits")
        rows = []
        for b in range(B):
            r = {"prompt": ids[b][: int(lens[b])].tolist(),
                 "n": int(ins["request_output_len"].reshape(-1)[b]),
                 "end_id": int(ins["end_id"].reshape(-1)[b]) if "end_id" in ins else -1,
                 "pad_id": int(ins["pad_id"].reshape(-1)[b]) if "pad_id" in ins else 0,
                 "draft": [] if draft is None else draft[b].tolist(),
                 "exclude": bool(ins["exclude_input_in_output"].reshape(-1)[b])
                 if "exclude_input_in_output" in ins else self.exclude_default,
                 "gen_logits": bool(ins["return_generation_logits"].reshape(-1)[b])
                 if "return_generation_logits" in ins else False,
                 "log_probs": bool(ins["return_log_probs"].reshape(-1)[b]) if "return_log_probs" in ins else False,
                 # TensorRT-LLM samples greedily unless top_k or top_p is given (temperature alone is not enough).
                 "temperature": float(ins["temperature"].reshape(-1)[b])
                 if "temperature" in ins and ("runtime_top_k" in ins or "runtime_top_p" in ins) else 0.0,
                 "top_k": int(ins["runtime_top_k"].reshape(-1)[b]) if "runtime_top_k" in ins else 0,
                 "top_p": float(ins["runtime_top_p"].reshape(-1)[b]) if "runtime_top_p" in ins else 1.0,
                 "seed": int(ins["random_seed"].reshape(-1)[b]) if "random_seed" in ins else 0,
                 "streaming": streaming}
            if r["n"] < 1:
                raise BadRequest(f"{self.name}: request_output_len must be positive, got {r['n']}")
            if logits is not None and r["draft"]:
                shape = tuple(logits[b].shape)
                if shape != (len(r["draft"]), self.vocab):
                    raise BadRequest(f"{self.name}: draft_logits shape {shape} != (draft tokens "
                                     f"{len(r['draft'])}, vocab {self.vocab})")
            rows.append(r)
        return rows

    # -- decoding ------------------------------------------------------------------------------------

    def _requests(self, rows: list[dict]):
        # lazy: the project is on sys.path only once initialize has run (inside tritonserver)
        from pipeline.runtime.generate import Request
        from pipeline.runtime.sampling import SamplingParams

        out = []
        for r in rows:
            params = SamplingParams(temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"], seed=r["seed"])
            out.append(Request(list(r["prompt"]), r["n"], params, end_ids=(r["end_id"],) if r["end_id"] >= 0 else ()))
        return out

    def _decode(self, rows: list[dict], on_emit=None) -> list[list[int]]:
        # lazy: the project is on sys.path only once initialize has run (inside tritonserver)
        from pipeline.runtime.generate import generate
        from pipeline.runtime.medusa import medusa_generate

        out: list[list[int] | None] = [None] * len(rows)
        # Greedy verification of draft tokens: one forward over prompt + draft, as the engine does.
        for b, r in enumerate(rows):
            if r["draft"] and r["temperature"] == 0.0 and on_emit is None:
                out[b] = self._verify(r)
        rest = [b for b in range(len(rows)) if out[b] is None]
        if rest:
            reqs = self._requests([rows[b] for b in rest])
            if self.medusa is not None:
                results = medusa_generate(self.model, self.medusa, reqs, on_emit)
            else:
                results = generate(self.model, reqs, on_emit)
            for b, res in zip(rest, results):
                tokens = list(res.tokens)
                if rows[b]["draft"]:  # sampled: the target's own tokens, cut after the first disagreement
                    a = 0
                    while a < len(rows[b]["draft"]) and a < len(tokens) and rows[b]["draft"][a] == tokens[a]:
                        a += 1
                    tokens = tokens[: a + 1]
                out[b] = tokens
        return out

    def _verify(self, r: dict) -> list[int]:
        """Accepted draft tokens plus the target's next token (greedy token matching)."""
        draft = r["draft"][: r["n"] - 1]
        best = self._logits(r["prompt"], draft + [0]).argmax(-1).tolist()
        a = 0
        while a < len(draft) and draft[a] == best[a]:
            a += 1
        out = draft[:a] + [best[a]]
        if r["end_id"] in out:
            out = out[: out.index(r["end_id"]) + 1]
        return out

    def _logits(self, prompt: list[int], tokens: list[int]) -> np.ndarray:
        """The logits that produced each of `tokens` after `prompt` [len(tokens), vocab] (generation logits)."""
        torch = self.torch
        seq = prompt + tokens
        cache = self.model.new_cache(1, (len(seq) + 63) // 64 * 64)
        with torch.inference_mode():
            hidden = self.model(torch.tensor([seq]), torch.arange(len(seq))[None], cache)
            logits = self.model.logits(hidden[0, len(prompt) - 1: len(seq) - 1])
        return logits.float().numpy()

    def _response(self, rows: list[dict], toks: list[list[int]], stream_piece: bool = False):
        seqs = [(t if (r["exclude"] or stream_piece) else r["prompt"] + t) for r, t in zip(rows, toks)]
        width = max(1, max(len(s) for s in seqs))
        ids = np.full((len(rows), 1, width), rows[0]["pad_id"], np.int32)
        for b, s in enumerate(seqs):
            ids[b, 0, : len(s)] = s
        lens = np.array([[len(s)] for s in seqs], np.int32)
        new = max(1, max(len(t) for t in toks))
        out = [pb_utils.Tensor("output_ids", ids), pb_utils.Tensor("sequence_length", lens),
               pb_utils.Tensor("cum_log_probs", np.zeros((len(rows), 1), np.float32)),
               pb_utils.Tensor("output_log_probs", np.zeros((len(rows), 1, new), np.float32))]
        if any(r["gen_logits"] for r in rows) and not stream_piece:
            g = np.zeros((len(rows), 1, new, self.vocab), np.float32)
            for b, (r, t) in enumerate(zip(rows, toks)):
                if t:
                    g[b, 0, : len(t)] = self._logits(r["prompt"], t)
            out.append(pb_utils.Tensor("generation_logits", g))
        return pb_utils.InferenceResponse(output_tensors=out)

    def execute(self, requests):
        self.calls += 1
        parsed, answers = [], [None] * len(requests)
        for j, request in enumerate(requests):
            try:
                parsed.append((j, self._rows(request)))
            except BadRequest as e:
                answers[j] = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e)))
        plain = [(j, rows) for j, rows in parsed if not rows[0]["streaming"]]
        if plain:
            flat = [r for _, rows in plain for r in rows]
            toks = self._decode(flat)
            i = 0
            for j, rows in plain:
                answers[j] = self._response(rows, toks[i: i + len(rows)])
                i += len(rows)
        for j, rows in parsed:
            if rows[0]["streaming"]:
                sender = requests[j].get_response_sender()

                def emit(row, tokens, rows=rows, sender=sender):
                    if tokens:
                        toks = [list(tokens) if b == row else [] for b in range(len(rows))]
                        sender.send(self._response(rows, toks, stream_piece=True))

                self._decode(rows, on_emit=emit)
                sender.send(flags=FINAL)
        if not self.decoupled:
            return answers
        for j, request in enumerate(requests):
            if answers[j] is not None:
                request.get_response_sender().send(answers[j], flags=FINAL)
        return None
