#!/usr/bin/python3
"""The same training as equivalence_worker.py, but with torch DDP over gloo (4 processes on
loopback): the reference Poseidon is compared with. Rank 0 writes the parameters."""
import os
import sys

import torch
import torch.distributed as dist

import equivalence_worker as eq


def run(rank, world, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, x, y = eq.model_and_data(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    K = eq.K
    for step in range(eq.STEPS):
        mine = slice(rank * K, (rank + 1) * K)
        loss = torch.nn.functional.cross_entropy(ddp(x[step, mine]), y[step, mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out)
    dist.destroy_process_group()


if __name__ == "__main__":
    port, out = int(sys.argv[1]), sys.argv[2]
    torch.multiprocessing.spawn(run, args=(4, port, out), nprocs=4)
