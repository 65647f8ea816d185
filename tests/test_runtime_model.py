"""Our runtime's logits equal transformers' LlamaForCausalLM on the same weights."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.runtime.model import ModelConfig, build_model, hf_to_runtime, runtime_to_hf

# Attention reads a bf16 K/V cache and rounds q and its softmax weights to bf16 (kernels.KV_DTYPE; the torch path
# does the same): logits move by about 1e-3 from transformers' fp32 attention on these models. A wrong weight
# mapping, RoPE or mask moves them by 0.1 and more.
TOL = 3e-3


def _pair(kv_heads=2, tie=True, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=256, rope_theta=777.0,
                      tie_word_embeddings=tie)
    hf = LlamaForCausalLM(cfg).eval()
    mc = ModelConfig.from_hf(cfg.to_dict())
    return hf, build_model(mc, hf_to_runtime(hf.state_dict(), mc), torch.float32, "cpu")


def test_prefill_logits_match_transformers_with_gqa():
    hf, ours = _pair(kv_heads=2)
    ids = torch.randint(0, 97, (1, 19))
    with torch.no_grad():
        ref = hf(ids).logits
    cache = ours.new_cache(1, 64)
    got = ours.logits(ours(ids, torch.arange(19)[None], cache))
    assert (got - ref).abs().max() <= TOL


def test_step_by_step_decode_matches_full_forward():
    hf, ours = _pair(kv_heads=1, tie=False)
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache = ours.new_cache(1, 64)
    ours(ids[:, :5], torch.arange(5)[None], cache)
    for t in range(5, 12):
        got = ours.logits(ours(ids[:, t:t + 1], torch.tensor([[t]]), cache))[0, 0]
        assert (got - ref[t]).abs().max() <= TOL


def test_batch_of_different_lengths_matches_each_row_alone():
    hf, ours = _pair(kv_heads=2)
    lens = [7, 13, 3]
    rows = [torch.randint(0, 97, (n,)) for n in lens]
    S = max(lens)
    tokens = torch.zeros(3, S, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    cache = ours.new_cache(3, 64)
    hidden = ours(tokens, torch.arange(S).expand(3, S), cache)
    # one decode step per row at each row's own position
    nxt = torch.tensor([[5], [6], [7]])
    step = ours.logits(ours(nxt, torch.tensor([[n] for n in lens]), cache))[:, 0]
    for b, r in enumerate(rows):
        with torch.no_grad():
            ref = hf(torch.cat([r, nxt[b]])[None]).logits[0]
        assert (ours.logits(hidden[b, len(r) - 1]) - ref[len(r) - 1]).abs().max() <= TOL
        assert (step[b] - ref[-1]).abs().max() <= TOL


def test_runtime_layout_round_trips_to_hf_keys():
    hf, ours = _pair(tie=False)
    back = runtime_to_hf(ours.state_dict(), ours.cfg)
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k


def test_verify_pass_logits_equal_single_token_decode_to_float_rounding():
    """k+1-token verification sees what plain decoding sees, up to float rounding. Not bit for bit: the matmul
    kernels are row-count independent (skinny.c), but attention (torch's SDPA over k+1 queries or one) rounds
    differently, by about 1e-7 on these logits; a real drift (a wrong position, a stale cache slot) is far
    larger than the bound."""
    _, ours = _pair()
    ids = torch.randint(0, 97, (1, 10))
    c1, c2 = ours.new_cache(1, 64), ours.new_cache(1, 64)
    ours(ids[:, :4], torch.arange(4)[None], c1)
    ours(ids[:, :4], torch.arange(4)[None], c2)
    multi = ours.logits(ours(ids[:, 4:10], torch.arange(4, 10)[None], c1))[0]
    for t in range(4, 10):
        one = ours.logits(ours(ids[:, t:t + 1], torch.tensor([[t]]), c2))[0, 0]
        assert (one - multi[t - 4]).abs().max() <= 1e-6


def test_the_cpu_kv_cache_is_bf16_two_bytes_a_value():
    """The K/V cache on CPU is bf16 (kernels.KV_DTYPE), half fp32's bytes: a 16k-token prompt of the 1.5B holds
    0.47 GB, not 0.94."""
    _, ours = _pair(kv_heads=2)
    cache = ours.new_cache(3, 40)
    c = ours.cfg
    assert cache.k.dtype == cache.v.dtype == torch.bfloat16 == ours.kv_dtype
    assert cache.nbytes == 2 * c.num_layers * 3 * c.num_kv_heads * 40 * c.head_dim * 2
