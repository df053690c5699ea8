#!/usr/bin/python3
"""The baseline worker of bench/cluster: PyTorch DistributedDataParallel with the gloo backend on
parameters of a (scaled) model spec's shapes, each layer an autograd Function that sleeps the
layer's emulated compute time in forward and in backward (as poseidon-synth does), so the only
difference to the Poseidon runs is the communication system.

    ddp_worker.py --spec scaled.json --rank r --world_size N --master 10.x.y.1 --batch 4
                  --compute_scale 507 --gpu_flops 6.1e12 --iterations 6 [--bucket_mb 0.39]

Prints "ddp rank r/N: ... X s per iteration after the first" like poseidon-synth.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class SleepLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        ctx.weight = weight
        if fwd_s > 0:
            time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.bwd_s > 0:
            time.sleep(ctx.bwd_s)
        return grad, torch.ones_like(ctx.weight), None, None


class Emulated(torch.nn.Module):
    def __init__(self, spec, batch, compute_scale, gpu_flops):
        super().__init__()
        self.params = torch.nn.ParameterList()
        self.times = []
        for l in spec["layers"]:
            n = 1
            for d in l["shape"]:
                n *= int(d)
            self.params.append(torch.nn.Parameter(torch.zeros(n)))
            f = float(l.get("forward_flops", 0)) * batch * compute_scale / gpu_flops
            b = float(l.get("backward_flops", 0)) * batch * compute_scale / gpu_flops
            self.times.append((f, b))

    def forward(self, x):
        for p, (f, b) in zip(self.params, self.times):
            x = SleepLayer.apply(x, p, f, b)
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world_size", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--compute_scale", type=float, default=1.0)
    ap.add_argument("--gpu_flops", type=float, default=6.1e12)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--bucket_mb", type=float, default=25.0)
    ap.add_argument("--comm_hook", choices=["none", "fp16"], default="none",
                    help="fp16: DDP's fp16_compress_hook (gradients all-reduced in fp16)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = json.load(open(args.spec))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                            rank=args.rank, world_size=args.world_size)
    model = Emulated(spec, args.batch, args.compute_scale, args.gpu_flops)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    if args.comm_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    x = torch.zeros(1, requires_grad=True)
    marks = []
    t0 = time.time()
    for _ in range(args.iterations):
        ddp(x).sum().backward()
        for p in model.params:  # the optimizer's step is not part of the comparison
            p.grad = None
        marks.append(time.time())
    dist.barrier()
    per_iter = (marks[-1] - marks[0]) / max(1, args.iterations - 1)
    print(f"ddp rank {args.rank}/{args.world_size}: {args.iterations} iterations of "
          f"{spec['name']} ({len(spec['layers'])} layers, 0 on SFB) in {marks[-1] - t0:.3f} s, "
          f"{per_iter:.4f} s per iteration after the first", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
