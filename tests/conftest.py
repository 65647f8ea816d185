"""Tiny models made on the fly: a random Llama checkpoint with a BPE tokenizer trained on our prompts."""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.triton import server as srvmod

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

# No test may hang: one that runs past this (setup included, so a server that never starts is caught too) has
# every thread's stack, py-spy dumps of the servers' python-backend stubs and the servers' log tails written to
# reports/test_hang.txt and stderr; its servers are killed and the run exits with code 3.
TEST_TIMEOUT_S = float(os.environ.get("PIPELINE_TEST_TIMEOUT", "420"))
HANG_REPORT = ROOT / "reports" / "test_hang.txt"

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def prompts() -> list[str]:
    lines = (ROOT / "build" / "prompts.txt").read_text().splitlines()
    return [ln for ln in lines if ln.strip() and not ln.startswith("#")]


def train_tokenizer(vocab: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(prompts() * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model_dir(path: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                   seed: int = 0, vocab: int = 320, tie: bool = True, tokenizer=None, family: str = "llama") -> Path:
    """Save a random LlamaForCausalLM (or Qwen2ForCausalLM, with random q/k/v biases) + tokenizer as a
    Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = tokenizer or train_tokenizer(vocab)
    torch.manual_seed(seed)
    config, model_cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    extra = {"use_sliding_window": False} if family == "qwen2" else {}
    cfg = config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 max_position_embeddings=512, rope_theta=1000.0, tie_word_embeddings=tie,
                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **extra)
    model = model_cls(cfg)
    # Sharper logits than the default init, so greedy decoding has few near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def write_spec(root: Path, name: str = "tiny", **sections) -> Path:
    """Write root/build/<name>.yaml for a tiny model; sections override the defaults."""
    data = {
        "name": name,
        "backend": "torch",
        "device": "cpu",
        "dtype": "float32",
        "target": {"source": "models/target"},
        "limits": {"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 256, "max_draft_len": 8},
        "speculation": {"num_draft_tokens": 4},
        "validate": {"prompts": str(ROOT / "build" / "prompts.txt"), "max_prompts": 4, "max_new_tokens": 16,
                     "concurrency": [1, 2], "temperatures": [0.0, 0.7]},
    }
    for k, v in sections.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    (root / "build").mkdir(parents=True, exist_ok=True)
    p = root / "build" / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory, tiny_tokenizer) -> Path:
    """A project root with models/target (a 2-layer random Llama) and build/tiny.yaml."""
    root = tmp_path_factory.mktemp("tiny")
    make_model_dir(root / "models" / "target", tokenizer=tiny_tokenizer)
    write_spec(root)
    return root


@pytest.fixture(scope="session")
def tiny_engine(tiny_root):
    """The tiny target engine, built once per session."""
    from pipeline import spec as specmod
    from pipeline.engine import build_target

    s = specmod.load(tiny_root / "build" / "tiny.yaml")
    return build_target(s, log=lambda *a: None)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest single-threaded; threads only contend on a shared machine."""
    from pipeline.runtime import kernels

    n, kn = torch.get_num_threads(), kernels.threads()
    torch.set_num_threads(1)
    kernels.set_threads(1)
    yield
    torch.set_num_threads(n)
    kernels.set_threads(kn)


def np_unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Independent reading of the documented layout, as q = u - 8: a row is read as little-endian 16-bit
    words; the first K - K % 128 columns are superblocks of 32 words (word i holds column 32m + i in
    nibble m, bits 4m..4m+3), the rest blocks of 8 words (word i holds column 8m + i in nibble m)."""
    n, half = packed.shape
    k = 2 * half
    words = packed.astype(np.int64).reshape(n, half // 2, 2)
    words = words[..., 0] | (words[..., 1] << 8)  # [n, K / 4]
    out = np.zeros((n, k), dtype=np.int64)
    col, w = 0, 0
    while col < k:
        width = 128 if k - col >= 128 else 32
        nw = width // 4
        for i in range(nw):
            for m in range(4):
                out[:, col + nw * m + i] = (words[:, w + i] >> (4 * m)) & 15
        col, w = col + width, w + nw
    return out - 8


def _hang_report(nodeid: str) -> str:
    import psutil

    HANG_REPORT.parent.mkdir(parents=True, exist_ok=True)
    with open(HANG_REPORT, "w") as f:
        f.write(f"{nodeid} ran past {TEST_TIMEOUT_S:.0f}s (PIPELINE_TEST_TIMEOUT); stacks, stub dumps and server "
                "logs:\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    lines = [HANG_REPORT.read_text()]
    procs = psutil.Process().children(recursive=True)
    spy = Path(sys.executable).parent / "py-spy"
    for p in procs:
        try:
            name, cmd = p.name(), p.cmdline()
        except psutil.Error:
            continue
        if "triton_python_backend_stub" in name and spy.is_file():
            try:
                out = subprocess.run([str(spy), "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                     timeout=60)
                lines.append(f"--- py-spy dump of stub {p.pid} ({cmd[-2] if len(cmd) > 2 else ''}):\n"
                             f"{out.stdout}{out.stderr}")
            except (OSError, subprocess.SubprocessError) as e:
                lines.append(f"--- py-spy dump of stub {p.pid} failed: {e}")
    for p in procs:
        try:
            if p.name() != "tritonserver":
                continue
            log = os.readlink(f"/proc/{p.pid}/fd/1")
            tail = Path(log).read_text(errors="replace").splitlines()[-80:]
            lines.append(f"--- tail of {log} (tritonserver {p.pid}):\n" + "\n".join(tail))
        except (OSError, psutil.Error) as e:
            lines.append(f"--- no log for {p.pid}: {e}")
    for p in procs:
        try:
            if p.name() == "tritonserver":
                os.killpg(p.pid, 9)
        except (OSError, psutil.Error):
            pass
    text = "\n".join(lines)
    HANG_REPORT.write_text(text)
    return text


def _on_hang(config, nodeid: str) -> None:
    text = _hang_report(nodeid)
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        try:
            capman.suspend_global_capture(in_=True)
        except Exception:  # noqa: BLE001 - the report is on disk anyway
            pass
    sys.stderr.write(text + f"\n(written to {HANG_REPORT})\n")
    sys.stderr.flush()
    os._exit(3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    timer = threading.Timer(TEST_TIMEOUT_S, _on_hang, args=(item.config, item.nodeid))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# ---- test tiers (markers registered in pyproject.toml; `make test-fast` runs -m "not server and not slow") ----
# Marks follow the fixtures a test uses, so a new test that takes a server fixture is tiered without a decorator:
# - server: it starts tritonserver (a fixture with "served", "server" or "harness" in its name, or an explicit
#   @pytest.mark.server on a test that starts one itself). Checked: pipeline.triton.server.start fails any test
#   not marked server, so the quick loop cannot quietly grow a server.
# - harness: the TensorRT-LLM stand-in harness (the `harness` fixture); these are server tests too.
# - slow: heavy without a server: distributions checked by sampling (`small_pair`), the bench run (`bench`), engine
#   builds (`big_root`, `qwen_root`), and the tests marked @pytest.mark.slow by hand (fuzzing, subprocess builds).
SERVER_FIXTURE_WORDS = ("served", "server", "harness")
SLOW_FIXTURES = {"small_pair", "bench", "big_root", "qwen_root"}
_server_tests: set[str] = set()
_running: list[str] = []  # the node id of the test now running


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = set(item.fixturenames)
        if any(word in name for name in names for word in SERVER_FIXTURE_WORDS):
            item.add_marker(pytest.mark.server)
        if "harness" in names:
            item.add_marker(pytest.mark.harness)
        if names & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("server") is not None:
            _server_tests.add(item.nodeid)


def pytest_runtest_logstart(nodeid, location):
    _running[:] = [nodeid]


def pytest_sessionstart(session):
    from pipeline.triton import server

    real = server.start
    if getattr(real, "tier_guarded", False):
        return

    def start(*args, **kwargs):
        if _running and _running[0] not in _server_tests:
            pytest.fail(f"{_running[0]} starts tritonserver but is not marked `server`: take the server from a "
                        f"fixture whose name has one of {SERVER_FIXTURE_WORDS} in it, or mark the test "
                        "@pytest.mark.server (tests/conftest.py, test tiers)", pytrace=False)
        return real(*args, **kwargs)

    start.tier_guarded = True
    server.start = start


# ---- servers stopped without waiting ---------------------------------------------------------------------------
# A tritonserver stop is mostly waiting: tritonserver looks at its models' unload once a second and each python stub's
# interpreter takes a second to exit. A fixture's server stops in the background while the next tests run (the next
# spec's server starts meanwhile); the session waits for every stop at its end and fails if one did not finish.
_stopping: list[threading.Thread] = []
_stop_errors: list[str] = []


def stop_later(*specs) -> None:
    """Stop these specs' servers in the background (pipeline.triton.server.stop: SIGTERM, SIGKILL after 30 s)."""

    def one(spec) -> None:
        try:
            srvmod.stop(spec)
        except Exception as e:  # noqa: BLE001 - reported at the end of the session
            _stop_errors.append(f"stopping {spec.name}'s server ({srvmod.pid_file(spec)}): {e!r}")

    for s in specs:
        t = threading.Thread(target=one, args=(s,), name=f"stop {s.name}", daemon=True)
        t.start()
        _stopping.append(t)


def pytest_sessionfinish(session, exitstatus):
    for t in _stopping:
        t.join(timeout=60)
    left = [f"{t.name}: still running after 60 s" for t in _stopping if t.is_alive()] + _stop_errors
    if left:
        sys.stderr.write("servers not stopped cleanly: " + "; ".join(left) + "\n")
        session.exitstatus = session.exitstatus or 1


# ---- llama-server's stand-in (validate's and bench's interleaved peer) -------------------------------------------

STAND_IN = """#!{python}
# llama-server's command line and HTTP API as far as PlainPeer uses them: /health, and /v1/chat/completions answered
# with the shape of RESPONSE (no draft counts). Each request's prompt goes to $STAND_IN_LOG; the prompt CRASH kills
# the first process that receives it (the marker file says it happened), as a crashed server would.
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
log, marker = os.environ["STAND_IN_LOG"], os.environ["STAND_IN_LOG"] + ".crashed"
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, n = body["messages"][0]["content"], body["max_tokens"]
        with open(log, "a") as f:
            f.write(json.dumps({{"prompt": prompt, "max_tokens": n, "port": port, "pid": os.getpid()}}) + "\\n")
        if prompt == "CRASH" and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(9)
        self._send({{"choices": [{{"message": {{"role": "assistant", "content": "x" * n}}}}],
                    "usage": {{"completion_tokens": n}},
                    "timings": {{"prompt_n": 5, "prompt_ms": 10.0, "predicted_n": n,
                                "predicted_per_second": 100.0 + n}}}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def install_stand_in(tmp_path: Path, monkeypatch):
    """peers' llama-server and the spec's GGUF target replaced by the stand-in and an empty file (the binary cannot be
    built in the tests); returns the request log reader: one dict per request, in arrival order."""
    from pipeline import peers

    exe = tmp_path / "llama-server"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(0o755)
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"")
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setattr(peers, "binary", lambda *a, **k: exe)
    monkeypatch.setattr(peers, "gguf_of", lambda spec, part="target": gguf if part == "target" else None)

    def requests() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return requests


@pytest.fixture
def stand_in_server(tmp_path, monkeypatch):
    """install_stand_in for one test."""
    return install_stand_in(tmp_path, monkeypatch)
