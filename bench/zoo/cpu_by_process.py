#!/usr/bin/python3
"""CPU seconds a command and its descendants used, by process name (docs/benchmarks.md, "PyTorch
zoo": where a CPU-bound run's cores go).

    bench/zoo/cpu_by_process.py -- COMMAND [ARGS...]

Samples /proc every 0.2 s while COMMAND runs, keeps each descendant's last user + system time,
then prints the totals per process name (poseidon-server, poseidon-agent, python3, ...) and the
command's own output's last lines. A process that lives less than 0.2 s may be missed."""
import collections
import os
import subprocess
import sys
import time

args = sys.argv[1:]
if args[:1] == ["--"]:
    args = args[1:]
if not args:
    sys.exit("usage: cpu_by_process.py -- COMMAND [ARGS...]")
tick = os.sysconf("SC_CLK_TCK")
proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
seen = {}  # pid -> (name, cpu seconds)


def sample():
    parents = {}
    stats = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        parents[int(pid)] = int(fields[1])
        stats[int(pid)] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
    for pid, (name, cpu) in stats.items():
        p = pid
        while p > 1 and p != proc.pid:
            p = parents.get(p, 0)
        if p == proc.pid:
            seen[pid] = (name, cpu)


output = []
import threading  # noqa: E402
reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
reader.start()
while proc.poll() is None:
    sample()
    time.sleep(0.2)
reader.join(timeout=5)
totals = collections.Counter()
for name, cpu in seen.values():
    totals[name] += cpu
for name, cpu in totals.most_common():
    print(f"{name:18s} {cpu:8.2f} s")
print("".join(output[-3:]), end="")
sys.exit(proc.returncode)
