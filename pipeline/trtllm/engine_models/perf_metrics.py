"""perf_metrics: per-response token counts and speculation statistics for the ensemble.

Written into the repository by pipeline.trtllm.engine_repo. tensorrtllm_backend v0.18 reports no
per-request acceptance: with a Medusa engine the ensemble speculates but the three statistics are
-1 ("not reported"); elsewhere the ensemble runs the target alone, so they are 0.
num_input_tokens and num_output_tokens are exact.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(params: dict, key: str, default: str) -> str:
    return params.get(key, {}).get("string_value", default) or default


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.exclude_default = _param(params, "exclude_input_in_output", "false").lower() in ("1", "true", "yes")
        self.speculates = _param(params, "method", "baseline") != "baseline"

    def execute(self, requests):
        responses = []
        for request in requests:
            n_in = pb_utils.get_input_tensor_by_name(request, "REQUEST_INPUT_LEN").as_numpy().reshape(-1)
            seq = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            seq = seq.reshape(seq.shape[0], -1)[:, 0]
            excl = pb_utils.get_input_tensor_by_name(request, "exclude_input_in_output")
            exclude = bool(excl.as_numpy().reshape(-1)[0]) if excl is not None else self.exclude_default
            n_out = seq if exclude else np.maximum(seq - n_in, 0)
            rows = n_in.shape[0]
            stat = -1 if self.speculates else 0
            out = [
                pb_utils.Tensor("num_input_tokens", n_in.astype(np.int32).reshape(rows, 1)),
                pb_utils.Tensor("num_output_tokens", n_out.astype(np.int32).reshape(rows, 1)),
                pb_utils.Tensor("acceptance_rate", np.full((rows, 1), float(stat), np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", np.full((rows, 1), stat, np.int32)),
                pb_utils.Tensor("total_draft_tokens", np.full((rows, 1), stat, np.int32)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=out))
        return responses
