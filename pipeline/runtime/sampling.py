"""Sampling: one warping function (temperature, top-k, top-p) shared by plain and speculative decoding.

Greedy is temperature 0 and is decided by argmax, never by dividing by a tiny temperature.
Speculative methods must warp the draft and the target with the same function, or the
rejection rule stops preserving the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.runtime import kernels


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check(self, vocab_size: int) -> None:
        """Raise ValueError naming the bad field."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature: got {self.temperature}; must be 0 (greedy) or positive")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: got {self.top_p}; must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k: got {self.top_k}; must be 0 (off) or positive")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed: got {self.seed}; must be non-negative")

    def generator(self, device="cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


@kernels.torch_on_caller()
def warp(logits: Tensor, p: SamplingParams) -> Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p; one-hot at the argmax when greedy. On the calling
    thread alone (kernels.torch_on_caller: OpenMP's regions over a vocabulary wait for the kernels' spinning pool)."""
    logits = logits.float()
    if p.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if 0 < p.top_k < logits.shape[-1]:  # the same tokens before or after the temperature
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = kernels.softmax_rows(logits, p.temperature)
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p)
    return probs


# Top-p looks at the most likely tokens first: when these hold top_p of the mass, the nucleus is among them and
# the full sort (152k entries per row per step for Qwen, ~20% of a mixed serving load's decode thread) is not needed.
# Then at a wider window, before that sort: over 151,936 probabilities topk(256) took 0.29 ms, topk(4096) 0.63 and
# the sort 11.4 (2-core Zen 4), and a flat step's nucleus (a sampled chat answer's uncertain token) often passes 256.
TOP_P_CANDIDATES = 256
TOP_P_WIDER = 4096


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Keep the most likely tokens while the mass before each is below top_p, renormalized.

    The boundary: a token whose preceding mass equals top_p exactly is dropped, because the tokens before it
    already hold top_p (the smallest set reaching top_p; Hugging Face's TopPLogitsWarper draws the same line).
    The preceding mass is the running total of the more likely tokens, read from the cumulative sum one place
    back; `cumsum - vals` would round differently (top_p equal to the top token's probability could keep a
    second token)."""
    for n in (TOP_P_CANDIDATES, TOP_P_WIDER):
        vals, idx = probs.topk(min(n, probs.shape[-1]), dim=-1)
        total = vals.cumsum(-1)
        if vals.shape[-1] == probs.shape[-1] or not bool((total[..., -1] < top_p).any()):
            break
    else:
        vals, idx = probs.sort(dim=-1, descending=True)  # the nucleus reaches past the candidates
        total = vals.cumsum(-1)
    before = torch.cat([torch.zeros_like(total[..., :1]), total[..., :-1]], dim=-1)
    kept = torch.zeros_like(probs).scatter_(-1, idx, vals.masked_fill(before >= top_p, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: Tensor, g: torch.Generator) -> Tensor:
    """One token per row of probs [N, V] (or [V]) from generator g: one uniform draw a row, read against the row's
    running total (kernels.sample_rows, inverse-CDF sampling). torch.multinomial draws an exponential per entry:
    3.1 ms a token over Qwen's 151,936, where this takes 0.04 (beside a 22 ms target step and a 5 ms draft step;
    2-core Zen 4), the same distribution."""
    flat = probs.reshape(-1, probs.shape[-1])
    u = torch.rand(flat.shape[0], generator=g, dtype=torch.float64)
    return kernels.sample_rows(flat, u).reshape(probs.shape[:-1])


def greedy(logits: Tensor) -> Tensor:
    """torch's argmax over the last dimension of logits [..., V] (the first largest; a NaN wins), in one
    single-threaded C pass on CPU (kernels.argmax_prob). torch's own argmax over a 151,936-token row is an OpenMP
    region: its workers then wait beside the kernels' threads, and decoding in process with it ran 2.5% slower
    (baseline and draft_target alike, paired median of 12, AMD EPYC Zen 4, 2026-12-03)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return kernels.argmax_prob(flat, with_prob=False)[0].view(logits.shape[:-1])


def next_token(logits: Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """Pick the next token from logits [V] for one request."""
    if p.greedy:
        return int(greedy(logits))
    return int(sample(warp(logits, p), g))
