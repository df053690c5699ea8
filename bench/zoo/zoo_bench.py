#!/usr/bin/python3
"""Throughput of the PyTorch model zoo: Poseidon's DistributedDataParallel against torch DDP over
gloo, same model, same per-worker batch, same machine, in one run (docs/benchmarks.md, "PyTorch
zoo").

    PYTHONPATH=libclient/python POSEIDON_BUILD_DIR=build/release \\
        /usr/bin/python3 bench/zoo/zoo_bench.py [--workers 2,4] [--models chargpt,gpt,lstm,resnet18]
        [--steps 40] [--repeats 1] [--json results.json]

chargpt is examples/train_chargpt.py (a 427k-parameter character-level GPT, 16 x 64 tokens per
worker and step) run through `poseidon run` and, unchanged but for --backend ddp, as torch DDP
processes; the others are tests/python/zoo.py's specs with the zoo's training loop. Each cell
runs Poseidon and DDP back to back (repeats alternate them) and reports the median throughput of
rank 0 from step 5 on (the first steps hold start-up: the probe forward, thread pools), and the
ratio Poseidon / DDP (> 1: Poseidon is faster).
"""
import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
PY = sys.executable
WARMUP = 5


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unit(name):
    return "tokens/s" if name in ("chargpt", "gpt", "lstm") else "samples/s"


def worker(backend, name, steps):
    """One rank of a zoo model (this script with --worker): rank 0 prints its throughput."""
    import torch
    import zoo
    spec = zoo.SPECS[name]
    if backend == "poseidon":
        import poseidon
        import poseidon.torch
        poseidon.init()
        rank, world = poseidon.rank(), poseidon.size()
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    model = spec.model(seed=rank)
    wrap = (poseidon.torch.DistributedDataParallel if backend == "poseidon"
            else torch.nn.parallel.DistributedDataParallel)
    ddp = wrap(model, **spec.ddp_kwargs)
    opt = spec.optimizer(model)
    marks = {}
    zoo.train(spec, model, ddp, opt, rank, world, steps,
              on_step=lambda s, n: marks.setdefault(s, time.perf_counter()))
    if rank == 0:
        x, _ = spec.data(0, 1)
        per_sample = x[0].numel() if unit(name) == "tokens/s" else 1
        elapsed = marks[steps - 1] - marks[WARMUP - 1]
        rate = (steps - WARMUP) * spec.batch * world * per_sample / elapsed
        print(f"throughput: {rate:.1f}")
    if backend == "poseidon":
        poseidon.shutdown()
    else:
        dist.destroy_process_group()


def command(name, backend, steps):
    if name == "chargpt":
        return [PY, os.path.join(ROOT, "examples", "train_chargpt.py"), "--steps", str(steps),
                "--quiet", "--sample", "0", "--backend", backend]
    return [PY, os.path.abspath(__file__), "--worker", backend, "--model", name,
            "--steps", str(steps)]


def parse(out, name):
    m = (re.search(r"([\d,]+) tokens/s", out) if name == "chargpt"
         else re.search(r"throughput: ([\d.]+)", out))
    if not m:
        raise RuntimeError(f"no throughput in the output:\n{out[-3000:]}")
    return float(m.group(1).replace(",", ""))


def run_poseidon(name, workers, steps, launcher_args=()):
    r = subprocess.run([PY, "-m", "poseidon.run", "-n", str(workers), *launcher_args, "--"]
                       + command(name, "poseidon", steps), capture_output=True, text=True,
                       timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"poseidon {name} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return parse(r.stdout, name)


def run_ddp(name, workers, steps):
    port = free_port()
    procs = []
    for rank in range(workers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(workers), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), LOCAL_RANK=str(rank))
        if workers > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun launches them (and poseidon run)
        procs.append(subprocess.Popen(command(name, "ddp", steps), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    for p, o in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"ddp {name} failed:\n{o[-3000:]}")
    return parse(outs[0], name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--models", default="chargpt,gpt,lstm,resnet18")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--launcher_args", default="",
                    help="options for `poseidon run`, e.g. '--allreduce by-cost' or '--allreduce off'")
    ap.add_argument("--worker", choices=["poseidon", "ddp"])
    ap.add_argument("--model")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.steps)
    rows = []
    print(f"{'model':10s} {'N':>2s} {'unit':>9s} {'Poseidon':>10s} {'DDP-gloo':>10s} {'ratio':>6s}")
    for name in args.models.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            ours, theirs = [], []
            for rep in range(args.repeats):
                order = [(lambda *a: run_poseidon(*a, shlex.split(args.launcher_args)), ours),
                         (run_ddp, theirs)]
                for run, into in (order if rep % 2 == 0 else order[::-1]):
                    into.append(run(name, workers, args.steps))
            p, d = statistics.median(ours), statistics.median(theirs)
            rows.append(dict(model=name, workers=workers, unit=unit(name), poseidon=p, ddp=d,
                             ratio=p / d, steps=args.steps, repeats=args.repeats))
            print(f"{name:10s} {workers:2d} {unit(name):>9s} {p:10.0f} {d:10.0f} {p / d:6.2f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
