#!/usr/bin/env python3
"""One full iteration of a VGG-sized layer set on the GPU path, with its time split into copy,
network and rebuild.

Starts one KV server, N agents (with --timeline) and N poseidon-synth processes in --cuda mode
(all on GPU 0), runs a few iterations with no emulated compute, then reads the agents' timelines
and prints, for one steady-state iteration of rank 0: the iteration's wall time (first layer
ready to last layer done) and the busy time of each phase (the union of its spans, so parallel
chunks are not double counted):

  d2h        device -> host staging of gradients and factors (the stager's copies)
  network    PS push+pull of each chunk; SFB from our factors' send to the rebuild's start
  rebuild    SFB rebuild on the GPU (gather + cuBLAS)
  h2d        results host -> device

Usage: iteration_split.py --build BUILD_DIR [--model vgg16] [--workers 2] [--scheme auto]
Standard library only (runs with any python3).
"""
import argparse
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_line(p, text, timeout):
    """The first line of p's output containing `text`, within `timeout` seconds (a silent or
    hung process does not block past it)."""
    deadline = time.time() + timeout
    lines = []
    while True:
        left = deadline - time.time()
        if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
            break
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return line
    raise RuntimeError(f"no '{text}' from {p.args[0]} within {timeout} s: {''.join(lines)}")


def union(spans):
    """Total length of the union of [start, end) intervals."""
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--model", default="vgg16")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--scheme", default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--host", action="store_true", help="CPU buffers (no --cuda): to try the script")
    args = ap.parse_args()
    b = args.build
    tmp = tempfile.mkdtemp(prefix="psd-split-")
    procs = []
    try:
        server = subprocess.Popen([f"{b}/server/poseidon-server", "--listen=127.0.0.1:0",
                                   "--job_id=1", "--job_secret=split", "--log_level=warn"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(server)
        address = wait_line(server, "listening on ", 30).split("listening on ")[1].strip()
        peers = [f"127.0.0.1:{free_port()}" for _ in range(args.workers)]
        agents = []
        for r in range(args.workers):
            a = subprocess.Popen([f"{b}/agent/poseidon-agent", "--secret=split", f"--rank={r}",
                                  f"--world_size={args.workers}", f"--servers={address}",
                                  f"--peers={','.join(peers)}", f"--scheme={args.scheme}",
                                  f"--segment=/psd-split-{os.getpid()}-{r}",
                                  f"--timeline={tmp}/rank{r}.json", "--log_level=warn"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(a)
            agents.append(a)
        for a in agents:
            wait_line(a, "poseidon-agent ready", 30)
        synths = []
        for r in range(args.workers):
            s = subprocess.Popen([f"{b}/bench/poseidon-synth", f"--segment=/psd-split-{os.getpid()}-{r}",
                                  f"--model={args.model}", f"--batch={args.batch}",
                                  f"--iterations={args.iterations}", "--compute_scale=0"] + ([] if args.host else ["--cuda"]),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(s)
            synths.append(s)
        outs = [s.communicate(timeout=300)[0] for s in synths]
        for s, out in zip(synths, outs):
            if s.returncode != 0:
                raise RuntimeError(f"poseidon-synth failed: {out}")
        for a in agents:
            a.wait(timeout=60)
        print(outs[0].strip())
        with open(f"{tmp}/rank0.json") as f:
            events = json.load(f)["traceEvents"]
        it = args.iterations - 1  # steady state, not the last (nothing overlaps its end)
        spans = {}
        sends = {}
        rebuild_start = {}
        ready, done = [], []
        for e in events:
            a = e.get("args", {})
            if a.get("iteration") != it:
                continue
            if e["ph"] == "X":
                s, t = e["ts"], e["ts"] + e["dur"]
                spans.setdefault(e["name"], []).append((s, t))
                if e["name"] == "sync":
                    done.append(t)
                if e["name"] in ("rebuild", "gpu rebuild"):
                    rebuild_start[e["tid"]] = min(rebuild_start.get(e["tid"], s), s)
            elif e["name"] == "ready":
                ready.append(e["ts"])
            elif e["name"] == "send factors":
                sends[e["tid"]] = e["ts"]
        network = spans.get("push+pull", []) + [
            (sends[l], rebuild_start[l]) for l in sends if l in rebuild_start]
        wall = (max(done) - min(ready)) / 1e3
        rows = [("iteration (first ready .. last done)", wall),
                ("d2h staging", union(spans.get("d2h", [])) / 1e3),
                ("network (PS push+pull, SFB exchange)", union(network) / 1e3),
                ("rebuild (GPU; CPU with --host)", union(spans.get("gpu rebuild", []) + spans.get("rebuild", [])) / 1e3),
                ("h2d results", union(spans.get("h2d", [])) / 1e3)]
        print(f"\n{args.model}, {args.workers} workers on one GPU, scheme {args.scheme}, "
              f"K={args.batch}, iteration {it} of rank 0 (busy time of each phase; phases "
              f"overlap)\n")
        print("| phase | ms |\n|---|---|")
        for name, ms in rows:
            print(f"| {name} | {ms:.2f} |")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for r in range(args.workers):
            for suffix in ("", ".data"):
                try:
                    os.unlink(f"/dev/shm/psd-split-{os.getpid()}-{r}{suffix}")
                except OSError:
                    pass


if __name__ == "__main__":
    sys.exit(main())
