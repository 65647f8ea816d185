"""Stand-in for tensorrtllm_backend v0.18's `postprocessing` model.

TOKENS_BATCH [batch, beams, tokens] and SEQUENCE_LENGTH [batch, beams] in; OUTPUT (one string per
beam, `batch_decode` of tokens[:sequence_length], skip_special_tokens from the config) out, as the
original; any other input is an error there too.
"""

import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = cfg["parameters"]
        path = params.get("python_path", {}).get("string_value", "")
        sys.path[:0] = [x for x in path.split(":") if x and x not in sys.path]
        from transformers import AutoTokenizer  # lazy: the venv is on sys.path only after the line above

        skip = params.get("skip_special_tokens", {}).get("string_value", "true").lower()
        self.skip_special_tokens = skip in ("true", "1", "t", "y", "yes")
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"]["string_value"], legacy=False,
                                                       padding_side="left")
        self.output_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(cfg, "OUTPUT")["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens, lengths = None, None
            for t in request.inputs():
                if t.name() == "TOKENS_BATCH":
                    tokens = t.as_numpy()
                elif t.name() == "SEQUENCE_LENGTH":
                    lengths = t.as_numpy()
                else:
                    raise ValueError(f"unknown input {t.name()}")
            seqs = [beam[: lengths[b][k]] for b, beams in enumerate(tokens) for k, beam in enumerate(beams)]
            texts = self.tokenizer.batch_decode(seqs, skip_special_tokens=self.skip_special_tokens)
            out = np.array([x.encode("utf8") for x in texts]).astype(self.output_dtype)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
        return responses
