#!/usr/bin/python3
"""Ring all-reduce across processes: four agents joined through a coordinator run every layer of
the tiny model by Gloo's ring (--scheme=allreduce, the rendezvous through the coordinator's
store); four poseidon-synth training processes verify every result against the exact sum over
the ranks. On a lossy wire (--wire=bf16: each rank sums its shard in float32 from 16-bit
contributions) every result is the sum within bfloat16's rounding and not exactly; with fp16 and
gradients beyond its range the divergence guard makes every rank fall back to float32 at the
first all-reduce, so every result is exact, and without the guard they are not. At low rank
(PowerSGD) the sums of gradients of rank <= r are carried within float rounding, of higher rank
they are not, and low rank's divergence guard, forged to trip, makes every rank go exact. Then rank 3's agent is killed (SIGKILL): rank 0's training process fails within
seconds (inside the 60 s sync timeout) with an error naming the all-reduce, the layer and the
ring (rank 3's neighbours, which read the reset), or rank 3 as declared dead by the coordinator
(a rank whose collective waits on a live neighbour, within the 15 s lease). Every process is
killed (and every shared-memory segment removed) on every path."""

import argparse
import os
import re
import signal
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from metrics_test import (Daemon, coordinated_job, ended_after, job_environment,  # noqa: E402
                          stop_all)

TOKEN = "ops-allreduce-token"
SECRET = "ops-allreduce-secret"
RANKS = 4


def synth(args, rank, segment, iterations, extra=()):
    return Daemon(f"synth {rank}", [
        args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
        f"--iterations={iterations}", "--compute_scale=0", "--timeout_ms=120000", "--verify",
        *extra])


def ring_job(args, name, daemons, segments, iterations, agent_flags=(), synth_flags=()):
    """A job of RANKS agents with every layer on the ring; returns each rank's training process's
    return code and "verified N results, M mismatches" as (N, M) (None when absent), and the
    agents' logs, once every process ended."""
    _, agents = coordinated_job(args, name, SECRET, daemons, segments, ranks=RANKS,
                                agent_flags=["--scheme=allreduce", "--sync_timeout=60s",
                                             *agent_flags])
    synths = [synth(args, r, s, iterations, synth_flags) for r, s in enumerate(segments)]
    daemons.extend(synths)
    for s in synths:
        s.wait(120)
    results = []
    for s in synths:
        m = re.search(r"verified (\d+) results, (\d+) mismatches", "\n".join(s.lines + s.stderr))
        results.append((s.proc.returncode, (int(m.group(1)), int(m.group(2))) if m else None))
    for a in agents:
        a.wait(30)  # an agent exits once its training process detached
    return results, "\n".join(l for a in agents for l in a.lines + a.stderr)


def main():
    ap = argparse.ArgumentParser()
    for flag in ("coordinator", "server", "agent", "synth", "model"):
        ap.add_argument(f"--{flag}", required=True)
    args = ap.parse_args()
    job_environment(TOKEN, SECRET)
    daemons, segments = [], []
    try:
        # Exact sums: 30 iterations of every layer through the ring, the 8 layers fused into one
        # all-reduce bucket (the default, DDP's 25 MiB) and one collective per layer.
        for bucket in ("25MiB", "0"):
            results, logs = ring_job(args, f"ring{bucket}", daemons, segments, 30,
                                     [f"--allreduce_bucket_bytes={bucket}"])
            for r, (code, verified) in enumerate(results):
                check(code == 0, f"{bucket} buckets: rank {r}'s training process exits 0")
                check(verified is not None and verified[0] == 30 * 8 and verified[1] == 0,
                      f"{bucket} buckets: rank {r}: every all-reduced result is the exact sum "
                      f"({verified})")
            check(logs.count("Gloo ring of 4 ranks connected") == RANKS,
                  "every agent connected the ring through the coordinator's store")
            check(logs.count("0 on SFB, 8 on all-reduce") == RANKS, "every layer runs on the ring")
            fused = logs.count("8 all-reduce layers fused into 1 all-reduce buckets")
            check(fused == (RANKS if bucket != "0" else 0),
                  f"{bucket} buckets: the layers are fused as told ({fused} agents say so)")
            stop_all(daemons, segments)
            daemons, segments = [], []

        # A bfloat16 wire: values up to 4 x 11 with a part of 2^-10 that bfloat16 cannot hold;
        # within its rounding (each rank's and each owner's error feedback may release a unit of
        # the clock before), not exactly.
        # In one bucket and layer by layer.
        fraction = "--grad_fraction=0.0009765625"
        for bucket in ("25MiB", "0"):
            results, logs = ring_job(args, f"ringbf16{bucket}", daemons, segments, 10,
                                     ["--wire=bf16", f"--allreduce_bucket_bytes={bucket}"],
                                     [fraction, "--tolerance=0.2"])
            for r, (code, verified) in enumerate(results):
                check(code == 0 and verified == (80, 0),
                      f"bf16, {bucket} buckets: rank {r}'s results are the sums within rounding "
                      f"({code}, {verified})")
            lossy = "1 layers or buckets" if bucket != "0" else "8 layers or buckets"
            check(logs.count(f"{lossy} on a lossy wire when on the ring") == RANKS,
                  f"bf16, {bucket} buckets: every agent puts its layers on the lossy wire")
            stop_all(daemons, segments)
            daemons, segments = [], []
        results, _ = ring_job(args, "ringbf16x", daemons, segments, 3, ["--wire=bf16"], [fraction])
        check(all(v is not None and v[1] > 0 for _, v in results),
              f"bf16: checked exactly, the rounding shows ({[v for _, v in results]})")
        stop_all(daemons, segments)
        daemons, segments = [], []

        # The divergence guard: gradients up to 8192 x 11 saturate fp16 (±65504). With the guard
        # every rank falls back at the first all-reduce of every layer: every result is exact.
        for guard in (True, False):
            results, logs = ring_job(
                args, f"ringguard{int(guard)}", daemons, segments, 5,
                ["--wire=fp16", f"--wire_check_every={100 if guard else 0}"],
                ["--grad_scale=8192"])
            if guard:
                for r, (code, verified) in enumerate(results):
                    check(code == 0 and verified == (40, 0),
                          f"fp16 with the guard: rank {r}'s results are exact ({code}, {verified})")
                check(logs.count("falling back to float32 (exact)") >= RANKS,
                      "fp16 with the guard: every rank falls back, logged")
            else:
                check(all(v is None or v[1] > 0 for _, v in results),
                      f"fp16 without the guard: the results saturate ({[v for _, v in results]})")
            stop_all(daemons, segments)
            daemons, segments = [], []

        # Low rank (PowerSGD). The synthetic gradients are periodic in the element index (period
        # 17), so every FC weight's matrix has rank <= 17: at rank 17 the factors carry every
        # sum within float rounding (after 2 exact warm-up all-reduces), in one bucket (fc1 and
        # fc2 factored, conv1, fc3 and the biases plain in the same collectives) and layer by
        # layer; at rank 2 the loss shows.
        for bucket in ("25MiB", "0"):
            results, logs = ring_job(
                args, f"ringlowrank{bucket}", daemons, segments, 10,
                ["--lowrank_rank=17", "--lowrank_warmup=2", f"--allreduce_bucket_bytes={bucket}"],
                ["--tolerance=0.001"])
            for r, (code, verified) in enumerate(results):
                check(code == 0 and verified == (80, 0),
                      f"rank 17, {bucket} buckets: rank {r}'s results are the sums within float "
                      f"rounding ({code}, {verified})")
            check(logs.count("2 layers at low rank (PowerSGD") == RANKS,
                  f"rank 17, {bucket} buckets: every agent factors fc1 and fc2")
            stop_all(daemons, segments)
            daemons, segments = [], []
        results, _ = ring_job(args, "ringlowrank2", daemons, segments, 5,
                              ["--lowrank_rank=2", "--lowrank_warmup=2"], ["--tolerance=0.001"])
        check(all(v is not None and v[1] > 0 for _, v in results),
              f"rank 2: the factors lose what rank 2 cannot carry ({[v for _, v in results]})")
        stop_all(daemons, segments)
        daemons, segments = [], []
        # Low rank's divergence guard, forged to trip (a limit of 0.01 of the gradient held back,
        # checked on every all-reduce): every rank falls back after the first factored all-reduce
        # (iteration 3), the next one carries what was held back, and from iteration 5 on every
        # result is exact.
        results, logs = ring_job(
            args, "ringlowrankguard", daemons, segments, 10,
            ["--lowrank_rank=2", "--lowrank_warmup=2", "--wire_check_every=1",
             "--lowrank_max_held=0.01"], ["--verify_from=5"])
        for r, (code, verified) in enumerate(results):
            check(code == 0 and verified == (48, 0),
                  f"low rank's guard: rank {r}'s results from iteration 5 on are exact "
                  f"({code}, {verified})")
        check(logs.count("falling back to the exact all-reduce") == RANKS,
              "low rank's guard: every rank falls back, logged")
        stop_all(daemons, segments)
        daemons, segments = [], []

        # A killed agent: its neighbours' collectives fail at once, naming the ring.
        _, agents = coordinated_job(args, "ringkill", SECRET, daemons, segments, ranks=RANKS,
                                    agent_flags=["--scheme=allreduce", "--sync_timeout=60s"])
        synths = [synth(args, r, s, 1000000) for r, s in enumerate(segments)]
        daemons.extend(synths)
        time.sleep(2)  # training
        os.kill(agents[3].proc.pid, signal.SIGKILL)
        out = ended_after(synths[0], time.monotonic(), "the kill")
        check(synths[0].proc.poll() not in (None, 0),
              "rank 0's training process fails once rank 3's agent is killed")
        # Rank 3's neighbours read the reset at once (Gloo's error, naming the ring); a rank whose
        # collective waits on a live rank learns it from the coordinator within its lease.
        check(("all-reduce of layer" in out and "Gloo ring of 4 ranks" in out)
              or ("rank 3" in out and "declared dead" in out),
              "its error names the all-reduce and the ring, or rank 3 as declared dead")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        stop_all(daemons, segments)
    finish("PASS: the ring's sums are exact across processes and a killed agent is reported",
           on_failure="\n".join(l for d in daemons for l in d.stderr[-10:]))


if __name__ == "__main__":
    main()
