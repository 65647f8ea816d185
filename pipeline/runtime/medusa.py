"""Medusa on the torch runtime: heads, their checkpoint format, and tree verification.

Heads (Medusa-1): head i maps the target's final normed hidden state h_t to a guess for token
t+2+i: `ResBlock^L` (x + SiLU(Wx + b)) followed by a vocabulary projection. When every head's
projection equals the target's LM head (our trained heads keep it frozen), the heads share one
read of it; a `head_vocab` restricts the projection to a token subset, which only changes what
is proposed, never what is emitted.

One step per row: the pending token (the target's own, already emitted) is the tree's root; the
candidates are the heads' top-k tokens placed by the tree; one target forward runs all nodes
under the tree mask; acceptance walks down from the root; the accepted path's K/V are compacted
into contiguous slots. Acceptance rules:

- greedy: at each node the target's argmax picks the child to descend into. Output equals the
  target's greedy output.
- exact (default when sampling): at each node draw x from the target's warped distribution there;
  descend into the child whose token is x, else stop and emit x. Every emitted token is a draw
  from the target's own conditional, so the output distribution is the target's.
- typical (LOSSY): Medusa's rule. A candidate is accepted when its target probability exceeds
  min(posterior_threshold, posterior_alpha * exp(-entropy)); the longest accepted path wins (ties:
  highest log-probability), then one token is sampled from the target after it. Faster, but the
  output distribution is not the target's.

Statistics per row: steps = target forwards including prefill; draft_proposed += tree depth per
verification step (the heads' tokens on one root-to-leaf path, the most that can be accepted);
draft_accepted += candidate tokens accepted and emitted; so acceptance_rate is in [0, 1] and
accepted_per_position[d] counts steps whose accepted path reached depth d+1.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from pipeline.runtime.engine_io import read_config
from pipeline.runtime.generate import (
    Emit,
    Handoff,
    OnFinish,
    Request,
    Result,
    Sequence,
    YieldTo,
    finish,
    finish_or_hand_off,
    grow,
    report_finished,
    resume_cache,
    row_stats,
    start_length,
)
from pipeline.runtime.kernels import linear, torch_on_caller
from pipeline.runtime.loadpolicy import tree_plain_from
from pipeline.runtime.model import Transformer, wt
from pipeline.runtime.prompt_cache import prefill_cached
from pipeline.runtime.quant import head_rows
from pipeline.runtime.sampling import sample, warp
from pipeline.tree import Tree, build_tree, validate_choices

ACCEPTANCE = ("greedy", "exact", "typical")
LOSSY = {"typical": "typical acceptance is lossy: the output distribution is not the target's"}


class MedusaHeads(nn.Module):
    """Medusa-1 heads: `w` [heads, layers, H, H], `b` [heads, layers, H]; `proj` [heads, V, H] or None (shared)."""

    def __init__(self, num_heads: int, num_layers: int, hidden: int, proj: Tensor | None = None):
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.w = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, hidden))
        bound = hidden ** -0.5
        self.b = nn.Parameter(torch.empty(num_heads, num_layers, hidden).uniform_(-bound, bound))
        self.proj = None if proj is None else nn.Parameter(proj, requires_grad=False)
        self.head_vocab: Tensor | None = None
        self._sub: Tensor | None = None

    def hidden(self, h: Tensor) -> Tensor:
        """h [..., H] -> each head's transformed state [..., heads, H]."""
        x = h.unsqueeze(-2).expand(*h.shape[:-1], self.num_heads, h.shape[-1])
        for j in range(self.num_layers):
            y = torch.einsum("...nh,nkh->...nk", x, self.w[:, j]) + self.b[:, j]
            x = x + F.silu(y)
        return x

    def set_vocab(self, target: Transformer, vocab: Tensor | None) -> None:
        """Restrict shared-projection proposals to `vocab` token ids (None: the full vocabulary)."""
        self.head_vocab = vocab
        self._sub = None if vocab is None else head_rows(target.lm_head, vocab)

    @torch.inference_mode()
    def topk(self, h: Tensor, target: Transformer, k: int) -> Tensor:
        """Top-k token ids [B, heads, k] from hidden states h [B, H]."""
        x = self.hidden(h.float())
        if self.proj is None:
            w = self._sub if self._sub is not None else wt(target.lm_head)
            logits = linear(x.reshape(-1, x.shape[-1]).contiguous(), w).view(*x.shape[:-1], -1)
        else:
            logits = torch.stack([linear(x[:, i].contiguous(), self.proj[i]) for i in range(self.num_heads)], 1)
        idx = logits.topk(k, dim=-1).indices
        if self.proj is None and self.head_vocab is not None:
            idx = self.head_vocab[idx]
        return idx


# ---- FasterDecoding checkpoint format: {h}.{l}.linear.weight/bias, {h}.{L}.weight + config.json ----

def heads_from_state(state: dict[str, Tensor], num_layers: int, hidden: int, vocab: int,
                     lm_head: Tensor | None = None, config_heads: int | None = None,
                     log=print) -> MedusaHeads:
    """Strictly read a FasterDecoding `medusa_head` state dict; the head count comes from the tensors.

    A missing or unexpected key, or a wrong shape, raises ValueError naming it. A head count that
    disagrees with config.json's medusa_num_heads is reported (released checkpoints disagree).
    When every projection equals `lm_head`, the heads share it instead of holding copies.
    """
    heads = sorted({int(k.split(".", 1)[0]) for k in state if k.split(".", 1)[0].isdigit()})
    if not heads:
        raise ValueError(f"no Medusa head tensors found (keys look like {sorted(state)[:3]}); "
                         "expected FasterDecoding keys such as '0.0.linear.weight' and '0.1.weight'")
    n = max(heads) + 1
    want = {}
    for i in range(n):
        for j in range(num_layers):
            want[f"{i}.{j}.linear.weight"] = (hidden, hidden)
            want[f"{i}.{j}.linear.bias"] = (hidden,)
        want[f"{i}.{num_layers}.weight"] = (vocab, hidden)
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    if missing:
        raise ValueError(f"Medusa heads: missing key {missing[0]!r} ({len(missing)} missing; {n} heads, "
                         f"{num_layers} layers from the tensors and config.json)")
    if extra:
        raise ValueError(f"Medusa heads: unexpected key {extra[0]!r} ({len(extra)} unexpected; expected "
                         f"{n} heads with medusa_num_layers={num_layers}); check medusa_num_layers in config.json")
    for k, shape in want.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"Medusa heads: {k} has shape {tuple(state[k].shape)}, expected {shape} "
                             f"(target hidden {hidden}, vocab {vocab}); heads were trained for another model")
    if config_heads is not None and config_heads != n:
        log(f"warning: config.json says medusa_num_heads={config_heads} but the weights hold {n} heads; using {n}")
    projs = [state[f"{i}.{num_layers}.weight"].float() for i in range(n)]
    shared = lm_head is not None and all(torch.equal(p, lm_head.float()) for p in projs)
    m = MedusaHeads(n, num_layers, hidden, None if shared else torch.stack(projs))
    with torch.no_grad():
        for i in range(n):
            for j in range(num_layers):
                m.w[i, j] = state[f"{i}.{j}.linear.weight"].float()
                m.b[i, j] = state[f"{i}.{j}.linear.bias"].float()
    return m.eval().requires_grad_(False)


def heads_to_state(m: MedusaHeads, lm_head: Tensor, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The FasterDecoding state dict (projections written out in full, as TensorRT-LLM's converter reads)."""
    out = {}
    for i in range(m.num_heads):
        for j in range(m.num_layers):
            out[f"{i}.{j}.linear.weight"] = m.w[i, j].detach().to(dtype).contiguous()
            out[f"{i}.{j}.linear.bias"] = m.b[i, j].detach().to(dtype).contiguous()
        p = lm_head if m.proj is None else m.proj[i]
        out[f"{i}.{m.num_layers}.weight"] = p.detach().to(dtype).contiguous().clone()
    return out


def read_heads_dir(path: Path) -> tuple[dict[str, Tensor], dict]:
    """Read medusa_lm_head.pt (preferred, as TensorRT-LLM does) or .safetensors and config.json."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{path}: no config.json (FasterDecoding Medusa heads need medusa_num_heads and "
                         "medusa_num_layers)")
    cfg = json.loads(cfg_path.read_text())
    for key in ("medusa_num_heads", "medusa_num_layers"):
        if key not in cfg:
            raise ValueError(f"{cfg_path}: missing {key!r}")
    if (path / "medusa_lm_head.pt").is_file():
        state = torch.load(path / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    elif (path / "medusa_lm_head.safetensors").is_file():
        state = load_file(str(path / "medusa_lm_head.safetensors"))
    else:
        raise ValueError(f"{path}: neither medusa_lm_head.pt nor medusa_lm_head.safetensors exists")
    return state, cfg


def load_heads_dir(path: Path, target: Transformer, log=print) -> MedusaHeads:
    state, cfg = read_heads_dir(path)
    return heads_from_state(state, int(cfg["medusa_num_layers"]), target.cfg.hidden_size, target.cfg.vocab_size,
                            target.lm_head.weight, int(cfg["medusa_num_heads"]), log)


# ---- runtime engine: engines/<name>/medusa/ ----

@dataclass
class MedusaEngine:
    heads: MedusaHeads
    tree: Tree
    choices: list[list[int]]
    config: dict = field(default_factory=dict)
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    @property
    def head_accuracy(self) -> list[dict] | None:
        """Held-out top-1 / top-k accuracy per head, as measured at build time."""
        acc = self.config.get("medusa", {}).get("head_accuracy_topk")
        if not acc:
            return None
        return [{"head": d, "token": f"t+{d + 2}", "top1": row[0], f"top{len(row)}": round(sum(row), 4)}
                for d, row in enumerate(acc)]


def make_engine(heads: MedusaHeads, choices: list[list[int]], max_draft_len: int | None = None,
                **kw) -> MedusaEngine:
    validate_choices(choices, heads.num_heads, max_draft_len or len(choices))
    return MedusaEngine(heads, build_tree(choices), choices, **kw)


def load_medusa_engine(engine_dir: Path, target: Transformer, verify: bool = True) -> MedusaEngine:
    """Load engines/<name>/medusa: heads.safetensors (runtime layout) + config.json (tree, thresholds)."""
    engine_dir = Path(engine_dir)
    cfg = read_config(engine_dir, verify=verify)
    med = cfg["medusa"]
    state = load_file(str(engine_dir / "heads.safetensors"))
    proj = state.get("proj")
    heads = MedusaHeads(med["num_heads"], med["num_layers"], target.cfg.hidden_size, proj)
    with torch.no_grad():
        heads.w.copy_(state["w"])
        heads.b.copy_(state["b"])
    heads.eval().requires_grad_(False)
    if "head_vocab" in state:
        heads.set_vocab(target, state["head_vocab"].long())
    return make_engine(heads, med["choices"], cfg["build_config"]["max_draft_len"], config=cfg,
                       posterior_threshold=med.get("posterior_threshold", 0.09),
                       posterior_alpha=med.get("posterior_alpha", 0.3))


# ---- tree verification ----

def tree_inputs(tree: Tree, roots: Tensor, cand: Tensor, L: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Tokens, RoPE positions, cache slots and attention mask [B, N, kv_len] for one tree forward."""
    N = tree.size
    tokens = cand[:, tree.head.clamp(min=0), tree.rank]
    tokens[:, 0] = roots
    pos = L[:, None] + tree.depth[None]
    slots = L[:, None] + torch.arange(N)[None]
    kv_len = int(L.max()) + N
    ar = torch.arange(kv_len)
    rel = ar[None] - L[:, None]
    in_tree = (rel >= 0) & (rel < N)
    tm = tree.mask[:, rel.clamp(0, N - 1)].permute(1, 0, 2)
    mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tm)
    return tokens, pos, slots, mask, kv_len


def _walk(tree: Tree, tokens: Tensor, pick) -> list[int]:
    """Greedy / exact rule: at each node take the target's own token (pick[u] or pick(u)); descend
    while a child carries it. Returns the accepted node path followed by -1 - (the token after it)."""
    path, u = [0], 0
    cand = tokens.tolist()
    while True:
        x = pick(u) if callable(pick) else pick[u]
        nxt = next((c for c in tree.children[u] if cand[c] == x), None)
        if nxt is None:
            return path + [-1 - x]
        path.append(nxt)
        u = nxt


def _walk_typical(tree: Tree, tokens: Tensor, probs: Tensor, g: torch.Generator, eps: float,
                  alpha: float) -> list[int]:
    """Medusa's typical acceptance (lossy): longest path of candidates above the entropy threshold."""
    ent = -(probs * torch.log(probs + 1e-5)).sum(-1)
    thresh = torch.minimum(torch.full_like(ent, eps), alpha * torch.exp(-ent))
    par = tree.parent.clamp(min=0)
    p_cand = probs[par, tokens]
    ok = p_cand > thresh[par]
    ok[0] = True
    score = torch.log(p_cand.clamp_min(1e-30))
    score[0] = 0.0
    good, cum = [False] * tree.size, [0.0] * tree.size
    good[0] = True
    for i in range(1, tree.size):
        p = int(tree.parent[i])
        good[i] = good[p] and bool(ok[i])
        cum[i] = cum[p] + float(score[i])
    best = max((i for i in range(tree.size) if good[i]), key=lambda i: (int(tree.depth[i]), cum[i]))
    path, u = [], best
    while u >= 0:
        path.append(u)
        u = int(tree.parent[u])
    path = path[::-1]
    x = int(sample(probs[best], g))
    return path + [-1 - x]


def _warp_rows(logits: Tensor, reqs: list[Request], rules: list[str], live: list[bool]) -> dict[int, Tensor]:
    """Warped target probabilities for the sampled rows, one warp call per distinct sampling setting."""
    groups: dict[tuple, list[int]] = {}
    for b, r in enumerate(reqs):
        if live[b] and rules[b] != "greedy":
            groups.setdefault((r.params.temperature, r.params.top_k, r.params.top_p), []).append(b)
    out = {}
    for rows in groups.values():
        p = warp(logits[rows], reqs[rows[0]].params)
        out.update(zip(rows, p, strict=True))
    return out


class _Clock:
    """Accumulates the time since the previous call under a label (no-op without a dict)."""

    def __init__(self, out: dict | None):
        self.out, self.t = out, time.perf_counter()

    def __call__(self, label: str) -> None:
        if self.out is not None:
            now = time.perf_counter()
            self.out[label] = self.out.get(label, 0.0) + now - self.t
            self.t = now


def _check_acceptance(reqs: list[Request], acceptance: str | None) -> list[str]:
    if acceptance is not None and acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance: got {acceptance!r}; use one of {ACCEPTANCE} ('typical' is lossy)")
    rules = []
    for i, r in enumerate(reqs):
        if r.params.greedy:
            rules.append("greedy")
        elif acceptance == "greedy":
            raise ValueError(f"acceptance 'greedy' needs temperature 0, but request {i} samples at "
                             f"temperature {r.params.temperature}; use 'exact' (or the lossy 'typical')")
        else:
            rules.append(acceptance or "exact")
    return rules


@torch.inference_mode()
def medusa_generate(target: Transformer, medusa: MedusaEngine, reqs: list[Request], on_emit: Emit | None = None,
                    acceptance: str | None = None, posterior_threshold: float | None = None,
                    posterior_alpha: float | None = None, timings: dict | None = None,
                    yield_to: YieldTo | None = None, on_finish: OnFinish | None = None,
                    resume: list[Handoff] | None = None, prompt_cache=None, **_unused) -> list[Result | Handoff]:
    """Decode a batch with Medusa tree verification; see the module docstring for the acceptance rules.

    `acceptance`: None (greedy rows greedy, sampled rows exact), "exact", "greedy" or "typical"
    (lossy). Rows have their own committed lengths and accept different path lengths. `timings`, when
    given, accumulates seconds spent in heads / forward / logits / accept / compact (where the time goes).
    When `yield_to()` turns true between steps, unfinished rows come back as Handoffs for plain decoding;
    `resume` (Handoffs, with `reqs` their requests) continues such rows with Medusa, and `on_finish(b, result)`
    hears of each row as it finishes. `prompt_cache`: prompts start from their cached prefix and are kept; answers
    are not (tree verification's K/V are not the bits a prefill writes: pipeline/runtime/prompt_cache.py).
    """
    clock = _Clock(timings)
    start: float | list[float] = time.perf_counter()
    rules = _check_acceptance(reqs, acceptance)
    eps = medusa.posterior_threshold if posterior_threshold is None else posterior_threshold
    alpha = medusa.posterior_alpha if posterior_alpha is None else posterior_alpha
    tree, heads = medusa.tree, medusa.heads
    K, depth_max = tree.topk(), tree.max_depth
    B = len(reqs)
    if resume:
        stats = [row_stats(h.stats, depth_max) for h in resume]
        start = [h.start for h in resume]
        seqs, gens = [h.seq for h in resume], [h.gen for h in resume]
        cache = resume_cache(target, resume, start_length(reqs, tree.size, max(h.cur for h in resume)))
        roots = torch.tensor([h.token for h in resume], dtype=torch.long)
        L = torch.tensor([h.cur for h in resume], dtype=torch.long)
        # The heads need the hidden state that chose each pending token: feed the token before it again at
        # its own slot (rewriting the same K/V), one target pass for the whole batch.
        before = torch.tensor([[(h.seq.req.prompt + h.seq.tokens)[h.cur - 1]] for h in resume])
        hidden = target(before, (L - 1)[:, None], cache)[:, 0]
    else:
        stats = [row_stats({}, depth_max) for _ in reqs]
        seqs = [Sequence(r) for r in reqs]
        gens = [r.params.generator() for r in reqs]
        cache = target.new_cache(B, start_length(reqs, tree.size))
        hidden, reused = prefill_cached(target, cache, [r.prompt for r in reqs], prompt_cache, "target",
                                        [r.cache_prompt for r in reqs])
        for s, n in zip(seqs, reused):
            s.cached = n
        logits = target.logits(hidden)
        probs = _warp_rows(logits, reqs, rules, [True] * B)
        roots = torch.zeros(B, dtype=torch.long)
        for b, s in enumerate(seqs):
            roots[b] = int(logits[b].argmax()) if rules[b] == "greedy" else int(sample(probs[b], gens[b]))
            out = s.extend([int(roots[b])])
            if out and on_emit:
                on_emit(b, out)
        L = torch.tensor([len(r.prompt) for r in reqs], dtype=torch.long)
    reported = [False] * B
    report_finished(seqs, reported, start, lambda b: stats[b], on_finish)
    while not all(s.done for s in seqs):
        if yield_to is not None and yield_to():
            out = finish_or_hand_off(seqs, start, stats, gens, cache, L.tolist(), roots.tolist())
            for h in out:
                if isinstance(h, Handoff):
                    h.exact_kv = False  # tree verification's K/V: never into the prompt cache
            return out
        clock("other")
        cand = heads.topk(hidden, target, K)
        clock("heads")
        tokens, pos, slots, mask, kv_len = tree_inputs(tree, roots, cand, L)
        cache = grow(cache, int(slots.max()) + 1)  # K/V taken as the rows advance
        h = target(tokens, pos, cache, slots=slots, mask=mask, kv_len=kv_len)
        clock("forward")
        logits = target.logits(h)
        clock("logits")
        paths = []
        probs = _warp_rows(logits, reqs, rules, [not s.done for s in seqs])
        for b, s in enumerate(seqs):
            if s.done:
                paths.append([0])
                continue
            if rules[b] == "greedy":
                walk = _walk(tree, tokens[b], logits[b].argmax(-1).tolist())
            elif rules[b] == "exact":
                walk = _walk(tree, tokens[b], lambda u, p=probs[b], g=gens[b]: int(sample(p[u], g)))
            else:
                walk = _walk_typical(tree, tokens[b], probs[b], gens[b], eps, alpha)
            path, nxt = walk[:-1], -1 - walk[-1]
            acc = len(path) - 1
            out = s.extend([int(tokens[b, i]) for i in path[1:]] + [nxt])
            st = stats[b]
            st["steps"] += 1
            st["draft_proposed"] += depth_max
            st["draft_accepted"] += min(acc, len(out))
            for d in range(depth_max):
                st["proposed_per_position"][d] += 1
                st["accepted_per_position"][d] += int(d < min(acc, len(out)))
            if out and on_emit:
                on_emit(b, out)
            roots[b] = nxt
            paths.append(path)
        clock("accept")
        m = max(len(p) for p in paths)
        if m > 1:
            src = torch.tensor([p + [p[-1]] * (m - len(p)) for p in paths]) + L[:, None]
            dst = torch.tensor([list(range(len(p))) + [len(p) - 1] * (m - len(p)) for p in paths]) + L[:, None]
            cache.compact(torch.arange(B), src, dst)
        clock("compact")
        last = torch.tensor([p[-1] for p in paths])
        hidden = h[torch.arange(B), last]
        L = L + torch.tensor([0 if s.done else len(p) for s, p in zip(seqs, paths, strict=True)])
        report_finished(seqs, reported, start, lambda b: stats[b], on_finish)
    return finish(seqs, start, stats)


class Medusa:
    """`decode`'s medusa: the heads propose a tree of candidates, verified in one tree-attention pass (its own
    loop, `medusa_generate`: tree verification does not fit the chain drafters' shared loop)."""

    name, resumable = "medusa", True

    def available(self, b) -> bool:
        return b.medusa is not None

    def batch_plain_from(self, b, max_rows: int) -> int | None:
        """Under `draft_length: load`, the fewest rows from which this deployment's tree is not expected to pay
        (`loadpolicy.tree_plain_from`, on the tree its build chose and timed). A tree round has no per-row width to
        narrow, so a batch is judged whole: `decode` runs it plainly from there, the scheduler sends it to the
        continuous batch."""
        if b.medusa is None:
            return None
        return tree_plain_from(b.medusa.config.get("medusa", {}).get("tree"), b.medusa.tree.size, max_rows)

    def run(self, b, reqs: list[Request], k: int, on_emit: Emit | None, **opts) -> list[Result | Handoff]:
        # The rounds' torch ops (the heads, the tree's inputs, the argmax over every node's logits) on the calling
        # thread: as OpenMP regions they waited for the cores the kernels' pool holds, and a round took 2.4x as long
        # (SmolLM2-135M, in process, 6 prompts x 128 tokens, 2026-12-06: 0.36x baseline, 0.86x on the caller).
        with torch_on_caller():
            return medusa_generate(b.target, b.medusa, reqs, on_emit, **opts)


MEDUSA = Medusa()
