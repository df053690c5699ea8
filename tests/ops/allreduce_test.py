#!/usr/bin/python3
"""Ring all-reduce across processes: four agents joined through a coordinator run every layer of
the tiny model by Gloo's ring (--scheme=allreduce, the rendezvous through the coordinator's
store); four poseidon-synth training processes verify every result against the exact sum over
the ranks. Then rank 3's agent is killed (SIGKILL): rank 0's training process fails within
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


def synth(args, rank, segment, iterations):
    return Daemon(f"synth {rank}", [
        args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
        f"--iterations={iterations}", "--compute_scale=0", "--timeout_ms=120000", "--verify"])


def main():
    ap = argparse.ArgumentParser()
    for flag in ("coordinator", "server", "agent", "synth", "model"):
        ap.add_argument(f"--{flag}", required=True)
    args = ap.parse_args()
    job_environment(TOKEN, SECRET)
    daemons, segments = [], []
    try:
        # Exact sums: 30 iterations of every layer through the ring.
        _, agents = coordinated_job(args, "ring", SECRET, daemons, segments, ranks=RANKS,
                                    agent_flags=["--scheme=allreduce", "--sync_timeout=60s"])
        synths = [synth(args, r, s, 30) for r, s in enumerate(segments)]
        daemons.extend(synths)
        for s in synths:
            s.wait(120)
        for r, s in enumerate(synths):
            out = "\n".join(s.lines + s.stderr)
            check(s.proc.returncode == 0, f"rank {r}'s training process exits 0")
            m = re.search(r"verified (\d+) results, (\d+) mismatches", out)
            check(m is not None and int(m.group(1)) > 0 and m.group(2) == "0",
                  f"rank {r}: every all-reduced result is the exact sum ({m.group(0) if m else out[-300:]})")
        for a in agents:
            a.wait(30)  # an agent exits once its training process detached
        logs = "\n".join(l for a in agents for l in a.lines + a.stderr)
        check(logs.count("Gloo ring of 4 ranks connected") == RANKS,
              "every agent connected the ring through the coordinator's store")
        check(logs.count("0 on SFB, 8 on all-reduce") == RANKS, "every layer runs on the ring")
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
