"""Weight-only int8 / int4 quantization: round-trip error bounds against a numpy reference, the stored
layout, engines that record TensorRT-LLM's quant_algo and rebuild when quantization changes, greedy
speculative decoding identical to the baseline of the same quantized engine (batches past 32 rows,
models with near-ties), exact multi-row prefill, and the spec refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from pipeline import engine as E
from pipeline import spec as specmod
from pipeline.runtime import kernels, quant
from pipeline.runtime.decode import Bundle, decode
from pipeline.runtime.engine_io import EngineError, load_engine
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.model import ModelConfig, Transformer, build_model
from pipeline.runtime.specconfig import SpecDecodeConfig
from tests.conftest import np_unpack_int4

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- quantize / dequantize against numpy ----

def _np_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.abs(w).max(axis=1) / np.float32(127)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    return np.clip(np.round(w / s[:, None]), -127, 127), s


def _np_int4(w: np.ndarray, gs: int) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    g = w.reshape(n, k // gs, gs)
    s = np.abs(g).max(axis=2) / np.float32(7)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    u = s.view(np.uint32)  # to bf16, round to nearest even: int4 scales are stored as bf16
    s = (((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return np.clip(np.round(g / s[..., None]), -7, 7).reshape(n, k), s


def test_int8_round_trip_is_within_half_a_step_per_row():
    w = torch.randn(37, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 37)[:, None]
    q, s = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (37,)
    nq, ns = _np_int8(w.numpy())
    assert np.array_equal(q.numpy(), nq) and np.allclose(s.numpy(), ns, rtol=0, atol=0)
    err = np.abs(quant.dequantize(q, s).numpy() - w.numpy())
    assert (err <= ns[:, None] / 2 * (1 + 1e-5)).all()
    # The largest weight of each row is exact up to rounding of the scale.
    assert np.abs(np.abs(q.numpy()).max(axis=1) - 127).max() == 0


def _group_err(w: np.ndarray, deq: np.ndarray, gs: int, imp: np.ndarray | None = None) -> np.ndarray:
    e = (deq.astype(np.float64) - w.astype(np.float64)) ** 2
    if imp is not None:
        e = e * imp[None, :]
    return e.reshape(len(w), -1, gs).sum(axis=2)


@pytest.mark.parametrize("k", [256, 384 + 96])  # whole 128-column superblocks; and three 32-column blocks after
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_int4_packs_two_nibbles_and_rounds_each_weight_to_the_nearest_level_of_its_groups_scale(gs, k):
    if k % gs:
        pytest.skip("group size does not divide K")
    w = torch.randn(19, k, generator=torch.Generator().manual_seed(gs))
    packed, s = quant.quantize_int4(w, gs)
    assert packed.dtype == torch.uint8 and packed.shape == (19, k // 2) and s.shape == (19, k // gs)
    assert s.dtype == torch.bfloat16  # int4 scales are stored as bf16, int8 ones as fp32
    q = np_unpack_int4(packed.numpy())
    step = np.repeat(s.float().numpy(), gs, axis=1)
    assert np.array_equal(q, np.clip(np.round(w.numpy() / step), -8, 7))  # nearest level of the chosen scale
    deq = quant.dequantize(packed, s).numpy()
    assert np.allclose(deq, q * step, rtol=1e-7, atol=0)
    assert (q == -8).any() and (s.float() < 0).any()  # the 16th level, taken through a negative scale


@pytest.mark.parametrize("dist", ["normal", "heavy", "outlier"])
def test_int4_scale_search_is_never_worse_than_nearest_rounding_group_by_group(dist):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 256, generator=g)
    if dist == "heavy":
        w = w ** 3
    elif dist == "outlier":
        w[:, ::37] *= 20
    for gs in (32, 128):
        nq, ns = _np_int4(w.numpy(), gs)
        nearest = _group_err(w.numpy(), nq * np.repeat(ns, gs, axis=1), gs)
        packed, s = quant.quantize_int4(w, gs)
        searched = _group_err(w.numpy(), quant.dequantize(packed, s).numpy(), gs)
        assert (searched <= nearest * (1 + 1e-6)).all()
        assert searched.sum() < 0.9 * nearest.sum()  # the search finds real gains, not just ties


def test_int4_importance_weighs_the_error_toward_the_columns_with_large_inputs():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    imp = torch.ones(128)
    imp[::8] = 100.0  # a few columns whose inputs are large
    plain = quant.dequantize(*quant.quantize_int4(w, 64)).numpy()
    weighed = quant.dequantize(*quant.quantize_int4(w, 64, imp)).numpy()
    e_plain, e_weighed = (_group_err(w.numpy(), d, 64, imp.numpy()) for d in (plain, weighed))
    assert (e_weighed <= e_plain * (1 + 1e-6)).all() and e_weighed.sum() < e_plain.sum()
    with pytest.raises(ValueError, match=r"importance: got shape \(64,\), expected \(128,\)"):
        quant.quantize_int4(w, 64, torch.ones(64))


def test_linear_input_power_is_the_mean_square_of_each_layers_inputs():
    from pipeline.runtime.model import linear_input_power

    cfg = _cfg()
    model = build_model(cfg, _state(cfg, 0), torch.float32, "cpu")
    seqs = [[1, 5, 9, 2], [7, 7, 3]]
    power = linear_input_power(model, seqs)
    assert set(power) == {f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in ("wqkv", "wo", "w13", "w2")} | {
        "lm_head"}
    # layer 0's QKV input is the normed embedding; the head's is the model's final hidden state
    with torch.inference_mode():
        x0 = torch.cat([model.layers[0].attn_norm(model.embed(torch.tensor(q))) for q in seqs])
        hid = torch.cat([model(torch.tensor([q]), torch.arange(len(q))[None], model.new_cache(1, 64))[0] for q in seqs])
    torch.testing.assert_close(power["layers.0.wqkv"], x0.square().mean(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(power["lm_head"], hid.square().mean(0), rtol=1e-4, atol=1e-6)


def test_int4_refuses_a_group_size_that_does_not_divide_the_width():
    with pytest.raises(ValueError, match="group_size 128"):
        quant.quantize_int4(torch.randn(4, 96), 128)


def test_zero_rows_quantize_to_zero():
    w = torch.zeros(3, 64)
    for algo in quant.ALGOS:
        assert torch.equal(quant.QLinear(*quant.quantize(w, algo, 32)).weight, w)


def test_row_subset_of_a_quantized_head_is_the_same_rows():
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(1))
    for algo in quant.ALGOS:
        layer = quant.QLinear(*quant.quantize(w, algo, 32))
        idx = torch.tensor([3, 0, 49, 7])
        assert torch.equal(layer.rows(idx).weight, layer.weight[idx])
        x = torch.randn(2, 64)
        assert torch.equal(kernels.linear(x, layer.rows(idx)), kernels.linear(x, layer)[:, idx])


# ---- models ----

def _cfg(vocab=64, hidden=32, tie=True) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=hidden // 4, tie_embeddings=tie, max_position_embeddings=512,
                       eos_token_id=[1])


def _state(cfg: ModelConfig, seed: int, scale: float = 0.3, head_scale: float | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()
                  if not (cfg.tie_embeddings and k == "lm_head.weight")}
    return {k: torch.ones(s) if len(s) == 1 else
            torch.randn(s, generator=g) * (head_scale if head_scale and k == "lm_head.weight" else scale)
            for k, s in shapes.items()}


def near_tie_model(algo: str, seed: int = 0) -> Transformer:
    """Untied head with small weights: logits a few 1e-2 apart, top-2 margins down to ~1e-6 (no x3 scaling)."""
    cfg = _cfg(tie=False)
    return build_model(cfg, quant.quantize_state(_state(cfg, seed, head_scale=0.001), algo, 32), torch.float32, "cpu",
                       act8=algo == "int4_a8")


def test_quantize_state_quantizes_every_linear_and_a_tied_head_separately():
    cfg = _cfg(tie=True)
    st = _state(cfg, 0)
    q = quant.quantize_state(st, "int8", 32)
    assert "lm_head.qweight" in q and "embed.weight" in q and "lm_head.weight" not in q
    assert not any(k.endswith((".wqkv.weight", ".wo.weight", ".w13.weight", ".w2.weight")) for k in q)
    m = build_model(cfg, q, torch.float32, "cpu")
    assert isinstance(m.lm_head, quant.QLinear) and m.embed.weight.dtype == torch.float32
    assert all(isinstance(getattr(b, n), quant.QLinear) for b in m.layers for n in ("wqkv", "wo", "w13", "w2"))
    full = build_model(cfg, st, torch.float32, "cpu")
    assert quant.weight_bytes(m) < 0.45 * quant.weight_bytes(full) + cfg.vocab_size * cfg.hidden_size * 4
    assert quant.quantize_state(st, "none", 32) == st


def _logits5(model: Transformer) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(model(torch.tensor([[5, 9, 3, 7, 11]]), torch.arange(5)[None], model.new_cache(1, 8)))


@pytest.mark.skipif(not kernels.available(), reason="tiles are a layout of the CPU kernels")
def test_cpu_bf16_models_are_tiled_give_back_their_weights_and_decode_the_same_bits(monkeypatch):
    from pipeline.precision import read_bytes
    from pipeline.runtime.model import float_state

    monkeypatch.setenv("PIPELINE_TILES", "1")  # whatever this CPU's default (kernels.tiles)

    cfg = _cfg(tie=True)
    st = {k: v.bfloat16() if v.dim() == 2 else v for k, v in _state(cfg, 4).items()}
    m = build_model(cfg, dict(st), torch.bfloat16, "cpu")
    lins = [getattr(b, n) for b in m.layers for n in ("wqkv", "wo", "w13", "w2")] + [m.lm_head]
    assert all(isinstance(q, quant.QLinear) and q.algo == "bf16" for q in lins)
    assert isinstance(m.embed, nn.Embedding) and torch.equal(m.embed.weight, st["embed.weight"])
    plain = float_state(m)
    assert all(torch.equal(plain[k], v) for k, v in st.items())
    assert torch.equal(plain["lm_head.weight"], st["embed.weight"])  # the tied head's own tiled copy

    tiled = _logits5(m)
    m.to("cpu")  # neither dtype nor device changes: the tiles stay
    assert isinstance(m.lm_head, quant.QLinear)
    assert quant.untile_model(m, tie_embeddings=True) == len(lins)
    assert m.lm_head.weight is m.embed.weight and isinstance(m.layers[0].w13, nn.Linear)
    assert torch.equal(_logits5(m), tiled)
    assert read_bytes(m) == read_bytes(build_model(cfg, dict(st), torch.bfloat16, "cpu"))


@pytest.mark.skipif(not kernels.available(), reason="tiles are a layout of the CPU kernels")
def test_cpu_int4_models_and_draft_heads_are_tiled_and_decode_the_same_bits(monkeypatch):
    from pipeline.runtime.speculative import attach_draft_head

    monkeypatch.setenv("PIPELINE_TILES", "1")

    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, tie_embeddings=True, max_position_embeddings=512)
    q = quant.quantize_state(_state(cfg, 5), "int4", 64)
    m = build_model(cfg, dict(q), torch.float32, "cpu")
    lins = [getattr(b, n) for b in m.layers for n in ("wqkv", "wo", "w13", "w2")] + [m.lm_head]
    assert all(isinstance(x, quant.QLinear) and x.algo == "int4" and x.tiled for x in lins)

    tiled = _logits5(m)
    assert quant.untile_model(m) == len(lins) and not m.lm_head.tiled
    assert torch.equal(_logits5(m), tiled)
    ids = torch.tensor([3, 1, 4, 15, 9, 2, 6, 5])
    attach_draft_head(m, m.lm_head.rows(ids), ids)
    assert m.lm_head.tiled and all(x.tiled for b in m.layers for x in (b.wqkv, b.wo, b.w13, b.w2))
    assert torch.equal(_logits5(m), tiled[..., ids])


@pytest.mark.parametrize("tiles", ["0", "1"])
def test_quantizing_a_model_tiled_at_load_quantizes_every_layer_as_quantize_state_does(tiles, monkeypatch):
    """A bf16 CPU model's layers are tiled QLinears, no longer nn.Linear: quantize_model must still take all of them
    (the engine build's draft step was once timed on a bf16 draft because it did not)."""
    monkeypatch.setenv("PIPELINE_TILES", tiles)
    cfg = _cfg(tie=False)
    st = {k: v.bfloat16() if v.dim() == 2 else v for k, v in _state(cfg, 6).items()}
    a = quant.quantize_model(build_model(cfg, dict(st), torch.bfloat16, "cpu"), "int4", 32)
    lins = [getattr(b, n) for b in a.layers for n in ("wqkv", "wo", "w13", "w2")] + [a.lm_head]
    assert all(isinstance(x, quant.QLinear) and x.algo == "int4" for x in lins)
    b = build_model(cfg, quant.quantize_state(st, "int4", 32), torch.bfloat16, "cpu")
    assert torch.equal(_logits5(a), _logits5(b))


@pytest.mark.skipif(not kernels.available(), reason="tiles are a layout of the CPU kernels")
def test_weights_are_tiled_only_where_the_avx512_build_runs(monkeypatch):
    """The AVX2 build reads one or two rows at a time, and tiles made its bf16 matmuls 0.58x at two tokens on Zen 3."""
    monkeypatch.delenv("PIPELINE_TILES", raising=False)
    cfg = _cfg(tie=True)
    st = {k: v.bfloat16() if v.dim() == 2 else v for k, v in _state(cfg, 4).items()}
    prev = kernels.path()
    try:
        out = {}
        for isa in kernels.supported_isas():
            kernels.set_path(isa)
            m = build_model(cfg, dict(st), torch.bfloat16, "cpu")
            assert kernels.tiles() == (isa == "avx512")
            assert isinstance(m.layers[0].w13, quant.QLinear) == (isa == "avx512"), isa
            assert (m.lm_head.weight is m.embed.weight) == (isa != "avx512"), isa
            out[isa] = _logits5(m)
        assert len({tuple(v.flatten().tolist()) for v in out.values()}) == 1  # same bits either way
    finally:
        kernels.set_path(prev)
    monkeypatch.setenv("PIPELINE_TILES", "0")
    assert not kernels.tiles()


def test_quantize_model_in_place_matches_quantize_state():
    cfg = _cfg(tie=False)
    st = _state(cfg, 2)
    a = quant.quantize_model(build_model(cfg, st, torch.float32, "cpu"), "int4", 32)
    b = build_model(cfg, quant.quantize_state(st, "int4", 32), torch.float32, "cpu")
    toks = torch.tensor([[5, 9, 3, 7]])
    with torch.inference_mode():
        la = a.logits(a(toks, torch.arange(4)[None], a.new_cache(1, 8)))
        lb = b.logits(b(toks, torch.arange(4)[None], b.new_cache(1, 8)))
    assert torch.equal(la, lb)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (int(m),), generator=g).tolist() for m in torch.randint(3, 14, (n,), generator=g)]


def _margins(model: Transformer, reqs, results) -> torch.Tensor:
    out = []
    for q, r in zip(reqs, results):
        seq = torch.tensor([q.prompt + r.tokens])
        with torch.inference_mode():
            lg = model.logits(model(seq, torch.arange(seq.shape[1])[None], model.new_cache(1, seq.shape[1])))
        top = lg[0, len(q.prompt) - 1:-1].topk(2).values
        out.append(top[:, 0] - top[:, 1])
    return torch.cat(out)


@pytest.mark.parametrize("algo", ["int8", "int4", "int4_a8"])
def test_greedy_speculative_equals_baseline_past_32_rows_on_a_near_tie_model(algo):
    target = near_tie_model(algo, seed=1)
    draft = near_tie_model(algo, seed=5)
    b = Bundle(target, None, {"build_config": {"max_draft_len": 8}}, draft=draft,
               spec=SpecDecodeConfig(max_draft_len=8, num_draft_tokens=4, prompt_lookup_num_tokens=7))
    reqs = [Request(p, 30) for p in _prompts(8, seed=3)]
    base = decode(b, "baseline", reqs)
    # The model has the near-ties (top-2 logit margins of a few 1e-6) that a path difference would flip.
    assert _margins(target, reqs, base).min() < 2e-5
    for method, k in (("draft_target", 4), ("draft_target", 6), ("prompt_lookup", 7)):  # 8 x (k+1) = 40..64 rows
        spec = decode(b, method, reqs, num_draft_tokens=k)
        assert [r.tokens for r in spec] == [r.tokens for r in base], (method, k)


def test_prefill_of_many_rows_is_bitwise_the_same_as_token_by_token_decoding():
    model = near_tie_model("int4", seed=3)
    n = 100  # two 48-row chunks of the kernel and a tail
    seq = torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        full = model.logits(model(seq, torch.arange(n)[None], model.new_cache(1, n)))
        cache = model.new_cache(1, n)
        steps = torch.cat([model.logits(model(seq[:, i:i + 1], torch.tensor([[i]]), cache)) for i in range(n)], 1)
    assert torch.equal(full, steps)


def test_quantized_model_stays_close_to_the_float_model():
    cfg = _cfg(tie=False)
    st = _state(cfg, 4)
    ref = build_model(cfg, st, torch.float32, "cpu")
    toks = torch.tensor([_prompts(1, 2)[0]])
    pos = torch.arange(toks.shape[1])[None]
    with torch.inference_mode():
        lr = ref.logits(ref(toks, pos, ref.new_cache(1, 16)))
        errs = {}
        for algo in quant.ALGOS:
            m = build_model(cfg, quant.quantize_state(st, algo, 32), torch.float32, "cpu")
            errs[algo] = float((m.logits(m(toks, pos, m.new_cache(1, 16))) - lr).abs().max() / lr.abs().max())
    # A random 2-layer model amplifies weight noise (int4 0.39 with fp32 scales, 0.43 with bf16 ones); a wrong
    # scale or layout gives errors of order 1.
    assert errs["int8"] < 0.06 and errs["int4"] < 0.5 and errs["int8"] < errs["int4"], errs


# ---- engines ----

def _spec(tiny_root, name: str, **target) -> specmod.Spec:
    data = yaml.safe_load((tiny_root / "build" / "tiny.yaml").read_text())
    data["name"] = name
    data["target"] = {"source": str(tiny_root / "models" / "target"), **target}
    p = tiny_root / "build" / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return specmod.load(p)


@pytest.fixture(scope="module")
def quant_engines(tiny_root):
    return {algo: E.build_target(_spec(tiny_root, f"tiny-{algo}", quantization=algo, group_size=32),
                                 log=lambda *a: None) for algo in ("int8", "int4")}


def test_engine_config_records_quant_algo_the_tensorrt_llm_way(quant_engines, tiny_engine):
    for algo, want in (("int8", "W8A16"), ("int4", "W4A16")):
        cfg = json.loads((quant_engines[algo] / "config.json").read_text())
        assert cfg["pretrained_config"]["quantization"] == {"quant_algo": want, "group_size": 32,
                                                             "kv_cache_quant_algo": None}
        st = load_file(str(quant_engines[algo] / "model.safetensors"))
        assert st["layers.0.wqkv.qweight"].dtype == (torch.int8 if algo == "int8" else torch.uint8)
        assert "lm_head.qweight" in st and "embed.weight" in st and "layers.0.wqkv.weight" not in st
        eng = load_engine(quant_engines[algo])
        assert isinstance(eng.model.lm_head, quant.QLinear) and eng.model.lm_head.algo == algo
    plain = json.loads((tiny_engine / "config.json").read_text())
    assert plain["pretrained_config"]["quantization"]["quant_algo"] is None


def test_changing_quantization_rebuilds_the_engine(tiny_root, quant_engines):
    logs: list[str] = []
    E.build_target(_spec(tiny_root, "tiny-int8", quantization="int8", group_size=32), log=logs.append)
    assert any("up to date" in m for m in logs)
    logs.clear()
    d = E.build_target(_spec(tiny_root, "tiny-int8", quantization="int4", group_size=32), log=logs.append)
    assert not any("up to date" in m for m in logs)
    assert json.loads((d / "config.json").read_text())["pretrained_config"]["quantization"]["quant_algo"] == "W4A16"
    E.build_target(_spec(tiny_root, "tiny-int8", quantization="int8", group_size=32), log=lambda *a: None)


def test_quantized_engines_decode_greedy_identically_with_every_method(quant_engines):
    from pipeline.runtime.decode import load_bundle

    b = load_bundle(quant_engines["int8"].parent)
    b.draft = load_engine(quant_engines["int4"]).model  # an int4 draft for the int8 target
    b.spec = replace(b.spec, num_draft_tokens=4, prompt_lookup_num_tokens=4)
    reqs = [Request(b.tokenizer.encode(t), 20, end_ids=b.end_ids) for t in
            ("Why is the sky blue?", "Write a haiku about rain.", "List three colours.", "What is 2+2?",
             "Describe the water cycle.", "Name a fruit.", "How do plants grow?")]
    base = decode(b, "baseline", reqs)
    for method in ("draft_target", "prompt_lookup"):
        assert [r.tokens for r in decode(b, method, reqs)] == [r.tokens for r in base], method


def test_generate_rows_of_a_batch_equal_their_solo_runs_quantized():
    model = near_tie_model("int8", seed=6)
    reqs = [Request(p, 12) for p in _prompts(6, seed=4)]
    batch = generate(model, reqs)
    for r, q in zip(batch, reqs):
        assert generate(model, [q])[0].tokens == r.tokens


# ---- spec refusals ----

@pytest.mark.parametrize("section,key,value,path", [
    ({"dtype": "float16"}, None, None, "dtype"),
    ({"draft": {"source": "train", "dtype": "float16"}}, None, None, "draft.dtype"),
    ({"target": {"source": "x", "quantization": "int4_awq"}}, None, None, "target.quantization"),
    ({"target": {"source": "x", "quantization": "fp8"}}, None, None, "target.quantization"),
    ({"target": {"source": "x", "quantization": "int4", "group_size": 48}}, None, None, "target.group_size"),
    ({"draft": {"source": "train", "quantization": "int4", "group_size": 100}}, None, None, "draft.group_size"),
    ({"draft": {"source": "train", "quantization": "int4_a8", "group_size": 16}}, None, None, "draft.group_size"),
    ({"device": "cuda", "draft": {"source": "train", "quantization": "int4_a8"}}, None, None, "draft.quantization"),
    ({"draft": {"source": "none", "quantization": "int8"}}, None, None, "draft.quantization"),
])
def test_spec_refuses_bad_precision_settings_naming_the_key(tmp_path, section, key, value, path):
    from tests.conftest import write_spec

    p = write_spec(tmp_path, name="bad", **section)
    with pytest.raises(specmod.SpecError) as e:
        specmod.load(p)
    assert str(e.value).startswith(f"{path}:")


def test_spec_accepts_int8_int4_and_int4_a8_on_the_torch_backend(tmp_path):
    from tests.conftest import write_spec

    s = specmod.load(write_spec(tmp_path, name="ok", target={"source": "x", "quantization": "int4", "group_size": 64},
                                draft={"source": "train", "quantization": "int8"}))
    assert (s.target.quantization, s.target.group_size, s.draft.quantization) == ("int4", 64, "int8")
    s = specmod.load(write_spec(tmp_path, name="ok", target={"source": "x", "quantization": "int4_a8"},
                                draft={"source": "train", "quantization": "int4_a8", "group_size": 32}))
    assert (s.target.quantization, s.draft.quantization, s.draft.group_size) == ("int4_a8", "int4_a8", 32)


def test_build_model_refuses_float16_on_cpu_naming_the_fix():
    cfg = _cfg()
    with pytest.raises(ValueError, match="bfloat16"):
        build_model(cfg, _state(cfg, 0), torch.float16, "cpu")


@pytest.mark.parametrize("algo", ["int8", "int4", "int4_a8"])
def test_qwen2_qkv_bias_survives_quantization_on_both_paths(algo):
    cfg = ModelConfig(**{**_cfg(tie=False).to_dict(), "qkv_bias": True, "model_type": "qwen2"})
    st = _state(cfg, 8)
    st = {k: (torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) if k.endswith(".bias") else v)
          for k, v in st.items()}
    a = build_model(cfg, quant.quantize_state(st, algo, 32), torch.float32, "cpu", act8=algo == "int4_a8")
    b = quant.quantize_model(build_model(cfg, st, torch.float32, "cpu"), algo, 32)
    assert a.layers[0].w13.act8 == b.layers[0].w13.act8 == (algo == "int4_a8")
    assert a.layers[0].wqkv.bias is not None and torch.equal(a.layers[0].wqkv.bias, st["layers.0.wqkv.bias"])
    toks = torch.tensor([[4, 8, 15, 16, 23, 42]])
    pos = torch.arange(6)[None]
    with torch.inference_mode():
        fast = a.logits(a(toks, pos, a.new_cache(1, 8)))
        assert torch.equal(fast, b.logits(b(toks, pos, b.new_cache(1, 8))))
        prev = kernels.set_path("torch")
        try:
            slow = a.logits(a(toks, pos, a.new_cache(1, 8)))
        finally:
            kernels.set_path(prev)
        nobias = build_model(cfg, quant.quantize_state({k: v * 0 if k.endswith(".bias") else v for k, v in st.items()},
                                                       algo, 32), torch.float32, "cpu", act8=algo == "int4_a8")
        other = nobias.logits(nobias(toks, pos, nobias.new_cache(1, 8)))
    assert (fast - slow).abs().max() <= 1e-4
    assert (fast - other).abs().max() > 1e-3  # the bias is applied, not dropped


def test_an_engine_in_another_quantized_layout_is_refused_not_misread(quant_engines, tmp_path):
    import shutil

    d = tmp_path / "old"
    shutil.copytree(quant_engines["int4"], d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["runtime"]["quant_format"] == quant.FORMAT
    cfg["runtime"]["quant_format"] = "qlinear/1"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="--force"):
        load_engine(d)


def test_weights_moved_to_huge_pages_keep_values_ties_and_save(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    cfg = ModelConfig(**{**_cfg(vocab=4096, hidden=128, tie=True).to_dict()})
    st = _state(cfg, 3)
    monkeypatch.setenv("PIPELINE_HUGEPAGES", "0")
    plain = build_model(cfg, dict(st), torch.float32, "cpu")
    monkeypatch.setenv("PIPELINE_HUGEPAGES", "1")
    moved = build_model(cfg, dict(st), torch.float32, "cpu")
    assert moved.embed.weight.data_ptr() != st["embed.weight"].data_ptr()  # 2 MB embedding: moved
    assert moved.lm_head.weight is moved.embed.weight
    assert torch.equal(moved.embed.weight, plain.embed.weight)
    q = quant.quantize_model(build_model(cfg, dict(st), torch.float32, "cpu"), "int8")
    assert quant.to_hugepages(q) > 0
    toks = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        a = plain.logits(plain(toks, torch.arange(3)[None], plain.new_cache(1, 4)))
        b = moved.logits(moved(toks, torch.arange(3)[None], moved.new_cache(1, 4)))
    assert torch.equal(a, b)
    save_file({k: v.contiguous() for k, v in q.state_dict().items()}, str(tmp_path / "m.safetensors"))


def test_weights_moved_to_huge_pages_are_on_huge_pages():
    """The mapping must be private: a shared anonymous one is shmem and got 4 KB pages here (shmem_enabled never)."""
    if quant.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {quant.thp_mode() or 'unknown'} on this kernel")
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(2048, 4096), requires_grad=False)  # 32 MB
    before = quant.hugepage_bytes()
    assert quant.to_hugepages(m) == 32 << 20
    m.w.data.add_(1.0)  # touch every page
    assert quant.hugepage_bytes() - before >= 16 << 20


def test_many_weights_smaller_than_a_few_huge_pages_share_huge_pages():
    """Packed into one 2 MB-aligned mapping: one mapping per 2.5 MB tensor held at most one huge page each."""
    if quant.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {quant.thp_mode() or 'unknown'} on this kernel")
    m = nn.ModuleList(nn.Linear(640, 1024, bias=False) for _ in range(16)).requires_grad_(False)  # 16 x 2.5 MB
    want = [layer.weight.clone() for layer in m]
    before = quant.hugepage_bytes()
    assert quant.to_hugepages(m) == 16 * 640 * 1024 * 4
    assert all(torch.equal(layer.weight, w) for layer, w in zip(m, want))
    assert len({layer.weight.untyped_storage().data_ptr() for layer in m}) == 16  # a storage each
    assert quant.hugepage_bytes() - before >= 36 << 20  # of 40 MB


@pytest.mark.parametrize("algo", ["int8", "int4", "int4_a8"])
def test_medusa_tree_verification_past_32_rows_equals_baseline(algo):
    import math

    from pipeline.runtime.medusa import MedusaHeads, make_engine, medusa_generate

    target = near_tie_model(algo, seed=1)
    torch.manual_seed(0)
    heads = MedusaHeads(3, 1, target.cfg.hidden_size)
    with torch.no_grad():
        heads.w.normal_(0, 0.3 / math.sqrt(target.cfg.hidden_size))
    heads = heads.eval().requires_grad_(False)
    # 9 tree nodes + the root per row, 6 rows: 60 token rows per verification forward.
    tree = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [2, 0], [0, 2]]
    reqs = [Request(p, 24) for p in _prompts(6, seed=11)]
    base = generate(target, reqs)
    got = medusa_generate(target, make_engine(heads, tree), reqs, acceptance="greedy")
    assert [r.tokens for r in got] == [r.tokens for r in base]
    assert _margins(target, reqs, base).min() < 1e-4


@pytest.mark.parametrize("algo,vocab", [("int8", 64), ("int4", 0), ("int4_a8", 40)])
def test_quantized_trained_draft_engine_records_and_decodes_exactly(tiny_root, algo, vocab):
    from pipeline.runtime.decode import load_bundle
    from pipeline.train.draft import build_draft
    from tests.conftest import write_spec

    budget = {"steps": 10, "minutes": 1, "sequences": 4, "seq_len": 24, "batch_size": 4, "lr": 0.003}
    p = write_spec(tiny_root, name=f"qdraft-{algo}", speculation={"num_draft_tokens": 3},
                   draft={"source": "train", "layers": 1, "vocab": vocab, "dtype": "float32", "train": budget,
                          "quantization": algo, "group_size": 32})
    s = specmod.load(p)
    E.build_target(s, log=lambda *a: None)
    out = build_draft(s, log=lambda *a: None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pretrained_config"]["quantization"]["quant_algo"] == quant.QUANT_ALGO[algo]
    b = load_bundle(s.engine_dir)
    assert isinstance(b.draft.lm_head, quant.QLinear) and isinstance(b.draft.layers[0].w13, quant.QLinear)
    assert (getattr(b.draft, "vocab_ids", None) is not None) == bool(vocab)
    # int8 activations (W4A8) from the config, in the kernel's 16-row blocks where it runs; the head too
    assert b.draft.layers[0].w13.act8 == b.draft.lm_head.act8 == (algo == "int4_a8")
    assert b.draft.lm_head.blocks_a8 == (algo == "int4_a8" and kernels.available())
    assert not getattr(b.target.layers[0].w13, "act8", False)
    # int4 rounding weighed by the draft's inputs on its training sequences (quant.quantize_int4)
    assert (cfg["draft"]["training"].get("int4_calibration_tokens", 0) > 0) == (algo != "int8")
    b.spec = replace(b.spec, num_draft_tokens=3)
    reqs = [Request(b.tokenizer.encode(t), 16, end_ids=b.end_ids) for t in ("Why is the sky blue?", "Name a fruit.")]
    assert [r.tokens for r in decode(b, "draft_target", reqs)] == [r.tokens for r in decode(b, "baseline", reqs)]


def test_int4_group_size_that_does_not_divide_the_model_is_an_engine_error_naming_the_key(tiny_root):
    # The tiny target is 64 wide: group_size 128 cannot divide it.
    with pytest.raises(EngineError, match="^target.group_size: group_size 128"):
        E.build_target(_spec(tiny_root, "tiny-int4-128", quantization="int4", group_size=128), log=lambda *a: None)


@pytest.mark.parametrize("algo", ["int8", "int4", "int4_a8"])
def test_batched_verification_logits_past_32_rows_equal_one_token_steps_bitwise(algo):
    model = near_tie_model(algo, seed=2)
    B, ctx, S = 8, 6, 5  # a 48-row batched prefill, then a 40-row batched k+1 verification
    toks = torch.randint(2, 64, (B, ctx + S), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = []
        for b in range(B):
            cache = model.new_cache(1, ctx + S)
            steps = [model.logits(model(toks[b:b + 1, i:i + 1], torch.tensor([[i]]), cache)) for i in range(ctx + S)]
            ref.append(torch.cat(steps[ctx:], 1))
        cache = model.new_cache(B, ctx + S)
        model(toks[:, :ctx], torch.arange(ctx).expand(B, ctx), cache)
        got = model.logits(model(toks[:, ctx:], torch.arange(ctx, ctx + S).expand(B, S), cache))
    assert torch.equal(got, torch.cat(ref))


def test_medusa_heads_train_and_decode_exactly_on_an_int8_target(tiny_root):
    from pipeline.runtime.decode import load_bundle
    from pipeline.train.medusa import build_medusa
    from tests.conftest import write_spec

    med = {"source": "train", "num_heads": 2, "num_layers": 1, "choices": [[0], [0, 0], [1]],
           "train": {"steps": 10, "minutes": 0.5, "sequences": 6, "seq_len": 16, "batch_size": 3, "lr": 0.003}}
    p = write_spec(tiny_root, name="qmedusa", medusa=med,
                   target={"source": "models/target", "quantization": "int8"})
    s = specmod.load(p)
    E.build_target(s, log=lambda *a: None)
    build_medusa(s, log=lambda *a: None)
    b = load_bundle(s.engine_dir, methods=("baseline", "medusa"))
    assert isinstance(b.target.lm_head, quant.QLinear) and b.medusa is not None
    reqs = [Request(b.tokenizer.encode(t), 16, end_ids=b.end_ids) for t in ("Why is the sky blue?", "Name a fruit.")]
    assert [r.tokens for r in decode(b, "medusa", reqs)] == [r.tokens for r in decode(b, "baseline", reqs)]


def test_int8_engines_from_before_the_layout_version_still_load_and_keep_their_hash(quant_engines, tmp_path):
    import shutil

    d = tmp_path / "old8"
    shutil.copytree(quant_engines["int8"], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["runtime"]["quant_format"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert isinstance(load_engine(d).model.lm_head, quant.QLinear)
    assert quant.layout_tag("int8") == () and quant.layout_tag("int4") == (quant.FORMAT, quant.ROUNDING)
