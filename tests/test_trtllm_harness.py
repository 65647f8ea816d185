"""The CPU harness: every shipped tensorrt_llm spec's generated repository, loaded whole by the real tritonserver.

Each spec (build/llama70b_draft1b_tp4.yaml, build/vicuna7b_medusa.yaml, build/qwen_coder_trtllm.yaml)
gets tiny random checkpoints of the same structure (untied target, tied draft, GQA or MHA as the
real models, four Medusa heads with the spec's 31-node tree), its repository written by
engine_repo and the container-only models replaced by our stand-ins (pipeline.trtllm.harness).
The project's client and a client written the way NVIDIA's end_to_end_grpc_client.py is must get the
torch runtime's greedy text through the ensemble, our tensorrt_llm_bls and NVIDIA's BLS.
"""

from __future__ import annotations

import json
import queue
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline import spec as specmod
from pipeline.client import RequestError, generate
from pipeline.triton import server as srvmod
from pipeline.trtllm import engine_repo
from pipeline.trtllm.harness import install_standins
from tests.conftest import make_model_dir, prompts, stop_later, write_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = [ROOT / "build" / n for n in ("llama70b_draft1b_tp4.yaml", "vicuna7b_medusa.yaml", "qwen_coder_trtllm.yaml")]
# Tiny checkpoints with the real models' structure (head_dim 8 everywhere).
TINY = {
    "llama70b_draft1b_tp4": {"target": dict(hidden=64, heads=8, kv_heads=1, tie=False),  # 64/8 heads like 70B
                             "draft": dict(layers=1, hidden=32, heads=4, kv_heads=1, tie=True)},  # 32/8 like 1B
    "vicuna7b_medusa": {"target": dict(hidden=64, heads=4, kv_heads=4, tie=False)},  # MHA like Llama-2-7B
    # Qwen2 (q/k/v biases) as Qwen2.5-Coder: 1.5B 12/2 heads with a separate output, 0.5B 14/2 tied.
    "qwen_coder_trtllm": {"target": dict(hidden=48, heads=6, kv_heads=1, tie=False, family="qwen2"),
                          "draft": dict(layers=1, hidden=56, heads=7, kv_heads=1, tie=True, family="qwen2")},
}
UNUSED_END = 0  # <unk>: the random models never stop early, so budgets are exact
N = 12
NVIDIA_BLS = "tensorrt_llm_bls_nvidia"


def _python_path() -> str:
    from pipeline.triton.repo import python_path

    return ":".join(python_path())


def _medusa_heads(dest: Path, target_engine: Path, n: int, seed: int = 0) -> Path:
    """Random Medusa-1 heads in the FasterDecoding format (what the spec's medusa.source points at)."""
    from safetensors.torch import save_file

    from pipeline.runtime.engine_io import load_engine
    from pipeline.runtime.medusa import MedusaHeads, heads_to_state

    model = load_engine(target_engine).model
    torch.manual_seed(seed)
    h = MedusaHeads(n, 1, model.cfg.hidden_size)
    with torch.no_grad():
        h.w.normal_(0, 0.3 / model.cfg.hidden_size ** 0.5)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(heads_to_state(h, model.lm_head.weight), str(dest / "medusa_lm_head.safetensors"))
    (dest / "config.json").write_text(json.dumps({"medusa_num_heads": n, "medusa_num_layers": 1}))
    return dest


class Harness:
    def __init__(self, spec, engines, tokenizer):
        from pipeline.runtime.engine_io import load_engine

        self.spec = spec
        self.url = srvmod.grpc_url(spec)
        self.tok = tokenizer
        self.model = load_engine(engines["target"]).model

    def greedy(self, prompt: str, n: int = N) -> tuple[list[int], list[int]]:
        from pipeline.runtime.generate import Request, generate

        ids = self.tok.encode(prompt, add_special_tokens=True)
        (res,) = generate(self.model, [Request(list(ids), n, end_ids=(UNUSED_END,))])
        return ids, res.tokens

    def text(self, tokens: list[int]) -> str:
        return self.tok.batch_decode([tokens], skip_special_tokens=True)[0]


@pytest.fixture(scope="module", params=SPECS, ids=[p.stem for p in SPECS])
def harness(request, tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp(request.param.stem)
    h = start_harness(request.param, root, tiny_tokenizer)
    try:
        yield h
    finally:
        stop_later(h.spec)  # exits while the next spec's server starts (tests/conftest.py)


def start_harness(path: Path, root: Path, tiny_tokenizer) -> Harness:
    """Tiny checkpoints and torch engines, the spec's repository with stand-ins, and a running server."""
    from transformers import AutoTokenizer

    from pipeline.engine import build_target

    data = yaml.safe_load(path.read_text())
    tiny = TINY[data["name"]]
    engines = {}
    for role, shape in tiny.items():
        make_model_dir(root / "models" / role, tokenizer=tiny_tokenizer, seed=len(role), **shape)
        torch_spec = specmod.load(write_spec(root, name=f"torch_{role}", target={"source": f"models/{role}"}))
        engines[role] = build_target(torch_spec, log=lambda *a: None)
    data["target"]["source"] = str(root / "models" / "target")
    if "draft" in tiny:
        data["draft"]["source"] = str(root / "models" / "draft")
    heads = None
    if data["medusa"]["source"] != "none":
        heads = _medusa_heads(root / "models" / "medusa", engines["target"], data["medusa"]["num_heads"])
        data["medusa"]["source"] = str(heads)
    grpc, http, metrics = srvmod.free_ports(3)
    ports = {"grpc_port": grpc, "http_port": http, "metrics_port": metrics}
    data["triton"] = {**data.get("triton", {}), **ports, "host": "127.0.0.1", "instance_count": 1,
                      "startup_timeout_s": 300}
    data["tensorrt_llm"].update(target_arch="auto", draft_arch="auto", era="engine")  # this file: the engine era
    spec = specmod.parse(data, root)
    pp = _python_path()
    repo, _ = engine_repo.write_repo(spec, container_models_dir=root / "no-container", python_path=pp)
    install_standins(spec, repo, engines, pp, medusa_heads=heads, nvidia_bls_as=NVIDIA_BLS if spec.has_draft else None)
    srvmod.start(spec, log=lambda *a: None)
    return Harness(spec, engines, AutoTokenizer.from_pretrained(str(root / "models" / "target")))


def _prompts() -> list[str]:
    return prompts()[:2]


# ------------------------------------------------------------------------------------------------
# The project's client


def test_project_client_gets_torch_greedy_text_from_ensemble_and_bls(harness):
    spec = harness.spec
    for prompt in _prompts():
        _, want = harness.greedy(prompt)
        # As the CLI sends them: exclude_input_in_output and return_perf_metrics on both models.
        ens = generate(harness.url, "ensemble", prompt, N, end_id=UNUSED_END, exclude_input_in_output=True)
        assert ens["text"] == harness.text(want)
        assert ens["num_output_tokens"] == N and ens["num_input_tokens"] == len(harness.greedy(prompt)[0])
        assert ens["total_draft_tokens"] == (-1 if spec.has_medusa else 0)
        bls = generate(harness.url, "tensorrt_llm_bls", prompt, N, end_id=UNUSED_END, exclude_input_in_output=True)
        assert bls["text"] == harness.text(want), "tensorrt_llm_bls (ours) differs from the torch greedy text"
        assert bls["num_output_tokens"] == N
        if spec.has_draft:
            # Speculation ran and was counted: drafts proposed each round, acceptance in [0, 1].
            assert bls["total_draft_tokens"] > 0
            assert 0 <= bls["total_accepted_draft_tokens"] <= bls["total_draft_tokens"]
            assert bls["acceptance_rate"] == pytest.approx(bls["total_accepted_draft_tokens"]
                                                           / bls["total_draft_tokens"])
        else:
            assert bls["acceptance_rate"] == -1.0  # the Medusa engine speculates inside; v0.18 reports nothing
    # Without exclude_input_in_output our BLS follows the project's contract (prompt left out), the
    # ensemble of a draft-target repository includes it (its target model is NVIDIA's BLS-compatible).
    prompt = _prompts()[0]
    ids, want = harness.greedy(prompt)
    assert generate(harness.url, "tensorrt_llm_bls", prompt, N, end_id=UNUSED_END)["text"] == harness.text(want)
    ens = generate(harness.url, "ensemble", prompt, N, end_id=UNUSED_END)["text"]
    assert ens == harness.text(ids + want if spec.has_draft else want)


def test_ensemble_takes_seed_or_random_seed_and_refuses_what_it_cannot_run(harness):
    prompt = _prompts()[0]
    _, want = harness.greedy(prompt)
    r = generate(harness.url, "ensemble", prompt, N, end_id=UNUSED_END, exclude_input_in_output=True, seed=7)
    assert r["text"] == harness.text(want)
    with pytest.raises(RequestError, match="tensorrt_llm_bls" if harness.spec.has_draft else "no draft model"):
        generate(harness.url, "ensemble", prompt, N, end_id=UNUSED_END, num_draft_tokens=4)
    with pytest.raises(RequestError, match="method: got 'draft_target'"):
        generate(harness.url, "ensemble", prompt, N, method="draft_target")


def test_our_bls_streams_batches_and_reports_acceptance(harness):
    if not harness.spec.has_draft:
        pytest.skip("draft-target only")
    import tritonclient.grpc as grpcclient

    prompt = _prompts()[0]
    _, want = harness.greedy(prompt)
    client = grpcclient.InferenceServerClient(harness.url)
    assert client.get_model_config("tensorrt_llm_bls").config.model_transaction_policy.decoupled \
        == harness.spec.triton.decoupled, "our BLS is decoupled or not as triton.decoupled says"
    if harness.spec.triton.decoupled:
        s = generate(harness.url, "tensorrt_llm_bls", prompt, N, stream=True, end_id=UNUSED_END,
                     method="draft_target", num_draft_tokens=3)
        assert s["responses"] >= 2, "a streamed draft-target request answers once per round"
        assert s["text"] == harness.text(want) and s["total_draft_tokens"] > 0
    else:
        with pytest.raises(RequestError, match="triton.decoupled: true"):
            generate(harness.url, "tensorrt_llm_bls", prompt, N, stream=True, end_id=UNUSED_END)
    # Concurrent requests are answered together (they run side by side through the LLM models).
    texts: dict[int, str] = {}

    def one(i, p):
        texts[i] = generate(harness.url, "tensorrt_llm_bls", p, N, end_id=UNUSED_END, method="draft_target")["text"]

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(_prompts() * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert [texts.get(i) for i in range(4)] == [harness.text(harness.greedy(p)[1]) for p in _prompts() * 2]
    # One request of two rows (NVIDIA's BLS refuses batch > 1 with a draft).
    ps = _prompts()
    ins = {"text_input": np.array([[p.encode()] for p in ps], dtype=object),
           "max_tokens": np.array([[N]] * 2, np.int32), "end_id": np.array([[UNUSED_END]] * 2, np.int32),
           "num_draft_tokens": np.array([[4]] * 2, np.int32), "return_perf_metrics": np.array([[True]] * 2)}
    out = _nvidia_style(harness.url, "tensorrt_llm_bls", ins)
    rows = out[0]["text_output"].reshape(-1).tolist()
    assert [r.decode() for r in rows] == [harness.text(harness.greedy(p)[1]) for p in ps]
    assert (out[0]["total_draft_tokens"].reshape(-1) > 0).all()


def test_a_non_decoupled_bls_answers_tritonclient_infer_with_the_whole_text(harness):
    """Issue 29: a unary ModelInfer (tritonclient's `infer`) to tensorrt_llm_bls works where the spec says
    triton.decoupled: false (the shipped engine-era specs), and a bad request in the same moment fails alone."""
    if harness.spec.triton.decoupled:
        pytest.skip("this spec's tensorrt_llm_bls is decoupled (streams); unary infer needs triton.decoupled: false")
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    def infer(**values):
        client = grpcclient.InferenceServerClient(harness.url)
        ins = []
        for name, v in values.items():
            t = grpcclient.InferInput(name, v.shape, np_to_triton_dtype(v.dtype))
            t.set_data_from_numpy(v)
            ins.append(t)
        return client.infer("tensorrt_llm_bls", ins)

    prompt = _prompts()[0]
    _, want = harness.greedy(prompt)
    good = {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": np.array([[N]], np.int32),
            "end_id": np.array([[UNUSED_END]], np.int32), "return_perf_metrics": np.array([[True]])}
    results: dict[str, object] = {}

    def bad():
        try:
            infer(**{**good, "max_tokens": np.array([[0]], np.int32)})
        except InferenceServerException as e:
            results["bad"] = str(e)

    t = threading.Thread(target=bad)
    t.start()
    r = infer(**good)
    t.join(timeout=120)
    assert r.as_numpy("text_output").reshape(-1)[0].decode() == harness.text(want)
    assert int(r.as_numpy("num_output_tokens").reshape(-1)[0]) == N
    drafted = int(r.as_numpy("total_draft_tokens").reshape(-1)[0])
    assert drafted > 0 if harness.spec.has_draft else drafted == -1
    assert "max_tokens: got 0" in results.get("bad", ""), results


# ------------------------------------------------------------------------------------------------
# A client written the way tensorrtllm_backend's inflight_batcher_llm/client/end_to_end_grpc_client.py is


def _nvidia_style(url: str, model: str, inputs: dict[str, np.ndarray]) -> list[dict]:
    """Stream one request as NVIDIA's end-to-end client does; returns each response's outputs."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    def prepare_tensor(name, value):
        t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        return t

    results: queue.Queue = queue.Queue()

    def callback(user_data, result, error):
        user_data.put(error if error else result)

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=partial(callback, results))
    client.async_stream_infer(model, [prepare_tensor(k, v) for k, v in inputs.items()], request_id="1")
    client.stop_stream()
    out = []
    while not results.empty():
        r = results.get()
        if isinstance(r, Exception):
            raise RequestError(str(r))
        resp = r.get_response()
        out.append({o.name: r.as_numpy(o.name) for o in resp.outputs})
    return out


def _nvidia_inputs(prompt: str, **extra) -> dict[str, np.ndarray]:
    """prepare_inputs of end_to_end_grpc_client.py: its defaults (beam 1, temperature 1.0, no top_k: greedy)."""
    ins = {"text_input": np.array([[prompt]]).astype(object), "max_tokens": np.ones((1, 1), np.int32) * N,
           "stream": np.array([[False]], dtype=bool), "beam_width": np.array([[1]], dtype=np.int32),
           "temperature": np.array([[1.0]], dtype=np.float32), "num_return_sequences": np.array([[1]], np.int32),
           "end_id": np.array([[UNUSED_END]], dtype=np.int32)}
    ins.update(extra)
    return ins


def test_nvidia_style_client_gets_the_same_greedy_text(harness):
    prompt = _prompts()[1]
    ids, want = harness.greedy(prompt)
    ens = _nvidia_style(harness.url, "ensemble", _nvidia_inputs(
        prompt, exclude_input_in_output=np.array([[True]]), random_seed=np.array([[3]], np.uint64),
        min_length=np.array([[1]], np.int32)))
    assert ens[-1]["text_output"].reshape(-1)[0].decode() == harness.text(want)
    if not harness.spec.has_draft:
        bls = _nvidia_style(harness.url, "tensorrt_llm_bls", _nvidia_inputs(prompt))
        assert bls[-1]["text_output"].reshape(-1)[0].decode() == harness.text(want)
        return
    logits = np.array([[harness.spec.speculation.use_draft_logits]])
    for model in (NVIDIA_BLS, "tensorrt_llm_bls"):
        out = _nvidia_style(harness.url, model, _nvidia_inputs(prompt, num_draft_tokens=np.array([[4]], np.int32),
                                                               use_draft_logits=logits))
        text = out[-1]["text_output"].reshape(-1)[0].decode()
        # NVIDIA's BLS answers with the whole target output (prompt included); ours follows the contract.
        assert text == harness.text(ids + want if model == NVIDIA_BLS else want), model
    with pytest.raises(RequestError, match="streaming is not supported with speculative decoding"):
        _nvidia_style(harness.url, NVIDIA_BLS, _nvidia_inputs(prompt, stream=np.array([[True]]),
                                                              num_draft_tokens=np.array([[4]], np.int32)))
