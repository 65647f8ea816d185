"""Offline experiment: does an EAGLE-style feature draft agree with the target more than our 4-layer draft?

The draft sees the target's final normed hidden state h_t and the embedding of the next token x_{t+1}
(fused by one linear layer), runs one decoder layer (initialised from the target's last) and predicts
x_{t+2} through the target's LM head restricted to the 8192 most used tokens, trained with the soft-label
loss of `pipeline.train.draft` plus a smooth-L1 pull towards h_{t+1}. It reuses the draft-training data
`make engine` cached (the target's generations for the training prompts plus the 8 held-out ones).

    .venv/bin/python experiments/feature_draft.py [engines/smollm2] [minutes]

Prints next-token agreement on the held-out rows: step 1 (true features) and steps 2-3 (the draft's own
features chained, as when drafting k tokens). Measured 2026-11-29 (10 minutes, 1361 steps, the first
version of this script): held out
0.33 / 0.18 / 0.16, train 0.84; the 4-layer draft on the same data 0.29 (3-minute build budget).
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.runtime.engine_io import load_engine  # noqa: E402
from pipeline.runtime.model import Block, RMSNorm, apply_rope  # noqa: E402
from pipeline.train.draft import choose_vocab, forward_train, pad  # noqa: E402


class FeatureDraft(nn.Module):
    def __init__(self, target):
        super().__init__()
        cfg, H = target.cfg, target.cfg.hidden_size
        self.cfg, self.rope = cfg, target._rope
        self.embed = target.embed.weight.detach().float()  # frozen, not a parameter
        self.fc = nn.Linear(2 * H, H)
        self.blk = Block(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.zero_()
            self.fc.weight[:, :H] = torch.eye(H) * 0.5
            self.fc.weight[:, H:] = torch.eye(H) * 0.5
            last = f"layers.{cfg.num_layers - 1}."
            self.blk.load_state_dict({k[len(last):]: v.float() for k, v in target.state_dict().items()
                                      if k.startswith(last)})
            self.norm.weight.copy_(target.norm.weight.float())

    def forward(self, h, x):
        cfg, blk, D = self.cfg, self.blk, self.cfg.head_dim
        B, S, _ = h.shape
        z = self.fc(torch.cat([h, self.embed[x]], -1))
        cos, sin = self.rope(S, h.device)
        cos, sin = cos[:S][None, :, None, :].float(), sin[:S][None, :, None, :].float()
        q, k, v = blk.wqkv(blk.attn_norm(z)).split([cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D], -1)
        q = apply_rope(q.view(B, S, cfg.num_heads, D), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(B, S, cfg.num_kv_heads, D), cos, sin).transpose(1, 2)
        v = v.view(B, S, cfg.num_kv_heads, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        z = z + blk.wo(o.transpose(1, 2).reshape(B, S, -1))
        g, u = blk.w13(blk.ffn_norm(z)).chunk(2, -1)
        return self.norm(z + blk.w2(F.silu(g) * u))


def main(engine_dir: Path, minutes: float) -> None:
    torch.manual_seed(0)
    target = load_engine(engine_dir / "target", "cpu").model
    cached = sorted((engine_dir / ".draft_data").glob("*.pt"), key=lambda p: p.stat().st_mtime)
    if not cached:
        raise SystemExit(f"no cached draft data under {engine_dir / '.draft_data'}; run `make engine` first")
    data = torch.load(cached[-1])
    seqs, vals, ids, held = data["seqs"], data["vals"], data["ids"], torch.tensor(data["held"])
    S = vals.shape[1]
    tokens = pad(seqs, S)
    lens, start = torch.tensor([len(s) for s in seqs]), torch.tensor(data["prompt_lens"]) - 1
    pos = torch.arange(S)[None]
    with torch.no_grad():
        hid = torch.cat([forward_train(target, tokens[i:i + 16]) for i in range(0, len(seqs), 16)])
    generated = (pos >= start[:, None]) & (pos < lens[:, None] - 1)
    vocab = choose_vocab(vals, ids, generated, 8192, target.cfg.vocab_size, list(target.cfg.eos_token_id or []))
    remap = torch.full((target.cfg.vocab_size,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    head = target.lm_head.weight.detach().float()[vocab]
    # position t: input (h_t, x_{t+1}); label: the target's distribution over x_{t+2}; feature label h_{t+1}
    Xh, Xt, M = hid[:, :-1], tokens[:, 1:], ((pos >= start[:, None]) & (pos < lens[:, None] - 2))[:, :-1]
    TV, TI, HT = vals[:, 1:].float(), ids[:, 1:].long(), hid[:, 1:]
    m = FeatureDraft(target)
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.98))

    def agreement(rows, steps=3):
        out, h = [], Xh[rows]
        with torch.no_grad():
            for j in range(steps):
                f = m(h, Xt[rows])
                ok = vocab[F.linear(f, head).argmax(-1)] == TI[rows][..., 0]
                mm = M[rows].clone()
                mm[:, :j] = False
                out.append(round(float(ok[mm].float().mean()), 3))
                h = torch.cat([Xh[rows][:, :1], f[:, :-1]], 1)
        return out

    train, held_rows = torch.nonzero(~held).flatten(), torch.nonzero(held).flatten()
    g = torch.Generator().manual_seed(0)
    deadline, step = time.time() + 60 * minutes, 0
    while time.time() < deadline:
        rows = train[torch.randint(len(train), (8,), generator=g)]
        mm = M[rows]
        f = m(Xh[rows], Xt[rows])[mm]
        ti = remap[TI[rows][mm]]
        tv, ti = TV[rows][mm] * (ti >= 0), ti.clamp_min(0)
        ce = -(tv * torch.log_softmax(F.linear(f, head), -1).gather(1, ti)).sum(-1).mean()
        loss = ce + F.smooth_l1_loss(f, HT[rows][mm])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            print(f"step {step}: soft-label loss {ce.item():.3f}", flush=True)
    print(f"{step} steps; agreement (step 1, 2, 3) train {agreement(train[:32])} held out {agreement(held_rows)}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "engines/smollm2"), float(sys.argv[2]) if len(sys.argv) > 2 else 10)
