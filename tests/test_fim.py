"""Fill-in-the-middle (docs/openai.md#fill-in-the-middle): `/v1/completions` with `suffix` through the official
`openai` client and llama.cpp's `/infill` in llama.vscode's shape, on a tiny model whose tokenizer has Qwen2.5-Coder's
FIM tokens, served by the real tritonserver; greedy answers equal the same FIM prompt sent as a plain completion."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from pipeline import spec as specmod
from pipeline.triton import fim, openai_api
from pipeline.triton import server as srvmod
from tests.conftest import make_model_dir, train_tokenizer, write_spec

PREFIX = "def rain(clouds):\n    total = 0\n    for c in clouds:\n"
SUFFIX = "\n    return total\n"
EXTRA = [{"filename": "weather/ocean.py", "text": "def evaporate(sea):\n    return sea * 0.1\n"}]
MARKERS = [fim.PREFIX, fim.SUFFIX, fim.MIDDLE, fim.PAD, fim.REPO, fim.FILE_SEP]
STOPS = [fim.PAD, fim.FILE_SEP, fim.REPO]  # where a middle ends (the plain path is sent the same stops)


def fim_tokenizer():
    tok = train_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    return tok


def _cfg(name: str = "fim") -> openai_api.FrontConfig:
    return openai_api.FrontConfig(name=name, host="127.0.0.1", port=0, grpc_url="127.0.0.1:1", triton_model="ensemble",
                                  tokenizer_dir="", max_input_len=256, max_seq_len=512)


# --------------------------------------------------------------------------------------- the prompt, Triton-free


def test_fim_support_is_read_from_the_tokenizers_special_tokens(tiny_tokenizer):
    assert fim.fim_tokens(tiny_tokenizer) is None
    assert fim.fim_tokens(fim_tokenizer()) == fim.FimTokens(repo=True)
    partial = train_tokenizer()
    partial.add_special_tokens({"additional_special_tokens": [fim.PREFIX, fim.SUFFIX, fim.MIDDLE]})
    assert fim.fim_tokens(partial) == fim.FimTokens(repo=False)


def test_a_model_without_fim_tokens_refuses_suffix_and_infill_clearly(tiny_tokenizer):
    front = openai_api.Front(_cfg(), tiny_tokenizer)
    with pytest.raises(openai_api.ApiError) as e:
        front.check({"model": "fim", "prompt": PREFIX, "suffix": SUFFIX}, "text")
    assert (e.value.status, e.value.param, e.value.code) == (400, "suffix", "unsupported_parameter")
    assert "<|fim_prefix|>" in e.value.message and "omit suffix" in e.value.message
    with pytest.raises(openai_api.ApiError) as e:
        front.check({"input_prefix": PREFIX, "input_suffix": SUFFIX}, "infill")
    assert (e.value.status, e.value.code) == (400, "unsupported_parameter")
    # an empty suffix stays what it was: no insertion
    assert front.check({"model": "fim", "prompt": PREFIX, "suffix": ""}, "text").prompt == PREFIX


def test_the_fim_prompt_follows_the_models_layout_and_refuses_spelled_out_markers():
    tok = fim_tokenizer()
    front = openai_api.Front(_cfg(), tok)
    job = front.check({"model": "fim", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4}, "text")
    assert job.prompt == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    assert job.stop == STOPS
    assert front.check({"model": "fim", "prompt": PREFIX, "stop": ["\n\n"]}, "text").stop == ["\n\n"]
    ids = tok(job.prompt, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids(fim.MIDDLE)) == 1 and ids[-1] == tok.convert_tokens_to_ids(fim.MIDDLE)
    job = front.check({"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "        total",
                       "input_extra": EXTRA, "n_predict": 8}, "infill")
    assert job.prompt == ("<|repo_name|>myproject\n<|file_sep|>weather/ocean.py\n" + EXTRA[0]["text"]
                          + "<|file_sep|>filename\n<|fim_prefix|>" + PREFIX + "        total<|fim_suffix|>" + SUFFIX
                          + "<|fim_middle|>")
    assert job.max_tokens == 8 and job.options["temperature"] == 0.8  # llama.cpp's default
    assert "end_id" not in job.options
    job = front.check({"input_prefix": PREFIX, "input_suffix": SUFFIX, "ignore_eos": True}, "infill")
    assert job.options["end_id"] == -1, "llama.cpp's ignore_eos: no end token (the gRPC contract's end_id -1)"
    for body, param in [({"model": "fim", "prompt": "a<|fim_middle|>b", "suffix": "c"}, "prompt"),
                        ({"model": "fim", "prompt": "a", "suffix": 3}, "suffix"),
                        ({"input_prefix": "a", "input_extra": [{"text": "<|file_sep|>"}]}, "input_extra[0].text"),
                        ({"input_prefix": "a", "input_extra": "x"}, "input_extra"),
                        ({"input_prefix": ["a"]}, "input_prefix"),
                        ({"input_prefix": "a", "n_predict": 0}, "n_predict")]:
        with pytest.raises(openai_api.ApiError) as e:
            front.check(body, "infill" if "input_prefix" in body else "text")
        assert e.value.status == 400 and e.value.param == param, body


# ------------------------------------------------------------------------------------------ served, end to end


@pytest.fixture(scope="module")
def served_fim(tmp_path_factory, tiny_engine):
    """`serve` on a tiny target with Qwen2.5-Coder's FIM tokens, its own draft (speculation applies to FIM) and a
    prompt cache (so does the cache)."""
    from pipeline.cli import main
    from pipeline.engine import build_target
    from pipeline.train.draft import build_draft

    root = tmp_path_factory.mktemp("fim")
    make_model_dir(root / "models" / "target", tokenizer=fim_tokenizer())
    grpc, http, metrics, api = srvmod.free_ports(4)
    ports = {"grpc_port": grpc, "http_port": http, "metrics_port": metrics}
    path = write_spec(root, name="fim", draft={"source": "models/target"},
                      triton={**ports, "startup_timeout_s": 240}, openai={"port": api},
                      prompt_cache={"bytes": 1 << 26, "block_tokens": 16},
                      limits={"max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512, "max_draft_len": 8})
    s = specmod.load(path)
    quiet = lambda *a, **k: None  # noqa: E731
    build_target(s, log=quiet)
    build_draft(s, log=quiet)
    assert main(["serve", str(path)]) == 0
    try:
        yield s
    finally:
        main(["stop", str(path)])


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_openai_client_suffix_answers_the_fim_prompt_exactly(served_fim):
    from openai import OpenAI

    s = served_fim
    c = OpenAI(base_url=openai_api.base_url(s), api_key="unused", max_retries=0, timeout=120)
    want = c.completions.create(model="fim", prompt=fim.fim_prompt(fim.FimTokens(True), PREFIX, SUFFIX),
                                max_tokens=16, temperature=0, stop=STOPS)
    assert want.choices[0].text  # an answer to compare, not two empty ones
    for method in ("baseline", "draft_target"):
        got = c.completions.create(model="fim", prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0,
                                   extra_body={"method": method})
        assert got.choices[0].text == want.choices[0].text, method
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="fim", prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0, stream=True) if ch.choices)
    assert streamed == want.choices[0].text


def test_llama_vscode_shaped_infill_is_answered_like_llama_cpp(served_fim):
    """llama.vscode's request (its fields, samplers and response_fields), top_k 1 so the answer is the greedy one."""
    s = served_fim
    root = openai_api.base_url(s).removesuffix("/v1")
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "",
            "n_predict": 12, "n_indent": 4, "top_k": 1, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]}
    code, raw = _post(root + "/infill", body)
    assert code == 200, raw
    got = json.loads(raw)
    assert set(got) == {"content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"}
    plain = fim.fim_prompt(fim.FimTokens(True), PREFIX, SUFFIX, [(e["filename"], e["text"]) for e in EXTRA])
    code, raw = _post(openai_api.base_url(s) + "/completions", {"model": "fim", "prompt": plain, "max_tokens": 12,
                                                                "temperature": 0, "stop": STOPS})
    want = json.loads(raw)
    assert want["choices"][0]["text"] and got["content"] == want["choices"][0]["text"]
    assert got["timings/predicted_n"] == want["usage"]["completion_tokens"]
    # the editor resends the same file: the prompt cache answers its prefix, the answer is the same
    code, raw = _post(root + "/infill", body)
    again = json.loads(raw)
    assert again["content"] == got["content"] and again["tokens_cached"] > 0
    assert again["timings/prompt_n"] == got["timings/prompt_n"] - again["tokens_cached"]
    # streamed: `data:` chunks with content and stop false, the last one the result with stop true
    code, raw = _post(root + "/infill", {**body, "stream": True, "response_fields": None})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert code == 200 and events[-1]["stop"] is True and not any(e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == want["choices"][0]["text"]
    assert events[-1]["tokens_predicted"] == want["usage"]["completion_tokens"]
    # bad FIM input: refused clearly, in OpenAI's error shape
    code, raw = _post(root + "/infill", {"input_prefix": "x<|fim_suffix|>", "input_suffix": ""})
    err = json.loads(raw)["error"]
    assert code == 400 and err["param"] == "input_prefix" and "<|fim_suffix|>" in err["message"]
