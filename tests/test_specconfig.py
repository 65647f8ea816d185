"""The typed speculation config: one rule for a draft length above max_draft_len (an error naming the field, the
value and the fix, never a clamp), in the spec, the runtime, the served model's parameters and requests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pipeline import spec as specmod
from pipeline.runtime import decode as decode_mod
from pipeline.runtime.decode import METHOD_NAMES, METHODS, Bundle, apply_spec, decode
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.specconfig import DEFAULT_K, SpecDecodeConfig, SpeculationError
from pipeline.runtime.speculative import speculate
from pipeline.triton.parse import BadRequest, Limits, RequestParser
from tests.test_speculative import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _bundle(max_draft_len: int = 4, **spec) -> Bundle:
    target = tiny(seed=21)
    return Bundle(target, None, {"build_config": {"max_draft_len": max_draft_len}},
                  draft=tiny(base=target, seed=22, noise=0.05),
                  spec=SpecDecodeConfig(max_draft_len=max_draft_len, **spec))


@pytest.mark.parametrize("method", ["draft_target", "prompt_lookup"])
def test_a_k_above_max_draft_len_is_an_error_in_decode_never_a_clamp(method):
    b = _bundle(4)
    reqs = [Request(p, 6) for p in prompts(2, 48, seed=23)]
    with pytest.raises(SpeculationError, match=r"num_draft_tokens: got 5; must be between 1 and "
                                               r"limits.max_draft_len \(4\); send a smaller k"):
        decode(b, method, reqs, num_draft_tokens=5)
    with pytest.raises(SpeculationError, match=r"num_draft_tokens: got 0; must be between 1"):
        decode(b, method, reqs, num_draft_tokens=0)
    at_limit = decode(b, method, reqs, num_draft_tokens=4)
    assert [r.tokens for r in at_limit] == [r.tokens for r in generate(b.target, reqs)]


def test_the_default_k_of_each_method_comes_from_the_config():
    cfg = SpecDecodeConfig(max_draft_len=8, num_draft_tokens=3, prompt_lookup_num_tokens=5)
    assert cfg.k_for("draft_target") == cfg.k_for("medusa") == 3 and cfg.k_for("prompt_lookup") == 5
    # 'auto' with nothing measured is a choice, DEFAULT_K, or max_draft_len where that is smaller
    assert SpecDecodeConfig(max_draft_len=8).k_for("draft_target") == DEFAULT_K
    assert SpecDecodeConfig(max_draft_len=2, prompt_lookup_num_tokens=2).k_for("draft_target") == 2


@pytest.mark.parametrize("field, value, message", [
    ("num_draft_tokens", 9, r"speculation.num_draft_tokens: got 9; must be between 1 and limits.max_draft_len \(8\); "
                            r"set it to 'auto'"),
    ("prompt_lookup_num_tokens", 9, r"speculation.prompt_lookup_num_tokens: got 9; must be between 1 and "
                                    r"limits.max_draft_len \(8\)"),
    ("disable_at_batch", -1, r"speculation.disable_at_batch: got -1; must be 0"),
    ("draft_confidence", 1.0, r"speculation.draft_confidence: got 1.0; .*probability below 1"),
    ("draft_lookup_min_ngram", 4, r"speculation.draft_lookup_min_ngram: got 4; .*prompt_lookup_max_ngram \(3\)"),
])
def test_every_construction_checks_the_limits_and_names_the_field(field, value, message):
    with pytest.raises(SpeculationError, match=message):
        SpecDecodeConfig(max_draft_len=8, **{field: value})
    ok = SpecDecodeConfig(max_draft_len=8)
    with pytest.raises(SpeculationError, match=message):
        replace(ok, **{field: value})  # a variant is checked again


def test_an_engine_without_draft_room_says_how_to_rebuild():
    cfg = SpecDecodeConfig(max_draft_len=0, prompt_lookup_num_tokens=1)
    with pytest.raises(SpeculationError, match=r"built with limits.max_draft_len 0 .*rebuild it"):
        cfg.k_for("draft_target")


def test_a_measured_k_above_the_engine_limit_fails_at_load_not_later():
    """The k `auto` stored in the draft engine is checked when the bundle is made (it used to be clamped)."""
    target = tiny(seed=24)
    stored = {"speculation": {"num_draft_tokens": 6}}
    with pytest.raises(SpeculationError, match="num_draft_tokens: got 6; must be between 1 and limits.max_draft_len"):
        Bundle(target, None, {"build_config": {"max_draft_len": 4}}, draft=target, draft_config=stored)
    b = Bundle(target, None, {"build_config": {"max_draft_len": 8}}, draft=target, draft_config=stored)
    assert b.measured_k == 6 and b.spec.k_for("draft_target") == 6


SPEC = {"name": "x", "limits": {"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 256, "max_draft_len": 8}}


def test_the_spec_block_becomes_the_config_and_an_integer_k_wins_over_the_measured_one():
    s = specmod.parse({**SPEC, "speculation": {"num_draft_tokens": "auto", "disable_at_batch": 3}})
    b = _bundle(8)
    b.draft_config = {"speculation": {"num_draft_tokens": 5}}
    cfg = apply_spec(b, s).spec
    assert (cfg.num_draft_tokens, cfg.disable_at_batch, cfg.max_draft_len) == (5, 3, 8)
    s = specmod.parse({**SPEC, "speculation": {"num_draft_tokens": 2}})
    assert apply_spec(b, s).spec.num_draft_tokens == 2
    s = specmod.parse({**SPEC, "limits": {**SPEC["limits"], "max_draft_len": 2},
                       "speculation": {"num_draft_tokens": 2, "prompt_lookup_num_tokens": 2}})
    with pytest.raises(ValueError, match=r"limits.max_draft_len: got 2 but the engine was built with max_draft_len 8"):
        apply_spec(b, s)


def test_the_served_parameters_read_back_to_the_same_config():
    for cfg in (SpecDecodeConfig(max_draft_len=8), SpecDecodeConfig(
            max_draft_len=6, num_draft_tokens=5, prompt_lookup_num_tokens=2, prompt_lookup_max_ngram=4,
            use_draft_logits=False, disable_at_batch=7, draft_lookup_min_ngram=2, draft_confidence=0.25)):
        params = cfg.to_params()
        assert SpecDecodeConfig.from_params(lambda k, d, p=params: p.get(k, d), cfg.max_draft_len) == cfg
    auto = SpecDecodeConfig(max_draft_len=8).to_params()
    assert auto["num_draft_tokens"] == "auto"
    assert SpecDecodeConfig.from_params(lambda k, d: auto.get(k, d), 8, measured_k=3).num_draft_tokens == 3


def _inputs(name: str, value: int | None):
    """A request's tensors as the parser's `get` reads them: a short prompt, 4 tokens, and `name` unless None."""
    d = {"text_input": np.array([[b"hello there"]], dtype=object), "max_tokens": np.array([[4]], np.int32)}
    if value is not None:
        d[name] = np.array([[value]], np.int32)
    return d.get


def test_a_request_k_above_the_limit_is_refused_with_the_same_rule(tiny_tokenizer):
    cfg = SpecDecodeConfig(max_draft_len=4, num_draft_tokens=3)
    lim = Limits(max_batch_size=2, max_input_len=64, max_seq_len=128, vocab=len(tiny_tokenizer), end_ids=(1,),
                 methods=["baseline", "draft_target", "prompt_lookup"], default_method="draft_target", spec=cfg)
    parser = RequestParser(tiny_tokenizer, lim)
    get = lambda k: _inputs("num_draft_tokens", k)  # noqa: E731

    with pytest.raises(BadRequest, match=r"num_draft_tokens: got 5; must be between 1 and limits.max_draft_len \(4\); "
                                         r"send one within it"):
        parser.parse(get(5))
    assert parser.parse(get(None)).k == 3 and parser.parse(get(4)).k == 4
    assert parser.parse(get(0)).method == "baseline"


def test_end_id_minus_one_means_no_end_token_and_other_negatives_are_refused(tiny_tokenizer):
    """end_id -1 (TensorRT-LLM's executor reads it so): the request decodes to max_tokens or a stop word; the load
    tool's abandoned requests use it so that none ends by itself in the moment its client goes."""
    lim = Limits(max_batch_size=2, max_input_len=64, max_seq_len=128, vocab=len(tiny_tokenizer), end_ids=(1, 2),
                 methods=["baseline"], default_method="baseline", spec=SpecDecodeConfig(max_draft_len=4))
    parser = RequestParser(tiny_tokenizer, lim)
    get = lambda end_id: _inputs("end_id", end_id)  # noqa: E731

    assert parser.parse(get(None)).reqs[0].end_ids == (1, 2)
    assert parser.parse(get(5)).reqs[0].end_ids == (5,)
    assert parser.parse(get(-1)).reqs[0].end_ids == ()
    with pytest.raises(BadRequest, match=r"end_id: got -2; must be a token id between 0 and \d+, or -1 for none"):
        parser.parse(get(-2))


def test_the_methods_table_lists_each_method_once_and_availability_follows_what_was_loaded():
    assert METHOD_NAMES == ("baseline", "draft_target", "prompt_lookup", "medusa", "suffix", "hybrid")
    assert all(m.name in METHOD_NAMES and isinstance(m.resumable, bool) for m in METHODS)
    b = _bundle(4)
    assert b.methods() == ["baseline", "draft_target", "prompt_lookup", "suffix", "hybrid"]
    b.draft = None
    assert b.methods() == ["baseline", "prompt_lookup", "suffix"]
    with pytest.raises(ValueError, match="'draft_target' is not available here"):
        decode(b, "draft_target", [Request([3, 4], 2)])


class _RepeatDrafter:
    """A new chain drafter for the test: proposes the context's last token k times (a Drafter)."""

    def __init__(self, k: int, dev):
        self.width, self.dev = k, dev

    def prefill(self, prompts):
        pass

    def resume(self, handoffs):
        pass

    def hand_off(self):
        return None

    def propose(self, ctx, pos, gens):
        drafts = torch.tensor([[c[-1]] * self.width for c in ctx], device=self.dev)
        return drafts, None, [self.width] * len(ctx)


class _Repeat:
    name, resumable = "repeat", False

    def available(self, b) -> bool:
        return True

    def run(self, b, reqs, k, on_emit, **opts):
        return speculate(b.target, reqs, k, on_emit, _RepeatDrafter(k, b.target.embed.weight.device))


def test_a_new_method_is_its_drafter_and_one_entry_in_the_methods_table(monkeypatch):
    """The interface is enough for a method that did not exist: decode serves it, with the deployment's k, and
    the shared verify loop keeps greedy output identical to plain decoding."""
    monkeypatch.setattr(decode_mod, "METHODS", (*METHODS, _Repeat()))
    b = _bundle(4, num_draft_tokens=3)
    assert b.methods()[-1] == "repeat"
    reqs = [Request(p, 10) for p in prompts(3, 48, seed=25)]
    got = decode(b, "repeat", reqs)
    assert [r.tokens for r in got] == [r.tokens for r in generate(b.target, reqs)]
    assert all(r.draft_proposed > 0 and r.draft_proposed % 3 == 0 for r in got)  # k = 3 from the config
