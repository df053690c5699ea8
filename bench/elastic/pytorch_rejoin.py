#!/usr/bin/python3
"""Elastic PyTorch ranks (issue 18): what a dead rank costs a training loop, and that it costs
nothing else. Each trial runs tests/python/equivalence_worker.py on 3 ranks and 2 KV servers
through `poseidon run --scheme ps --max_restarts 1 --rejoin`; rank 1's training process exits
before a random step S (5 <= S < 25 of 30), is restarted, and takes up the running job with its
state from the KV servers (server-side Adam) or handed over by rank 0 (SGD with momentum in the
ranks). Checked in every trial: the job ends with rank 1's parameters equal to one process on the
3x batch (relative difference <= 1e-5), the step it took up is S (S - 1 under the server-side
rule: it had pushed S - 1, which it computes again), and nobody else restarted.
Printed: the time from its exit to the end of its first step after it took up the job (a new
Python process importing torch included), p50 / p99 / range per state source.

    bench/elastic/pytorch_rejoin.py --build build/release --trials 10 --seed 18
"""
import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "libclient", "python"))
import torch  # noqa: E402

import equivalence_worker  # noqa: E402

PY = "/usr/bin/python3"
SOURCES = {
    "servers (server-side Adam)": ("server-adam", lambda p: torch.optim.Adam(p, lr=0.01)),
    "handed over (SGD with momentum in the ranks)":
        ("momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
}


def reference(make_optimizer, workers=3):
    model, x, y = equivalence_worker.model_and_data(seed=0, workers=workers, device="cpu",
                                                    steps=equivalence_worker.STEPS)
    opt = make_optimizer(model.parameters())
    for step in range(equivalence_worker.STEPS):
        loss = torch.nn.functional.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def trial(args, mode, step, want):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "params.pt")
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "libclient", "python"),
                   POSEIDON_BUILD_DIR=os.path.abspath(args.build))
        r = subprocess.run([os.path.join(args.build, "tools", "poseidon"), "run", "-n", "3",
                            "--servers", "2", "--scheme", "ps", "--max_restarts", "1", "--rejoin",
                            "--", PY, os.path.join(ROOT, "tests", "python", "equivalence_worker.py"),
                            out, f"{mode},workers=3,crash-at={step},elastic-state,writer=1"],
                           capture_output=True, text=True, env=env, timeout=300)
        text = r.stdout + r.stderr
        if r.returncode != 0:
            raise RuntimeError(f"{mode} S={step}: exit {r.returncode}\n{text[-3000:]}")
        crashed = float(re.search(r"rank 1 crashes at ([0-9.]+)", text).group(1))
        back = float(re.search(r"first resumed step done at ([0-9.]+)", text).group(1))
        took = int(re.search(r"resumed at step (\d+)", text).group(1))
        # (Under a server-side rule it re-reads the step it had pushed: S - 1.)
        if not step - 1 <= took <= step or text.count("rejoins the running job") != 1:
            raise RuntimeError(f"{mode} S={step}: took up step {took}\n{text[-3000:]}")
        got = torch.load(out)
        rel = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
        if rel > 1e-5:
            raise RuntimeError(f"{mode} S={step}: parameters {rel:.2e} off the reference")
        return back - crashed, rel


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--trials", type=int, default=10, help="per state source")
    ap.add_argument("--seed", type=int, default=18)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    print("| state of the rank taking up the job | trials | kill to first step, p50 (s) | p99 | "
          "range | largest relative difference |\n|---|---:|---:|---:|---:|---:|", flush=True)
    for name, (mode, make) in SOURCES.items():
        want = reference(make)
        times, worst = [], 0.0
        for _ in range(args.trials):
            t, rel = trial(args, mode, rng.randrange(5, 25), want)
            times.append(t)
            worst = max(worst, rel)
        times.sort()
        p99 = times[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))]
        print(f"| {name} | {len(times)} | {statistics.median(times):.2f} | {p99:.2f} | "
              f"{times[0]:.2f} – {times[-1]:.2f} | {worst:.1e} |", flush=True)


if __name__ == "__main__":
    main()
