"""The prompt cache: K/V of token prefixes computed by earlier requests, reused so a request prefills only the rest.

Editors and agents resend the same text plus a little more (a file around the cursor, a chat's history with our own
answers, an agent's system prompt and tool output). A request whose token ids start with a prefix an earlier request
computed copies that prefix's K/V into its cache row and runs only the tokens after it.

Layout: blocks of `block_tokens` token ids, chained (a block's key is its parent block and its own ids, so a block
stands for the whole prefix up to its end: a trie of blocks, as vLLM's hashed blocks but keyed by the ids themselves,
so two prefixes can never collide), and at the end of a stored sequence its last partial block (a tail, fewer ids).
Each block holds the K/V of its tokens for one model (`kind`: "target" or "draft"), in host memory, as a
[2, layers, kv_heads, tokens, head_dim] tensor of the cache's dtype. A hit is token-granular, as in SGLang's radix
tree: the chain of whole blocks the prompt starts with, then the longest common prefix with one block after them
(a K/V slot depends only on the tokens up to it, so the first m slots of a block serve any prompt that shares its
first m ids); it always leaves at least one prompt token to run (its hidden state gives the first token's logits).

Budget: `budget_bytes` over both models' blocks together. When a new block does not fit, the least recently used
*leaf* block goes first (a block no cached block continues). Why leaves and LRU: evicting an inner block would strand
its descendants (unreachable, still taking bytes), so leaves-first keeps every byte reachable; and what clients resend
is what they sent recently (a conversation's next turn, an agent's next step), while a prefix shared by many requests
(a system prompt) is touched by each of them and stays. A block larger than the whole budget is never stored.

Why it never changes an answer: the C kernels compute each token's K/V and hidden state with arithmetic that does not
depend on how many tokens share the forward, nor on which slots past a query are padding (pipeline/runtime/skinny.c),
so K/V copied from a block are the bits a full prefill would write, and the prefill of the rest gives the same logits
(tests/test_prompt_cache.py pins it for every method, greedy and sampled). Only whole, finished prefixes enter:
callers store a prompt's blocks after its prefill succeeded, and prompt + answer when a request finished normally
(never a cancelled or failed one); K/V computed under a tree mask (Medusa's verification) is not stored, its
attention sums slots in another order.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pipeline.runtime.model import KVCache, Transformer, prefill

KINDS = ("target", "draft")


@dataclass
class _Block:
    id: int
    kind: str
    parent: int  # 0: the first block of a prefix
    ids: tuple[int, ...]
    kv: Tensor  # [2, L, Hkv, block_tokens, D]
    children: int = 0

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class CacheStats:
    """Counters since the cache was made (Prometheus reads them as totals)."""

    reused_blocks: int = 0  # blocks copied into a request's row instead of computed
    missed_blocks: int = 0  # whole prompt blocks a lookup did not find (computed, then stored)
    reused_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens prefilled (looked up and not found, or the tail after a hit)
    stored_blocks: int = 0
    evicted_blocks: int = 0
    per_kind: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Reused prompt blocks / prompt blocks looked up (0 before any lookup)."""
        n = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / n if n else 0.0


class PromptCache:
    """Prefix K/V of the target and the draft under one byte budget (see the module docstring for the rules)."""

    def __init__(self, budget_bytes: int, block_tokens: int = 64):
        if block_tokens < 1:
            raise ValueError(f"prompt_cache.block_tokens: got {block_tokens}; must be 1 or more (64 is the default)")
        if budget_bytes < 0:
            raise ValueError(f"prompt_cache.bytes: got {budget_bytes}; must be 0 (off) or a byte budget")
        self.budget, self.block_tokens = int(budget_bytes), int(block_tokens)
        self.blocks: dict[tuple, _Block] = {}  # (kind, parent id, ids) -> block
        self.lru: OrderedDict[int, tuple] = OrderedDict()  # block id -> its key, least recently used first
        self.by_id: dict[int, _Block] = {}
        self.kids: dict[tuple[str, int], set[int]] = {}  # (kind, parent id) -> its blocks, whole and tails
        self.bytes = 0
        self.stats = CacheStats()
        self._ids = itertools.count(1)

    # ---- lookups ------------------------------------------------------------------------------------------

    def _chain(self, kind: str, tokens: list[int], limit: int) -> list[_Block]:
        """The cached whole blocks `tokens` starts with, at most `limit` tokens of them."""
        bt, out, parent = self.block_tokens, [], 0
        for s in range(0, limit - bt + 1, bt):
            b = self.blocks.get((kind, parent, tuple(tokens[s:s + bt])))
            if b is None:
                break
            out.append(b)
            parent = b.id
        return out

    def _partial(self, kind: str, parent: int, rest: list[int], most: int) -> tuple[_Block | None, int]:
        """The block after `parent` sharing the longest prefix with `rest` (at most `most` ids), and that length."""
        best, m = None, 0
        for bid in self.kids.get((kind, parent), ()):
            b = self.by_id[bid]
            n = 0
            for x, y in zip(b.ids[:most], rest):
                if x != y:
                    break
                n += 1
            if n > m:
                best, m = b, n
        return best, m

    def _match(self, kind: str, tokens: list[int], limit: int) -> tuple[list[_Block], _Block | None, int]:
        """(whole blocks, the block a partial hit reads, how many of its tokens) for at most `limit` tokens."""
        chain = self._chain(kind, tokens, limit)
        s = len(chain) * self.block_tokens
        if s >= limit:
            return chain, None, 0
        part, m = self._partial(kind, chain[-1].id if chain else 0, tokens[s:], limit - s)
        return chain, part, m

    def cached(self, kind: str, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a `load` would reuse now (at least one token left to run)."""
        chain, _, m = self._match(kind, tokens, len(tokens) - 1)
        return len(chain) * self.block_tokens + m

    def load(self, kind: str, tokens: list[int], cache: KVCache, row: int) -> int:
        """Copy the longest cached prefix of `tokens` (leaving at least one token to run) into slots [0, n) of
        `cache` row `row`; return n. Counts the lookup (reused and missed whole blocks, reused and computed tokens)."""
        chain, part, m = self._match(kind, tokens, min(len(tokens) - 1, cache.length))
        bt = self.block_tokens
        for i, b in enumerate(chain):
            cache.k[:, row, :, i * bt:(i + 1) * bt] = b.kv[0]
            cache.v[:, row, :, i * bt:(i + 1) * bt] = b.kv[1]
            self.lru.move_to_end(b.id)
        n = len(chain) * bt
        if part is not None:
            cache.k[:, row, :, n:n + m] = part.kv[0][:, :, :m]
            cache.v[:, row, :, n:n + m] = part.kv[1][:, :, :m]
            self.lru.move_to_end(part.id)
            n += m
        st = self.stats
        st.reused_blocks += len(chain)
        st.missed_blocks += len(tokens) // bt - len(chain)
        st.reused_tokens += n
        st.computed_tokens += len(tokens) - n
        k = st.per_kind.setdefault(kind, [0, 0])
        k[0], k[1] = k[0] + n, k[1] + len(tokens) - n
        return n

    # ---- stores -------------------------------------------------------------------------------------------

    def store(self, kind: str, tokens: list[int], cache: KVCache, row: int, n: int) -> int:
        """Keep `tokens[:n]`, whose K/V are in slots [0, n) of `cache` row `row` (computed and final: call it after a
        prefill succeeded, or when a request finished): its whole blocks, and its last partial block as a tail unless a
        cached block after the same prefix already starts with those ids. Blocks already cached are only touched.
        Returns the blocks added."""
        if kind not in KINDS:
            raise ValueError(f"prompt cache kind: got {kind!r}; one of {KINDS}")
        bt, parent, added = self.block_tokens, 0, 0
        n = min(n, len(tokens), cache.length)
        for s in range(0, n, bt):
            ids = tuple(tokens[s:min(s + bt, n)])
            key = (kind, parent, ids)
            b = self.blocks.get(key)
            if b is None and len(ids) < bt:  # a tail: not if a block after this prefix already covers it
                have, m = self._partial(kind, parent, list(ids), len(ids))
                if m == len(ids):
                    self.lru.move_to_end(have.id)
                    break
            if b is None:
                size = 2 * cache.k[:, row, :, s:s + len(ids)].numel() * cache.k.element_size()
                if size > self.budget or not self._make_room(size, keep=parent):
                    break
                for old in [self.by_id[i] for i in self.kids.get((kind, parent), ()) if len(self.by_id[i].ids) < bt]:
                    if ids[:len(old.ids)] == old.ids:  # a shorter tail this one extends: it serves nothing more
                        self._evict(old.id)
                kv = torch.stack([cache.k[:, row, :, s:s + len(ids)], cache.v[:, row, :, s:s + len(ids)]]).clone()
                b = _Block(next(self._ids), kind, parent, ids, kv)
                self.blocks[key], self.by_id[b.id] = b, b
                self.kids.setdefault((kind, parent), set()).add(b.id)
                if parent:
                    self.by_id[parent].children += 1
                self.bytes += b.nbytes
                self.stats.stored_blocks += 1
                added += 1
            self.lru[b.id] = key
            self.lru.move_to_end(b.id)
            parent = b.id
        return added

    def _make_room(self, size: int, keep: int) -> bool:
        """Evict least recently used leaves until `size` more bytes fit; never the chain being stored (`keep` and
        its ancestors are not leaves while it grows, and `keep` itself is skipped)."""
        while self.bytes + size > self.budget:
            victim = next((bid for bid in self.lru if self.by_id[bid].children == 0 and bid != keep), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, bid: int) -> None:
        b = self.by_id.pop(bid)
        del self.blocks[self.lru.pop(bid)]
        self.kids[(b.kind, b.parent)].discard(bid)
        if b.parent:
            self.by_id[b.parent].children -= 1
        self.bytes -= b.nbytes
        self.stats.evicted_blocks += 1

    def clear(self) -> None:
        """Forget every block (the counters stay)."""
        self.blocks.clear()
        self.lru.clear()
        self.by_id.clear()
        self.kids.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.blocks)


def rows_to_run(cache: PromptCache | None, kind: str, prompts: list[list[int]], kv: KVCache,
                use: list[bool] | None = None) -> list[int]:
    """For each prompt (row b of `kv`), load its cached prefix into the row; the number of leading tokens loaded
    (0 where the cache is off, or the request said `cache_prompt: false`)."""
    if cache is None or cache.budget == 0:
        return [0] * len(prompts)
    use = use or [True] * len(prompts)
    return [cache.load(kind, p, kv, b) if ok else 0 for b, (p, ok) in enumerate(zip(prompts, use, strict=True))]


def keep_rows(cache: PromptCache | None, kind: str, prompts: list[list[int]], kv: KVCache,
              use: list[bool] | None = None, held: list[int] | None = None) -> None:
    """Store each row's prefix (`held[b]` tokens whose K/V row b of `kv` holds; default the whole prompt)."""
    if cache is None or cache.budget == 0:
        return
    use = use or [True] * len(prompts)
    for b, p in enumerate(prompts):
        if use[b]:
            cache.store(kind, p, kv, b, len(p) if held is None else held[b])


def prefill_cached(model: Transformer, kv: KVCache, prompts: list[list[int]], cache: PromptCache | None,
                   kind: str, use: list[bool] | None = None) -> tuple[Tensor, list[int]]:
    """`model.prefill` through the prompt cache: each row's cached prefix is copied in, the rest is run, and the
    prompts' whole blocks are stored once the prefill succeeded. Returns (last hidden states [B, H], tokens reused
    per row)."""
    starts = rows_to_run(cache, kind, prompts, kv, use)
    hidden = prefill(model, kv, prompts, starts)
    keep_rows(cache, kind, prompts, kv, use)
    return hidden, starts
