#!/usr/bin/python3
"""One rank of the lossy-wire convergence test: a learnable task (labels from a fixed random
teacher network), an MLP student trained by SGD with momentum for STEPS steps through Poseidon,
rank r on rows [r*K, (r+1)*K) of each global batch of P*K. Rank 0 writes the loss on a fixed
held-out set after every EVAL_EVERY steps (a list of floats, torch.save) to OUT. The wire and the
scheme are the launcher's (poseidon run --wire, --scheme): the test compares the curves.

    convergence_worker.py OUT [P]

Also the reference: `convergence_worker.py OUT P --single` trains one process on the P*K batch."""
import sys

import torch

K, STEPS, EVAL_EVERY = 16, 300, 25


def task(workers):
    """The teacher, the student (seed 0 on every rank: the launcher broadcasts rank 0's anyway),
    the training batches and the held-out set."""
    g = torch.Generator().manual_seed(7)
    teacher = [torch.randn(20, 64, generator=g), torch.randn(64, 5, generator=g)]

    def label(x):
        return (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)

    x = torch.randn(STEPS, workers * K, 20, generator=g)
    y = torch.stack([label(b) for b in x])
    held_x = torch.randn(2048, 20, generator=g)
    held_y = label(held_x)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 5))
    return model, x, y, held_x, held_y


def held_out_loss(model, held_x, held_y):
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(held_x), held_y).item()


def train(model, opt, x, y, rows, held_x, held_y, step_done=lambda: None):
    curve = []
    for step in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(x[step, rows]), y[step, rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_done()
        if (step + 1) % EVAL_EVERY == 0:
            curve.append(held_out_loss(model, held_x, held_y))
    return curve


def main(out, workers, single):
    model, x, y, held_x, held_y = task(workers)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if single:
        torch.save(train(model, sgd, x, y, slice(None), held_x, held_y), out)
        return
    import poseidon
    import poseidon.torch
    poseidon.init()
    rank = poseidon.rank()
    assert poseidon.size() == workers, f"world {poseidon.size()}, expected {workers}"
    opt = poseidon.torch.distribute(model, sgd, batch_size=K)
    curve = train(model, opt, x, y, slice(rank * K, (rank + 1) * K), held_x, held_y)
    opt.synchronize()
    if rank == 0:
        torch.save(curve, out)
        print("schemes:", ",".join(s for _, s, _ in poseidon.torch.plan_summary(opt)))
    poseidon.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2, "--single" in sys.argv[3:])
