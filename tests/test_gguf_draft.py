"""A pretrained draft on its GGUF's own blocks (`draft.quantization: gguf`): it builds from a GGUF file laid out as
llama.cpp's converter lays one out, keeps its reduced head as the GGUF's own rows, and draft_target on it answers with
baseline's greedy tokens, in process (prompt cache on and off) and through the real tritonserver."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline import spec as specmod
from pipeline.runtime import gguf_weights as gw
from pipeline.runtime.engine_io import EngineError
from tests.conftest import make_model_dir, train_tokenizer, write_spec

DRAFT_VOCAB = 200  # of the tiny tokenizer's 321: the reduced head keeps these rows
# The 0.5B Qwen2.5-Coder draft's mix: mostly Q5_0, some Q8_0 (its token embedding, the tied head, too), and a
# Q4_1 matrix for good measure. Every width here (64, 128) is whole blocks of 32, as 896 and 4864 are there.
TYPES = {"token_embd": gw.Q8_0, "attn_q": gw.Q5_0, "attn_k": gw.Q5_0, "attn_v": gw.Q8_0, "attn_output": gw.Q5_0,
         "ffn_gate": gw.Q5_0, "ffn_up": gw.Q5_0, "ffn_down": gw.Q4_1}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute for attn_q / attn_k rows (its RoPE pairs neighbours)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, path: Path, types: dict[str, int]) -> Path:
    """The Llama checkpoint at `model_dir` as a GGUF file: llama.cpp's tensor names and q/k row order, its tokenizer as
    metadata (byte-level BPE, merges, special ids, chat template), each matrix quantized by gguf.quants to its type in
    `types` (by tensor kind), norms F32, the head tied to the token embedding as in the checkpoint."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    st = load_file(str(model_dir / "model.safetensors"))
    assert cfg.tie_word_embeddings
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    special = set(tok.all_special_ids)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_unk_token_id(tok.unk_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)

    def put(name: str, t: torch.Tensor) -> None:
        a = t.float().numpy()
        qtype = types.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0])
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
        else:
            w.add_tensor(name, quants.quantize(a, GGMLQuantizationType(qtype)), raw_dtype=GGMLQuantizationType(qtype))

    put("token_embd.weight", st["model.embed_tokens.weight"])
    put("output_norm.weight", st["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", st[p + "input_layernorm.weight"])
        put(b + "attn_q.weight", torch.from_numpy(_permute(st[p + "self_attn.q_proj.weight"].numpy(),
                                                           cfg.num_attention_heads)))
        put(b + "attn_k.weight", torch.from_numpy(_permute(st[p + "self_attn.k_proj.weight"].numpy(),
                                                           cfg.num_key_value_heads)))
        put(b + "attn_v.weight", st[p + "self_attn.v_proj.weight"])
        put(b + "attn_output.weight", st[p + "self_attn.o_proj.weight"])
        put(b + "ffn_norm.weight", st[p + "post_attention_layernorm.weight"])
        put(b + "ffn_gate.weight", st[p + "mlp.gate_proj.weight"])
        put(b + "ffn_up.weight", st[p + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", st[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _spec(root: Path, name: str, draft: dict, **sections) -> specmod.Spec:
    from pipeline.triton import server as srvmod

    grpc, http, metrics = srvmod.free_ports(3)
    ports = {"grpc_port": grpc, "http_port": http, "metrics_port": metrics}
    return specmod.load(write_spec(root, name=name, draft=draft, triton={**ports, "startup_timeout_s": 240},
                                   **sections))


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory) -> Path:
    """A root with models/target (a tiny random Llama) and models/draft.gguf: the same weights as a GGUF of 32-weight
    blocks, so the draft agrees with the target often, but not always (its weights are the rounded ones). The
    tokenizer carries <|endoftext|>, as byte-level GGUF vocabularies do (transformers adds it to one that lacks it)."""
    root = tmp_path_factory.mktemp("ggufdraft")
    tok = train_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    make_model_dir(root / "models" / "target", tokenizer=tok)
    write_gguf(root / "models" / "target", root / "models" / "draft.gguf", TYPES)
    return root


@pytest.fixture(scope="module")
def built(gguf_root):
    from pipeline.engine import build_target
    from pipeline.train.draft import build_draft

    s = _spec(gguf_root, "gd", {"source": "models/draft.gguf", "quantization": "gguf", "vocab": DRAFT_VOCAB},
              prompt_cache={"bytes": 8 << 20, "block_tokens": 8})
    build_target(s, log=lambda *a: None)
    build_draft(s, log=lambda *a: None)
    return s


def test_the_spec_takes_a_gguf_draft_from_a_pretrained_source_and_refuses_it_for_a_trained_one(tmp_path):
    s = specmod.load(write_spec(tmp_path, name="ok", draft={"source": "models/d.gguf", "quantization": "gguf"}))
    assert s.draft.quantization == "gguf"
    with pytest.raises(specmod.SpecError, match=r"^draft\.quantization: .*draft\.source: train"):
        specmod.load(write_spec(tmp_path, name="bad", draft={"source": "train", "quantization": "gguf"}))


def test_a_gguf_draft_is_built_on_its_own_blocks_with_its_reduced_head_of_the_gguf_rows(built, gguf_root):
    from gguf import GGUFReader

    from pipeline.runtime.speculative import DRAFT_HEAD_FILE, load_draft

    ddir = built.engine_dir / "draft"
    cfg = json.loads((ddir / "config.json").read_text())
    assert cfg["pretrained_config"]["quantization"]["quant_algo"] == "GGUF"
    assert not any(k.startswith("lm_head.") for k in load_file(str(ddir / "model.safetensors")))  # the tied head is cut
    assert set(load_file(str(ddir / DRAFT_HEAD_FILE))) == {"gguf_w", "gguf_parts", "ids"}
    model, _ = load_draft(ddir)
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n.endswith((".wqkv", ".wo", ".w13", ".w2"))}
    assert kinds and set(kinds.values()) == {"GGUFLinear"}, kinds
    head, ids = model.lm_head, model.vocab_ids
    assert isinstance(head, gw.GGUFLinear) and head.out_features == len(ids) == DRAFT_VOCAB
    # The head's weights are the GGUF's own token_embd rows as gguf.quants decodes them, bit for bit.
    t = {x.name: x for x in GGUFReader(str(gguf_root / "models" / "draft.gguf")).tensors}["token_embd.weight"]
    want = gw.reference_dequantize(int(t.tensor_type), np.asarray(t.data), int(t.shape[0]))[ids.numpy()]
    assert torch.equal(head.weight, torch.from_numpy(want))
    # ... and the layers' too (layer 0's gate/up, the Q5_0 parts).
    t = {x.name: x for x in GGUFReader(str(gguf_root / "models" / "draft.gguf")).tensors}["blk.0.ffn_gate.weight"]
    gate = gw.reference_dequantize(int(t.tensor_type), np.asarray(t.data), int(t.shape[0]))
    assert torch.equal(model.layers[0].w13.weight[: gate.shape[0]], torch.from_numpy(gate))
    assert cfg["speculation"]["num_draft_tokens"] == 4 and cfg["draft"]["vocab"] == DRAFT_VOCAB


def test_draft_target_on_a_gguf_draft_answers_with_baseline_greedy_tokens_cache_on_and_off(built):
    from pipeline.runtime.decode import load_bundle
    from pipeline.runtime.generate import Request, generate
    from pipeline.runtime.prompt_cache import PromptCache
    from pipeline.runtime.speculative import draft_target

    b = load_bundle(built.engine_dir, "cpu")
    tok = b.tokenizer
    texts = ["Explain how rain forms over the ocean.", "Write a short poem about a cat.", "List three prime numbers."]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    base = generate(b.target, [Request(p, 24, end_ids=()) for p in prompts])
    spec = draft_target(b.target, b.draft, [Request(p, 24, end_ids=()) for p in prompts], 4)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert sum(r.draft_accepted for r in spec) > 0
    # Two turns, the second resending the first with its answer: the draft's prefill reuses its cached K/V.
    pc = PromptCache(8 << 20, 8)
    first = draft_target(b.target, b.draft, [Request(prompts[0], 16, end_ids=())], 4, prompt_cache=pc)[0]
    turn2 = prompts[0] + first.tokens + prompts[1]
    (cached,) = draft_target(b.target, b.draft, [Request(turn2, 16, end_ids=())], 4, prompt_cache=pc)
    (plain,) = generate(b.target, [Request(turn2, 16, end_ids=())])
    assert cached.tokens == plain.tokens and cached.cached_tokens >= 8
    assert pc.stats.per_kind["draft"][0] > 0


@pytest.mark.server
def test_a_served_gguf_draft_answers_draft_target_with_baseline_text(built):
    from pipeline.client import generate
    from pipeline.triton import server as srvmod
    from pipeline.triton.repo import write_repo
    from tests.conftest import stop_later

    write_repo(built, log=lambda *a: None)
    srv = srvmod.start(built, log=lambda *a: None)
    try:
        prompt = "Explain how rain forms over the ocean."
        base = generate(srv.grpc_url, "ensemble", prompt, 20, method="baseline", end_id=0)
        spec = generate(srv.grpc_url, "ensemble", prompt, 20, method="draft_target", end_id=0)
        again = generate(srv.grpc_url, "ensemble", prompt, 20, method="draft_target", end_id=0)
    finally:
        stop_later(built)
    assert base["complete"] and base["num_output_tokens"] == 20
    assert spec["text"] == again["text"] == base["text"]
    assert spec["total_draft_tokens"] > 0 and spec["total_accepted_draft_tokens"] > 0


def test_a_gguf_draft_from_a_source_that_is_not_a_gguf_is_refused_naming_the_key(gguf_root, built):
    from pipeline.train.draft import build_draft

    s = _spec(gguf_root, "gd_hf", {"source": "models/target", "quantization": "gguf"})
    (s.engine_dir).mkdir(parents=True, exist_ok=True)
    (s.engine_dir / "target").symlink_to(built.engine_dir / "target")
    with pytest.raises(EngineError, match=r"^draft\.quantization: gguf reads a GGUF's own weights, and Hugging Face "):
        build_draft(s, log=lambda *a: None)
