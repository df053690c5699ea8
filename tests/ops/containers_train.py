"""The training script of tests/ops/containers_test.py, run by `poseidon run` in the train image.

Each rank trains a small MLP through poseidon.torch.DistributedDataParallel on its own batches;
rank 0 then trains the same model in one plain PyTorch process on the batches of every rank
concatenated, and prints how far the two sets of parameters are apart (BSP: N workers compute
what one worker computes on the N-times larger batch).
"""
import torch

import poseidon
import poseidon.torch

STEPS, BATCH = 6, 4


def model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 2, generator=g)


poseidon.init()
rank, size = poseidon.rank(), poseidon.size()
torch.manual_seed(rank)  # a different start on every rank: DDP takes rank 0's parameters
m = poseidon.torch.DistributedDataParallel(model())
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(STEPS):
    x, y = batch(step, rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()
trained = [p.detach().clone() for p in m.parameters()]
print("checksum", round(sum(p.double().sum().item() for p in trained), 6), flush=True)

if rank == 0:
    torch.manual_seed(0)
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in range(size)))
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(trained, ref.parameters()))
    print(f"reference maxdiff {diff:.3g} workers {size}", flush=True)
poseidon.shutdown()
