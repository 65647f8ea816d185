"""Medusa on the torch runtime: exact greedy output, exact sampling, lossy typical acceptance, strict heads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor

from pipeline.runtime.engine_io import load_engine
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.medusa import (
    MedusaHeads,
    heads_from_state,
    heads_to_state,
    load_heads_dir,
    make_engine,
    medusa_generate,
)
from pipeline.runtime.model import ModelConfig, Transformer
from pipeline.runtime.sampling import SamplingParams, warp

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [ln for ln in (ROOT / "build" / "prompts.txt").read_text().splitlines() if ln.strip() and ln[0] != "#"]
TREES = {
    "chain": [[0], [0, 0], [0, 0, 0]],
    "wide": [[0], [1], [2], [0, 0], [1, 0], [0, 1]],
    "mc": [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2]],
}


@pytest.fixture(scope="module")
def target(tiny_engine):
    return load_engine(tiny_engine)


def random_heads(model: Transformer, n: int = 3, seed: int = 0, scale: float = 0.3) -> MedusaHeads:
    torch.manual_seed(seed)
    h = MedusaHeads(n, 1, model.cfg.hidden_size)
    with torch.no_grad():
        h.w.normal_(0, scale / math.sqrt(model.cfg.hidden_size))
    return h.eval().requires_grad_(False)


def chat_reqs(eng, idx, max_new=24, params=None):
    out = []
    for i in idx:
        ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i]}],
                                                add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append(Request(ids, max_new, params or SamplingParams(), end_ids=tuple(eng.model.cfg.eos_token_id or ())))
    return out


class OracleHeads(MedusaHeads):
    """Heads that know the target's greedy future (nearest stored hidden state) and rank it by a fixed pattern.

    Head i puts the true token at rank (t + i) % 3 for stored position t, so trees with ranks 0..2
    accept multi-token paths of varying length and the rest of the tree is rejected.
    """

    def __init__(self, model: Transformer, seqs: list[list[int]], n: int = 3, ranks: Tensor | None = None):
        super().__init__(n, 1, model.cfg.hidden_size)
        keys, futures = [], []
        V = model.cfg.vocab_size
        for s in seqs:
            cache = model.new_cache(1, len(s) + 8)
            with torch.inference_mode():
                h = model(torch.tensor([s]), torch.arange(len(s))[None], cache)[0]
            for t in range(len(s)):
                keys.append(h[t])
                futures.append([s[t + 2 + i] if t + 2 + i < len(s) else (t * 7 + i) % V for i in range(n)])
        self.keys = torch.stack(keys)
        self.futures = torch.tensor(futures)
        self.pos = torch.arange(len(keys))
        # ranks[j, i]: where head i puts the true token for stored position j (default: the fixed pattern)
        self.ranks = (self.pos[:, None] + torch.arange(n)) % 3 if ranks is None else ranks

    def topk(self, h, target, k):
        j = torch.cdist(h.float(), self.keys).argmin(-1)
        B, V = h.shape[0], target.cfg.vocab_size
        out = torch.empty(B, self.num_heads, k, dtype=torch.long)
        for b in range(B):
            for i in range(self.num_heads):
                true = int(self.futures[j[b], i])
                fill = [t for t in range(V) if t != true][: k]
                r = int(self.ranks[j[b], i])
                row = fill[:r] + [true] + fill[r:]
                out[b, i] = torch.tensor(row[:k])
        return out


@pytest.mark.slow
@pytest.mark.parametrize("tree", sorted(TREES))
def test_greedy_medusa_equals_greedy_baseline_batch1_and_ragged_batch(target, tree):
    m = make_engine(random_heads(target.model), TREES[tree])
    reqs = chat_reqs(target, [0, 5, 11])
    base = generate(target.model, reqs)
    for one, ref in zip(reqs[:1], base[:1], strict=True):
        assert medusa_generate(target.model, m, [one])[0].tokens == ref.tokens
    got = medusa_generate(target.model, m, reqs)
    for g, r in zip(got, base, strict=True):
        assert g.tokens == r.tokens
        assert g.finish_reason == r.finish_reason
        assert 0.0 <= g.acceptance_rate <= 1.0
        assert g.steps >= 2 and len(g.tokens) >= g.steps - 1


@pytest.mark.slow
def test_good_heads_accept_several_tokens_per_step_and_stay_exact(target):
    reqs = chat_reqs(target, [1, 2, 7], max_new=40)
    base = generate(target.model, reqs)
    heads = OracleHeads(target.model, [r.prompt + b.tokens for r, b in zip(reqs, base, strict=True)])
    m = make_engine(heads, TREES["mc"])
    streamed = {i: [] for i in range(len(reqs))}
    got = medusa_generate(target.model, m, reqs, on_emit=lambda row, toks: streamed[row].extend(toks))
    for i, (g, r) in enumerate(zip(got, base, strict=True)):
        assert g.tokens == r.tokens
        assert streamed[i] == g.tokens
        assert g.mean_accepted_len > 1.8, g
        assert g.accepted_per_position[1] > 0
        assert g.draft_accepted <= g.draft_proposed


def test_greedy_acceptance_refuses_sampled_requests(target):
    m = make_engine(random_heads(target.model), TREES["chain"])
    with pytest.raises(ValueError, match="temperature"):
        medusa_generate(target.model, m, chat_reqs(target, [0], params=SamplingParams(0.7, seed=1)),
                        acceptance="greedy")
    with pytest.raises(ValueError, match="lossy"):
        medusa_generate(target.model, m, chat_reqs(target, [0]), acceptance="fast")


# ---- distributions on a tiny-vocabulary model ----

def tiny_vocab_model(V: int = 6, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, max_position_embeddings=64)
    m = Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    return m.eval().requires_grad_(False)


def first_two_distribution(model: Transformer, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    V = model.cfg.vocab_size
    cache = model.new_cache(1, 16)
    with torch.inference_mode():
        p1 = warp(model.logits(model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache))[0, -1], params)
        joint = torch.zeros(V, V)
        for x in range(V):
            c = model.new_cache(1, 16)
            seq = prompt + [x]
            h = model(torch.tensor([seq]), torch.arange(len(seq))[None], c)
            joint[x] = p1[x] * warp(model.logits(h)[0, -1], params)
    return joint.flatten()


def sampled_first_two(model, m, prompt, params, n, acceptance):
    reqs = [Request(prompt, 2, SamplingParams(params.temperature, params.top_k, params.top_p, seed=s))
            for s in range(n)]
    V = model.cfg.vocab_size
    counts = torch.zeros(V * V)
    for r in medusa_generate(model, m, reqs, acceptance=acceptance):
        counts[r.tokens[0] * V + r.tokens[1]] += 1
    return counts


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow
def test_exact_sampled_rule_preserves_the_target_distribution_and_typical_does_not():
    model = tiny_vocab_model()
    heads = random_heads(model, n=2, scale=0.3)
    m = make_engine(heads, [[0], [1], [0, 0]])
    params = SamplingParams(temperature=1.0)
    prompt = [1, 2, 3]
    exact = first_two_distribution(model, prompt, params)
    n = 3000
    counts = sampled_first_two(model, m, prompt, params, n, "exact")
    keep = exact * n >= 5
    chi2 = float((((counts - n * exact) ** 2)[keep] / (n * exact[keep])).sum())
    assert chi2 < chi2_critical(int(keep.sum()) - 1), chi2
    tv_exact = 0.5 * float((counts / n - exact).abs().sum())
    typical = sampled_first_two(model, m, prompt, params, n, "typical")
    tv_typical = 0.5 * float((typical / n - exact).abs().sum())
    assert tv_exact < 0.05
    assert tv_typical > 0.15, (tv_typical, tv_exact)


# ---- the FasterDecoding format ----

def test_heads_round_trip_through_faster_decoding_files_and_share_the_lm_head(target, tmp_path):
    model = target.model
    h = random_heads(model, n=2)
    save_file(heads_to_state(h, model.lm_head.weight), str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    back = load_heads_dir(tmp_path, model)
    assert back.proj is None and back.num_heads == 2
    assert torch.equal(back.w, h.w) and torch.equal(back.b, h.b)


def test_strict_loading_names_missing_and_unexpected_keys_and_reports_head_count(target, tmp_path):
    model = target.model
    H, V = model.cfg.hidden_size, model.cfg.vocab_size
    state = heads_to_state(random_heads(model, n=2), model.lm_head.weight)
    bad = dict(state)
    del bad["1.0.linear.bias"]
    with pytest.raises(ValueError, match=r"missing key '1\.0\.linear\.bias'"):
        heads_from_state(bad, 1, H, V)
    with pytest.raises(ValueError, match=r"unexpected key '0\.2\.weight'"):
        heads_from_state({**state, "0.2.weight": state["0.1.weight"]}, 1, H, V)
    with pytest.raises(ValueError, match="shape"):
        heads_from_state({**state, "0.1.weight": torch.zeros(V + 1, H)}, 1, H, V)
    logs = []
    h = heads_from_state(state, 1, H, V, config_heads=5, log=logs.append)
    assert h.num_heads == 2
    assert "medusa_num_heads=5" in logs[0] and "2 heads" in logs[0]
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(ValueError, match="medusa_num_layers"):
        load_heads_dir(tmp_path, model)


# ---- build: train heads, grow the tree, write both formats, load through the bundle ----

def write_med_spec(root: Path, med: dict) -> Path:
    import yaml

    data = yaml.safe_load((root / "build" / "tiny.yaml").read_text())
    data.update(name="tinymed", medusa=med)
    p = root / "build" / "tinymed.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.mark.slow
def test_build_trains_heads_grows_auto_tree_and_decodes_exactly(tiny_root):
    from pipeline import spec as specmod
    from pipeline.engine import build_target
    from pipeline.runtime.decode import decode, load_bundle
    from pipeline.runtime.engine_io import read_config
    from pipeline.train.medusa import build_medusa

    med = {"source": "train", "num_heads": 2, "num_layers": 1, "choices": "auto",
           "train": {"steps": 40, "minutes": 0.5, "sequences": 12, "seq_len": 24, "batch_size": 4, "lr": 0.003}}
    s = specmod.load(write_med_spec(tiny_root, med))
    build_target(s, log=lambda *a: None)
    logs = []
    dest = build_medusa(s, log=logs.append)
    cfg = read_config(dest)
    info = cfg["medusa"]
    assert cfg["build_config"]["speculative_decoding_mode"] == "medusa"
    assert cfg["build_config"]["max_draft_len"] == len(info["choices"]) <= s.limits.max_draft_len
    assert any("auto tree" in ln for ln in logs) and any("head 1" in ln for ln in logs)
    assert len(info["head_accuracy_topk"]) == 2 and len(info["tree"]["verify_cost_ms"]) == s.limits.max_draft_len + 1
    hf = json.loads((s.engine_dir / "medusa_hf" / "config.json").read_text())
    assert hf["medusa_num_heads"] == 2 and hf["medusa_num_layers"] == 1
    assert build_medusa(s, log=logs.append) == dest and "up to date" in logs[-1]

    b = load_bundle(s.engine_dir, methods=("baseline", "medusa"))
    reqs = chat_reqs(load_engine(s.engine_dir / "target"), [3, 4], max_new=20)
    assert [r.tokens for r in decode(b, "medusa", reqs)] == [r.tokens for r in decode(b, "baseline", reqs)]

    med2 = {**med, "source": str(s.engine_dir / "medusa_hf"), "choices": [[0], [1], [0, 0]]}
    s2 = specmod.load(write_med_spec(tiny_root, med2))
    build_medusa(s2, log=logs.append)
    loaded = read_config(s2.engine_dir / "medusa")["medusa"]
    assert loaded["choices"] == [[0], [1], [0, 0]] and loaded["head_accuracy_topk"] == info["head_accuracy_topk"]
    assert any("2 heads x 1 layers, keys strict OK" in ln for ln in logs)  # the build ran medusa_preflight

    # The spec allows 3 heads, the head directory has 2: the build stops at its preflight, before any work.
    s3 = specmod.load(write_med_spec(tiny_root, {**med2, "num_heads": 3, "choices": [[0], [0, 0], [0, 0, 0]]}))
    before = len(logs)
    with pytest.raises(ValueError, match=r"depth 3 but there are only 2 Medusa heads"):
        build_medusa(s3, force=True, log=logs.append)
    assert not any("built" in ln or "head 0" in ln for ln in logs[before:])


def test_preflight_reads_head_directories_strictly_and_checks_tree_depth_against_their_head_count(target, tmp_path):
    import yaml

    from pipeline import spec as specmod
    from pipeline.train.medusa import medusa_preflight

    model = target.model
    state = heads_to_state(random_heads(model, n=2), model.lm_head.weight)
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))

    def spec_with(choices):
        data = {"name": "pf", "target": {"source": "smollm2"}, "limits": {"max_draft_len": 8},
                "medusa": {"source": str(tmp_path), "num_heads": 3, "choices": choices}}
        return specmod.parse(yaml.safe_load(yaml.safe_dump(data)), tmp_path)

    lines = medusa_preflight(spec_with([[0], [0, 0]]))
    assert any("medusa_num_heads=4" in ln for ln in lines) and any("2 heads" in ln for ln in lines)
    with pytest.raises(ValueError, match=r"depth 3 but there are only 2 Medusa heads"):
        medusa_preflight(spec_with([[0], [0, 0], [0, 0, 0]]))
    save_file({k: v for k, v in state.items() if k != "1.1.weight"}, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"missing key '1\.1\.weight'"):
        medusa_preflight(spec_with([[0]]))


# ---- tree acceptance and KV compaction, against a replay ----

def _oracle_case(target, idx, new):
    """Requests with budgets `new` (one per row), their greedy continuations (longer than decoded, so every head
    guess is a real token) and oracle heads over them that put the true token at random ranks."""
    reqs = [chat_reqs(target, [i], max_new=n)[0] for i, n in zip(idx, new, strict=True)]
    longer = generate(target.model, chat_reqs(target, idx, max_new=max(new) + 8))
    seqs = [r.prompt + b.tokens for r, b in zip(reqs, longer, strict=True)]
    n_keys = sum(len(s) for s in seqs)
    ranks = torch.randint(0, 3, (n_keys, 3), generator=torch.Generator().manual_seed(0))
    return reqs, longer, seqs, OracleHeads(target.model, seqs, ranks=ranks)


def _replay(choices, heads, seqs, b, prompt_len, new):
    """Row b's counters under greedy tree acceptance with OracleHeads, computed from the oracle's ranks: head i
    holds the true token t+2+i at rank ranks[key, i], so the accepted depth is the longest prefix of those
    ranks that is a path of the tree."""
    paths = {tuple(p) for p in choices}
    depth_max = max(len(p) for p in choices)
    off = sum(len(s) for s in seqs[:b])
    L, emitted = prompt_len, 1
    st = {"steps": 1, "draft_proposed": 0, "draft_accepted": 0, "accepted_per_position": [0] * depth_max}
    while emitted < new:
        j = off + L - 1  # the key of the hidden state that proposes after the pending token at L
        ranks = heads.ranks[j].tolist()
        d = 0
        while d < depth_max and tuple(ranks[: d + 1]) in paths:
            d += 1
        out = min(d + 1, new - emitted)
        acc = min(d, out)  # the budget can cut an accepted path short: only emitted drafts count
        st["cut"] = st.get("cut", 0) + (out < d + 1)
        st["steps"] += 1
        st["draft_proposed"] += depth_max
        st["draft_accepted"] += acc
        for i in range(acc):
            st["accepted_per_position"][i] += 1
        emitted += out
        L += d + 1
    return st


@pytest.mark.parametrize("tree", sorted(TREES))
def test_greedy_tree_acceptance_and_counters_equal_a_replay(target, tree):
    new = [30, 29, 28, 31]
    reqs, longer, seqs, heads = _oracle_case(target, [1, 2, 7, 4], new)
    got = medusa_generate(target.model, make_engine(heads, TREES[tree]), reqs)
    cut = 0
    for b, (g, r) in enumerate(zip(got, reqs, strict=True)):
        want = _replay(TREES[tree], heads, seqs, b, len(r.prompt), new[b])
        cut += want.pop("cut", 0)
        assert g.tokens == longer[b].tokens[:new[b]]
        assert {k: getattr(g, k) for k in want} == want
        assert g.mean_accepted_len == pytest.approx(new[b] / want["steps"])
    if tree != "chain":
        assert cut  # some row's budget cut its last accepted path short


@pytest.mark.slow
def test_compaction_leaves_the_cache_as_prefill_would_for_every_path_length(target):
    """After some steps the handed-off cache must hold, slot for slot, the K/V a plain prefill of the committed
    context writes, bit for bit: an accepted path of any length is moved into contiguous slots (a skipped or wrong
    move leaves a rejected node's K/V where the next steps attend), and a node's K/V are its chain's (issue 53)."""
    from pipeline.runtime.generate import Handoff, prefill

    reqs, _, seqs, heads = _oracle_case(target, [1, 2, 7], [40] * 3)
    depths = set()
    for choices in (TREES["mc"], TREES["chain"]):
        m = make_engine(heads, choices)
        for batch in ([reqs[0]], [reqs[1]], [reqs[2]], reqs):
            calls = []
            out = medusa_generate(target.model, m, batch, yield_to=lambda c=calls: c.append(1) or len(c) > 8)
            for h in out:
                assert isinstance(h, Handoff)
                acc = h.stats["accepted_per_position"] + [0] * 3
                rounds = h.stats["steps"] - 1
                by_depth = [rounds - acc[0], acc[0] - acc[1], acc[1] - acc[2], acc[2]]
                depths |= {d for d, n in enumerate(by_depth) if n}
                ctx = (h.seq.req.prompt + h.seq.tokens)[: h.cur]
                ref = target.model.new_cache(1, h.cache.length)
                prefill(target.model, ref, [ctx])
                n = h.cur
                assert torch.equal(h.cache.k[:, h.row, :, :n], ref.k[:, 0, :, :n])
                assert torch.equal(h.cache.v[:, h.row, :, :n], ref.v[:, 0, :, :n])
    assert depths == {0, 1, 2, 3}  # every accepted path length was compacted and checked


# ---- a tree forward against the chains of its nodes ----

def _gqa_model(Hq: int, Hkv: int, D: int, kind: str) -> Transformer:
    """A 2-layer random model with Hq query heads on Hkv kv heads of D columns; int4_a8 quantizes its activations
    to int8 as a GGUF target's kernels do (the rounding that turned issue 53's 5e-6 into flipped tokens)."""
    from pipeline.runtime import quant
    from pipeline.runtime.model import build_model

    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=Hq,
                      num_kv_heads=Hkv, head_dim=D, max_position_embeddings=128)
    g = torch.Generator().manual_seed(Hq + D)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    st = {k: torch.rand(s, generator=g) + 0.5 if "norm" in k else torch.randn(s, generator=g) * 0.2
          for k, s in shapes.items()}
    model = build_model(cfg, st, torch.float32, "cpu")
    return quant.quantize_model(model, "int4_a8", 32) if kind == "int4_a8" else model


@pytest.mark.parametrize("kind", ["float32", "int4_a8"])
@pytest.mark.parametrize("shape", [(6, 2, 64), (12, 2, 128)])
def test_a_tree_forward_gives_every_node_the_bits_of_its_ancestors_chain(kind, shape):
    """Tree verification writes node i at slot L + i but RoPE position L + depth, siblings between a node and its
    parent hidden by the mask; every node's hidden state and the K/V it writes in every layer must equal, bit for
    bit, those of a plain forward of its ancestors' chain after the same context (so greedy medusa is the baseline
    whatever the weights' rounding: issue 53). Two rows of different lengths, the 'mc' tree (siblings at every
    depth), GQA groups 3 and 6, D 64 and 128, float and W4A8 weights, every kernel build this CPU runs."""
    from pipeline.runtime import kernels
    from pipeline.runtime.medusa import tree_inputs
    from pipeline.tree import build_tree

    if not kernels.available():
        pytest.skip("no C kernels: the torch path has no tree of its own to check")
    model = _gqa_model(*shape, kind)
    tree = build_tree(TREES["mc"])
    g = torch.Generator().manual_seed(1)
    L = torch.tensor([13, 30])
    ctx = torch.randint(0, 64, (2, 30), generator=g)
    roots = torch.randint(0, 64, (2,), generator=g)
    cand = torch.randint(0, 64, (2, 3, 3), generator=g)
    tokens, pos, slots, mask, kv_len = tree_inputs(tree, roots, cand, L)
    for isa in kernels.supported_isas():
        prev = kernels.set_path(isa)
        try:
            with torch.inference_mode():
                cache = model.new_cache(2, 48)
                for b in range(2):  # each row's context in its own cache row
                    n = int(L[b])
                    model(ctx[b:b + 1, :n], torch.arange(n)[None], cache.rows(b, b + 1))
                h = model(tokens, pos, cache, slots=slots, mask=mask, kv_len=kv_len)
                for b in range(2):
                    n = int(L[b])
                    for i in range(tree.size):
                        path, u = [], i
                        while u >= 0:
                            path.append(u)
                            u = int(tree.parent[u])
                        path = path[::-1]
                        seq = torch.cat([ctx[b, :n], tokens[b, path]])[None]
                        one = model.new_cache(1, 48)
                        ref = model(seq, torch.arange(seq.shape[1])[None], one)
                        assert torch.equal(h[b, i], ref[0, -1]), (isa, b, i)
                        at = n + len(path) - 1
                        assert torch.equal(cache.k[:, b, :, n + i], one.k[:, 0, :, at]), (isa, b, i)
                        assert torch.equal(cache.v[:, b, :, n + i], one.v[:, 0, :, at]), (isa, b, i)
        finally:
            kernels.set_path(prev)
