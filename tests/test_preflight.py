"""Preflight refuses draft/target pairs that cannot work, before any build work starts."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from pipeline import spec as specmod
from pipeline.preflight import PreflightError, check_draft_len, compare_tokenizers, compare_vocab_sizes, is_padding


def _clone(tok) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer

    out = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.backend_tokenizer.to_str()),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>")
    return out


def _swapped(tok, a: str, b: str) -> PreTrainedTokenizerFast:
    """The same tokenizer with two vocabulary entries' ids exchanged (same size, different mapping)."""
    from tokenizers import Tokenizer

    d = json.loads(tok.backend_tokenizer.to_str())
    v = d["model"]["vocab"]
    v[a], v[b] = v[b], v[a]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(d)), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", pad_token="</s>")


def test_identical_tokenizers_pass(tiny_tokenizer):
    msg = compare_tokenizers(tiny_tokenizer, _clone(tiny_tokenizer))
    assert "match token by token" in msg and "padding" not in msg


def test_padding_only_difference_is_accepted_and_reported(tiny_tokenizer):
    padded = _clone(tiny_tokenizer)
    padded.add_tokens(["<pad_0>", "<pad_1>", "<|extra_2|>"], special_tokens=True)
    msg = compare_tokenizers(tiny_tokenizer, padded)
    assert "3 extra padding-only tokens" in msg and f"ids {len(tiny_tokenizer)}" in msg


def test_same_size_but_different_mapping_is_refused(tiny_tokenizer):
    vocab = tiny_tokenizer.get_vocab()
    a, b = sorted((t for t in vocab if vocab[t] > 100), key=vocab.get)[:2]
    other = _swapped(tiny_tokenizer, a, b)
    assert len(other) == len(tiny_tokenizer)
    with pytest.raises(PreflightError, match=rf"first at id {vocab[a]}.*draft must use the target's tokenizer"):
        compare_tokenizers(tiny_tokenizer, other)


def test_real_extra_tokens_are_refused(tiny_tokenizer):
    more = _clone(tiny_tokenizer)
    more.add_tokens(["banana", "<pad_9>"])
    with pytest.raises(PreflightError, match="1 of them real.*'banana'"):
        compare_tokenizers(tiny_tokenizer, more)


def test_different_special_tokens_are_refused(tiny_tokenizer):
    other = _clone(tiny_tokenizer)
    other.eos_token = "<|user|>"
    with pytest.raises(PreflightError, match="eos_token_id"):
        compare_tokenizers(tiny_tokenizer, other)


def test_padding_names():
    assert all(is_padding(t) for t in [None, "", "<pad>", "<pad_12>", "[PAD]", "<|extra_3|>", "<unused7>"])
    assert not any(is_padding(t) for t in ["pad", "padding", "Ġpad", "<s>", "</s>", "extra"])


def test_model_vocab_sizes_may_differ_only_in_padding_rows():
    assert "padding rows" in compare_vocab_sizes(49152, 49216, 49152)
    with pytest.raises(PreflightError, match="does not cover"):
        compare_vocab_sizes(49152, 32000, 49152)


def _spec(**over):
    data = {"name": "t", "target": {"source": "x"}, "draft": {"source": "train"},
            "limits": {"max_draft_len": 8}, "speculation": {"num_draft_tokens": 4}}
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v}
    return specmod.parse(data)


def test_max_draft_len_must_match_the_target_engine():
    s = _spec()
    assert check_draft_len(s, {"build_config": {"max_draft_len": 8}})
    with pytest.raises(PreflightError, match="built with max_draft_len 4; run `python -m pipeline engine SPEC`"):
        check_draft_len(s, {"build_config": {"max_draft_len": 4}})


def test_stored_k_above_max_draft_len_is_refused():
    s = _spec(speculation={"num_draft_tokens": "auto"})
    with pytest.raises(PreflightError, match=r"num_draft_tokens \(the k 'auto' measured\): got 12; "
                       r"must be between 1 and limits.max_draft_len \(8\).*pick-k"):
        check_draft_len(s, None, {"speculation": {"num_draft_tokens": 12}})


def _normalized(tok, normalizer: dict) -> PreTrainedTokenizerFast:
    """The same vocabulary (id -> token identical) with another normalizer: it splits some text differently."""
    from tokenizers import Tokenizer

    d = json.loads(tok.backend_tokenizer.to_str())
    d["normalizer"] = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(d)), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", pad_token="</s>")


@pytest.mark.parametrize("normalizer, sample", [
    ({"type": "Lowercase"}, "Hello"),
    ({"type": "Replace", "pattern": {"String": "\t"}, "content": "    "}, "def f"),
    ({"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "StripAccents"}]}, "émoji"),
    ({"type": "Replace", "pattern": {"String": "中"}, "content": "x"}, "ÄÖÜ"),
    ({"type": "Replace", "pattern": {"String": "<|im_end|>"}, "content": ""}, "im_start"),
], ids=["lowercase", "tabs", "accents", "cjk", "chat-markers"])
def test_same_vocabulary_that_splits_text_differently_is_refused(tiny_tokenizer, normalizer, sample):
    """Each normalizer changes how only some of the sample texts split; every sample must be tried."""
    other = _normalized(tiny_tokenizer, normalizer)
    from pipeline.preflight import vocab_list

    assert vocab_list(other) == vocab_list(tiny_tokenizer)
    with pytest.raises(PreflightError, match=rf"splits .*{sample}.* differently"):
        compare_tokenizers(tiny_tokenizer, other)


def test_a_real_token_against_a_padding_slot_is_refused(tiny_tokenizer):
    """Padding is exempt only where both sides hold padding: one real token at that id is a real difference."""
    a, b = _clone(tiny_tokenizer), _clone(tiny_tokenizer)
    a.add_tokens(["<pad_0>", "<pad_1>"], special_tokens=True)
    b.add_tokens(["<pad_0>", "banana"])
    n = len(tiny_tokenizer)
    with pytest.raises(PreflightError, match=rf"first at id {n + 1}: target '<pad_1>' vs draft 'banana'"):
        compare_tokenizers(a, b)
    with pytest.raises(PreflightError, match=rf"first at id {n + 1}: target 'banana' vs draft '<pad_1>'"):
        compare_tokenizers(b, a)
    c = _clone(tiny_tokenizer)
    c.add_tokens(["<|extra_0|>", "[PAD]"], special_tokens=True)
    assert "match token by token" in compare_tokenizers(a, c)  # padding against padding, any spelling


@pytest.mark.parametrize("token", ["<pad_0>", "<|reserved_special_token_5|>", "[unused12]", "<madeupword3>",
                                   "<dummy-1>", "<placeholder7>", "[PAD]", "<|extra_0|>"])
def test_padding_spellings(token):
    assert is_padding(token)


@pytest.mark.parametrize("token", ["<|im_start|>", "<|endoftext|>", "[CLS]", "<mask>", "<unk>", "<|user|>",
                                   "<pad> x", "x<pad>", "<pad", "pad>", "[pad", "<padding text|> ok", "▁pad",
                                   "<|pad|>x", "unused", "<reservedword> ", "<pad> <s>", "[unused1] [CLS]",
                                   "<pad_1 banana>", "<extra.0>"])
def test_real_tokens_are_not_padding(token):
    assert not is_padding(token)
