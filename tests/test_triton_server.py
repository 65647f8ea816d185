"""The real tritonserver on a tiny engine: gRPC answers equal in-process decoding, streaming, perf, metrics, stop."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
import urllib.request

import numpy as np
import psutil
import pytest

from pipeline import spec as specmod
from pipeline.client import chat_text, generate, infer_stream, make_inputs
from pipeline.triton import server as srvmod
from pipeline.triton.repo import write_repo
from tests.conftest import write_spec

PROMPT = "Explain how rain forms over the ocean."
UNUSED_END = 0  # <unk>: the random model never stops early, so budgets are exact


def _spec(root, name: str, triton: dict | None = None, **sections) -> specmod.Spec:
    grpc, http, metrics = srvmod.free_ports(3)
    ports = {"grpc_port": grpc, "http_port": http, "metrics_port": metrics}
    return specmod.load(write_spec(root, name=name, triton={**ports, "startup_timeout_s": 240, **(triton or {})},
                                   **sections))


@pytest.fixture(scope="module")
def served(tiny_root, tiny_engine):
    from pipeline.engine import build_target
    from pipeline.train.draft import build_draft

    # The target doubles as its own draft: draft_target is served too, and accepts every draft token. Every step's
    # text goes out as its own piece (stream_interval_ms 0), where the default would join a tiny model's pieces.
    s = _spec(tiny_root, "srv", draft={"source": "models/target"}, triton={"stream_interval_ms": 0})
    build_target(s, log=lambda *a: None)
    build_draft(s, log=lambda *a: None)
    write_repo(s, log=lambda *a: None)
    srv = srvmod.start(s, log=lambda *a: None)
    yield s, srv
    srvmod.stop(s)


@pytest.fixture(scope="module")
def bundle(served):
    from pipeline.runtime.decode import load_bundle

    s, _ = served
    return load_bundle(s.engine_dir, "cpu")


def _local(bundle, prompt: str, n: int, method: str = "baseline") -> tuple[str, list[int], list[int]]:
    """In-process greedy answer for the same text the server receives."""
    from pipeline.runtime.decode import decode
    from pipeline.runtime.generate import Request

    ids = bundle.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    (res,) = decode(bundle, method, [Request(list(ids), n, end_ids=(UNUSED_END,))])
    text = bundle.tokenizer.decode(res.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text, ids, res.tokens


def _metrics(s) -> dict[str, float]:
    text = urllib.request.urlopen(srvmod.metrics_url(s), timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _moved(before: dict, after: dict, name: str, method: str, model: str = "ensemble") -> float:
    """How far the served model's counter `name` for `method` moved between two `_metrics` reads."""
    key = f'{name}{{method="{method}",model="{model}"}}'
    return after.get(key, 0) - before.get(key, 0)


def test_greedy_text_over_grpc_equals_in_process_generation(served, bundle):
    s, srv = served
    prompt = chat_text(bundle.tokenizer, PROMPT)
    want, ids, tokens = _local(bundle, prompt, 12)
    for model in ("ensemble", "tensorrt_llm_bls"):
        r = generate(srv.grpc_url, model, prompt, 12, end_id=UNUSED_END)
        assert r["complete"]
        assert r["text"] == want, model
        assert r["num_input_tokens"] == len(ids)
        assert r["num_output_tokens"] == len(tokens) == 12


def test_streamed_pieces_concatenate_to_the_unary_answer(served):
    s, srv = served
    unary = generate(srv.grpc_url, "ensemble", PROMPT, 16, end_id=UNUSED_END)
    pieces = []
    streamed = generate(srv.grpc_url, "ensemble", PROMPT, 16, stream=True, on_piece=pieces.append,
                        end_id=UNUSED_END)
    assert streamed["complete"] and len(pieces) > 1
    assert "".join(pieces) == streamed["text"] == unary["text"]
    assert streamed["num_output_tokens"] == 16
    assert 0 < streamed["ttft_s"] <= streamed["latency_s"]


def test_the_specs_stream_interval_reaches_the_served_model_every_steps_text_its_own_piece_at_0(served, bundle):
    s, srv = served
    assert s.triton.stream_interval_ms == 0
    pieces = []
    r = generate(srv.grpc_url, "tensorrt_llm_bls", PROMPT, 16, method="baseline", stream=True, on_piece=pieces.append,
                 end_id=UNUSED_END)
    _, _, tokens = _local(bundle, PROMPT, 16)
    texts = [bundle.tokenizer.decode(tokens[:i], skip_special_tokens=True, clean_up_tokenization_spaces=False)
             for i in range(17)]
    # a step sends what its token added unless that ends in a partial character (held for the next step)
    grew = sum(1 for i in range(1, 17) if len(texts[i]) > len(texts[i - 1]) and not texts[i].endswith("\ufffd"))
    assert "".join(pieces) == r["text"] == texts[16]
    # at the default 50 ms this tiny model's 16 steps (a few ms) would come as 2-3 pieces
    assert len(pieces) >= grew - 1 >= 8, (len(pieces), grew)


def test_exclude_input_in_output_false_prepends_the_prompt(served):
    s, srv = served
    a = generate(srv.grpc_url, "ensemble", PROMPT, 6, end_id=UNUSED_END)
    b = generate(srv.grpc_url, "ensemble", PROMPT, 6, end_id=UNUSED_END, exclude_input_in_output=False)
    assert b["text"] == PROMPT + a["text"]


def test_speculative_method_is_exact_and_its_perf_outputs_are_consistent(served, bundle):
    s, srv = served
    assert "prompt_lookup" in bundle.methods(), "the spec's max_draft_len (8) serves prompt_lookup"
    prompt = "the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    base = generate(srv.grpc_url, "ensemble", prompt, 20, method="baseline", end_id=UNUSED_END)
    spec_ = generate(srv.grpc_url, "ensemble", prompt, 20, method="prompt_lookup", num_draft_tokens=3,
                     end_id=UNUSED_END)
    want, _, tokens = _local(bundle, prompt, 20, "prompt_lookup")
    assert spec_["text"] == base["text"] == want
    assert spec_["num_output_tokens"] == len(tokens) == 20
    assert 0 <= spec_["total_accepted_draft_tokens"] <= spec_["total_draft_tokens"]
    assert spec_["total_draft_tokens"] > 0
    assert spec_["acceptance_rate"] == pytest.approx(spec_["total_accepted_draft_tokens"] / spec_["total_draft_tokens"])
    assert base["total_draft_tokens"] == 0 and base["acceptance_rate"] == 0.0


def test_every_method_runs_side_by_side_on_one_server_with_the_same_greedy_text(served, bundle):
    s, srv = served
    assert {"baseline", "draft_target", "prompt_lookup"} <= set(bundle.methods())
    want, _, _ = _local(bundle, PROMPT, 14)
    got = {}
    threads = [threading.Thread(target=lambda m=m: got.__setitem__(
        m, generate(srv.grpc_url, "ensemble", PROMPT, 14, method=m, end_id=UNUSED_END)))
        for m in bundle.methods()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert {m: r["text"] for m, r in got.items()} == {m: want for m in bundle.methods()}
    for r in got.values():
        assert 0 <= r["total_accepted_draft_tokens"] <= r["total_draft_tokens"]
    default = generate(srv.grpc_url, "ensemble", PROMPT, 14, end_id=UNUSED_END)
    assert default["total_draft_tokens"] > 0, "a spec with a draft serves draft_target by default"
    # Side by side the methods are of different groups, so each speculative one steps aside for the others and
    # decodes plainly in part or whole (fairness, pipeline/triton/scheduler.py); alone, the self-draft accepts all.
    self_draft = generate(srv.grpc_url, "ensemble", PROMPT, 14, method="draft_target", end_id=UNUSED_END)
    assert self_draft["text"] == want and self_draft["acceptance_rate"] == 1.0
    assert self_draft["total_accepted_draft_tokens"] == self_draft["total_draft_tokens"] > 0
    baseline = generate(srv.grpc_url, "ensemble", PROMPT, 14, num_draft_tokens=0, end_id=UNUSED_END)
    assert baseline["total_draft_tokens"] == 0, "num_draft_tokens 0 without a method means baseline"


def test_both_models_decode_at_once_each_for_its_own_clients_with_their_solo_answers(served):
    """ensemble and tensorrt_llm_bls are two processes taking turns at steps (the step lock): requests on both at
    once each equal their solo answer, and each model counts the requests it served."""
    s, srv = served
    prompts = [f"{PROMPT} ({i})" for i in range(4)]
    models = ["ensemble", "tensorrt_llm_bls"] * 2
    solo = [generate(srv.grpc_url, "ensemble", p, 40, method="baseline", end_id=UNUSED_END)["text"] for p in prompts]
    before = _metrics(s)
    got: dict = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, generate(
        srv.grpc_url, models[i], prompts[i], 40, method="baseline", stream=i % 3 == 0, end_id=UNUSED_END,
        timeout=120))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert [got[i]["text"] for i in range(4)] == solo
    after = _metrics(s)
    for model in ("ensemble", "tensorrt_llm_bls"):
        assert _moved(before, after, "spec_decode_requests_total", "baseline", model) == 2, model


def test_requests_sent_while_a_batch_runs_each_equal_their_solo_answer(served):
    s, srv = served
    prompts = [f"{PROMPT} ({i})" for i in range(3)]
    budgets = [5, 13, 9]
    solo = [generate(srv.grpc_url, "ensemble", p, n, method="baseline", end_id=UNUSED_END)["text"]
            for p, n in zip(prompts, budgets)]
    before = _metrics(s)
    got: list = [None] * 3
    finished: list = []
    blocker = threading.Thread(target=lambda: (generate(srv.grpc_url, "ensemble", PROMPT, 200, method="baseline",
                                                        end_id=UNUSED_END), finished.append("blocker")))
    blocker.start()
    time.sleep(0.3)
    threads = [threading.Thread(target=lambda i=i: (got.__setitem__(
        i, generate(srv.grpc_url, "ensemble", prompts[i], budgets[i], method="baseline", stream=i == 1,
                    end_id=UNUSED_END)), finished.append(i))) for i in range(3)]
    for t in threads:
        t.start()
    for t in [blocker, *threads]:
        t.join(timeout=120)
    assert [g["text"] for g in got] == solo
    assert [g["num_output_tokens"] for g in got] == budgets
    after = _metrics(s)
    total = lambda m, name: sum(v for k, v in m.items() if k.startswith(f'{name}{{model="ensemble"'))
    assert total(after, "nv_inference_count") - total(before, "nv_inference_count") == 4
    assert sorted(finished, key=str) == [0, 1, 2, "blocker"]
    # (That they share the running batch is test_a_short_request_joins_a_running_one_and_finishes_first: execute
    # hands each request to the scheduler at once, so Triton's own batch count does not say it.)


def _short_during_long(srv, short_prompt: str, method: str, short_opts: dict | None = None,
                       **long_opts) -> tuple[list[str], dict]:
    """Stream a 220-token request with `method`; once its first piece arrives, send a 4-token request (baseline
    unless `short_opts` say otherwise). Returns the order they finished in and both responses."""
    started, done, got = threading.Event(), [], {}

    def long_run():
        got["long"] = generate(srv.grpc_url, "ensemble", PROMPT, 220, method=method, stream=True,
                               on_piece=lambda _: started.set(), end_id=UNUSED_END, **long_opts)
        done.append("long")

    t = threading.Thread(target=long_run)
    t.start()
    assert started.wait(60)
    got["short"] = generate(srv.grpc_url, "ensemble", short_prompt, 4, end_id=UNUSED_END, timeout=120,
                            **(short_opts or {"method": "baseline"}))
    done.append("short")
    t.join(timeout=120)
    return done, got


def _solo(srv, prompt: str, n: int) -> str:
    return generate(srv.grpc_url, "ensemble", prompt, n, method="baseline", end_id=UNUSED_END)["text"]


def test_a_short_request_joins_a_running_one_and_finishes_first(served):
    """Continuous batching: a request arriving mid-way joins the running batch at the next step instead of
    waiting for the long request to finish, and both answers equal their solo runs."""
    s, srv = served
    short_prompt = f"{PROMPT} (short)"
    solo_long, solo_short = _solo(srv, PROMPT, 220), _solo(srv, short_prompt, 4)
    done, got = _short_during_long(srv, short_prompt, "baseline")
    assert done == ["short", "long"]
    assert got["short"]["text"] == solo_short and got["long"]["text"] == solo_long


def test_a_request_arriving_during_a_speculative_one_turns_it_plain_until_it_finishes_first(served):
    """disable_at_batch 2: when a second request arrives, the running speculative one hands its KV cache to the
    continuous batch instead of holding the newcomer until it ends, and speculates again once the newcomer
    has left; both answers equal their solo runs."""
    s, srv = served
    short_prompt = f"{PROMPT} (short, during speculation)"
    solo_long, solo_short = _solo(srv, PROMPT, 220), _solo(srv, short_prompt, 4)
    before = _metrics(s)
    done, got = _short_during_long(srv, short_prompt, "draft_target", disable_at_batch=2)
    assert done == ["short", "long"]
    assert got["short"]["text"] == solo_short and got["long"]["text"] == solo_long
    # The self-draft accepts everything, so drafted tokens count the speculative part: a few rounds before the
    # short request arrived (about 8 tokens), then most of the rest once it left and speculation resumed.
    assert 110 < got["long"]["total_draft_tokens"] < 220
    after = _metrics(s)
    assert _moved(before, after, "spec_decode_requests_speculation_off_total", "draft_target") == 1
    assert _moved(before, after, "spec_decode_speculation_resumed_total", "draft_target") == 1


def test_a_speculative_request_arriving_below_disable_at_batch_joins_the_running_speculative_batch(served):
    """disable_at_batch 0 (never switch off): a draft_target request arriving during another one joins its batch
    at the next round instead of waiting for it to end, both speculate throughout, and both answers equal their
    solo runs. Nothing counts as decoded plainly or resumed."""
    s, srv = served
    short_prompt = f"{PROMPT} (short, joining)"
    solo_long, solo_short = _solo(srv, PROMPT, 220), _solo(srv, short_prompt, 4)
    before = _metrics(s)
    done, got = _short_during_long(srv, short_prompt, "draft_target", disable_at_batch=0,
                                   short_opts={"method": "draft_target", "disable_at_batch": 0})
    assert done == ["short", "long"]
    assert got["short"]["text"] == solo_short and got["long"]["text"] == solo_long
    # The self-draft accepts everything, k=4: the long stream's 219 tokens after its first come 5 a round (176
    # drafted), and the short one's 3 in one round (2 drafts and the target's own: no drafts past its room).
    assert got["short"]["total_draft_tokens"] >= 2 and got["long"]["total_draft_tokens"] >= 170
    after = _metrics(s)
    assert _moved(before, after, "spec_decode_requests_speculation_off_total", "draft_target") == 0
    assert _moved(before, after, "spec_decode_speculation_resumed_total", "draft_target") == 0


def test_a_request_with_two_rows_gets_both_answers(served):
    s, srv = served
    one = generate(srv.grpc_url, "ensemble", PROMPT, 5, end_id=UNUSED_END)["text"]
    two = generate(srv.grpc_url, "ensemble", "Why is the sky blue?", 5, end_id=UNUSED_END)["text"]
    ins = make_inputs(PROMPT, 5, end_id=UNUSED_END)
    from pipeline.client import _tensor

    ins = [_tensor("text_input", [[PROMPT.encode()], [b"Why is the sky blue?"]], object),
           _tensor("max_tokens", [[5], [5]], np.int32), _tensor("end_id", [[UNUSED_END], [UNUSED_END]], np.int32)]
    responses, complete = infer_stream(srv.grpc_url, "ensemble", ins)
    assert complete
    out = responses[-1].as_numpy("text_output").reshape(-1)
    assert [o.decode() for o in out] == [one, two]


def test_custom_speculative_metrics_move_after_requests(served, bundle):
    s, srv = served
    method = "prompt_lookup" if "prompt_lookup" in bundle.methods() else "baseline"
    key = lambda name: f'{name}{{method="{method}",model="ensemble"}}'
    before = _metrics(s)
    r = generate(srv.grpc_url, "ensemble", "a b c a b c a b c a b", 10, method=method, end_id=UNUSED_END)
    after = _metrics(s)
    assert after[key("spec_decode_requests_total")] == before.get(key("spec_decode_requests_total"), 0) + 1
    assert after[key("spec_decode_output_tokens_total")] - before.get(key("spec_decode_output_tokens_total"), 0) == 10
    moved = lambda name: after[key(name)] - before[key(name)]
    proposed = moved("spec_decode_draft_tokens_proposed_total")
    accepted = moved("spec_decode_draft_tokens_accepted_total")
    assert proposed == r["total_draft_tokens"] and accepted == r["total_accepted_draft_tokens"]
    assert any(k.startswith("nv_inference_request_success") for k in after), "Triton's own metrics are served too"


def test_disable_at_batch_serves_the_batch_plainly_and_counts_it(served, bundle):
    s, srv = served
    key = lambda name: f'{name}{{method="prompt_lookup",model="ensemble"}}'
    prompt = "a b c a b c a b c a b"
    base = generate(srv.grpc_url, "ensemble", prompt, 10, method="baseline", end_id=UNUSED_END)
    before = _metrics(s)
    off = generate(srv.grpc_url, "ensemble", prompt, 10, method="prompt_lookup", end_id=UNUSED_END,
                   disable_at_batch=1)
    after = _metrics(s)
    assert off["text"] == base["text"] and off["total_draft_tokens"] == 0
    assert after[key("spec_decode_requests_speculation_off_total")] - before[key(
        "spec_decode_requests_speculation_off_total")] == 1
    on = generate(srv.grpc_url, "ensemble", prompt, 10, method="prompt_lookup", end_id=UNUSED_END, disable_at_batch=0)
    assert on["text"] == base["text"] and on["total_draft_tokens"] > 0


def test_server_listens_only_on_loopback_ports_of_the_spec(served):
    s, srv = served
    procs = [psutil.Process(srv.pid), *psutil.Process(srv.pid).children(recursive=True)]
    listening = {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    assert {port for _, port in listening} == {s.triton.grpc_port, s.triton.http_port, s.triton.metrics_port}
    mapped = lambda ip: str(getattr(ipaddress.ip_address(ip), "ipv4_mapped", None) or ip)  # gRPC's ::ffff:127.0.0.1
    assert {mapped(ip) for ip, _ in listening} == {"127.0.0.1"}


def test_a_busy_port_is_a_clear_error_not_a_hang(tiny_root, served):
    s = _spec(tiny_root, "busy")
    with socket.socket() as hold:
        hold.bind(("127.0.0.1", s.triton.http_port))
        hold.listen()
        with pytest.raises(srvmod.ServerError, match=f"triton.http_port: port {s.triton.http_port}.*in use"):
            srvmod.start(s)
    # refused before tritonserver was started (no log, no pid file), so there was nothing to wait for
    assert not srvmod.log_file(s).exists() and not srvmod.pid_file(s).exists()


def test_starting_twice_says_a_server_is_running(served):
    s, _ = served
    with pytest.raises(srvmod.ServerError, match="already running.*make stop"):
        srvmod.start(s)


def test_serve_dry_run_binds_the_host_the_spec_names(tiny_root, capsys):
    from pipeline.cli import main

    p = write_spec(tiny_root, name="exposed", triton={"host": "0.0.0.0"})
    assert main(["serve", str(p), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for flag in ("--grpc-address=0.0.0.0", "--http-address=0.0.0.0", "--metrics-address=0.0.0.0"):
        assert flag in out
    s = specmod.load(write_spec(tiny_root, name="defaulted"))
    assert s.triton.host == "127.0.0.1"


def test_http_generate_endpoint_answers_like_grpc(served):
    import json

    s, srv = served
    want = generate(srv.grpc_url, "ensemble", PROMPT, 6, end_id=UNUSED_END)["text"]
    body = json.dumps({"text_input": PROMPT, "max_tokens": 6, "end_id": UNUSED_END}).encode()
    req = urllib.request.Request(f"{srvmod.http_url(s)}/v2/models/ensemble/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    out = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert out["text_output"] == want


def test_client_verb_streams_and_prints_perf_metrics(served, capsys):
    from pipeline.cli import main

    s, _ = served
    spec_path = str(s.path("build/srv.yaml"))
    assert main(["client", spec_path, "--prompt", "Hello there", "--stream", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "num_output_tokens 5" in out and "acceptance_rate" in out
    assert main(["client", spec_path, "--prompt", "Hello", "--max-tokens", "0"]) == 2
    assert "max_tokens: got 0" in capsys.readouterr().err


def test_both_served_models_map_one_copy_of_the_weights(served):
    """ensemble and tensorrt_llm_bls are two stub processes of one model: both map the same shared weights file
    (pipeline/runtime/shared.py) instead of holding a copy each, and neither keeps the engine file mapped."""
    from pipeline.runtime import shared

    s, srv = served
    for model in ("ensemble", "tensorrt_llm_bls"):  # each stub decodes: its weight pages are mapped in
        assert generate(srv.grpc_url, model, PROMPT, 4, end_id=UNUSED_END)["complete"]
    stubs = []
    for p in psutil.Process(srv.pid).children(recursive=True):
        try:
            if "triton_python_backend_stub" in " ".join(p.cmdline()):
                stubs.append(p)
        except psutil.Error:  # a helper process that has just exited
            continue
    assert len(stubs) == 2
    maps = [shared.shared_mappings(p.pid) for p in stubs]
    target = str(s.engine_dir / "target")
    files = [{f for f in m if f.startswith(target)} for m in maps]
    assert len(files[0]) == 1 and files[0] == files[1], maps
    (f,) = files[0]
    assert all(m[f]["Rss"] > 0 for m in maps)
    for p in stubs:
        assert not [m.path for m in p.memory_maps() if m.path.endswith("model.safetensors")], p.pid


def test_stop_leaves_no_process_and_frees_the_ports(served):
    s, srv = served
    procs = [psutil.Process(srv.pid), *psutil.Process(srv.pid).children(recursive=True)]
    assert len(procs) >= 2, "tritonserver and its python-backend stub"
    assert srvmod.stop(s)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    assert not srvmod.pid_file(s).exists()
    assert all(srvmod.port_free("127.0.0.1", port) for port in srvmod.ports(s).values())
    assert not srvmod.stop(s)


def test_free_ports_are_distinct_and_each_can_be_bound():
    """Tests take a spec's ports from free_ports: one call never hands out a port twice (free_port called 18 times
    in a row had, and the routing test's spec failed its port-clash check)."""
    ports = srvmod.free_ports(32)
    assert len(set(ports)) == 32
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
