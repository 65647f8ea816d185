"""Medusa trees: choices validation names the bad path; buffers match Medusa's construction; auto growth."""

from __future__ import annotations

import pytest
import torch

from pipeline.tree import build_tree, expected_accept_len, grow_tree, validate_choices


@pytest.mark.parametrize("choices, heads, limit, match", [
    ([], 3, 8, "empty tree"),
    ([[0], []], 3, 8, r"path 1 is empty"),
    ([[0], [0, -1]], 3, 8, r"path 1 \[0, -1\]: ranks must be non-negative"),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], 3, 8, r"path 3 \[0, 0, 0, 0\] has depth 4 but there are only 3"),
    ([[0], [1, 0]], 3, 8, r"path 1 \[1, 0\]: its prefix \[1\] is missing"),
    ([[0], [0]], 3, 8, r"path 1 \[0\] appears twice"),
    ([[0], [1], [2], [0, 0]], 3, 3, r"4 nodes exceed limits.max_draft_len \(3\)"),
])
def test_invalid_choices_name_the_bad_path(choices, heads, limit, match):
    with pytest.raises(ValueError, match=match):
        validate_choices(choices, heads, limit)


def test_buffers_match_medusa_reference_example():
    t = build_tree([[0, 0, 0], [1, 0], [0], [1], [0, 1], [0, 0]])
    assert t.choices == [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.head.tolist() == [-1, 0, 0, 1, 1, 1, 2]
    assert t.rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert t.mask[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert sorted(r[r >= 0].tolist() for r in t.retrieve) == [[0, 1, 3, 6], [0, 1, 4], [0, 2, 5]]
    assert t.size == 7 and t.max_depth == 3 and t.topk() == 2
    # every node attends exactly to its ancestors and itself
    for i in range(t.size):
        anc, u = set(), i
        while u >= 0:
            anc.add(u)
            u = int(t.parent[u])
        assert set(t.mask[i].nonzero().flatten().tolist()) == anc


def test_expected_accept_len_multiplies_along_paths():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    assert expected_accept_len([[0], [1], [0, 0]], acc) == pytest.approx(1 + 0.5 + 0.2 + 0.5 * 0.4)


def test_auto_tree_grows_deeper_when_heads_are_good_and_stops_when_verification_is_expensive():
    good = [[0.9, 0.05], [0.85, 0.05], [0.8, 0.05]]
    flat = [0.1] * 17
    choices, info = grow_tree(good, flat, 16)
    validate_choices(choices, 3, 16)
    assert [0, 0, 0] in choices and info["expected_speedup"] > 2
    steep = [0.1 + 0.05 * n for n in range(17)]
    small, info2 = grow_tree(good, steep, 16)
    assert 1 < len(small) < len(choices)
    hopeless, info3 = grow_tree([[0.01] * 2] * 3, steep, 16)
    assert hopeless == [[0]] and info3["expected_speedup"] < 1
    assert info2["expected_speedup"] == pytest.approx(
        expected_accept_len(small, good) * steep[0] / steep[len(small)], rel=1e-2)


def test_auto_tree_respects_the_size_limit_and_head_count():
    acc = [[0.3] * 10, [0.3] * 10]
    choices, _ = grow_tree(acc, [0.1] * 5, 4)
    validate_choices(choices, 2, 4)
    assert len(choices) <= 4
    assert torch.equal(build_tree(choices).mask.diagonal(), torch.ones(len(choices) + 1, dtype=torch.bool))
