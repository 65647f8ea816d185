"""request_check: the ensemble's first step; folds the project's names into the era's and refuses what it cannot do.

Written into the repository by pipeline.trtllm.engine_repo. tensorrtllm_backend v0.18's tensorrt_llm
model reads `random_seed` and `min_length`; the project's clients (and later backends) send `seed`
and `min_tokens`. Either name works here; both with different values is an error. It also answers,
before any engine runs, a `method` this ensemble does not serve (naming the model that does),
`num_draft_tokens` above 0 (the ensemble cannot run draft-target: tensorrt_llm_bls does), and
`disable_at_batch` above 0 where the engine speculates (in-flight batching cannot switch it off).
max_tokens passes through it to preprocessing, so nothing else runs until the check has passed.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

DEFAULT_SEED = 0  # TensorRT-LLM's default random seed
DEFAULT_MIN_LENGTH = 1  # and minimum output length


def _param(params: dict, key: str, default: str) -> str:
    return params.get(key, {}).get("string_value", default) or default


def _value(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy().reshape(t.as_numpy().shape[0], -1)[:, 0]


class BadRequest(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.method = _param(params, "method", "baseline")
        self.draft_model = _param(params, "draft_model", "false") == "true"
        self.elsewhere = {m: w for m, _, w in (x.partition("=") for x in _param(params, "other_methods", "").split(";")
                                              if x)}

    def _pick(self, request, later: str, era: str, default: int, dtype) -> np.ndarray:
        a, b = _value(request, later), _value(request, era)
        if a is not None and b is not None and not np.array_equal(a, b):
            raise BadRequest(f"{later} and {era} are the same setting and differ ({a.tolist()} vs {b.tolist()}): "
                             "send one of them")
        v = a if a is not None else b
        rows = _value(request, "max_tokens").shape[0]
        out = np.full((rows, 1), default, dtype) if v is None else v.astype(dtype).reshape(rows, 1)
        return out

    def _check(self, request) -> None:
        method = _value(request, "method")
        if method is not None:
            want = method[0].decode() if isinstance(method[0], bytes) else str(method[0])
            if want.strip() != self.method:
                where = self.elsewhere.get(want.strip())
                hint = f"send it to model {where}" if where else f"this deployment serves only {self.method!r} here"
                raise BadRequest(f"method: got {want!r}; the ensemble runs {self.method!r}: {hint}")
        k = _value(request, "num_draft_tokens")
        if k is not None and int(k.max()) > 0:
            if self.draft_model:
                raise BadRequest(f"num_draft_tokens: got {int(k.max())}; the ensemble runs the target alone "
                                 "(tensorrtllm_backend cannot do draft-target in an ensemble): send draft-target "
                                 "requests to tensorrt_llm_bls")
            raise BadRequest(f"num_draft_tokens: got {int(k.max())}; this deployment has no draft model"
                             + (" (the Medusa engine drafts by itself): leave it out" if self.method == "medusa"
                                else ": leave it out or send 0"))
        off = _value(request, "disable_at_batch")
        if off is not None and int(off.max()) > 0 and self.method != "baseline":
            raise BadRequest("disable_at_batch: tensorrtllm_backend's in-flight batching cannot switch speculation "
                             "off per batch; send 0 or leave it out")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                self._check(request)
                seed = self._pick(request, "seed", "random_seed", DEFAULT_SEED, np.uint64)
                min_len = self._pick(request, "min_tokens", "min_length", DEFAULT_MIN_LENGTH, np.int32)
            except BadRequest as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
                continue
            max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT_MAX_TOKENS", max_tokens), pb_utils.Tensor("OUT_RANDOM_SEED", seed),
                pb_utils.Tensor("OUT_MIN_LENGTH", min_len)]))
        return responses
