"""Qwen2 in the torch runtime: q/k/v biases (C kernels and torch path), rope theta, separate output weight."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from pipeline.runtime import kernels
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.model import ModelConfig, build_model, hf_to_runtime, runtime_to_hf
from pipeline.runtime.speculative import draft_target, prompt_lookup

TOL = 3e-3  # bf16 K/V attention against transformers' fp32 (see test_runtime_model)


def _qwen(seed=0, tie=False):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie, use_sliding_window=False)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # the default init is zero, which would hide a dropped bias
    mc = ModelConfig.from_hf(cfg.to_dict())
    return hf, mc, build_model(mc, hf_to_runtime(hf.state_dict(), mc), torch.float32, "cpu")


def test_qwen2_config_reads_bias_theta_and_untied_head():
    _, mc, ours = _qwen()
    assert mc.qkv_bias and mc.model_type == "qwen2" and mc.rope_theta == 1e6 and not mc.tie_embeddings
    assert ours.layers[0].wqkv.bias is not None
    assert ours.lm_head.weight.data_ptr() != ours.embed.weight.data_ptr()


def test_qwen2_training_forward_keeps_the_qkv_biases():
    """The distillation forward (pipeline.train.draft.forward_train) must be the model the runtime serves."""
    from pipeline.train.draft import forward_train

    hf, _, ours = _qwen()
    ids = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.logits(forward_train(ours, ids))
    assert (got - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("fast", [True, False], ids=["c-kernels", "torch"])
def test_qwen2_prefill_and_decode_logits_match_transformers(fast, monkeypatch):
    hf, _, ours = _qwen()
    if not fast:
        monkeypatch.setattr(kernels, "fast_path", lambda tokens: False)
    elif not kernels.available():
        pytest.skip("no C kernel on this machine")
    ids = torch.randint(0, 101, (1, 14))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache = ours.new_cache(1, 64)
    got = ours.logits(ours(ids[:, :6], torch.arange(6)[None], cache))[0]
    assert (got - ref[:6]).abs().max() <= TOL
    for t in range(6, 14):
        step = ours.logits(ours(ids[:, t:t + 1], torch.tensor([[t]]), cache))[0, 0]
        assert (step - ref[t]).abs().max() <= TOL


def test_qwen2_without_biases_differs_so_the_bias_is_really_applied():
    hf, mc, ours = _qwen()
    state = hf_to_runtime(hf.state_dict(), mc)
    zeroed = {k: (torch.zeros_like(v) if k.endswith("wqkv.bias") else v) for k, v in state.items()}
    other = build_model(mc, zeroed, torch.float32, "cpu")
    ids = torch.randint(0, 101, (1, 8))
    a = ours.logits(ours(ids, torch.arange(8)[None], ours.new_cache(1, 16)))
    b = other.logits(other(ids, torch.arange(8)[None], other.new_cache(1, 16)))
    assert (a - b).abs().max() > 1e-2


def test_qwen2_layout_round_trips_to_hf_keys():
    hf, mc, ours = _qwen()
    back = runtime_to_hf(ours.state_dict(), mc)
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k


def test_qwen2_sliding_window_is_refused():
    cfg = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=16)
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(cfg.to_dict())


def test_qwen2_greedy_equals_transformers_generate():
    hf, _, ours = _qwen(seed=2)
    g = torch.Generator().manual_seed(1)
    for n in (3, 11):
        ids = torch.randint(0, 101, (1, n), generator=g)
        ref = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, n:].tolist()
        (res,) = generate(ours, [Request(ids[0].tolist(), 20)])
        assert res.tokens == ref


@pytest.mark.slow
def test_qwen2_speculative_greedy_equals_baseline_in_a_ragged_batch():
    _, mc, target = _qwen(seed=3)
    # A partly agreeing Qwen2 draft: the target's weights with noise (biases included).
    g = torch.Generator().manual_seed(5)
    st = {k: v * (1 + 0.1 * torch.randn(v.shape, generator=g)) for k, v in target.state_dict().items()}
    draft = build_model(mc, st, torch.float32, "cpu")
    gp = torch.Generator().manual_seed(9)
    reqs = [Request(torch.randint(2, 101, (n,), generator=gp).tolist(), m) for n, m in ((4, 25), (13, 9), (7, 31))]
    base = generate(target, reqs)
    for k in (2, 4):
        spec = draft_target(target, draft, reqs, k)
        assert [r.tokens for r in spec] == [r.tokens for r in base]
        assert sum(r.draft_accepted for r in spec) > 0
    lookup = prompt_lookup(target, reqs, 3)
    assert [r.tokens for r in lookup] == [r.tokens for r in base]


@pytest.fixture(scope="module")
def qwen_root(tmp_path_factory, tiny_tokenizer):
    """A tiny untied Qwen2 target and a one-layer Qwen2 draft (same tokenizer) as Hugging Face directories."""
    from tests.conftest import make_model_dir

    root = tmp_path_factory.mktemp("qwen")
    make_model_dir(root / "models" / "target", family="qwen2", tie=False, tokenizer=tiny_tokenizer)
    make_model_dir(root / "models" / "draft", family="qwen2", layers=1, seed=4, tie=False, tokenizer=tiny_tokenizer)
    return root


def test_qwen2_pipeline_builds_target_and_pretrained_draft_with_a_reduced_head(qwen_root, tiny_tokenizer):
    import json

    from transformers import AutoModelForCausalLM

    from pipeline import spec as specmod
    from pipeline.engine import build_target
    from pipeline.runtime.decode import decode, load_bundle
    from tests.conftest import prompts, write_spec

    tune = qwen_root / "tune.txt"
    tune.write_text("\n".join(prompts()[:3]) + "\n")
    p = write_spec(qwen_root, name="qw", draft={"source": "models/draft", "vocab": 200, "dtype": "float32",
                                                "train": {"prompts": str(tune)}},
                   speculation={"num_draft_tokens": "auto"})
    s = specmod.load(p)
    build_target(s, log=lambda *a: None)
    from pipeline.train.draft import build_draft

    logs: list[str] = []
    out = build_draft(s, log=logs.append)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pretrained_config"]["architecture"] == "Qwen2ForCausalLM"
    assert cfg["draft"]["vocab"] == 200 and 0 < cfg["draft"]["training"]["vocab_coverage"] <= 1
    assert 0 < cfg["speculation"]["draft_step_fraction"] < 10
    # The reduced head keeps every special token and every token of the tuning prompts.
    b = load_bundle(s.engine_dir, "cpu")
    kept = set(b.draft.vocab_ids.tolist())
    assert set(tiny_tokenizer.all_special_ids) <= kept
    for t in prompts()[:3]:
        ids = tiny_tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        assert set(ids["input_ids"] if hasattr(ids, "keys") else ids) <= kept
    # draft_hf is the pretrained draft whole: a Qwen2 checkpoint with its biases and its full head.
    hf = AutoModelForCausalLM.from_pretrained(str(s.engine_dir / "draft_hf"), dtype=torch.float32)
    src = AutoModelForCausalLM.from_pretrained(str(qwen_root / "models" / "draft"), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    for k, v in src.state_dict().items():
        assert torch.equal(hf.state_dict()[k], v), k
    reqs = [Request(tiny_tokenizer(t)["input_ids"], 20) for t in prompts()[5:9]]
    base = decode(b, "baseline", reqs)
    spec_out = decode(b, "draft_target", reqs, num_draft_tokens=3)
    assert [r.tokens for r in spec_out] == [r.tokens for r in base]


def test_the_transformers_peer_of_a_qwen2_engine_holds_its_weights():
    from pipeline.bench import hf_model

    hf_ref, _, ours = _qwen(seed=6)
    peer = hf_model(ours, torch.float32)
    assert type(peer).__name__ == "Qwen2ForCausalLM"
    ids = torch.randint(0, 101, (1, 9))
    with torch.no_grad():
        assert (peer(ids).logits - hf_ref(ids).logits).abs().max() <= TOL


@pytest.mark.parametrize("vocab", [0, 200], ids=["full-head", "reduced-head"])
def test_a_draft_distilled_from_an_untied_qwen2_target_builds_and_its_hf_checkpoint_is_the_draft(qwen_root, vocab,
                                                                                                 tiny_tokenizer):
    """`draft.source: train` on an untied target: draft_hf keeps the draft's own head (the target's rows outside a
    reduced head, the trained rows inside it), and draft_target stays exact."""
    from transformers import AutoModelForCausalLM

    from pipeline import spec as specmod
    from pipeline.engine import build_target
    from pipeline.runtime.decode import decode, load_bundle
    from pipeline.train.draft import build_draft
    from tests.conftest import prompts, write_spec

    budget = {"steps": 20, "minutes": 1, "sequences": 8, "seq_len": 40, "batch_size": 4, "lr": 0.003}
    p = write_spec(qwen_root, name=f"qt{vocab}", draft={"source": "train", "layers": 1, "vocab": vocab,
                                                          "dtype": "float32", "train": budget},
                   speculation={"num_draft_tokens": 3})
    s = specmod.load(p)
    build_target(s, log=lambda *a: None)
    build_draft(s, log=lambda *a: None)
    again: list[str] = []
    build_draft(s, log=again.append)
    assert any("up to date" in m for m in again)
    b = load_bundle(s.engine_dir, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(s.engine_dir / "draft_hf"), dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(str(qwen_root / "models" / "target"), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen2ForCausalLM" and not hf.config.tie_word_embeddings
    ids = torch.tensor([tiny_tokenizer(prompts()[0])["input_ids"]])
    with torch.no_grad():
        ref = hf(ids).logits[0]
        ours = b.draft.logits(b.draft(ids, torch.arange(ids.shape[1])[None], b.draft.new_cache(1, 64)))[0]
    if vocab:
        kept = b.draft.vocab_ids
        assert (ours - ref[:, kept]).abs().max() <= TOL
        rest = torch.ones(hf.lm_head.weight.shape[0], dtype=torch.bool)
        rest[kept] = False
        assert torch.equal(hf.lm_head.weight[rest], target.lm_head.weight[rest])
    else:
        assert (ours - ref).abs().max() <= TOL
    reqs = [Request(tiny_tokenizer(t)["input_ids"], 20) for t in prompts()[5:9]]
    base = decode(b, "baseline", reqs)
    assert [r.tokens for r in decode(b, "draft_target", reqs, num_draft_tokens=3)] == [r.tokens for r in base]


def test_only_drafts_distilled_from_qwen2_or_untied_targets_are_built_again_after_the_2026_12_06_fixes():
    from pipeline.train.draft import rebuild_tag

    assert rebuild_tag("train", {"model_type": "qwen2", "tie_word_embeddings": True}) == ("distilled/2",)
    assert rebuild_tag("train", {"model_type": "llama", "tie_word_embeddings": False}) == ("distilled/2",)
    assert rebuild_tag("train", {"model_type": "llama", "tie_word_embeddings": True}) == ()
    assert rebuild_tag("qwen2.5-coder-0.5b-instruct", {"model_type": "qwen2", "tie_word_embeddings": True}) == ()
