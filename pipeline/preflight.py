"""Checks that fail before any build work: draft/target tokenizer pairing and max_draft_len consistency.

Tokenizers are compared token by token (id -> token string), not by vocab_size: two vocabularies
of the same size can disagree, and two of different sizes can agree except for padding slots.
"""

from __future__ import annotations

import re

from pipeline.runtime.specconfig import SpeculationError
from pipeline.spec import Spec, SpecError, decode_config

PAD_TOKEN = re.compile(r"^(?:<\|?|\[)(?:pad|extra|unused|reserved|dummy|madeupword|placeholder)[\w\-]*(?:\|?>|\])$",
                       re.IGNORECASE)
SAMPLES = ["Hello, world! What's the capital of France?", "  def f(x):\n\treturn x**2  # émoji 🙂",
           "1234567890 ÄÖÜ ß 中文 テスト", "<|im_start|>user\nhi<|im_end|>"]


class PreflightError(ValueError):
    """A pairing or configuration problem found before building; the message says how to fix it."""


def is_padding(token: str | None) -> bool:
    return token is None or token == "" or bool(PAD_TOKEN.match(token))


def vocab_list(tok) -> list[str | None]:
    """Token strings by id, added tokens included."""
    return list(tok.convert_ids_to_tokens(list(range(len(tok)))))


def compare_tokenizers(a, b, name_a: str = "target", name_b: str = "draft") -> str:
    """A one-line report when `a` and `b` tokenize identically (padding aside); PreflightError otherwise."""
    va, vb = vocab_list(a), vocab_list(b)
    n = min(len(va), len(vb))
    diff = [i for i in range(n) if va[i] != vb[i] and not (is_padding(va[i]) and is_padding(vb[i]))]
    if diff:
        i = diff[0]
        raise PreflightError(
            f"tokenizers differ: {len(diff)} of the first {n} token ids map to different tokens (first at id {i}: "
            f"{name_a} {va[i]!r} vs {name_b} {vb[i]!r}); a draft must use the target's tokenizer. Use a draft "
            f"trained with the target's tokenizer, or set draft.source: train")
    longer, extra_name = (va, name_a) if len(va) > len(vb) else (vb, name_b)
    extra = longer[n:]
    real = [(n + j, t) for j, t in enumerate(extra) if not is_padding(t)]
    if real:
        i, t = real[0]
        raise PreflightError(
            f"tokenizers differ: {extra_name} has {len(extra)} more tokens, {len(real)} of them real (first at id {i}: "
            f"{t!r}); drafts for those ids could never be verified. Use a draft with the target's tokenizer")
    for attr in ("eos_token_id", "bos_token_id"):
        ea, eb = getattr(a, attr, None), getattr(b, attr, None)
        if ea is not None and eb is not None and ea != eb:
            raise PreflightError(f"tokenizers differ: {attr} is {ea} for the {name_a} but {eb} for the {name_b}; "
                                 "fix the draft's tokenizer_config.json or use a draft with the target's tokenizer")
    for text in SAMPLES:
        ia, ib = a(text, add_special_tokens=False)["input_ids"], b(text, add_special_tokens=False)["input_ids"]
        if ia != ib:
            raise PreflightError(f"tokenizers differ: the same vocabulary splits {text!r} differently ({name_a} "
                                 f"{ia[:8]} vs {name_b} {ib[:8]}; normalizer or pre-tokenizer differ); use the "
                                 "target's tokenizer")
    if extra:
        return (f"tokenizers match token by token ({n} tokens); {extra_name} has {len(extra)} extra padding-only "
                f"tokens (ids {n}..{n + len(extra) - 1}), which a draft never proposes")
    return f"tokenizers match token by token ({n} tokens)"


def compare_vocab_sizes(target_vocab: int, draft_vocab: int, tokenizer_len: int) -> str:
    """Model vocabularies (embedding rows) may differ only in padding rows beyond the tokenizer's length."""
    if target_vocab == draft_vocab:
        return f"model vocab_size {target_vocab} on both sides"
    if min(target_vocab, draft_vocab) >= tokenizer_len:
        return (f"model vocab_size differs only by padding rows (target {target_vocab}, draft {draft_vocab}, "
                f"tokenizer {tokenizer_len}); padding ids are never sampled")
    raise PreflightError(f"draft vocab_size {draft_vocab} vs target {target_vocab}: the smaller one does not cover the "
                         f"tokenizer's {tokenizer_len} tokens; use a draft with the target's full vocabulary")


def check_draft_len(spec: Spec, target_config: dict | None = None, draft_config: dict | None = None) -> list[str]:
    """max_draft_len agrees across the spec, the target engine and the stored k; raise PreflightError naming the key."""
    lim = spec.limits.max_draft_len
    try:
        cfg = decode_config(spec)  # k and prompt lookup's k within max_draft_len (the one place they are checked)
    except SpecError as e:
        raise PreflightError(str(e)) from None
    if (spec.has_draft or spec.has_medusa) and lim < 1:
        raise PreflightError("limits.max_draft_len: got 0 but the spec speculates (draft or medusa); set it to at "
                             "least speculation.num_draft_tokens")
    notes = []
    if target_config is not None:
        built = int(target_config.get("build_config", {}).get("max_draft_len", 0))
        if built != lim:
            raise PreflightError(f"limits.max_draft_len is {lim} but the target engine was built with max_draft_len "
                                 f"{built}; run `python -m pipeline engine SPEC` (`make engine`: the torch backend "
                                 "writes a new max_draft_len into the engines' config.json in place)")
        notes.append(f"max_draft_len {lim} in the spec and the target engine")
    if draft_config is not None:
        stored = (draft_config.get("speculation") or {}).get("num_draft_tokens")
        if isinstance(stored, int):
            try:
                cfg.check_k(stored, "draft/config.json speculation.num_draft_tokens (the k 'auto' measured)",
                            "rebuild the draft or run `python -m pipeline pick-k SPEC --write`")
            except SpeculationError as e:
                raise PreflightError(str(e)) from None
    return notes
