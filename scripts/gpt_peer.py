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

With --train DIR it trains instead, as train_gpt does with its defaults, on the token shards in DIR
(llm.c's format, scripts/example-data.sh; files whose name contains "val" validate): --iters steps
on random (block + 1)-token windows of the train stream (seeded), learning rate warmed up linearly
for --warmup steps then cosine to --min-lr, and reports the validation loss defined as train_gpt's
--eval-only: the mean per-token cross-entropy over the first eval-iters x batch consecutive,
non-overlapping block-token windows of the validation stream.

  python scripts/gpt_peer.py --train build/data/shakespeare --iters 2000 --seed 1
"""
import argparse
import json
import math
import pathlib
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


def read_shard(path):
    """The uint16 tokens of an llm.c token shard (header: 256 int32, magic 20240520, version, count)."""
    data = pathlib.Path(path).read_bytes()
    header = torch.frombuffer(bytearray(data[:1024]), dtype=torch.int32)
    if header[0].item() != 20240520:
        raise SystemExit(f"{path}: magic {header[0].item()} (expected 20240520, an llm.c token shard)")
    count = header[2].item()
    tokens = torch.frombuffer(bytearray(data[1024:1024 + 2 * count]), dtype=torch.uint16)
    if tokens.numel() != count:
        raise SystemExit(f"{path}: {tokens.numel()} tokens (expected {count})")
    return tokens.to(torch.int64)


def evaluate(model, val, windows, block):
    model.eval()
    with torch.no_grad():
        total = 0.0
        for start in range(0, windows, 64):
            n = min(64, windows - start)
            rows = torch.stack([val[(start + i) * block:(start + i) * block + block + 1] for i in range(n)])
            total += model(rows[:, :-1], rows[:, 1:]).item() * n
    model.train()
    return total / windows


def train(args, cfg, model, opt):
    files = sorted(pathlib.Path(args.train).glob("*.bin"))
    train_tokens = torch.cat([read_shard(f) for f in files if "val" not in f.name])
    val_tokens = torch.cat([read_shard(f) for f in files if "val" in f.name])
    b, t = cfg["batch_size"], cfg["block_size"]
    windows = args.eval_iters * b
    if (windows * t + 1) > val_tokens.numel():
        raise SystemExit(f"{windows} validation windows of {t} tokens need {windows * t + 1} tokens "
                         f"(the validation split has {val_tokens.numel()})")
    generator = torch.Generator().manual_seed(args.seed)
    start_time = time.perf_counter()
    for it in range(args.iters):
        if it < args.warmup:
            lr = args.lr * (it + 1) / args.warmup
        else:
            r = min(1.0, (it - args.warmup) / max(1, args.iters - args.warmup))
            lr = args.min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (args.lr - args.min_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(train_tokens.numel() - t, (b,), generator=generator)
        rows = torch.stack([train_tokens[s:s + t + 1] for s in starts.tolist()])
        loss = model(rows[:, :-1], rows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    seconds = time.perf_counter() - start_time
    print(json.dumps({
        "program": "pytorch", "config": args.config, **cfg, "threads": args.threads, "seed": args.seed,
        "iters": args.iters, "train_loss": round(loss.item(), 4), "val_loss": evaluate(model, val_tokens, windows, t),
        "eval_windows": windows, "tokens_per_s": round(args.iters * b * t / seconds, 1), "torch": torch.__version__,
    }))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="nano")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60, help="timed steps")
    parser.add_argument("--warmup", type=int,
                        help="untimed steps first (default 3); with --train, the learning rate's warm-up steps "
                             "(default 100, as train_gpt)")
    parser.add_argument("--train", metavar="DIR", help="train on the token shards in DIR instead of timing steps")
    parser.add_argument("--iters", type=int, default=2000, help="--train: training steps")
    parser.add_argument("--seed", type=int, default=1337, help="--train: seed of the weights and the windows")
    parser.add_argument("--lr", type=float, default=1e-3, help="--train: peak learning rate")
    parser.add_argument("--min-lr", type=float, default=1e-4, help="--train: learning rate at the end of the cosine")
    parser.add_argument("--eval-iters", type=int, default=50, help="--train: validation batches")
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = 100 if args.train else 3
    torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    torch.manual_seed(args.seed if args.train else 0)
    model = GPT(cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["block_size"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    if args.train:
        return train(args, cfg, model, opt)
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
