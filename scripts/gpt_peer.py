#!/usr/bin/env python3
"""The PyTorch peer of bench_gpt: the same GPT training step, timed the same way.

Model (GPT-2 architecture, as nn::gpt builds it): token + learned position embedding; n_layer
pre-LN blocks x + proj(causal attention(LN(x))) with one fused qkv Linear (q|k|v) and
F.scaled_dot_product_attention(is_causal=True), x + Linear(GELU_tanh(Linear(LN(x)))) with 4C
hidden; final LayerNorm; LM head tied to the token embedding; biases on, no dropout; GPT-2 init.
Step: forward, mean per-token cross-entropy, backward, clip_grad_norm_(1.0), torch.optim.AdamW
(lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on 2-D weights), eager, float32, CPU.
Batches: random token windows (vocab 256) from a pool of 8, used in turn, as bench_gpt does.
Timing: every step after `--warmup` is timed alone with time.perf_counter; tokens_per_s is
batch * block / the median step time (robust to other load on the machine).

  python scripts/gpt_peer.py --config nano --threads 1 --steps 60

Prints one JSON line: config, threads, tokens_per_s, step_ms (median), steps, params, torch.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {  # bench_gpt's shapes
    "nano": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12),
    "gpt2s": dict(n_layer=12, n_head=12, n_embd=768, block_size=256, batch_size=4),
}
VOCAB = 256
POOL = 8


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn_qkv = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(c, dim=2)
        heads = [z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        residual_std = 0.02 / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("attn_proj.weight", "mlp_proj.weight")):
                nn.init.normal_(p, 0.0, residual_std)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, ids, targets):
        t = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="nano")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    model = GPT(cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["block_size"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    b, t = cfg["batch_size"], cfg["block_size"]
    windows = torch.randint(VOCAB, (POOL, b, t + 1), generator=torch.Generator().manual_seed(7))
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        window = windows[step % POOL]
        loss = model(window[:, :-1], window[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
    step_s = statistics.median(times)
    print(json.dumps({
        "program": "pytorch", "config": args.config, **cfg, "threads": args.threads,
        "tokens_per_s": round(b * t / step_s, 1), "step_ms": round(step_s * 1e3, 3), "steps": len(times),
        "params": sum(p.numel() for p in model.parameters()), "loss": round(loss.item(), 4),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
