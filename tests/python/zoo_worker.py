#!/usr/bin/python3
"""One training run of a zoo model (tests/python/zoo.py), written to OUT by rank 0.

    zoo_worker.py poseidon MODEL OUT [STEPS] [--save CKPT | --resume CKPT] [--device cuda:0]
    zoo_worker.py ddp MODEL OUT WORLD PORT [STEPS]   # torch DDP over gloo, WORLD processes

Poseidon's run uses the two-line change a DDP script needs: poseidon.init() instead of
init_process_group, poseidon.torch.DistributedDataParallel instead of torch's. Every rank starts
from its own seed (the initial broadcast must make the replicas equal); DDP's ranks too (its
construction broadcasts rank 0's). Rank 0 prints the plan, each SFB candidate's K and the
gradient norms clipping saw. --save writes the model's and the optimizer's state dicts after
STEPS steps; --resume loads them on every rank and trains on to STEPS."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo  # noqa: E402


class Checks:
    """What rank 0 reports: clipping, and for teacher-forced specs every step's gradient error
    against one process on the same parameters (zoo.gradient_error)."""

    def __init__(self, spec, model, rank, world):
        self.spec, self.model, self.rank, self.world = spec, model, rank, world
        self.norms = []
        self.worst = (0.0, None, None)

    def on_step(self, step, norm):
        self.norms.append(norm)

    def on_backward(self, step, before, x, y):
        err, where = zoo.gradient_error(self.spec, self.model, before, x, y, step, self.world)
        if err >= self.worst[0]:
            self.worst = (err, where, step)

    def hooks(self):
        teacher = self.spec.teacher_forced and self.rank == 0
        return dict(on_step=self.on_step, on_backward=self.on_backward if teacher else None)

    def report(self, out, wrapped):
        spec, model = self.spec, self.model
        if spec.teacher_forced:
            # One more forward (evaluation, no gradient): it broadcasts rank 0's buffers, so every
            # rank's parameters and buffers must now equal rank 0's.
            model.eval()
            with torch.no_grad():
                wrapped(spec.data(0, self.world)[0][:spec.batch])
            torch.save(zoo.state(model), f"{out}.rank{self.rank}")
        if self.rank != 0:
            return
        torch.save(zoo.state(model), out)
        if spec.clip is not None:
            clipped = sum(n > spec.clip for n in self.norms)
            print(f"clipped on {clipped} of {len(self.norms)} steps (max norm {spec.clip})")
        if spec.teacher_forced:
            err, where, step = self.worst
            print(f"gradient check: worst {err:.3e} at {where}, step {step}")


def run_poseidon(args):
    import poseidon
    import poseidon.torch
    spec = zoo.SPECS[args.model]
    poseidon.init()
    rank, world = poseidon.rank(), poseidon.size()
    model = spec.model(seed=rank).to(args.device)
    if args.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False  # (the default) full float32 matmuls
    ddp = poseidon.torch.DistributedDataParallel(model, **spec.ddp_kwargs)
    opt = spec.optimizer(model)
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=args.device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start = ckpt["step"]
        if rank == 0:
            print(f"resumed at step {start}")
    checks = Checks(spec, model, rank, world)
    zoo.train(spec, model, ddp, opt, rank, world, args.steps, start=start, **checks.hooks())
    if rank == 0:
        plan = ddp.plan
        print("plan:", " ".join(f"{n}={s}" for n, s, _ in plan))
        print(f"SFB layers: {sum(s == 'SFB' for _, s, _ in plan)} of {len(plan)}")
        print("K:", " ".join(f"{l.name}={l.rows}" for l in ddp._engine.layers if l.rows))
        if args.save:
            torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(),
                            step=args.steps), args.save)
    checks.report(args.out, ddp)
    poseidon.shutdown()


def ddp_rank(rank, world, port, name, out, steps):
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = zoo.SPECS[name]
    model = spec.model(seed=rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model, **spec.ddp_kwargs)
    opt = spec.optimizer(model)
    checks = Checks(spec, model, rank, world)
    zoo.train(spec, model, ddp, opt, rank, world, steps, **checks.hooks())
    checks.report(out, ddp)
    if rank == 0:
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "poseidon":
        ap = argparse.ArgumentParser()
        ap.add_argument("how")
        ap.add_argument("model")
        ap.add_argument("out")
        ap.add_argument("steps", type=int, nargs="?")
        ap.add_argument("--save")
        ap.add_argument("--resume")
        ap.add_argument("--device", default="cpu")
        run_poseidon(ap.parse_args())
    else:
        name, out, world, port = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        steps = int(sys.argv[6]) if len(sys.argv) > 6 else None
        torch.multiprocessing.spawn(ddp_rank, args=(world, port, name, out, steps), nprocs=world)
