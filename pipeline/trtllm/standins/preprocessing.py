"""Stand-in for tensorrtllm_backend v0.18's `preprocessing` model (text model path, no multimodal).

Reads what the original reads (QUERY, DECODER_QUERY, REQUEST_OUTPUT_LEN, BAD_WORDS_DICT,
STOP_WORDS_DICT, EMBEDDING_BIAS_WORDS/WEIGHTS, END_ID, PAD_ID, PROMPT_TABLE_EXTRA_ID) and answers
with what it answers: INPUT_ID (right-padded with the pad id), REQUEST_INPUT_LEN, DECODER_INPUT_ID,
REQUEST_DECODER_INPUT_LEN, BAD_WORDS_IDS / STOP_WORDS_IDS in the [batch, 2, n] word-list format,
EMBEDDING_BIAS, REQUEST_OUTPUT_LEN, OUT_END_ID, OUT_PAD_ID. Like the original, its initialize()
looks up the config of every output it may write and the parameters `tokenizer_dir`,
`add_special_tokens` and `visual_model_path`, so a config that lacks one fails to load.
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

        tokenizer_dir = params["tokenizer_dir"]["string_value"]
        _ = params["visual_model_path"]["string_value"]  # indexed unconditionally by the original
        add = params.get("add_special_tokens", {}).get("string_value", "true").lower()
        self.add_special_tokens = add in ("true", "1", "t", "y", "yes")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, legacy=False, padding_side="left")
        if not self.tokenizer.pad_token:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.end_id = self.tokenizer.encode(self.tokenizer.eos_token, add_special_tokens=False)[0]
        self.pad_id = self.tokenizer.encode(self.tokenizer.pad_token, add_special_tokens=False)[0]
        self.dtypes = {}
        for name in ("INPUT_ID", "DECODER_INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_DECODER_INPUT_LEN",
                     "BAD_WORDS_IDS", "STOP_WORDS_IDS", "OUT_END_ID", "OUT_PAD_ID", "OUT_PROMPT_TABLE_EXTRA_IDS",
                     "PIXEL_VALUES", "IMAGE_SIZES"):
            self.dtypes[name] = pb_utils.triton_string_to_numpy(
                pb_utils.get_output_config_by_name(cfg, name)["data_type"])
        for name in ("EMBEDDING_BIAS_WORDS", "EMBEDDING_BIAS_WEIGHTS"):
            pb_utils.get_input_config_by_name(cfg, name)["data_type"]  # noqa: B018 - must exist, as in the original

    def _ids(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seqs = [self.tokenizer.encode(q[0].decode(), add_special_tokens=self.add_special_tokens) for q in query]
        lens = np.array([[len(s)] for s in seqs], np.int32)
        width = max(len(s) for s in seqs)
        ids = np.array([s + [self.pad_id] * (width - len(s)) for s in seqs], np.int32)
        return ids, lens

    def _word_list(self, words, batch: int) -> np.ndarray:
        if words is None:
            return np.empty([batch, 2, 0], dtype=np.int32)
        flat, offsets = [], []
        for row in words:
            ids, offs = [], []
            for w in row:
                w = w.decode() if isinstance(w, bytes) else w
                t = self.tokenizer.encode(w, add_special_tokens=False)
                if t:
                    ids += t
                    offs.append(len(ids))
            flat.append(ids)
            offsets.append(offs)
        width = max(1, max(len(x) for x in flat))
        flat = [x + [0] * (width - len(x)) for x in flat]
        offsets = [x + [-1] * (width - len(x)) for x in offsets]
        return np.array([flat, offsets], dtype=np.int32).transpose((1, 0, 2))

    def _bias(self, words, weights, batch: int) -> np.ndarray:
        if words is None or weights is None:
            return np.empty([batch, 0], dtype=np.float32)
        out = np.zeros([batch, len(self.tokenizer)], dtype=np.float32)
        for b, (ws, vs) in enumerate(zip(words, weights)):
            for w, v in zip(ws, vs):
                for t in self.tokenizer.encode(w.decode() if isinstance(w, bytes) else w, add_special_tokens=False):
                    out[b, t] += v
        return out

    def execute(self, requests):
        responses = []
        for request in requests:
            def get(name, request=request):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            query = get("QUERY")
            batch = query.shape[0]
            end_id = get("END_ID")
            end_id = [[self.end_id]] * batch if end_id is None else end_id
            pad_id = get("PAD_ID")
            pad_id = [[self.pad_id]] * batch if pad_id is None else pad_id
            ids, lens = self._ids(query)
            dec = get("DECODER_QUERY")
            if dec is not None:
                dec_ids, dec_lens = self._ids(dec)
            else:
                dec_ids = np.array(pad_id, np.int32) * np.ones((batch, 1), np.int32)
                dec_lens = np.ones((batch, 1), np.int32)
            out = [
                pb_utils.Tensor("INPUT_ID", ids.astype(self.dtypes["INPUT_ID"])),
                pb_utils.Tensor("DECODER_INPUT_ID", dec_ids.astype(self.dtypes["DECODER_INPUT_ID"])),
                pb_utils.Tensor("BAD_WORDS_IDS", self._word_list(get("BAD_WORDS_DICT"), batch)),
                pb_utils.Tensor("STOP_WORDS_IDS", self._word_list(get("STOP_WORDS_DICT"), batch)),
                pb_utils.Tensor("REQUEST_INPUT_LEN", lens.astype(self.dtypes["REQUEST_INPUT_LEN"])),
                pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN",
                                dec_lens.astype(self.dtypes["REQUEST_DECODER_INPUT_LEN"])),
                pb_utils.Tensor("REQUEST_OUTPUT_LEN", get("REQUEST_OUTPUT_LEN")),
                pb_utils.Tensor("EMBEDDING_BIAS", self._bias(get("EMBEDDING_BIAS_WORDS"),
                                                             get("EMBEDDING_BIAS_WEIGHTS"), batch)),
                pb_utils.Tensor("OUT_END_ID", np.array(end_id, np.int32)),
                pb_utils.Tensor("OUT_PAD_ID", np.array(pad_id, np.int32)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=out))
        return responses
