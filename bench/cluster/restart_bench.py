#!/usr/bin/python3
"""How long a crashed rank costs a job under `poseidon run --max_restarts` (issue 18's benchmark,
for the restart-from-checkpoint policy): each trial trains tests/python/equivalence_worker.py
(server-side Adam, 2 ranks, 2 KV servers, a checkpoint after every 5th iteration), rank 1 exits
at a random step of the first run, the launcher restarts the job from its servers' last
checkpoint, and the trial reads from the ranks' output

  recovery: from the crash to the first step the restarted job completed (wall clock), and
  steps lost: how many steps the restarted job did again (crash step - the checkpoint's).

Prints one line per trial and p50 / p99 / max over the trials.

    bench/cluster/restart_bench.py [--build build/release] [--trials 10] [--every 5]
"""
import argparse
import os
import random
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKER = os.path.join(ROOT, "tests", "python", "equivalence_worker.py")


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def trial(build, every, crash_step):
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "libclient", "python"),
                   POSEIDON_BUILD_DIR=os.path.abspath(build))
        r = subprocess.run([sys.executable, "-m", "poseidon.run", "-n", "2", "--servers", "2",
                            "--checkpoint_dir", os.path.join(tmp, "ckpt"),
                            "--checkpoint_every", str(every), "--max_restarts", "1", "--",
                            sys.executable, WORKER, os.path.join(tmp, "params.pt"),
                            f"server-adam,workers=2,crash-at={crash_step}"],
                           capture_output=True, text=True, env=env, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"trial failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        crash = float(re.search(r"rank 1 crashes at ([0-9.]+)", r.stdout).group(1))
        resumed = re.search(r"\[rank 0\] resumed at step (\d+)", r.stdout)
        done = float(re.search(r"\[rank 0\] first resumed step done at ([0-9.]+)",
                               r.stdout).group(1))
        return done - crash, crash_step - int(resumed.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N iterations")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    recoveries, lost = [], []
    for t in range(args.trials):
        step = rng.randrange(args.every + 2, 28)  # after the first checkpoint, before the end
        seconds, steps = trial(args.build, args.every, step)
        recoveries.append(seconds)
        lost.append(steps)
        print(f"trial {t}: crash at step {step}: recovered in {seconds:.2f} s, "
              f"{steps} steps done again", flush=True)
    print(f"\n{args.trials} trials, checkpoint every {args.every} iterations:")
    print("| | p50 | p99 | max |")
    print("|---|---:|---:|---:|")
    print(f"| crash to the first step of the restarted job (s) | {percentile(recoveries, 0.5):.2f} "
          f"| {percentile(recoveries, 0.99):.2f} | {max(recoveries):.2f} |")
    print(f"| steps done again | {percentile(lost, 0.5)} | {percentile(lost, 0.99)} | "
          f"{max(lost)} |")


if __name__ == "__main__":
    main()
