"""The llmapi era (TensorRT-LLM 1.2.1, LLM API / PyTorch backend): spec keys, the plan, trtllm-serve, the Triton
repository's pinned names; then the generated repository in the real tritonserver under the CPU stand-ins (the
stand-in `tensorrt_llm` package and our stand-in of the container's llmapi model.py), answering the project's
client and a plain tritonclient with the torch runtime's greedy text through Draft_Target and NGram."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline import spec as specmod
from pipeline.cli import main
from pipeline.client import RequestError, generate
from pipeline.trtllm import llmapi
from pipeline.trtllm.era import LLMAPI_ERA
from pipeline.trtllm.llmapi_repo import LLM_MODEL, parse_config, write_llmapi_repo
from tests.conftest import make_model_dir, prompts, stop_later, write_spec

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "build" / "qwen_coder_trtllm.yaml"
SHIPPED = {"qwen_coder_trtllm.yaml": "llmapi", "llama70b_draft1b_tp4.yaml": "engine", "vicuna7b_medusa.yaml": "engine"}


def load(root: Path = ROOT, **changes) -> specmod.Spec:
    data = yaml.safe_load(QWEN.read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        d = data
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return specmod.parse(data, root)


# ------------------------------------------------------------------------------------------------
# Spec and plan


def test_every_shipped_gpu_spec_states_its_era_and_new_specs_default_to_llmapi():
    for name, era in SHIPPED.items():
        assert yaml.safe_load((ROOT / "build" / name).read_text())["tensorrt_llm"]["era"] == era
    data = {"name": "t", "backend": "tensorrt_llm", "device": "cuda", "target": {"source": "x"}}
    assert specmod.parse(data).tensorrt_llm.era == "llmapi"


@pytest.mark.parametrize("changes,match", [
    ({"tensorrt_llm__era": "tensorrt"}, r"tensorrt_llm.era: got 'tensorrt'.*'llmapi' \| 'engine'"),
    ({"medusa__source": "/m", "draft__source": "none"}, r"medusa.source: got '/m'; Medusa exists only in the engine "
                                                         r"era.*tensorrt_llm.era: engine"),
    ({"draft__quantization": "int8"}, r"draft.quantization: got 'int8'.*ModelOpt.*tensorrt_llm.era: engine"),
    ({"tensorrt_llm__speculative": "eagle3"}, r"tensorrt_llm.speculative: got 'eagle3'; Eagle3 needs "
                                              r"tensorrt_llm.eagle3_model"),
    ({"draft__source": "none", "tensorrt_llm__speculative": "draft_target"}, r"Draft_Target needs draft.source"),
    ({"target__quantization": "fp8", "tensorrt_llm__gpu_arch": "ampere"}, r"tensorrt_llm.gpu_arch: got 'ampere'; FP8"),
])
def test_llmapi_spec_errors_name_the_key_and_the_fix(changes, match):
    with pytest.raises(specmod.SpecError, match=match):
        load(**changes)


def test_engine_era_refuses_llmapi_only_methods():
    with pytest.raises(specmod.SpecError, match="tensorrt_llm.speculative: got 'ngram'.*era: llmapi"):
        load(tensorrt_llm__era="engine", tensorrt_llm__speculative="ngram")


def _cli(capsys, *args: str):
    """The command line in-process (a subprocess would pay a fresh interpreter's start for a dry run)."""
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out, err)


def test_dry_run_prints_the_llmapi_plan_without_trtllm_build(capsys):
    r = _cli(capsys, "engine", str(QWEN), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "trtllm-build" not in r.stdout and "convert_checkpoint" not in r.stdout
    assert f"TensorRT-LLM {LLMAPI_ERA.tensorrt_llm} LLM API plan" in r.stdout
    plan = yaml.safe_load("\n".join(ln for ln in r.stdout.split("# LLM(...) arguments")[1].split("\n# trtllm-serve")[0]
                                     .splitlines()[1:]))
    assert plan["speculative_config"] == {"decoding_type": "Draft_Target", "max_draft_len": 6,
                                          "speculative_model": str(ROOT / "engines/qwen_coder/draft_hf")}
    assert plan["backend"] == "pytorch" and plan["tensor_parallel_size"] == 1 and plan["max_batch_size"] == 8
    assert "trtllm-serve " in r.stdout and "--extra_llm_api_options" in r.stdout and "memory plan" in r.stdout


def test_speculative_config_per_method_uses_only_pinned_keys():
    ngram = llmapi.speculative_config(load(draft__source="none", speculation__prompt_lookup_num_tokens=5,
                                           speculation__prompt_lookup_max_ngram=2))
    assert ngram == {"decoding_type": LLMAPI_ERA.ngram, "max_draft_len": 5, "max_matching_ngram_size": 2,
                     "is_keep_all": True, "is_use_oldest": True, "is_public_pool": True}
    eagle = llmapi.speculative_config(load(draft__source="none", tensorrt_llm__eagle3_model="/heads/eagle3"))
    assert eagle["decoding_type"] == "Eagle3" and eagle["speculative_model"] == "/heads/eagle3"
    assert llmapi.speculative_config(load(tensorrt_llm__speculative="none")) is None
    fp8 = load(target__quantization="fp8", tensorrt_llm__kv_cache_dtype="fp8")
    for spec in (load(), load(draft__source="none"), fp8):
        args = llmapi.llm_args(spec)
        assert set(args) <= set(LLMAPI_ERA.llm_keys)
        assert set(args["kv_cache_config"]) <= set(LLMAPI_ERA.kv_cache_keys)
        assert set(args["speculative_config"]) <= set(LLMAPI_ERA.spec_keys)


def test_trtllm_serve_command_and_config_come_from_the_same_spec():
    spec = load()
    argv = llmapi.serve_argv(spec)
    assert argv[:2] == ["trtllm-serve", str(ROOT / "engines/qwen_coder/target_hf")]
    assert argv[argv.index("--extra_llm_api_options") + 1] == str(llmapi.serve_config_path(spec))
    assert argv[argv.index("--port") + 1] == "8000" and argv[argv.index("--backend") + 1] == "pytorch"
    cfg = llmapi.serve_config(spec)
    assert "model" not in cfg and cfg["speculative_config"]["decoding_type"] == "Draft_Target"
    assert llmapi.openai_base_url(spec) == "http://127.0.0.1:8000/v1"


def test_preflight_finds_draft_length_tokenizer_and_modelopt_problems(tmp_path, tiny_tokenizer):
    from tests.conftest import train_tokenizer

    make_model_dir(tmp_path / "t", tokenizer=tiny_tokenizer)
    make_model_dir(tmp_path / "d", tokenizer=train_tokenizer(300), layers=1)
    spec = load(tmp_path, target__source=str(tmp_path / "t"), draft__source=str(tmp_path / "d"),
                target__quantization="fp8", tensorrt_llm__target_arch="auto", tensorrt_llm__draft_arch="auto")
    problems = "\n".join(llmapi.preflight(spec))
    assert "tokenizer files differ" in problems and "vocab_size" in problems
    assert "target.quantization: fp8 needs a ModelOpt checkpoint with hf_quant_config.json quant_algo FP8" in problems
    too_long = load(speculation__num_draft_tokens="auto", limits__max_draft_len=4,
                    speculation__prompt_lookup_num_tokens=4, draft__source="none")
    assert llmapi.preflight(too_long) == []


def test_repository_declares_the_pinned_tensors_and_model_yaml(tmp_path):
    spec = load(tmp_path)
    repo, copies = write_llmapi_repo(spec)  # the container path does not exist here
    cfg = parse_config((repo / LLM_MODEL / "config.pbtxt").read_text())  # Triton's own ModelConfig schema
    assert cfg.backend == "python" and cfg.max_batch_size == 0
    from tritonclient.grpc import model_config_pb2 as mc

    got_in = [(t.name, mc.DataType.Name(t.data_type), tuple(t.dims), t.optional) for t in cfg.input]
    got_out = [(t.name, mc.DataType.Name(t.data_type), tuple(t.dims)) for t in cfg.output]
    assert got_in == list(LLMAPI_ERA.inputs) and got_out == list(LLMAPI_ERA.outputs)
    y = yaml.safe_load((repo / LLM_MODEL / "1" / "model.yaml").read_text())
    tc = y.pop(LLMAPI_ERA.triton_config_key)
    assert set(tc) == set(LLMAPI_ERA.triton_config_keys)
    assert tc["decoupled"] is cfg.model_transaction_policy.decoupled is True and tc["max_batch_size"] == 0
    assert y == llmapi.llm_args(spec)
    # model.py and helpers.py are the container's: listed for the copy script, not shipped.
    assert [Path(s).name for s, _, done in copies if not done] == list(LLMAPI_ERA.model_files)
    script = (repo.parent / f"{repo.name}.copy.sh").read_text()
    assert f"cp {LLMAPI_ERA.model_dir}/model.py" in script and not (repo / LLM_MODEL / "1" / "model.py").exists()
    for name in spec.triton.models:
        c = parse_config((repo / name / "config.pbtxt").read_text())
        assert {"text_input", "max_tokens", "stream", "num_draft_tokens", "method"} <= {t.name for t in c.input}
        assert [t.name for t in c.output][:4] == ["text_output", "acceptance_rate", "total_accepted_draft_tokens",
                                                  "total_draft_tokens"]


def test_medusa_in_the_llmapi_era_names_the_engine_era_from_the_cli(tmp_path, capsys):
    data = yaml.safe_load((ROOT / "build" / "vicuna7b_medusa.yaml").read_text())
    data["tensorrt_llm"]["era"] = "llmapi"
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "m.yaml").write_text(yaml.safe_dump(data))
    r = _cli(capsys, "engine", str(tmp_path / "build" / "m.yaml"), "--dry-run")
    assert r.returncode == 2 and "Medusa exists only in the engine era" in r.stderr and "era: engine" in r.stderr


# ------------------------------------------------------------------------------------------------
# The generated repository in the real tritonserver, under the CPU stand-ins

N = 10


class Served:
    def __init__(self, spec, tok, target):
        from pipeline.triton import server as srvmod

        self.spec, self.tok, self.model = spec, tok, target
        self.url = srvmod.grpc_url(spec)

    def greedy_text(self, prompt: str, n: int = N) -> str:
        from pipeline.runtime.generate import Request
        from pipeline.runtime.generate import generate as run

        ids = self.tok.encode(prompt, add_special_tokens=True)
        (res,) = run(self.model, [Request(list(ids), n, end_ids=tuple(self.model.cfg.eos_token_id or ()))])
        return self.tok.decode(res.tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def llmapi_models(tmp_path_factory, tiny_tokenizer):
    """The tiny Qwen2 target and draft every case serves, the target's reference engine, and one stand-in engine
    cache for the module: the cases that load the same checkpoint with the same limits and k (Draft_Target streamed
    and unary) build its engines once, as the stand-in's cache is meant to."""
    from pipeline.engine import build_target
    from pipeline.runtime.engine_io import load_engine

    root = tmp_path_factory.mktemp("llmapi_models")
    make_model_dir(root / "models" / "target", tokenizer=tiny_tokenizer, hidden=48, heads=6, kv_heads=1, tie=False,
                   family="qwen2")
    make_model_dir(root / "models" / "draft", tokenizer=tiny_tokenizer, layers=1, hidden=56, heads=7, kv_heads=1,
                   tie=True, family="qwen2", seed=5)
    ref = specmod.load(write_spec(root, name="ref", target={"source": "models/target"}))
    target = load_engine(build_target(ref, log=lambda *a: None)).model
    before = os.environ.get("TRTLLM_STANDIN_CACHE")
    os.environ["TRTLLM_STANDIN_CACHE"] = str(root / "standin-cache")  # the servers inherit it: engines stay here
    try:
        yield root / "models", target
    finally:
        if before is None:
            os.environ.pop("TRTLLM_STANDIN_CACHE", None)
        else:
            os.environ["TRTLLM_STANDIN_CACHE"] = before


@pytest.fixture(scope="module", params=["draft_target", "ngram", "unary"])
def served(request, tmp_path_factory, llmapi_models):
    from transformers import AutoTokenizer

    from pipeline.triton import server as srvmod
    from pipeline.triton.repo import python_path
    from pipeline.trtllm.harness import install_llmapi_standins

    models, target = llmapi_models
    root = tmp_path_factory.mktemp(f"llmapi_{request.param}")
    grpc, http, metrics = srvmod.free_ports(3)
    ports = {"grpc_port": grpc, "http_port": http, "metrics_port": metrics}
    changes = {"target__source": str(models / "target"), "tensorrt_llm__target_arch": "auto",
               "tensorrt_llm__draft_arch": "auto", "limits__max_seq_len": 256, "limits__max_input_len": 128,
               "triton": {**ports, "host": "127.0.0.1", "startup_timeout_s": 300}}
    if request.param in ("draft_target", "unary"):
        changes["draft__source"] = str(models / "draft")
        changes["triton"]["decoupled"] = request.param != "unary"
    else:
        changes.update(draft__source="none", speculation__prompt_lookup_num_tokens=3)
    spec = load(root, **changes)
    pp = ":".join(python_path())
    repo, _ = write_llmapi_repo(spec, container_model_dir=root / "no-container", python_path=pp)
    install_llmapi_standins(repo, pp)
    try:
        srvmod.start(spec, log=lambda *a: None)
        yield Served(spec, AutoTokenizer.from_pretrained(str(models / "target")), target)
    finally:
        stop_later(spec)  # exits while the next case's server starts (tests/conftest.py)


def test_project_client_gets_the_torch_greedy_text_streamed_and_whole_with_acceptance(served):
    if not served.spec.triton.decoupled:
        pytest.skip("streams need triton.decoupled: true (the unary case is tested below)")
    for prompt in prompts()[:2]:
        want = served.greedy_text(prompt)
        whole = generate(served.url, "ensemble", prompt, N, exclude_input_in_output=True)
        assert whole["text"] == want
        s = generate(served.url, "tensorrt_llm_bls", prompt, N, stream=True, exclude_input_in_output=True)
        assert s["text"] == want and s["responses"] >= 2
        for r in (whole, s):
            assert r["num_input_tokens"] == len(served.tok.encode(prompt, add_special_tokens=True))
            assert 0 <= r["total_accepted_draft_tokens"] <= r["total_draft_tokens"]
            if r["total_draft_tokens"]:
                assert r["acceptance_rate"] == pytest.approx(r["total_accepted_draft_tokens"] / r["total_draft_tokens"])
    if llmapi.method(served.spec) == "draft_target":
        assert whole["total_draft_tokens"] > 0, "Draft_Target proposed drafts every round"


def test_unary_infer_answers_the_whole_text_when_triton_decoupled_is_false(served):
    if served.spec.triton.decoupled:
        pytest.skip("triton.decoupled: false only")
    prompt = prompts()[0]
    for model in served.spec.triton.models:
        r = generate(served.url, model, prompt, N, unary=True, exclude_input_in_output=True)
        assert r["text"] == served.greedy_text(prompt) and r["responses"] == 1
        assert 0 < r["total_draft_tokens"] and r["num_output_tokens"] > 0


def test_a_request_for_another_method_or_draft_length_is_refused_naming_the_served_one(served):
    unary = not served.spec.triton.decoupled
    served_method = "draft_target" if llmapi.method(served.spec) == "draft_target" else "prompt_lookup"
    other = "prompt_lookup" if served_method == "draft_target" else "draft_target"
    with pytest.raises(RequestError, match=f"method: got '{other}'; this deployment's LLM runs '{served_method}'"):
        generate(served.url, "ensemble", "hi", N, method=other, unary=unary)
    with pytest.raises(RequestError, match="num_draft_tokens: got 1; the LLM was loaded with max_draft_len"):
        generate(served.url, "ensemble", "hi", N, num_draft_tokens=1, unary=unary)
    assert generate(served.url, "ensemble", "hi", 2, method=served_method, unary=unary)["complete"]


def test_plain_tritonclient_streams_from_the_llmapi_model_with_the_pinned_names(served):
    import tritonclient.grpc as grpcclient

    prompt = prompts()[0]
    want = served.greedy_text(prompt)

    def t(name, value, dtype, triton):
        x = grpcclient.InferInput(name, [len(value)], triton)
        x.set_data_from_numpy(np.asarray(value, dtype=dtype))
        return x

    inputs = [t("text_input", [prompt.encode()], np.object_, "BYTES"), t("streaming", [True], bool, "BOOL"),
              t("sampling_param_max_tokens", [N], np.int32, "INT32"),
              t("sampling_param_return_perf_metrics", [True], bool, "BOOL"),
              t("return_finish_reason", [True], bool, "BOOL")]
    q: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(served.url) as c:
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        c.async_stream_infer(LLM_MODEL, inputs, enable_empty_final_response=True)
        texts, last = [], None
        while True:
            result, error = q.get(timeout=120)
            assert error is None, error
            resp = result.get_response()
            if resp.outputs:
                texts.append(result.as_numpy("text_output")[0].decode())
                last = result
            if resp.parameters.get("triton_final_response").bool_param:
                break
        c.stop_stream()
    assert texts[-1] == want, "each streamed response carries the text so far (the pinned model.py)"
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert last.as_numpy("finish_reason")[0].decode() == "length"
    assert int(last.as_numpy("total_draft_tokens")[0]) >= int(last.as_numpy("total_accepted_draft_tokens")[0])
    # Unary infer without streaming answers the whole text (decoupled models answer on the stream API).
    with grpcclient.InferenceServerClient(served.url) as c:
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        c.async_stream_infer(LLM_MODEL, inputs[:1] + [t("sampling_param_max_tokens", [N], np.int32, "INT32")])
        result, error = q.get(timeout=120)
        c.stop_stream()
    assert error is None and result.as_numpy("text_output")[0].decode() == want


def test_serve_dry_run_prints_the_triton_launch_and_trtllm_serve(capsys):
    r = _cli(capsys, "serve", str(QWEN), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"{LLMAPI_ERA.launch_script} --model_repo=" in r.stdout and "--world_size=1" in r.stdout
    assert "trtllm-serve " in r.stdout and "http://127.0.0.1:8000/v1" in r.stdout


def test_gpu_check_without_a_gpu_fails_clearly(tmp_path):
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: `make gpu-check` runs for real here")
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PY": sys.executable})
    assert r.returncode == 3
    assert "no NVIDIA GPU here" in r.stdout and "tensorrt-llm==1.2.1" in r.stdout
