"""The CPU stand-in of TensorRT-LLM 1.2.1's LLM API, written from its documented behaviour (era.LLMAPI_ERA sources).

`LLM(model=<hf dir>, backend="pytorch", speculative_config=...)` builds torch-runtime engines of the checkpoint
(and of the draft: DraftTargetDecodingConfig.speculative_model) in a cache directory, then serves
`generate` / `generate_async` with `SamplingParams`: Draft_Target runs the runtime's draft-target, NGram its prompt
lookup (max_matching_ngram_size), no config plain decoding; greedy output is the target's either way. Unknown
LLM arguments, unknown speculative_config keys and a backend other than "pytorch" are refused as the real
pydantic models refuse them; EAGLE-3 is refused (no EAGLE-3 drafter on the CPU). Requests run one at a time
(in-flight batching is a GPU matter). `RequestOutput` streams: iterate it (sync or async) for the output so far;
`outputs[0].request_perf_metrics` carries the speculative-decoding counts when `return_perf_metrics` is set.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from pipeline import spec as specmod
from pipeline.engine import build_target
from pipeline.runtime.engine_io import load_engine
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.sampling import SamplingParams as RuntimeParams
from pipeline.runtime.speculative import draft_target, prompt_lookup
from pipeline.trtllm.era import LLMAPI_ERA


class _Aborted(Exception):
    pass


class _DecodingConfig:
    """A speculative_config: keyword fields only, unknown ones refused (StrictBaseModel)."""

    decoding_type = ""
    fields: tuple[str, ...] = ("max_draft_len", "speculative_model", "max_concurrency", "max_total_draft_tokens")

    def __init__(self, **kw: Any):
        if "speculative_model_dir" in kw:  # the alias [A]
            kw["speculative_model"] = kw.pop("speculative_model_dir")
        unknown = set(kw) - set(self.fields)
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown field(s) {sorted(unknown)}; valid: {list(self.fields)}")
        for f in self.fields:
            setattr(self, f, kw.get(f))
        self.validate()

    def validate(self) -> None:
        if not self.max_draft_len or self.max_draft_len <= 0:
            raise ValueError(f"max_draft_len must be > 0 for {self.decoding_type}")


class DraftTargetDecodingConfig(_DecodingConfig):
    decoding_type = LLMAPI_ERA.draft_target

    def validate(self) -> None:
        super().validate()
        if self.speculative_model is None:
            raise ValueError("speculative_model must be specified for DraftTarget")


class NGramDecodingConfig(_DecodingConfig):
    decoding_type = LLMAPI_ERA.ngram
    fields = _DecodingConfig.fields + ("max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool")


class Eagle3DecodingConfig(_DecodingConfig):
    decoding_type = LLMAPI_ERA.eagle3
    fields = _DecodingConfig.fields + ("eagle3_one_model", "eagle_choices", "use_dynamic_tree",
                                       "dynamic_tree_max_topK", "eagle3_layers_to_capture")


DECODING = {c.decoding_type: c for c in (DraftTargetDecodingConfig, NGramDecodingConfig, Eagle3DecodingConfig)}


@dataclass
class KvCacheConfig:
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool = True
    dtype: str = "auto"
    tokens_per_block: int = 32


def update_llm_args_with_extra_dict(llm_args: dict, extra: dict) -> dict:
    """LLM arguments from a YAML dict: speculative_config by decoding_type, kv_cache_config into its class."""
    out = {**llm_args, **extra}
    sc = out.get("speculative_config")
    if isinstance(sc, dict):
        sc = dict(sc)
        kind = sc.pop("decoding_type", None)
        if kind not in DECODING:
            raise ValueError(f"speculative_config.decoding_type: got {kind!r}; expected one of {sorted(DECODING)}")
        out["speculative_config"] = DECODING[kind](**sc)
    if isinstance(out.get("kv_cache_config"), dict):
        out["kv_cache_config"] = KvCacheConfig(**out["kv_cache_config"])
    return out


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    end_id: int | None = None
    pad_id: int | None = None
    ignore_eos: bool = False
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    detokenize: bool = True


@dataclass
class SpeculativeDecodingMetrics:
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


@dataclass
class KvCacheMetrics:
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class TimingMetrics:
    arrival_time: datetime.timedelta = datetime.timedelta(0)
    first_scheduled_time: datetime.timedelta = datetime.timedelta(0)
    first_token_time: datetime.timedelta = datetime.timedelta(0)
    last_token_time: datetime.timedelta = datetime.timedelta(0)


@dataclass
class RequestPerfMetrics:
    timing_metrics: TimingMetrics = field(default_factory=TimingMetrics)
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    speculative_decoding: SpeculativeDecodingMetrics = field(default_factory=SpeculativeDecodingMetrics)


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    request_perf_metrics: RequestPerfMetrics | None = None
    _last_text_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]


class RequestOutput:
    """One request's output; iterate it for each update (streaming) or call result() for the final one."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, prompt: str, prompt_token_ids: list[int], streaming: bool):
        self.request_id = next(self._ids)
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.outputs = [CompletionOutput()]
        self.finished = False
        self.streaming = streaming
        self._q: queue.Queue = queue.Queue()
        self._aborted = threading.Event()
        self._error: BaseException | None = None

    def abort(self) -> None:
        self._aborted.set()

    def __iter__(self):
        while True:
            item = self._q.get()
            if isinstance(item, BaseException):
                raise item
            self.outputs[0]._last_text_len = item.pop("last", 0)
            for k, v in item.items():
                setattr(self.outputs[0], k, v)
            self.finished = item.get("finish_reason") is not None
            yield self
            if self.finished:
                return

    def __aiter__(self):
        it = iter(self)
        loop = asyncio.get_running_loop()

        async def gen():
            while True:
                out = await loop.run_in_executor(None, lambda: next(it, None))
                if out is None:
                    return
                yield out
        return gen()

    def result(self, timeout: float | None = None) -> RequestOutput:
        for _ in self:
            pass
        return self

    async def aresult(self) -> RequestOutput:
        async for _ in self:
            pass
        return self


_LLM_ARGS = set(LLMAPI_ERA.llm_keys) | {"_mpi_session"}


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, backend: str = LLMAPI_ERA.backend_value,
                 **kwargs: Any):
        unknown = set(kwargs) - _LLM_ARGS
        if unknown:
            raise ValueError(f"LLM: unknown argument(s) {sorted(unknown)} (extra fields are not permitted)")
        if backend != LLMAPI_ERA.backend_value:
            raise ValueError(f"backend {backend!r}: TensorRT-LLM 1.x serves the PyTorch backend only "
                             f"(backend: {LLMAPI_ERA.backend_value})")
        if kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1) != 1:
            raise ValueError("the CPU stand-in runs one rank: tensor_parallel_size and pipeline_parallel_size 1")
        args = update_llm_args_with_extra_dict({}, kwargs)
        self.speculative_config = args.get("speculative_config")
        if isinstance(self.speculative_config, Eagle3DecodingConfig):
            raise ValueError("Eagle3: the CPU stand-in has no EAGLE-3 drafter (a GPU runs it)")
        self.model_dir = str(model)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or self.model_dir)
        k = self.speculative_config.max_draft_len if self.speculative_config else 0
        self.target = _engine(self.model_dir, args.get("max_seq_len") or 2048, args.get("max_input_len") or 1024, k)
        self.draft = None
        if isinstance(self.speculative_config, DraftTargetDecodingConfig):
            self.draft = _engine(str(self.speculative_config.speculative_model), args.get("max_seq_len") or 2048,
                                 args.get("max_input_len") or 1024, k)
        self.end_ids = tuple(self.target.cfg.eos_token_id or ())
        self._lock = threading.Lock()

    def generate_async(self, inputs: str | list[int], sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> RequestOutput:
        sp = sampling_params or SamplingParams()
        ids = list(inputs) if isinstance(inputs, list) else self.tokenizer.encode(inputs, add_special_tokens=True)
        out = RequestOutput(inputs if isinstance(inputs, str) else "", ids, streaming)
        threading.Thread(target=self._decode, args=(out, sp), daemon=True).start()
        return out

    def generate(self, inputs, sampling_params: SamplingParams | None = None):
        if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int):
            return [self.generate_async(p, sampling_params).result() for p in inputs]
        return self.generate_async(inputs, sampling_params).result()

    def shutdown(self) -> None:
        pass

    def _decode(self, out: RequestOutput, sp: SamplingParams) -> None:
        arrival = time.monotonic()
        try:
            with self._lock:
                scheduled = time.monotonic()
                params = RuntimeParams(float(sp.temperature or 0.0), int(sp.top_k or 0),
                                       1.0 if sp.top_p is None else float(sp.top_p), sp.seed)
                params.check(self.target.cfg.vocab_size)
                stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
                stop_ids = [self.tokenizer.encode(s, add_special_tokens=False) for s in stops if s]
                end_ids = () if sp.ignore_eos else ((sp.end_id,) if sp.end_id is not None else self.end_ids)
                req = Request(list(out.prompt_token_ids), int(sp.max_tokens), params, stop=stop_ids, end_ids=end_ids)
                tokens: list[int] = []
                first: list[float] = []
                shown = [0]

                def emit(row: int, toks: list[int]) -> None:
                    if out._aborted.is_set():
                        raise _Aborted()
                    if toks and not first:
                        first.append(time.monotonic())
                    tokens.extend(toks)
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True) if out.streaming else ""
                    # An incomplete UTF-8 sequence waits for its next token (as an incremental detokenizer does),
                    # so every streamed text starts with the one before it.
                    if out.streaming and toks and not text.endswith("\ufffd"):
                        out._q.put({"text": text, "token_ids": list(tokens), "last": shown[0]})
                        shown[0] = len(text)

                sc = self.speculative_config
                if isinstance(sc, DraftTargetDecodingConfig):
                    (res,) = draft_target(self.target, self.draft, [req], sc.max_draft_len, emit,
                                          use_draft_logits=False)
                elif isinstance(sc, NGramDecodingConfig):
                    (res,) = prompt_lookup(self.target, [req], sc.max_draft_len, emit,
                                           max_ngram=sc.max_matching_ngram_size or 3)
                else:
                    (res,) = generate(self.target, [req], emit)
            text = self.tokenizer.decode(res.tokens, skip_special_tokens=True)
            perf = None
            if sp.return_perf_metrics:
                t = TimingMetrics(*(datetime.timedelta(seconds=x) for x in
                                    (arrival, scheduled, (first or [time.monotonic()])[0], time.monotonic())))
                perf = RequestPerfMetrics(t, KvCacheMetrics(), SpeculativeDecodingMetrics(
                    res.acceptance_rate, res.draft_accepted, res.draft_proposed))
            reason = {"eos": "stop", "stop": "stop"}.get(res.finish_reason, "length")
            out._q.put({"text": text, "token_ids": list(res.tokens), "finish_reason": reason,
                        "request_perf_metrics": perf, "last": shown[0] if out.streaming else 0})
        except _Aborted:
            out._q.put({"finish_reason": "cancelled"})
        except Exception as e:  # noqa: BLE001 (the caller sees it when it reads the output)
            out._q.put(e)


def _engine(model_dir: str, max_seq_len: int, max_input_len: int, k: int):
    """A torch-runtime engine of a Hugging Face directory, built once into the stand-in's cache."""
    src = Path(model_dir).resolve()
    cfg = json.loads((src / "config.json").read_text())
    seq = min(int(max_seq_len), int(cfg.get("max_position_embeddings", max_seq_len)))
    key = hashlib.sha256(f"{src}:{(src / 'config.json').stat().st_mtime_ns}:{seq}:{k}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("TRTLLM_STANDIN_CACHE", Path(tempfile.gettempdir()) / "trtllm-standin")) / key
    spec = specmod.parse({"name": "standin", "target": {"source": str(src)},
                          "limits": {"max_batch_size": 8, "max_input_len": min(int(max_input_len), seq - 1),
                                     "max_seq_len": seq, "max_draft_len": max(k, 1)},
                          "speculation": {"num_draft_tokens": max(k, 1), "prompt_lookup_num_tokens": max(k, 1)}}, root)
    return load_engine(build_target(spec, log=lambda *a: None)).model
