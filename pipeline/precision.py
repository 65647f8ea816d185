"""Speed and quality per weight precision of the target, for `bench.json`'s `precision` table.

Every precision is built in-process from the same float weights (the target engine's, or its source
when the engine itself is quantized), so the table compares precisions and nothing else:

- `tokens_per_s`: greedy batch-1 decode steps per second after the first token (the prefill is not a
  decode step and would understate the roofline; median over prompts); `end_to_end_tokens_per_s`
  counts the prefill too;
- `bytes_per_token`: weight bytes one decode step reads (the embedding is a row lookup, not counted
  unless it doubles as an unquantized tied head);
- `roofline_fraction`: decode speed over bandwidth / bytes_per_token, per decode against the bandwidth read just
  before and just after it (their mean: `per_prompt_bandwidth_gbs`), median over prompts;
  `roofline_fraction_at_median_bandwidth` puts the median speed against the median of all the readings;
- `agreement_vs_reference`: fraction of positions where this precision's argmax equals the reference's
  greedy token, teacher-forced on the reference continuation (the reference is the engine's own float
  dtype, float32 when it is float32), on the decoded prompts and `agreement_ids`' more (`agreement_prompts`,
  `agreement_positions`): 4 prompts x 64 tokens are 256 positions, too few to tell 0.99 from 0.995 (the gguf row
  read 0.988 on bench's 4 and 0.995 on 16, every miss a near-tie of the reference, 2026-12-03);
- `mean_logprob`: this precision's mean log-probability of that reference continuation.

`int4_a8` is the int4 weights with activations quantized to int8 per group at each matmul (W4A8): the same bytes as
int4, fewer instructions per weight, and the quality cost of the activation rounding shows in its agreement.

`gguf` (when the target's source is a GGUF of Q4_K / Q6_K tensors) is the GGUF's own blocks in the CPU kernels
(gguf_weights.py): its weights are exactly the dequantized GGUF the float precisions are built from, so its
agreement and log-probability measure its int8 activations only; its row adds `gguf_tensor_bytes` (the GGUF's tensors
without the token embedding, a lookup) and `bytes_vs_gguf` (its bytes_per_token over those).

Quality is never silent: a precision that loses agreement shows it next to its speed.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline import rows_per_step, sources
from pipeline.runtime import kernels, quant
from pipeline.runtime.engine_io import read_config
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.gguf_weights import RECORD, gguf_bytes, gguf_state
from pipeline.runtime.model import ModelConfig, Transformer, build_model, hf_to_runtime

PRECISIONS = ("float32", "bfloat16", "int8", "int4", "int4_a8")
FLOAT32_MAX_BYTES = 4 << 30  # a float32 copy of a larger model is left out (memory on small machines)
MEMORY_RESERVE = 2 << 30  # left free beside the table's models: the teacher-forced logits, the KV caches, the OS
# A built model's resident bytes over its weight bytes, an upper bound measured on the 1.5B (2026-12-02): bfloat16
# 0.98, int8 1.13, int4 1.45, int4_a8 1.62 (quantization leftovers, huge-page rounding), gguf 1.33. Applied to the
# reference (the largest), it bounds every variant: 1.25 x 3.55 GB = 4.4 GB against at most 3.5 GB measured.
RESIDENT_OVER_WEIGHTS = 1.25


def read_bytes(model: Transformer) -> int:
    """Bytes of weights one greedy decode step reads: a screened head (pipeline/runtime/head_screen.py) counts as its
    screen, the panels it then computes exactly left out (a few of 16 rows: 0.01% of the flagship's step)."""
    total = quant.weight_bytes(model)
    screen = model.__dict__.get("_head_screen")
    if screen is not None and screen[0] is model.lm_head:
        total += quant.weight_bytes(screen[2].layer) - quant.weight_bytes(model.lm_head)
    if isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is model.embed.weight:
        return total
    return total - model.embed.weight.numel() * model.embed.weight.element_size()


def variant(cfg: ModelConfig, state: dict[str, torch.Tensor], precision: str, group_size: int,
            gguf_path=None) -> Transformer:
    """The model at `precision`, built from float weights `state` (runtime layout); `gguf` from the GGUF's own blocks
    at `gguf_path` (norms and biases from `state`)."""
    if precision == "gguf":
        return build_model(cfg, gguf_state(state, gguf_path, cfg.num_layers, log=lambda m: None), torch.bfloat16, "cpu")
    if precision in quant.ALGOS:
        st = quant.quantize_state(state, precision, group_size, tie_embeddings=cfg.tie_embeddings)
        return build_model(cfg, st, torch.float32, "cpu", act8=precision == "int4_a8")
    return build_model(cfg, state, torch.float32 if precision == "float32" else torch.bfloat16, "cpu")


@torch.inference_mode()
def teacher_forced(model: Transformer, prompt: list[int], cont: list[int]) -> tuple[int, float]:
    """(positions where the argmax equals `cont`, summed log-probability of `cont`) in one forward."""
    seq = torch.tensor([prompt + cont])
    n = seq.shape[1]
    hidden = model(seq, torch.arange(n)[None], model.new_cache(1, n))[:, len(prompt) - 1:n - 1]
    logp = torch.log_softmax(model.logits(hidden)[0].double(), dim=-1)
    tgt = torch.tensor(cont)
    return int((logp.argmax(-1) == tgt).sum()), float(logp[torch.arange(len(cont)), tgt].sum())


def mem_available() -> int:
    """Bytes Linux says can be allocated without swapping (/proc/meminfo's MemAvailable); 0 where it does not say."""
    return quant.proc_bytes("/proc/meminfo", "MemAvailable")


def group_plan(others: list[str], budget: int, cost: int) -> tuple[list[list[str]], int]:
    """(the non-reference precisions in decode groups, how many fit in a group) when each group sits beside the
    reference in `budget` bytes and no model costs more than `cost` (the reference's). No group when not even one
    fits: the table then has the reference alone."""
    per_group = max(0, (budget - cost) // max(cost, 1))
    if per_group == 0:
        return [], 0
    return [others[i:i + per_group] for i in range(0, len(others), per_group)], per_group


def _decode_group(models: dict[str, Transformer], ids: list[list[int]], new_tokens: int, end_ids, probe,
                  probes: list[float], runs: dict) -> None:
    """Every prompt round-robin over `models`, appending (decode tokens/s, end-to-end tokens/s, tokens, bandwidth
    around it) per prompt to `runs[prec]`."""
    for model in models.values():
        generate(model, [Request(ids[0][:8], 2)])  # warm-up
    for p in ids:
        for prec, model in models.items():
            t = time.perf_counter()
            (res,) = generate(model, [Request(p, new_tokens, end_ids=end_ids)])
            e2e = len(res.tokens) / (time.perf_counter() - t)
            decode_s = res.elapsed_s - res.first_token_s
            tps = (len(res.tokens) - 1) / decode_s if len(res.tokens) > 1 and decode_s > 0 else e2e
            if probe is not None:
                probes.append(probe())
                bw = (probes[-2] + probes[-1]) / 2
            else:
                bw = probes[0]
            runs[prec].append((tps, e2e, res.tokens, bw))


def precision_table(cfg: ModelConfig, state: dict[str, torch.Tensor], ids: list[list[int]], new_tokens: int,
                    bandwidth_gbs: float | Callable[[], float], group_size: int = 128, reference: str = "float32",
                    precisions: tuple[str, ...] = PRECISIONS, end_ids: tuple[int, ...] = (),
                    log: Callable[[str], None] = print, gguf_path=None, memory_bytes: int | None = None,
                    agreement_ids: list[list[int]] = ()) -> dict:
    """`precision.<name>.{tokens_per_s, bytes_per_token, roofline_fraction, agreement_vs_reference,
    mean_logprob}` for each precision, plus the reference's name and the kernel path that ran; with `gguf_path` (a
    GGUF of Q4_K / Q6_K tensors, whose dequantized weights `state` holds) a `gguf` row too.

    `bandwidth_gbs` is a figure or a probe: a probe runs before each decode and after the last, and each decode's
    roofline uses the mean of the readings on either side of it (`bandwidth_probes_gbs` lists them all,
    `bandwidth_gbs` is their median). One reading taken at another moment had put the bf16 target at 128% of its
    roofline (29.6 GB/s read while it decoded at 38); readings a prompt apart in one bench went 57, 60, 21, 57, 51.

    `agreement_ids`: more prompts for agreement and log-probability only (the reference decodes each once; every
    precision is teacher-forced on it, one forward a prompt).

    `memory_bytes` is what the table may allocate (default: MemAvailable less MEMORY_RESERVE). The precisions are
    built in groups that fit it beside the reference, each group decoded round-robin with the reference
    (`groups`), and each `speedup_vs_reference` is against the reference's runs in its own group: every variant at
    once passed 23 GB for the 1.5B and was killed on a 24 GiB machine."""
    # float32 from bf16 weights would only widen them; a float32 copy of a large model may not fit.
    nbytes = sum(v.numel() for v in state.values()) * 4
    chosen = [p for p in precisions if p != "float32" or reference == "float32" and nbytes <= FLOAT32_MAX_BYTES]
    if gguf_path is not None and "gguf" not in chosen:
        chosen.append("gguf")
    order = [reference] + [p for p in chosen if p != reference]
    widths = sorted({cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim})
    gs4 = quant.fit_group_size(widths, group_size)
    if gs4 is None:
        order = [p for p in order if p not in ("int4", "int4_a8")]
    out: dict = {"reference": reference, "group_size": group_size, "new_tokens": new_tokens,
                 "prompts": len(ids), "kernel_path": kernels.path()}
    if gs4 is None:
        out["int4_skipped"] = f"no int4 group size in {quant.GROUP_SIZES} divides the layer widths {widths}"
    budget = memory_bytes if memory_bytes is not None else mem_available() - MEMORY_RESERVE

    def build(prec: str) -> tuple[Transformer, int]:
        before = quant.hugepage_bytes()
        model = variant(cfg, state, prec, gs4 if prec.startswith("int4") else group_size, gguf_path)
        return model, max(0, quant.hugepage_bytes() - before)

    # The prompts run round-robin over the models of a group: this machine's memory bandwidth drifts by tens of
    # percent within a minute, and timing one precision after the other put that drift into the ratios (bf16 steps
    # of 70 and 102 ms a minute apart in one process). The reference is the largest model (float32 or bfloat16;
    # the quantized ones are smaller): its resident cost bounds every other's.
    ref_model, ref_huge = build(reference)
    cost = int(quant.weight_bytes(ref_model) * RESIDENT_OVER_WEIGHTS)
    groups, per_group = group_plan(order[1:], budget, cost)
    out["memory"] = {"budget_bytes": budget, "reference_cost_bytes": cost, "per_group": per_group}
    out["groups"] = [[reference, *g] for g in groups] or [[reference]]
    if not groups and order[1:]:
        out["skipped"] = (f"{order[1:]}: not one fits beside the {reference} reference (~{cost / 1e9:.1f} GB each) "
                          f"in {budget / 1e9:.1f} GB; free memory or run bench on a larger machine")
        log(f"  precision: {out['skipped']}")
    if len(out["groups"]) > 1:
        log(f"  precision: {len(out['groups'])} groups of at most {per_group} beside the reference "
            f"({budget / 1e9:.1f} GB to use, ~{cost / 1e9:.1f} GB a model)")
    probes: list[float] = [bandwidth_gbs()] if callable(bandwidth_gbs) else [bandwidth_gbs]
    probe = bandwidth_gbs if callable(bandwidth_gbs) else None
    ref_runs: list[list[tuple]] = []  # the reference's runs, one list per group
    rows: dict = {}
    extra = []  # (prompt, the reference's greedy continuation) for agreement only
    for p in agreement_ids:
        (res,) = generate(ref_model, [Request(p, new_tokens, end_ids=end_ids)])
        extra.append((p, res.tokens))
    for group in out["groups"]:
        models = {reference: ref_model}
        huge = {reference: ref_huge}
        for prec in group[1:]:
            models[prec], huge[prec] = build(prec)
        runs: dict = {prec: [] for prec in group}
        _decode_group(models, ids, new_tokens, end_ids, probe, probes, runs)
        ref_runs.append(runs[reference])
        ref_cont = [r[2] for r in ref_runs[0]]  # greedy: the same tokens in every group
        for prec in group if len(ref_runs) == 1 else group[1:]:  # the reference's row from its first group
            rows[prec] = _row(prec, models[prec], runs[prec], runs[reference], ids, ref_cont, huge[prec],
                              gs4, gguf_path, extra)
            _log_row(log, prec, rows[prec])
        for prec in group[1:]:
            del models[prec]
        gc.collect()
    del ref_model
    gc.collect()
    if probe is not None:
        out["bandwidth_probes_gbs"] = probes
    bandwidth = statistics.median(probes)
    out["bandwidth_gbs"] = bandwidth
    out["int8_macs_per_s"] = kernels.int8_peak(0.1)["macs_per_s"] if kernels.available() else None
    for prec in order:
        if prec in rows:
            rows[prec]["roofline_fraction_at_median_bandwidth"] = (
                rows[prec]["tokens_per_s"] / (bandwidth * 1e9 / rows[prec]["bytes_per_token"]))
            rows[prec]["rows_per_step"] = rows_per_step.limits(
                rows[prec].pop("rows_per_step_ms"), rows[prec]["bytes_per_token"], macs_per_token(cfg), bandwidth,
                out["int8_macs_per_s"])
            out[prec] = rows[prec]
    return out


def _row(prec: str, model: Transformer, runs: list[tuple], ref_runs: list[tuple], ids: list[list[int]],
         ref_cont: list[list[int]], huge: int, gs4, gguf_path, extra: list[tuple] = ()) -> dict:
    """One precision's row from its runs and the reference's runs in the same group (`extra`: more (prompt,
    reference continuation) pairs for agreement and log-probability)."""
    agree = total = 0
    logp = 0.0
    for p, c in [*zip(ids, ref_cont), *extra]:
        if not c:
            continue
        a, lp = teacher_forced(model, p, c)
        agree, total, logp = agree + a, total + len(c), logp + lp
    b = read_bytes(model)
    tps = [r[0] for r in runs]
    around = [r[3] for r in runs]
    row = {"tokens_per_s": statistics.median(tps), "end_to_end_tokens_per_s": statistics.median(r[1] for r in runs),
           "per_prompt_tokens_per_s": tps, "per_prompt_bandwidth_gbs": around,
           "speedup_vs_reference": statistics.median(x / r[0] for x, r in zip(tps, ref_runs)),
           "bytes_per_token": b, "hugepage_bytes": huge,
           **({"group_size": gs4} if prec.startswith("int4") else {}),
           "roofline_fraction": statistics.median(s * b / (g * 1e9) for s, g in zip(tps, around)),
           "agreement_vs_reference": agree / max(total, 1), "mean_logprob": logp / max(total, 1),
           "agreement_prompts": len(ids) + len(extra), "agreement_positions": total}
    row["rows_per_step_ms"] = rows_per_step.step_ms(model)  # issue 51: 1..32 token rows per step
    if prec == "gguf":
        tensors, embd = gguf_bytes(gguf_path)
        row.update(gguf_tensor_bytes=tensors - embd, bytes_vs_gguf=b / (tensors - embd), kernel_path=kernels.path())
    return row


def _log_row(log, prec: str, row: dict) -> None:
    log(f"  {prec:9s} {row['tokens_per_s']:7.2f} tokens/s  {row['bytes_per_token'] / 1e6:8.1f} MB/token  roofline "
        f"{row['roofline_fraction']:.2f}  agreement {row['agreement_vs_reference']:.3f}  "
        f"mean logprob {row['mean_logprob']:.3f}")


def gguf_source(spec):
    """The target's GGUF file when its tensors are all Q4_K / Q6_K (the `gguf` precision can be built), else None."""
    try:
        src = sources.resolve(spec.target.source, Path(spec.root))
    except sources.SourceError:
        return None
    if src.kind != "gguf":
        return None
    from gguf import GGUFReader  # lazy: the gguf package (~0.1 s) only when the target is a GGUF

    kinds = {int(t.tensor_type) for t in GGUFReader(str(src.path)).tensors
             if len(t.shape) == 2 and t.name != "token_embd.weight"}
    return src.path if kinds <= set(RECORD) else None


def engine_float_state(engine_dir, spec) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(config, float weights in runtime layout, reference dtype) for the target engine in `engine_dir`.

    A quantized engine no longer holds float weights: they are read again from `target.source`.
    """
    cfg = read_config(engine_dir, verify=False)
    mcfg = ModelConfig(**cfg["runtime"]["model"])
    ref = cfg["pretrained_config"]["dtype"]
    state = load_file(str(engine_dir / "model.safetensors"))
    if any(k.endswith((".qweight", ".gguf_w")) for k in state):
        hf_cfg, hf_state, _ = sources.load_hf(sources.resolve(spec.target.source, Path(spec.root)))
        state = hf_to_runtime(hf_state, mcfg)
        del hf_state  # its unfused q / k / v / gate / up copies: GBs for the 1.5B
    if mcfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    ref = ref if ref in ("float32", "bfloat16") else "float32"
    if ref == "bfloat16":
        narrow_layers(state)
    return mcfg, state, ref


def narrow_layers(state: dict[str, torch.Tensor]) -> None:
    """In place: a bfloat16 reference's layer matrices to bfloat16, as the engine build casts them before it
    quantizes (norms, biases and the embedding stay float32): half of the 1.5B's 6.2 GB of float32 layers. Not
    enough on its own: the precision table, every variant built at once, still passed 23 GB and was killed on a
    24 GiB machine (2026-12-02)."""
    for k, v in state.items():
        if v.dim() == 2 and v.dtype == torch.float32 and not k.startswith("embed."):
            state[k] = v.to(torch.bfloat16)


def macs_per_token(cfg) -> int:
    """Multiply-adds of one token's forward through the decoder's projections and the full output head (attention
    over the context is left out: a few percent at bench's 128-token context)."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * layer + h * cfg.vocab_size
