"""Medusa trees: `medusa_choices` (lists of top-k paths) validated and turned into buffers."""

from __future__ import annotations


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
