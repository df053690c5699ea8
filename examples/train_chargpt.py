#!/usr/bin/python3
"""A character-level GPT trained on the licence texts Debian ships (/usr/share/common-licenses,
package base-files, on every Debian system), written as a torch DDP script: the two lines marked
"Poseidon" are the whole change from DistributedDataParallel.

    poseidon run -n 2 -- /usr/bin/python3 examples/train_chargpt.py [--steps 300]
    # the same script on torch DDP over gloo (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set,
    # e.g. by torchrun or bench/zoo/zoo_bench.py):
    /usr/bin/python3 examples/train_chargpt.py --backend ddp

Every rank draws its own random windows of the text each step; gradients are averaged over the
ranks when backward returns (clip_grad_norm_ sees the averaged gradients), AdamW with parameter
groups and a cosine schedule steps. Rank 0 shows a progress bar, the loss, tokens per second
(all ranks together) and, at the end, a sample of generated text.
"""
import argparse
import glob
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety
    tqdm = None

TEXTS = "/usr/share/common-licenses"


class TinyGpt(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm TransformerEncoderLayers with
    a causal mask (nn.MultiheadAttention: in_proj_weight, and out_proj, whose forward never runs),
    a final LayerNorm and an nn.Linear head on [batch, tokens, features]."""

    def __init__(self, vocab, width=64, heads=4, layers=2, context=16, ff=None, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(1, context, width))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, ff or 4 * width, dropout=dropout,
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:, :t]
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t])
        return self.head(self.norm(x))


def adamw_groups(model, lr, weight_decay=0.1):
    """AdamW with parameter groups: decay on matrices, none on biases, norms and embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "tok" not in name and "pos" not in name else no_decay).append(p)
    return torch.optim.AdamW([dict(params=decay, weight_decay=weight_decay),
                              dict(params=no_decay, weight_decay=0.0)], lr=lr, betas=(0.9, 0.95))


def load_text():
    parts = []
    for path in sorted(glob.glob(os.path.join(TEXTS, "*"))):
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    if not parts:
        raise SystemExit(f"no texts under {TEXTS} (Debian's base-files package ships them)")
    text = "\n".join(parts)
    chars = sorted(set(text))
    return text, chars


@torch.no_grad()
def generate(model, start, steps, context, temperature=0.8, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = start.clone()
    for _ in range(steps):
        logits = model(idx[:, -context:])[:, -1] / temperature
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="sequences per worker and step")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--backend", choices=["poseidon", "ddp"], default="poseidon")
    ap.add_argument("--sample", type=int, default=300, help="characters to generate at the end")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args()

    if args.backend == "poseidon":
        import poseidon
        import poseidon.torch
        poseidon.init()                                                    # Poseidon (1 of 2)
        rank, world = poseidon.rank(), poseidon.size()
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    text, chars = load_text()
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    torch.manual_seed(1234 + rank)  # different on purpose: rank 0's parameters are broadcast
    model = TinyGpt(len(chars), args.width, 4, args.layers, args.context)
    if args.backend == "poseidon":
        ddp = poseidon.torch.DistributedDataParallel(model)               # Poseidon (2 of 2)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = adamw_groups(model, args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    windows = torch.Generator().manual_seed(99 + rank)  # each rank its own batches
    if rank == 0:
        print(f"{len(text):,} characters of {TEXTS}, {len(chars)} symbols; "
              f"{sum(p.numel() for p in model.parameters()):,} parameters; {world} workers "
              f"({args.backend}), {args.batch} x {args.context} tokens per worker and step")
    bar = tqdm(total=args.steps, ncols=100) if rank == 0 and tqdm and not args.quiet else None
    start = None
    losses = []
    for step in range(args.steps):
        if step == 5:  # the first steps include start-up (the probe, thread pools)
            start = time.perf_counter()
        at = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=windows)
        x = torch.stack([data[i:i + args.context] for i in at])
        y = torch.stack([data[i + 1:i + args.context + 1] for i in at])
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if bar:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            bar.update(1)
    elapsed = time.perf_counter() - start
    if bar:
        bar.close()
    if rank == 0:
        tokens = (args.steps - 5) * args.batch * args.context * world
        if args.backend == "poseidon":
            plan = ddp.plan
            print(f"plan: {sum(s == 'SFB' for _, s, _ in plan)} of {len(plan)} layers on SFB")
        print(f"final loss {sum(losses[-20:]) / 20:.3f} (first {losses[0]:.3f}); "
              f"{tokens / elapsed:,.0f} tokens/s ({elapsed / (args.steps - 5) * 1000:.1f} ms "
              "per step)")
        if args.sample:
            model.eval()
            seed = data[:args.context // 2].view(1, -1)
            out = generate(model, seed, args.sample, args.context)[0]
            print("sample:\n" + "".join(chars[i] for i in out.tolist()))
    if args.backend == "poseidon":
        poseidon.shutdown()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
