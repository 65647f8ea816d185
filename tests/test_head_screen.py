"""The exact greedy head (pipeline/runtime/head_screen.py): a Q4_K screen of a GGUF head and the rows it keeps.

Tiny random and adversarial GGUF heads made here. The greedy logits keep the full head's argmax (ties to the first
row) and its bits on every row they compute, on every kernel build this CPU runs; the bound they rest on covers
every row's distance between its screened score and its exact logit; and a model decodes the same greedy tokens with
and without the screen, while sampled requests read the whole head.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pipeline.runtime import gguf_weights as gw
from pipeline.runtime import head_screen, kernels, quant
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.model import build_model
from pipeline.runtime.sampling import SamplingParams
from tests.test_gguf_blocks32 import random_blocks as random_blocks32
from tests.test_gguf_weights import _tiny_cfg, _tiny_state, adversarial_blocks, random_blocks

BUILDS = kernels.supported_isas()
pytestmark = pytest.mark.skipif(not BUILDS, reason="no C kernel build runs on this CPU")


@pytest.fixture
def path():
    prev = kernels.path()
    yield kernels.set_path
    kernels.set_path(prev)


def _raw(qtype: int, N: int, K: int, seed: int = 0) -> np.ndarray:
    """N random GGUF rows with one fp16 scale for every block, as a trained head's rows are of like norms (random
    scales of 0 to 3 sigma let a few rows of large norm crowd every token)."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, N, K, rng, 1e-2) if qtype in gw.RECORD else random_blocks32(qtype, N, K, rng)
    blocks = raw.reshape(N, -1, gw.GGUF_BLOCK.get(qtype) or gw.GGUF_BLOCK32[qtype])
    blocks[..., (208, 209) if qtype == gw.Q6_K else (0, 1)] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


def _head(qtype: int, N: int, K: int, seed: int = 0, adversarial: bool = False) -> gw.GGUFLinear:
    raw = _raw(qtype, N, K, seed)
    if adversarial:  # 16 rows of extreme blocks (fp16 max and denormal scales, all-zero blocks) among the rest
        raw[100:116] = np.tile(adversarial_blocks(qtype, np.random.default_rng(seed)), (1, K // 256))
    return gw.GGUFLinear(*gw.pack_parts([(qtype, raw)], K))


def _aimed(head: gw.GGUFLinear, rows: list[int], seed: int = 1, scale: float = 30.0) -> torch.Tensor:
    """Hidden states each aimed at one head row (its logit stands out, as a trained model's do) plus noise with
    outlier columns: the screen rules most rows out."""
    g = torch.Generator().manual_seed(seed)
    W = head.weight[rows]
    x = scale * W / W.norm(dim=1, keepdim=True).clamp_min(1e-30) + 0.3 * torch.randn(len(rows), W.shape[1],
                                                                                      generator=g)
    x[:, 3] += 5.0
    return x.contiguous()


def _check(head: gw.GGUFLinear, screen: head_screen.HeadScreen, x: torch.Tensor) -> torch.Tensor:
    """Screened logits of x agree with the full head: the same argmax, the same bits wherever computed."""
    full = head(x)
    got = head_screen.logits(head, screen, x)
    assert got.shape == full.shape
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    done = torch.isfinite(got)
    assert torch.equal(got[done], full[done])
    return done


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("qtype", [gw.Q6_K, gw.Q8_0])
def test_greedy_logits_keep_the_full_heads_argmax_and_its_bits_on_every_row_they_compute(build, qtype, path):
    path(build)
    N, K = 4008, 512  # a last panel of 8 rows: its padding is never a logit
    head = _head(qtype, N, K)
    screen = head_screen.build(head)
    assert screen is not None and screen.layer.qweight.numel() < 0.75 * head.qweight.numel()
    computed = []
    for R in range(1, head_screen.max_rows() + 1):
        rows = [4005] + [(37 * R + 101 * i) % N for i in range(R - 1)]  # one aimed at the last, partial panel
        computed.append(_check(head, screen, _aimed(head, rows, seed=R)).sum(-1))
    # The screen did its work on every row count: most rows ruled out, never the argmax (the asserts in _check).
    assert all(c.max() < N * head_screen.MAX_PANEL_SHARE and c.min() >= 8 for c in computed)


@pytest.mark.parametrize("build", BUILDS)
def test_past_its_builds_row_limit_the_screen_reads_the_whole_head(build, path):
    """The AVX2 passes are compute-bound from 3 token rows, where the screen's second read stops paying (Zen 3): it
    serves up to 3 rows there and up to 6 on the AVX-512 tiles; past that every logit is the full head's."""
    path(build)
    assert head_screen.max_rows() == (head_screen.MAX_ROWS_AVX2 if build == "avx2" else head_screen.MAX_ROWS)
    head = _head(gw.Q6_K, 4008, 512)
    screen = head_screen.build(head)
    R = head_screen.max_rows()
    x = _aimed(head, [(37 * R + 101 * i) % 4008 for i in range(R + 1)], seed=R)
    assert not torch.isfinite(head_screen.logits(head, screen, x[:R])).all()  # screened: most rows ruled out
    assert torch.equal(head_screen.logits(head, screen, x), head(x).float())  # one row more: the whole head


@pytest.mark.parametrize("build", BUILDS)
def test_many_panels_left_are_shared_by_the_pool_and_too_many_read_the_whole_head(build, path, monkeypatch):
    path(build)
    monkeypatch.setattr(kernels, "threads", lambda: 2)
    head = _head(gw.Q6_K, 16384, 256, seed=11)  # 1,024 panels: the screen computes at most 128
    screen = head_screen.build(head)
    x = _aimed(head, [5000, 77], seed=2, scale=1.5)  # weakly aimed: about 70 panels left, past SH_POOL_FROM (32)
    done = _check(head, screen, x).any(0).sum().item() // 16
    assert 32 < done <= 1024 * head_screen.MAX_PANEL_SHARE
    x = _aimed(head, [5000, 77], seed=2, scale=1.2)  # past the share: the whole head, every logit
    assert torch.equal(head_screen.logits(head, screen, x), head(x).float())


@pytest.mark.parametrize("build", BUILDS)
def test_rows_that_tie_the_best_give_the_first_as_the_full_heads_argmax_does(build, path):
    path(build)
    N, K = 640, 256
    raw = _raw(gw.Q6_K, N, K, seed=3)
    raw[17] = raw[300]  # three rows of the same bytes: the same logits, bit for bit
    raw[555] = raw[300]
    head = gw.GGUFLinear(*gw.pack_parts([(gw.Q6_K, raw)], K))
    screen = head_screen.build(head)
    x = _aimed(head, [300, 300], seed=4)
    full = head(x)
    assert torch.equal(full[:, 17], full[:, 300]) and (full.argmax(-1) == 17).all()
    got = head_screen.logits(head, screen, x)
    assert (got.argmax(-1) == 17).all()


@pytest.mark.parametrize("build", BUILDS)
def test_extreme_blocks_zero_and_non_finite_states_still_give_the_full_heads_argmax(build, path):
    path(build)
    head = _head(gw.Q6_K, 1024, 256, seed=5, adversarial=True)
    screen = head_screen.build(head)
    x = _aimed(head, [7, 108, 900], seed=6)
    _check(head, screen, x)
    zero = torch.zeros(2, 256)  # every logit 0: every row ties, the first wins
    assert (head_screen.logits(head, screen, zero).argmax(-1) == 0).all()
    bad = x.clone()
    bad[1, 9] = float("nan")
    bad[2, 4] = float("inf")
    got, full = head_screen.logits(head, screen, bad), head(bad)
    assert torch.equal(got.isnan(), full.isnan()) and torch.equal(got.nan_to_num(), full.nan_to_num())


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("qtype", [gw.Q6_K, gw.Q8_0])
def test_the_bound_covers_every_rows_distance_from_its_screened_score_to_its_exact_logit(build, qtype, path):
    path(build)
    K = 512
    head = _head(qtype, 512, K, seed=7)
    screen = head_screen.build(head)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, K, generator=g) * torch.logspace(-3, 2, K)[torch.randperm(K, generator=g)]  # uneven groups
    x[2, 256:] = 0  # an all-zero super-block
    ab = torch.empty(6, 2)
    assert kernels._load().screen_bounds(x.data_ptr(), 6, K, screen.act_group, 256, head_screen.SUM_TOL,
                                         ab.data_ptr()) == 0
    gap = (head(x) - screen.layer(x)).abs()
    bound = screen.wn[None] * ab[:, :1] + screen.dn[None] * ab[:, 1:]
    assert (gap <= bound).all()
    assert (gap.amax(-1) > 0.05 * bound.amax(-1)).all()  # and it is not so loose that it could never fail


def test_the_screens_q4k_blocks_decode_as_the_gguf_package_and_as_the_kernel_multiplies():
    W = torch.randn(40, 512, generator=torch.Generator().manual_seed(9)) * 0.02
    W[3] += 0.05  # a row of positive weights: the minimum is 0, not the row's own
    raw, Q = head_screen.q4k_blocks(W)
    ref = quants.dequantize(raw, GGMLQuantizationType.Q4_K)
    assert ref.shape == (40, 512)
    assert np.allclose(ref, Q.numpy(), rtol=0, atol=1e-6)
    packed = torch.from_numpy(gw.pack(gw.Q4_K, raw, 512))
    f = gw.unpack(gw.Q4_K, packed, 40, 512)
    kernel_w = (f["D"].double()[..., None] * f["q"].double().view(40, 16, 32) - f["M"].double()[..., None])
    assert (kernel_w.view(40, 512) - Q.double()).abs().max() < 1e-6
    assert (Q - W).abs().max() < 0.1 * W.abs().max()  # a 4-bit rounding of W, not something else


def test_only_gguf_heads_of_wide_types_on_whole_super_blocks_get_a_screen():
    rng = np.random.default_rng(10)
    assert head_screen.build(gw.GGUFLinear(*gw.pack_parts([(gw.Q4_K, random_blocks(gw.Q4_K, 64, 256, rng))], 256)))\
        is None  # already 4.6 bits: nothing to save
    assert head_screen.build(gw.GGUFLinear(*gw.pack_parts([(gw.Q8_0, random_blocks32(gw.Q8_0, 64, 96, rng))], 96)))\
        is None  # not whole super-blocks of 256 (SmolLM2's 576 columns)
    assert head_screen.build(torch.nn.Linear(256, 64, bias=False)) is None


def _gguf_model(vocab: int):
    cfg = _tiny_cfg()
    cfg.vocab_size = vocab
    st = _tiny_state(cfg, np.random.default_rng(11))
    return build_model(cfg, quant.cast_state(st, torch.bfloat16), torch.bfloat16, "cpu")


def test_a_model_decodes_the_same_greedy_tokens_with_its_head_screen_and_samples_from_the_whole_head(monkeypatch):
    model = _gguf_model(2048)
    prompts = [[5, 9, 300, 41], [7, 1000, 3, 3, 3, 12, 88]]

    def run(params=None):
        reqs = [Request(prompt=p, max_new_tokens=24, end_ids=[], **({"params": params} if params else {}))
                for p in prompts]
        return [list(r.tokens) for r in generate(model, reqs)]

    plain = run()
    assert model.attach_head_screen()
    calls = []
    real = head_screen.logits

    def counted(head, screen, x):  # the real screen, counted
        out = real(head, screen, x)
        calls.append(int(torch.isfinite(out).sum()))
        return out

    monkeypatch.setattr(head_screen, "logits", counted)
    assert run() == plain
    assert calls and min(calls) < 2048 * len(prompts)  # it served the greedy picks, computing a part of the rows
    calls.clear()
    sampled = run(SamplingParams(temperature=0.8, seed=3))
    assert not calls and len(sampled[0]) == 24  # a sampled request reads the whole head


def test_the_screen_is_kept_beside_the_engine_read_back_by_the_next_load_and_rebuilt_when_damaged(tmp_path):
    head = _head(gw.Q6_K, 512, 256, seed=12)
    first = head_screen.build(head, tmp_path)
    files = list(tmp_path.glob(f"{head_screen.CACHE_PREFIX}*.safetensors"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp*"))
    again = head_screen.build(head, tmp_path)  # read back, not rebuilt: the same bytes and bounds
    assert torch.equal(again.layer.qweight, first.layer.qweight) and torch.equal(again.dn, first.dn)
    x = _aimed(head, [3, 400], seed=13)
    assert torch.equal(head_screen.logits(head, again, x), head_screen.logits(head, first, x))
    files[0].write_bytes(files[0].read_bytes()[:1000])  # a damaged file is rebuilt, never used
    rebuilt = head_screen.build(head, tmp_path)
    assert torch.equal(rebuilt.layer.qweight, first.layer.qweight)
    other = _head(gw.Q6_K, 512, 256, seed=14)  # a rebuilt engine's new head: its own file, the old one gone
    head_screen.build(other, tmp_path)
    now = list(tmp_path.glob(f"{head_screen.CACHE_PREFIX}*.safetensors"))
    assert len(now) == 1 and now != files


def test_processes_that_share_weights_map_one_file_of_the_screen_and_pick_the_same_tokens(tmp_path, monkeypatch):
    from pipeline.runtime import shared

    monkeypatch.setenv("PIPELINE_SHARED_WEIGHTS", "1")
    monkeypatch.setenv("PIPELINE_LOCK_WEIGHTS", "0")
    a, b, private = _gguf_model(2048), _gguf_model(2048), _gguf_model(2048)
    assert a.attach_head_screen(tmp_path) and b.attach_head_screen(tmp_path)
    (f,) = tmp_path.glob(f"{shared.SCREEN_PREFIX}*.bin")
    assert not list(tmp_path.glob(f"{shared.PREFIX}*.bin"))  # the model's own file is not touched
    qa, qb = (m.__dict__["_head_screen"][2].layer.qweight for m in (a, b))
    assert qa.data_ptr() != qb.data_ptr() and torch.equal(qa, qb)
    assert str(f) in shared.shared_mappings()  # both screens read the file's pages
    monkeypatch.setenv("PIPELINE_SHARED_WEIGHTS", "0")
    assert private.attach_head_screen(tmp_path)
    h = torch.randn(3, a.lm_head.in_features, generator=torch.Generator().manual_seed(15)) * 4
    want = private.logits(h, greedy=True)
    assert torch.equal(a.logits(h, greedy=True), want) and torch.equal(b.logits(h, greedy=True), want)
    assert torch.equal(want.argmax(-1), private.logits(h).argmax(-1))


def test_the_roofline_counts_a_screened_head_as_the_screens_bytes():
    from pipeline.precision import read_bytes

    model = _gguf_model(2048)
    whole = read_bytes(model)
    assert model.attach_head_screen()
    screen = model.__dict__["_head_screen"][2]
    assert read_bytes(model) == whole - quant.weight_bytes(model.lm_head) + quant.weight_bytes(screen.layer)
    assert read_bytes(model) < whole
