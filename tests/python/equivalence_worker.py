#!/usr/bin/python3
"""One rank of the equivalence test: 30 SGD steps of a small MLP on fixed data through Poseidon.
Rank r trains on rows [r*K, (r+1)*K) of each global batch of 4K; rank 0 writes the parameters."""
import sys

import torch

import poseidon
import poseidon.torch

K, STEPS = 8, 30


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    g = torch.Generator().manual_seed(99)
    x = torch.randn(STEPS, 4 * K, 20, generator=g)
    y = torch.randint(0, 5, (STEPS, 4 * K), generator=g)
    return model, x, y


def main(out, overlap=False, server=False):
    poseidon.init()
    rank, world = poseidon.rank(), poseidon.size()
    assert world == 4
    model, x, y = model_and_data(seed=rank)  # different seeds: the broadcast must fix it
    if server:  # the KV servers run Adam; no local optimizer
        opt = poseidon.torch.distribute(model, None, batch_size=K,
                                        server_optimizer=dict(rule="adam", lr=0.01))
    else:
        opt = poseidon.torch.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if overlap else torch.optim.SGD(model.parameters(), lr=0.1),
            batch_size=K, overlap_forward=overlap)
    for step in range(STEPS):
        mine = slice(rank * K, (rank + 1) * K)
        loss = torch.nn.functional.cross_entropy(model(x[step, mine]), y[step, mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.synchronize()  # with overlap_forward the last step waits for a forward: apply it
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out)
        print("schemes:", ",".join(s for _, s, _ in poseidon.torch.plan_summary(opt)))
    poseidon.shutdown()


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    main(sys.argv[1], overlap=mode == "overlap", server=mode == "server-adam")
