"""The one hold-out rule shared by draft training, Medusa training and pick-k."""

from pipeline.common import split_prompts


def _decoded_by_validation(texts: list[str], max_prompts: int) -> list[str]:
    """What `validate` decodes: a warm-up prompt, then `max_prompts` measured ones (the bench: 1 + 4)."""
    return texts[: max(max_prompts, 4) + 1]


def test_split_holds_out_what_validation_decodes():
    texts = [f"p{i}" for i in range(30)]
    for n_eval in (1, 4, 8):
        train, held = split_prompts(texts, n_eval)
        assert set(_decoded_by_validation(texts, n_eval)) <= set(held)
        assert not set(train) & set(held)
        assert sorted(train + held) == sorted(texts)


def test_split_with_separate_training_prompts():
    texts, extra = [f"p{i}" for i in range(10)], ["t0", "t1"]
    train, held = split_prompts(texts, 8, extra)
    assert train == extra and held == texts[:9]


def test_split_few_prompts_falls_back_to_every_sixth():
    texts = [f"p{i}" for i in range(12)]
    train, held = split_prompts(texts, 8)
    assert held == ["p5", "p11"] and len(train) == 10
    # max_prompts 0 (validate decodes all): still something held out, never the same prompt on both sides
    train, held = split_prompts([f"p{i}" for i in range(40)], 0)
    assert held and not set(train) & set(held)
