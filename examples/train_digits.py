#!/usr/bin/python3
"""Train an MLP on scikit-learn's handwritten digits with Poseidon (the README's main job).

    poseidon run -n 4 -- /usr/bin/python3 examples/train_digits.py [--epochs 30] [--cnn]

Every rank trains on its shard of each global batch; Poseidon sums the gradients (PS for some
layers, sufficient-factor broadcasting for others, as the planner decides) and every replica
steps identically. Rank 0 prints the plan, a progress bar per epoch, loss and accuracy, samples
per second and the final test accuracy.
"""
import argparse
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import poseidon
import poseidon.torch

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety
    tqdm = None


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10))


class SmallCnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = torch.nn.Linear(16 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv(x.view(-1, 1, 8, 8))), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="per-worker batch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--cnn", action="store_true")
    args = ap.parse_args()

    poseidon.init()
    rank, world = poseidon.rank(), poseidon.size()
    torch.manual_seed(1234 + rank)  # different on purpose: rank 0's parameters are broadcast
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)

    model = SmallCnn() if args.cnn else mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = poseidon.torch.distribute(model, optimizer, batch_size=args.batch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer._optimizer, args.epochs)
    if rank == 0:
        plan = poseidon.torch.plan_summary(optimizer)
        print(f"plan for {world} workers:")
        for name, scheme, params in plan:
            print(f"  {name:14s} {scheme:3s} {params:7d} parameters")
        print(f"  {sum(s == 'SFB' for _, s, _ in plan)} of {len(plan)} layers on SFB")
        # Bytes per iteration through one machine (colocated server, the agent's assumption):
        # PS 2*S*(P1+P2-2)/P2, SFB 2*K*(P1-1)*(M+N) for an M x N weight (DESIGN.md's table).
        servers = 1
        ps_only = plan_bytes = 0
        for (name, scheme, params), p in zip(plan, model.parameters()):
            ps = 2 * params * (world + servers - 2) / servers * 4
            ps_only += ps
            if scheme == "SFB":
                m, n = p.shape
                plan_bytes += 2 * args.batch * (world - 1) * (m + n) * 4
            else:
                plan_bytes += ps
        print(f"  bytes per iteration per machine: {plan_bytes / 1e6:.2f} MB with this plan, "
              f"{ps_only / 1e6:.2f} MB PS-only ({1 - plan_bytes / max(ps_only, 1):.0%} saved)")

    global_batch = args.batch * world
    steps = len(x_train) // global_batch  # drop the last partial batch: SFB needs K rows
    generator = torch.Generator().manual_seed(7)  # the same shuffle on every rank
    start = time.time()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=generator)
        total_loss, correct, seen = 0.0, 0, 0
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1:2d}", ncols=80) \
            if (tqdm and rank == 0) else range(steps)
        for step in bar:
            batch = order[step * global_batch:(step + 1) * global_batch]
            mine = batch[rank * args.batch:(rank + 1) * args.batch]
            out = model(x_train[mine])
            loss = torch.nn.functional.cross_entropy(out, y_train[mine])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
            correct += (out.argmax(1) == y_train[mine]).sum().item()
            seen += len(mine)
        scheduler.step()
        with torch.no_grad():
            test_acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            rate = (epoch + 1) * steps * global_batch / (time.time() - start)
            print(f"epoch {epoch + 1:2d}: loss {total_loss / steps:.4f}  train acc "
                  f"{correct / seen:.3f}  test acc {test_acc:.3f}  {rate:8.0f} samples/s", flush=True)
    if rank == 0:
        print(f"final test accuracy: {test_acc:.4f} ({world} workers, global batch {global_batch})")
    poseidon.shutdown()
    if test_acc < 0.95:
        raise SystemExit(f"test accuracy {test_acc:.3f} is below 0.95")


if __name__ == "__main__":
    main()
