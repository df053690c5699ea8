#!/usr/bin/python3
"""WFBP overlap: iteration time of an emulated model with wait-free backpropagation against
syncing after the whole backward, and against the bound max(compute, communication).

For each model: a local cluster (poseidon run: 1 KV server, N agents) and N poseidon-synth
workers with emulated compute (sleep, no CPU). Communication alone is measured in the same run
(--compute_scale=0), compute alone is the spec's FLOPs at the GPU rate; the bound is the larger.

    bench/overlap/overlap_bench.py [--build build/release] [--workers 2] [--models alexnet,tiny]
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(build, workers, model, scale, wfbp, iterations, batch, scheme):
    cmd = [os.path.join(build, "tools", "poseidon"), "run", "-n", str(workers), "--scheme", scheme,
           "--", os.path.join(build, "bench", "poseidon-synth"), f"--model={model}",
           f"--batch={batch}", f"--iterations={iterations}", f"--compute_scale={scale}",
           f"--wfbp={'true' if wfbp else 'false'}", "--gpu=titanx"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, POSEIDON_BUILD_DIR=build))
    m = re.search(r"rank 0/\d+: .* ([0-9.]+) s per iteration after the first", out.stdout)
    if out.returncode != 0 or not m:
        sys.exit(f"run failed ({model}, scale {scale}, wfbp {wfbp}):\n{out.stdout}\n{out.stderr}")
    return float(m.group(1))


def compute_seconds(model, batch, scale):
    sys.path.insert(0, ROOT)
    spec_path = model if os.path.exists(model) else os.path.join(ROOT, "coordinator", "models",
                                                                  f"{model}.json")
    spec = json.load(open(spec_path))
    flops = sum(l.get("forward_flops", 0) + l.get("backward_flops", 0) for l in spec["layers"])
    return scale * flops * batch / 6.1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--models", default="alexnet")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--scale", type=float, default=10.0,
                    help="compute time multiplier (a slower GPU) so compute and communication "
                         "are of the same order on loopback")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--scheme", default="auto")
    args = ap.parse_args()
    print(f"WFBP overlap: {args.workers} workers on loopback, 1 KV server, scheme {args.scheme}, "
          f"K = {args.batch}, compute = spec FLOPs at 6.1 TFLOP/s x {args.scale}")
    print(f"{'model':12s} | {'compute s':>9s} {'comm s':>8s} {'bound s':>8s} | "
          f"{'WFBP s':>8s} {'no-WFBP s':>9s} | {'WFBP/bound':>10s} {'no-WFBP/WFBP':>12s}")
    print("-" * 94)
    for model in args.models.split(","):
        comm = run(args.build, args.workers, model, 0, True, args.iterations, args.batch, args.scheme)
        compute = compute_seconds(model, args.batch, args.scale)
        wfbp = run(args.build, args.workers, model, args.scale, True, args.iterations, args.batch,
                   args.scheme)
        seq = run(args.build, args.workers, model, args.scale, False, args.iterations, args.batch,
                  args.scheme)
        bound = max(compute, comm)
        print(f"{model:12s} | {compute:9.3f} {comm:8.3f} {bound:8.3f} | {wfbp:8.3f} {seq:9.3f} | "
              f"{wfbp / bound:10.2f} {seq / wfbp:12.2f}", flush=True)


if __name__ == "__main__":
    main()
