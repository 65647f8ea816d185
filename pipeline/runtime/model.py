"""A compact Llama-family transformer with a static KV cache where position is the only state.

One call, `Transformer.forward`, serves prefill, single-token decode, k+1-token verification and
tree verification: the caller passes per-row positions (RoPE), per-row cache slots (where K/V is
written) and, for trees, an explicit attention mask. Rows of a batch advance independently.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.runtime import head_screen, kernels, shared
from pipeline.runtime.gguf_weights import GGUFLinear
from pipeline.runtime.kernels import linear
from pipeline.runtime.quant import QLinear, tile_model, to_hugepages, untile_model

FAMILIES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: list[int] | None = None
    # Qwen2 adds a bias to the q, k and v projections (Llama-family blocks otherwise).
    qkv_bias: bool = False
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Read a transformers Llama/Mistral/Qwen2 config dict; refuse features this runtime does not implement."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is not supported by the torch runtime; "
                             f"it runs {', '.join(FAMILIES)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise ValueError(f"rope type {rope} is not supported by the torch runtime; "
                             "use a model without rope scaling")
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        if cfg.get("mlp_bias") or cfg.get("attention_bias"):
            raise ValueError("mlp_bias / attention_bias (biases on o_proj and the MLP) are not supported by the "
                             "torch runtime; Qwen2's q/k/v biases are")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window: true) is not supported by the torch "
                             "runtime; use a checkpoint with use_sliding_window: false")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[eos] if isinstance(eos, int) else eos,
            qkv_bias=model_type == "qwen2",
            model_type=model_type,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


def rope_tables(cfg: ModelConfig, length: int, device=None) -> tuple[Tensor, Tensor]:
    """cos/sin tables [length, head_dim] in the half-rotation layout Hugging Face checkpoints use."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    t = torch.arange(length, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class KVCache:
    """Static per-layer K/V buffers [B, H_kv, S_max, D]; writes are indexed by slot, nothing else is tracked."""

    def __init__(self, cfg: ModelConfig, batch: int, length: int, dtype: torch.dtype, device):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = length
        self.batch = batch

    def rows(self, start: int, stop: int) -> KVCache:
        """Batch rows [start, stop) as a cache sharing this one's storage (each layer's block stays contiguous)."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.length, view.batch = self.length, stop - start
        return view

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def resized(self, batch: int, length: int, keep_rows: int, keep_slots: int) -> KVCache:
        """A cache of `batch` rows x `length` slots holding this one's first `keep_rows` rows' slots [0, keep_slots)."""
        new = object.__new__(KVCache)
        shape = (self.k.shape[0], batch, self.k.shape[2], length, self.k.shape[4])
        new.k = torch.zeros(shape, dtype=self.k.dtype, device=self.k.device)
        new.v = torch.zeros(shape, dtype=self.v.dtype, device=self.v.device)
        new.length, new.batch = length, batch
        r, s = min(keep_rows, batch, self.batch), min(keep_slots, length, self.length)
        new.k[:, :r, :, :s] = self.k[:, :r, :, :s]
        new.v[:, :r, :, :s] = self.v[:, :r, :, :s]
        return new

    def copy_row(self, row: int, src: KVCache, src_row: int, n: int) -> None:
        """Slots [0, n) of `src`'s row `src_row` into this cache's row `row` (a request moving between caches)."""
        self.k[:, row, :, :n] = src.k[:, src_row, :, :n]
        self.v[:, row, :, :n] = src.v[:, src_row, :, :n]

    def compact(self, rows: Tensor, src: Tensor, dst: Tensor) -> None:
        """Copy slots `src` [n, m] to `dst` [n, m] for batch rows `rows` [n] in every layer (tree acceptance)."""
        r = rows[:, None]
        for buf in (self.k, self.v):
            picked = buf[:, r, :, src]
            buf[:, r, :, dst] = picked


_observer = None  # linear_input_power's: called with (input, weight) before each linear of the torch path


def _linear(x: Tensor, w) -> Tensor:
    if _observer is not None:
        _observer(x, w)
    return linear(x, w)


@torch.inference_mode()
def linear_input_power(model: Transformer, seqs: list[list[int]]) -> dict[str, Tensor]:
    """The mean square of each input column of every linear layer (head included), keyed by the layer's name
    ("layers.3.w13", "lm_head"), over every position of `seqs` run through the model's torch path: how much each
    column's rounding error moves the layer's outputs, which quant.quantize_int4 weighs its scale search by."""
    global _observer
    names = {id(wt(mod)): name for name, mod in model.named_modules() if isinstance(mod, (nn.Linear, QLinear))}
    sums: dict[str, Tensor] = {}
    count = 0

    def observe(x: Tensor, w) -> None:
        name = names.get(id(w))
        if name is not None:
            sq = x.detach().reshape(-1, x.shape[-1]).double().square().sum(0)
            sums[name] = sq if name not in sums else sums[name] + sq
    _observer = observe
    try:
        for seq in seqs:
            cache = model.new_cache(1, (len(seq) + 63) // 64 * 64)
            model.logits(model(torch.tensor([seq]), torch.arange(len(seq))[None], cache))
            count += len(seq)
    finally:
        _observer = None
    return {name: (v / max(count, 1)).float() for name, v in sums.items()}


def _tensor(mod: nn.Module, name: str) -> Tensor | None:
    """A module's parameter or buffer `name` (None when it has neither), without nn.Module.__getattr__."""
    d = mod.__dict__
    t = d["_parameters"].get(name)
    return t if t is not None else d["_buffers"].get(name)


def wt(layer: nn.Module):
    """What the kernels multiply by: a QLinear itself (decoded in registers) or a plain layer's weight."""
    return layer if isinstance(layer, QLinear) else layer.weight


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wqkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q, cfg.hidden_size, bias=False)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def fast(self, x: Tensor, pos: Tensor, slots: Tensor, tables: tuple[Tensor, Tensor], kc: Tensor, vc: Tensor,
             mask: Tensor, kv_len: int) -> Tensor:
        """The same layer as `forward` in one C call, for fp32 CPU inference steps (x is updated in place).

        The call's plan (weight pointers and shapes) is built once; its addresses are checked again only after
        `kernels.weights_moved()` (or a replaced submodule), and it is rebuilt when they changed."""
        kernels.decoder_layer(self.plan(), x, pos, slots, *tables, kc, vc, mask, kv_len)
        return x

    def plan(self) -> kernels.LayerPlan:
        """This layer's kernel plan, rebuilt when its weights moved (`kernels.weights_moved`)."""
        cached = self.__dict__.get("_plan")
        if cached is None or cached[0] != kernels.weights_epoch():
            cached = self.__dict__["_plan"] = self._build_plan(cached)
        return cached[2]

    def _build_plan(self, cached: tuple | None) -> tuple:
        """(epoch, weight key, plan, what keeps the plan's memory alive), rebuilt when the weight addresses changed.

        The plan holds the tensors it points into (a Parameter's storage by an alias, which outlives `.data =`),
        so even a move nobody reported (`kernels.weights_moved`) can never make it read freed memory."""
        key = self._weight_key()
        if cached is not None and cached[1] == key:
            return (kernels.weights_epoch(), *cached[1:])
        cfg = self.cfg
        parts = (wt(self.wqkv), wt(self.wo), wt(self.w13), wt(self.w2), self.wqkv.bias, self.attn_norm.weight,
                 self.ffn_norm.weight)
        plan = kernels.layer_plan(*parts, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        keep = tuple(t for p in parts if p is not None
                     for t in ((p.qweight, p.scales) if isinstance(p, QLinear) else (p.detach(),)))
        return kernels.weights_epoch(), key, plan, keep

    def __setattr__(self, name: str, value) -> None:
        # A replaced submodule or weight: this plan is rebuilt at the next step, and the model's array of plans too.
        if self.__dict__.pop("_plan", None) is not None:
            kernels.weights_moved()
        super().__setattr__(name, value)

    def _weight_key(self) -> tuple[int, ...]:
        """The addresses of the tensors a plan points into, read straight from the modules' tables (through nn.Module
        attribute lookups, every step, the Python around the 0.5B draft's layers had taken 1.02 ms; 0.26 after)."""
        mods, key = self._modules, []
        for name in ("wqkv", "wo", "w13", "w2"):
            lin = mods[name]
            names = ("qweight", "scales") if isinstance(lin, QLinear) else ("weight",)
            key += (_tensor(lin, n).data_ptr() for n in names)
        for mod, name in ((mods["wqkv"], "bias"), (mods["attn_norm"], "weight"), (mods["ffn_norm"], "weight")):
            t = _tensor(mod, name)
            key.append(0 if t is None else t.data_ptr())
        return tuple(key)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor, rows: Tensor,
                slots: Tensor, mask: Tensor, kv_len: int) -> Tensor:
        cfg = self.cfg
        B, S, _ = x.shape
        D = cfg.head_dim
        Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
        qkv = _linear(self.attn_norm(x), wt(self.wqkv))
        if self.wqkv.bias is not None:
            qkv = qkv + self.wqkv.bias.to(qkv.dtype)
        qkv = qkv.view(B, S, Hq + 2 * Hkv, D)
        qk = apply_rope(qkv[:, :, : Hq + Hkv], cos, sin)
        q = qk[:, :, :Hq].transpose(1, 2)
        kc[rows, :, slots] = qk[:, :, Hq:].to(kc.dtype)
        vc[rows, :, slots] = qkv[:, :, Hq + Hkv:].to(vc.dtype)
        keys, values = kc[:, :, :kv_len].to(q.dtype), vc[:, :, :kv_len].to(q.dtype)
        if kc.dtype == kernels.KV_DTYPE and q.dtype == torch.float32:
            o = _bf16_attention(q, keys, values, mask)
        else:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        x = x + _linear(o.transpose(1, 2).reshape(B, S, Hq * D), wt(self.wo))
        gate, up = _linear(self.ffn_norm(x), wt(self.w13)).chunk(2, dim=-1)
        return x + _linear(F.silu(gate) * up, wt(self.w2))


def _bf16_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """The C attention's numerics in torch ops (the K/V cache bf16): q and the softmax weights rounded to bf16 as the
    kernel rounds them, so the two paths differ by summation order only. q [B, Hq, S, D], keys/values [B, Hkv, L, D]
    (bf16 values in fp32), mask [B, 1, S, L] (True = attend)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = (q.to(torch.bfloat16).float() @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights.to(torch.bfloat16).float() @ values


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # nn.Embedding's own init (normal_) on the meta device, where build_model constructs, runs torch's Python
        # reference op and so imports torch._dynamo: 2.4 s of every process that loads an engine (each server stub).
        # The same draw, skipped on meta only (build_model assigns the weights).
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._rope_len = 0

    def _apply(self, fn, recurse: bool = True):
        kernels.weights_moved()  # .to(), .float(), .bfloat16() give the weights new memory
        probe = fn(torch.empty(0, dtype=torch.bfloat16, device=self.embed.weight.device))
        if probe.dtype == torch.bfloat16 and probe.device == self.embed.weight.device:
            return super()._apply(fn, recurse)  # tiled layers stay as they are
        # Another dtype or device: tiles are a layout of the CPU kernels, so the layers go back to row-major first
        # (and are tiled again if they are still on CPU).
        untile_model(self, self.cfg.tie_embeddings)
        out = super()._apply(fn, recurse)
        if self.embed.weight.device.type == "cpu" and kernels.available():
            tile_model(self)
        return out

    def load_state_dict(self, *args, **kwargs):
        kernels.weights_moved()  # assign=True replaces the tensors
        return super().load_state_dict(*args, **kwargs)

    def _rope(self, length: int, device) -> tuple[Tensor, Tensor]:
        if length > self._rope_len:
            n = 1 << max(10, math.ceil(math.log2(length)))
            self.rope_cos, self.rope_sin = rope_tables(self.cfg, n, device)
            self._rope_len = n
        return self.rope_cos, self.rope_sin

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activations are fp32 on CPU (the KV cache bf16: kv_dtype); bf16 / int4 matmuls round them to bf16."""
        p = self.embed.weight
        return torch.float32 if p.device.type == "cpu" else p.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The K/V cache's dtype: bf16 on CPU (the kernels' cache, kernels.KV_DTYPE: half the bytes, attention in bf16
        dot products), else the compute dtype."""
        return kernels.KV_DTYPE if self.embed.weight.device.type == "cpu" else self.compute_dtype

    def new_cache(self, batch: int, length: int) -> KVCache:
        return KVCache(self.cfg, batch, length, self.kv_dtype, self.embed.weight.device)

    def forward(self, tokens: Tensor, pos: Tensor, cache: KVCache, *, slots: Tensor | None = None,
                mask: Tensor | None = None, kv_len: int | None = None) -> Tensor:
        """Run new tokens [B, S] at RoPE positions `pos` [B, S]; return normed hidden states [B, S, H].

        K/V go to cache `slots` (default: `pos`). Without `mask`, a query sees every slot up to its
        own: stale entries past a row's position are invisible, so rejecting drafts costs nothing.
        `mask` [B, S, kv_len] (True = attend) overrides that for trees. `kv_len` bounds the slots
        read; it defaults to one past the largest slot written.
        """
        top = int(pos.max()) + 1
        if slots is None:
            slots, kv_len = pos, top if kv_len is None else kv_len
        elif kv_len is None:
            kv_len = int(slots.max()) + 1
        cos, sin = self._rope(top, tokens.device)
        if _observer is None and kernels.fast_path(tokens) and self.norm.weight.dtype == torch.float32:
            # As few torch ops as possible: after a step's weights have streamed by, each costs tens of us.
            x = self.embed(tokens).float().contiguous()
            pos64, slots64 = pos.contiguous().long(), slots.contiguous().long()
            m8 = None if mask is None else mask.contiguous().to(torch.uint8)
            plans = self.__dict__.get("_plans")
            if plans is None or plans[0] != kernels.weights_epoch():
                layer_plans = [layer.plan() for layer in self.layers]
                plans = self.__dict__["_plans"] = (kernels.weights_epoch(), kernels.plan_array(layer_plans),
                                                   layer_plans)
            kernels.decoder_layers(plans[1], len(plans[2]), x, pos64, slots64, cos, sin, cache.k, cache.v, m8, kv_len)
            return kernels.rmsnorm(x, self.norm.weight, self.norm.eps)
        if mask is None:
            mask = torch.arange(kv_len, device=tokens.device)[None, None, :] <= slots[:, :, None]
        mask = mask[:, None]
        cos, sin = cos[pos][:, :, None, :], sin[pos][:, :, None, :]
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        x = self.embed(tokens).to(self.compute_dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), cache.k[i], cache.v[i], rows, slots, mask, kv_len)
        return self.norm(x)

    def logits(self, hidden: Tensor, greedy: bool = False) -> Tensor:
        """fp32 logits of hidden states [..., H]. `greedy`: the caller takes only each row's argmax, so a head with a
        screen (attach_head_screen) computes exactly only the rows that could be it, -inf elsewhere."""
        screen = self.__dict__.get("_head_screen")
        if (greedy and screen is not None and screen[0] is self.lm_head and _observer is None
                and screen[1] == self.lm_head.qweight.data_ptr()):
            return head_screen.logits(self.lm_head, screen[2], hidden)
        return _linear(hidden, wt(self.lm_head)).float()

    def attach_head_screen(self, cache_dir=None) -> bool:
        """Give a GGUF head of a screened type its Q4_K screen (pipeline/runtime/head_screen.py; kept in `cache_dir`,
        the engine's directory, when given), for greedy logits; False where the head has none. A head replaced or
        moved later is read whole again (the screen names the module and its weights' address)."""
        screen = head_screen.build(self.lm_head, cache_dir)
        if screen is None:
            self.__dict__.pop("_head_screen", None)
            return False
        if shared.enabled() and cache_dir is not None and screen.layer.qweight.device.type == "cpu":
            shared.share_weights(screen.layer, cache_dir, shared.SCREEN_PREFIX)  # one copy for Triton's two stubs
        else:
            to_hugepages(screen.layer)
        self.__dict__["_head_screen"] = (self.lm_head, self.lm_head.qweight.data_ptr(), screen)
        return True


def hf_to_runtime(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Map a transformers Llama state dict to this runtime's layout (fused QKV and gate/up)."""
    out = {"embed.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn_norm.weight"] = state[p + "input_layernorm.weight"]
        out[f"layers.{i}.ffn_norm.weight"] = state[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.wqkv.weight"] = torch.cat(
            [state[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")], dim=0)
        if cfg.qkv_bias:
            out[f"layers.{i}.wqkv.bias"] = torch.cat(
                [state[p + f"self_attn.{n}_proj.bias"] for n in ("q", "k", "v")], dim=0)
        out[f"layers.{i}.wo.weight"] = state[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.w13.weight"] = torch.cat(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]], dim=0)
        out[f"layers.{i}.w2.weight"] = state[p + "mlp.down_proj.weight"]
    return out


def runtime_to_hf(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Inverse of hf_to_runtime, for saving trained drafts as ordinary Hugging Face checkpoints."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    out["lm_head.weight"] = state.get("lm_head.weight", state["embed.weight"])
    for i in range(cfg.num_layers):
        p, r = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = state[r + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = state[r + "ffn_norm.weight"]
        wq, wk, wv = state[r + "wqkv.weight"].split([q, kv, kv], dim=0)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = wq, wk
        out[p + "self_attn.v_proj.weight"] = wv
        if cfg.qkv_bias:
            bq, bk, bv = state[r + "wqkv.bias"].split([q, kv, kv], dim=0)
            out[p + "self_attn.q_proj.bias"], out[p + "self_attn.k_proj.bias"] = bq, bk
            out[p + "self_attn.v_proj.bias"] = bv
        out[p + "self_attn.o_proj.weight"] = state[r + "wo.weight"]
        gate, up = state[r + "w13.weight"].chunk(2, dim=0)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = state[r + "w2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def float_state(model: nn.Module) -> dict[str, Tensor]:
    """`model.state_dict()` with each QLinear's `qweight` + `scales` replaced by its matrix as `weight` (tiled bf16:
    the row-major bf16 weight it was loaded from; int8 / int4: dequantized fp32), for code that wants plain weights."""
    state = model.state_dict()
    for name, mod in model.named_modules():
        if isinstance(mod, QLinear):
            del state[name + ".qweight"], state[name + ".scales"]
            state.pop(name + ".parts", None)  # a GGUF layer's part table (gguf_weights.GGUFLinear)
            state[name + ".weight"] = mod.weight.contiguous()
    return state


def device_type(device) -> str:
    return torch.device(device).type


def build_model(cfg: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, device,
                act8: bool = False, hugepages: bool = True) -> Transformer:
    """Construct on the meta device and assign weights, so nothing is initialised twice.

    Quantized linears (`P.qweight` + `P.scales`, see quant.py) become QLinear layers and keep their
    storage dtype; a quantized head is never tied to the embedding (the embedding stays for lookup). `act8`: int4
    linears quantize their activations to int8 (W4A8, an engine whose quant_algo is W4A8). On CPU the linears are laid
    out for the kernels (quant.tile_model: W4A8 in 16-row blocks; bf16, int8 and int4 tiled where `kernels.tiles()`);
    `float_state` gives back plain weights. `hugepages=False` leaves the weights where they are (the caller shares
    them: pipeline/runtime/shared.py).
    """
    if device_type(device) == "cpu" and dtype == torch.float16:
        raise ValueError("dtype float16: the CPU kernels and fp32 activations of the torch runtime do not run fp16 "
                         "weights (they give NaN); use dtype: bfloat16 (same size) or float32 on device: cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    ggufs = sorted(k[: -len(".gguf_w")] for k in state if k.endswith(".gguf_w"))
    for prefix in ggufs:  # the GGUF's own weights (gguf_weights.py)
        parent, _, leaf = prefix.rpartition(".")
        bias = state.get(prefix + ".bias")
        layer = GGUFLinear(state[prefix + ".gguf_w"], state[prefix + ".gguf_parts"],
                           None if bias is None else bias.to(device, torch.float32))
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    quantized = sorted(k[: -len(".qweight")] for k in state if k.endswith(".qweight"))
    for prefix in quantized:
        parent, _, leaf = prefix.rpartition(".")
        q, sc = state[prefix + ".qweight"].to(device), state[prefix + ".scales"].to(device)
        bias = state.get(prefix + ".bias")
        layer = QLinear(q, sc, None if bias is None else bias.to(device, torch.float32),
                        act8=act8 and q.dtype == torch.uint8)
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    skip = {p + s for p in quantized for s in (".qweight", ".scales", ".bias")}
    skip |= {p + s for p in ggufs for s in (".gguf_w", ".gguf_parts", ".bias", ".qweight", ".scales", ".parts")}
    quantized += ggufs
    # Norm weights and biases stay fp32 whatever the weight dtype: they are tiny and the CPU kernels read fp32. So does
    # the embedding of a model on GGUF weights: its rows are the GGUF's values, a lookup, never rounded to bf16.
    state = {k: v.to(device=device, dtype=torch.float32 if ("norm" in k or k.endswith(".bias") or ggufs and
                                                            k == "embed.weight") and device_type(device) == "cpu"
                     else dtype)
             for k, v in state.items() if k not in skip}
    tied_head = cfg.tie_embeddings and "lm_head" not in quantized
    if tied_head:
        state.setdefault("lm_head.weight", state["embed.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (tied_head and m == "lm_head.weight") and m not in skip]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tied_head:
        model.lm_head.weight = model.embed.weight
    del state
    if device_type(device) == "cpu":
        if kernels.available():
            tile_model(model)
        if hugepages:
            to_hugepages(model)
    return model.eval().requires_grad_(False)


PREFILL_TOKENS = 2048  # tokens (all rows) of one prefill forward: bounds the kernels' per-layer scratch (the 1.5B's
# fused gate/up output alone is 70 KB a token) on long prompts and wide admissions


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, prompts: list[list[int]], starts: list[int] | None = None,
            chunk: int | None = None) -> Tensor:
    """Run the prompts (row b from token `starts[b]`, its slots before that already filled, e.g. by the prompt
    cache) in forwards of at most `chunk` tokens per row (default: PREFILL_TOKENS over the rows, at least 64);
    return each row's last hidden state [B, H].

    Shorter rows are padded at the slots after their end (never read before a real token overwrites them); the
    kernels give every token the same bits whatever the chunking and padding, so this equals one whole forward."""
    dev = model.embed.weight.device
    starts = starts or [0] * len(prompts)
    B = len(prompts)
    S = max(len(p) - s for p, s in zip(prompts, starts, strict=True))
    tokens = torch.zeros(B, S, dtype=torch.long)
    for b, (p, s) in enumerate(zip(prompts, starts)):
        tokens[b, : len(p) - s] = torch.tensor(p[s:], dtype=torch.long)
    pos = (torch.tensor(starts)[:, None] + torch.arange(S)[None]).clamp_max(cache.length - 1)
    last = [len(p) - s - 1 for p, s in zip(prompts, starts)]
    out = None
    chunk = max(1, chunk or max(64, PREFILL_TOKENS // B))
    for c in range(0, S, chunk):
        hidden = model(tokens[:, c:c + chunk].to(dev), pos[:, c:c + chunk].to(dev), cache)
        if out is None:
            out = torch.empty(B, hidden.shape[-1], dtype=hidden.dtype, device=dev)
        for b, i in enumerate(last):
            if c <= i < c + chunk:
                out[b] = hidden[b, i - c]
    return out
