#!/usr/bin/python3
"""Failover of a KV server (issue 17, docs/benchmarks.md "Failover"): on loopback, 4 servers,
4 agents (--replicas=1) and 4 poseidon-synth ranks (--verify) train the tiny test model; in each
trial one random server is killed (SIGKILL) or frozen (SIGSTOP) at a random moment. Prints, over
the trials, the time from the signal to the keys' new primary serving (the backup's promotion,
from its log line) as p50/p99, the run's wall time against a fault-free run of the same length
started just before it (what the failure cost: each trial has its own, since this machine's
speed drifts by more than a failover costs from one minute to the next), and checks every trial
finished with 0 mismatches.

    bench/failover/failover_bench.py --build build/release --trials 20
    bench/failover/failover_bench.py --build build/release --trials 5 --signal STOP
    bench/failover/failover_bench.py --build build/release --trials 10 --second

With --second, a second server of the same chain (the victim's neighbour before or after it, at
random) is killed later in the run (10 %-20 % of a fault-free run after the first): it costs
nothing only because the first loss's keys were copied to the next servers of their chains
(adoption, docs/server.md "Replication and failover"). Printed besides: the time from the first
signal to the last adoption (the replication factor restored) and from the second signal to its
keys' new primary.

Timing figures on a 2-core machine that runs all 12 processes carry its scheduling noise; the
exactness check is the tests' (tests/agent_e2e_test.cc, Failover.*).
"""
import argparse
import datetime
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.path.join(ROOT, "tests", "models", "tiny.json")
SECRET = "failover-bench"
PROMOTED = re.compile(r"^(\S+) W \[poseidon-server\] job 1: .* is now the primary of the keys")
ADOPTED = re.compile(r"^(\S+) W \[poseidon-server\] job 1: .* adopts the keys")


def log_time(stamp):
    # spdlog's %Y-%m-%dT%H:%M:%S.%e in the daemon's local time zone (this machine's).
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def stamps_of(logdir, pattern):
    stamps = []
    for s in range(4):
        with open(os.path.join(logdir, f"server{s}.log")) as f:
            for line in f:
                m = pattern.match(line)
                if m:
                    stamps.append(log_time(m.group(1)))
    return stamps


def run(build, victim_signal, delay, iterations, compute_scale, peer_timeout, logdir,
        second_delay=None):
    b = build
    procs, servers, addresses = [], [], []
    try:
        for s in range(4):
            log = open(os.path.join(logdir, f"server{s}.log"), "w")
            p = subprocess.Popen([os.path.join(b, "server", "poseidon-server"),
                                  "--listen=127.0.0.1:0", "--job_id=1", f"--job_secret={SECRET}",
                                  "--log_level=warn", f"--peer_timeout={peer_timeout}"],
                                 stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(p)
            servers.append(p)
            line = p.stdout.readline()
            m = re.search(r"listening on (\S+)", line)
            if not m:
                sys.exit(f"failover_bench: server {s} did not start: {line!r}")
            addresses.append(m.group(1))
        peers = ",".join(f"127.0.0.1:{random.randrange(21000, 31000)}" for _ in range(4))
        tag = f"psd-fo-{os.getpid()}-{random.randrange(1 << 30)}"
        agents = []
        for r in range(4):
            log = open(os.path.join(logdir, f"agent{r}.log"), "w+")
            p = subprocess.Popen([os.path.join(b, "agent", "poseidon-agent"), f"--secret={SECRET}",
                                  f"--rank={r}", "--world_size=4", f"--servers={','.join(addresses)}",
                                  f"--peers={peers}", "--scheme=ps", f"--segment=/{tag}-{r}",
                                  "--log_level=warn", "--replicas=1", "--fusion=off",
                                  "--block_bytes=65536", f"--peer_timeout={peer_timeout}"],
                                 stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            agents.append((p, log))
        deadline = time.time() + 30
        for p, log in agents:
            while True:
                log.seek(0)
                if "poseidon-agent ready" in log.read():
                    break
                if p.poll() is not None or time.time() > deadline:
                    return None  # a port was taken: the caller retries
                time.sleep(0.05)
        synths = []
        start = time.time()
        for r in range(4):
            p = subprocess.Popen([os.path.join(b, "bench", "poseidon-synth"), f"--segment=/{tag}-{r}",
                                  f"--model={MODEL}", "--batch=8", f"--iterations={iterations}",
                                  "--verify", f"--compute_scale={compute_scale}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(p)
            synths.append(p)
        killed_at = None
        victim = None
        second_at = None
        if victim_signal is not None:
            time.sleep(delay)
            victim = random.randrange(4)
            killed_at = time.time()
            servers[victim].send_signal(victim_signal)
            if second_delay is not None:
                time.sleep(second_delay)
                second = (victim + random.choice([1, 3])) % 4
                second_at = time.time()
                servers[second].send_signal(signal.SIGKILL)
        outs = [p.communicate(timeout=300)[0] for p in synths]
        wall = time.time() - start
        ok = all(p.returncode == 0 and ", 0 mismatches" in o for p, o in zip(synths, outs))
        promoted = promoted2 = restored = None
        if killed_at is not None:
            stamps = stamps_of(logdir, PROMOTED)
            end = second_at if second_at is not None else float("inf")
            after = [t for t in stamps if killed_at - 0.01 <= t < end]
            promoted = min(after) - killed_at if after else None
            if second_at is not None:
                after2 = [t for t in stamps if t >= second_at - 0.01]
                promoted2 = min(after2) - second_at if after2 else None
                adopted = [t for t in stamps_of(logdir, ADOPTED) if killed_at - 0.01 <= t < end]
                restored = max(adopted) - killed_at if adopted else None
        return {"ok": ok, "wall": wall, "recovery": promoted, "victim": victim,
                "recovery2": promoted2, "restored": restored, "outs": outs if not ok else None}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    ap.add_argument("--iterations", type=int, default=600)
    ap.add_argument("--compute_scale", type=float, default=20)
    ap.add_argument("--peer_timeout", default="3s")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--second", action="store_true",
                    help="kill a second server of the same chain later in the run")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    random.seed(seed)
    sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGSTOP

    def attempt(victim_signal, delay, second_delay=None):
        for _ in range(5):
            with tempfile.TemporaryDirectory(prefix="failover-") as d:
                r = run(args.build, victim_signal, delay, args.iterations, args.compute_scale,
                        args.peer_timeout, d, second_delay)
            if r is not None:
                return r
        sys.exit("failover_bench: the cluster did not start in 5 attempts")

    clean = [attempt(None, 0)["wall"] for _ in range(3)]
    base = statistics.median(clean)  # the moments of the signals are drawn from it
    rows, failures, lost, paired = [], 0, [], []
    for t in range(args.trials):
        paired.append(attempt(None, 0)["wall"])
        if args.second:
            r = attempt(sig, random.uniform(0.2, 0.5) * base, random.uniform(0.1, 0.2) * base)
        else:
            r = attempt(sig, random.uniform(0.2, 0.7) * base)
        if not r["ok"]:
            failures += 1
            print(f"trial {t}: FAILED (server {r['victim']}):\n" + "\n".join(
                o[-2000:] for o in r["outs"]), file=sys.stderr)
        rows.append(r)
        lost.append(r["wall"] - paired[-1])
    rec = [r["recovery"] for r in rows if r["recovery"] is not None]
    print(f"Failover of one of 4 servers (SIG{args.signal}), {args.trials} trials, seed {seed}; "
          f"{args.iterations} iterations of tiny on 4 ranks, --replicas=1, peer_timeout "
          f"{args.peer_timeout}; fault-free runs {min(paired):.2f} - {max(paired):.2f} s "
          f"(one before each trial, its reference)")
    print("| signal | trials | exact | promoted | signal -> new primary p50 | p99 | "
          "run time lost p50 | p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| SIG{args.signal} | {args.trials} | {args.trials - failures} | {len(rec)} | "
          f"{pct(rec, 0.5) * 1000:.0f} ms | {pct(rec, 0.99) * 1000:.0f} ms | "
          f"{pct(lost, 0.5):.2f} s | {pct(lost, 0.99):.2f} s |" if rec else "| no promotion seen |")
    if args.second:
        res = [r["restored"] for r in rows if r["restored"] is not None]
        rec2 = [r["recovery2"] for r in rows if r["recovery2"] is not None]
        print("\nA second server of the same chain killed later (SIGKILL):")
        print("| trials | first signal -> copies restored p50 | p99 | second signal -> new primary "
              "p50 | p99 |")
        print("|---:|---:|---:|---:|---:|")
        if res and rec2:
            print(f"| {len(rec2)} | {pct(res, 0.5) * 1000:.0f} ms | {pct(res, 0.99) * 1000:.0f} ms "
                  f"| {pct(rec2, 0.5) * 1000:.0f} ms | {pct(rec2, 0.99) * 1000:.0f} ms |")
        else:
            print("| no adoption or second promotion seen |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
