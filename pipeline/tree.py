"""Medusa trees: `medusa_choices` (lists of top-k paths) validated and turned into buffers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def validate_choices(choices: list[list[int]], num_heads: int, max_draft_len: int) -> None:
    """Raise ValueError naming the first bad path: every prefix present, depth <= heads, size <= max_draft_len."""
    if not choices:
        raise ValueError("empty tree; give at least one path such as [[0]]")
    seen = set()
    for i, path in enumerate(choices):
        if not path:
            raise ValueError(f"path {i} is empty; do not include [] (the root is implicit)")
        if any((not isinstance(r, int)) or r < 0 for r in path):
            raise ValueError(f"path {i} {path}: ranks must be non-negative integers")
        if len(path) > num_heads:
            raise ValueError(f"path {i} {path} has depth {len(path)} but there are only {num_heads} Medusa heads; "
                             "shorten it or raise medusa.num_heads")
        t = tuple(path)
        if t in seen:
            raise ValueError(f"path {i} {path} appears twice")
        seen.add(t)
    for i, path in enumerate(choices):
        for d in range(1, len(path)):
            if tuple(path[:d]) not in seen:
                raise ValueError(f"path {i} {path}: its prefix {list(path[:d])} is missing; add it to the list")
    if len(choices) > max_draft_len:
        raise ValueError(f"{len(choices)} nodes exceed limits.max_draft_len ({max_draft_len}); "
                         "prune the tree or raise max_draft_len")


@dataclass
class Tree:
    """Buffers for one Medusa tree, built from `medusa_choices` the way Medusa and TensorRT-LLM order them.

    Node 0 is the root (the target's own next token); node j+1 is the j-th path after sorting by
    (length, ranks), so a parent always precedes its children. `mask[i, j]` is True when node j is
    node i or one of its ancestors; node i's candidate token is head `head[i]`'s rank `rank[i]`
    token; its RoPE position is the committed length plus `depth[i]`; `retrieve` lists the node
    indices of every root-to-leaf path (padded with -1), as Medusa's retrieve_indices.
    """

    choices: list[list[int]]
    depth: torch.Tensor
    parent: torch.Tensor
    head: torch.Tensor
    rank: torch.Tensor
    mask: torch.Tensor
    retrieve: torch.Tensor
    children: list[list[int]]

    @property
    def size(self) -> int:
        """Nodes in one verification forward, the root included (len(choices) + 1)."""
        return len(self.choices) + 1

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def topk(self) -> int:
        """How many candidates per head the tree reads (largest rank + 1)."""
        return int(self.rank.max()) + 1 if len(self.choices) else 1


def build_tree(choices: list[list[int]]) -> Tree:
    """Tree buffers for validated `choices` (call validate_choices first)."""
    paths = sorted((list(p) for p in choices), key=lambda p: (len(p), p))
    index = {(): 0} | {tuple(p): i + 1 for i, p in enumerate(paths)}
    n = len(paths) + 1
    depth, parent, head, rank = [0] * n, [-1] * n, [-1] * n, [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(paths, start=1):
        depth[i], head[i], rank[i] = len(p), len(p) - 1, p[-1]
        parent[i] = index[tuple(p[:-1])]
        children[parent[i]].append(i)
        for d in range(len(p)):
            mask[i, index[tuple(p[:d])]] = True
    leaves = [i for i in range(n) if not children[i]]
    rows = []
    for leaf in leaves:
        path, u = [], leaf
        while u >= 0:
            path.append(u)
            u = parent[u]
        rows.append(path[::-1])
    width = max(len(r) for r in rows)
    retrieve = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)
    t = lambda x: torch.tensor(x, dtype=torch.long)
    return Tree(paths, t(depth), t(parent), t(head), t(rank), mask, retrieve, children)


def expected_accept_len(choices: list[list[int]], acc: list[list[float]]) -> float:
    """Tokens per step if head d's rank-r token is right with probability acc[d][r], independently.

    Each node contributes the probability that its whole path is accepted (Medusa's tree-search
    value); the 1 is the target's own token, emitted every step.
    """
    total = 1.0
    for p in choices:
        v = 1.0
        for d, r in enumerate(p):
            v *= acc[d][r] if r < len(acc[d]) else 0.0
        total += v
    return total


def grow_tree(acc: list[list[float]], cost: list[float], max_nodes: int, head_cost: float = 0.0,
              log=None) -> tuple[list[list[int]], dict]:
    """Grow a tree greedily by path value and keep the size with the best expected tokens per second.

    `acc[d][r]`: measured probability that head d's rank-r token is the target's; `cost[n-1]`:
    seconds for one target forward (with logits) over n tokens, n = 1..max_nodes+1; `head_cost`:
    seconds to run the heads once. A tree of n nodes costs cost[n] + head_cost per step and yields
    expected_accept_len tokens; baseline yields 1 token per cost[0].
    """
    heads = len(acc)
    K = len(acc[0]) if heads else 0
    chosen: list[list[int]] = []
    frontier = {(0,)} if heads and K else set()
    value = lambda p: math.prod(acc[d][r] for d, r in enumerate(p))
    best = ([], cost[0] and 1.0 / cost[0], 1.0, cost[0])
    table = []
    while frontier and len(chosen) < min(max_nodes, len(cost) - 1):
        p = max(frontier, key=lambda q: (value(q), [-r for r in q]))
        frontier.discard(p)
        chosen.append(list(p))
        if p[-1] + 1 < K:
            frontier.add(p[:-1] + (p[-1] + 1,))
        if len(p) < heads:
            frontier.add(p + (0,))
        e = expected_accept_len(chosen, acc)
        step = cost[len(chosen)] + head_cost
        table.append((len(chosen), e, step))
        if e / step > best[1]:
            best = ([list(q) for q in chosen], e / step, e, step)
    if not best[0]:
        n, e, step = table[0] if table else (1, 1.0, cost[0])
        best = ([[0]], e / step, e, step)
        if log:
            log("auto tree: no tree beats plain decoding on these measurements; using the smallest tree [[0]]")
    choices = best[0]
    info = {"expected_accept_len": round(best[2], 3), "step_ms": round(best[3] * 1e3, 2),
            "baseline_step_ms": round(cost[0] * 1e3, 2),
            "expected_speedup": round(best[1] * cost[0], 3),
            "table": [{"nodes": n, "expected_accept_len": round(e, 3), "step_ms": round(s * 1e3, 2)}
                      for n, e, s in table]}
    if log:
        log(f"auto tree: {len(choices)} nodes, expected {info['expected_accept_len']} tokens/step, "
            f"expected speedup {info['expected_speedup']}x: {choices}")
    return choices, info
