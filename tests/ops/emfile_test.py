#!/usr/bin/python3
"""A daemon out of file descriptors backs off instead of spinning (issue 21, item 3): a
poseidon-server limited to 64 descriptors is sent 150 connections it cannot accept; over the next
3 s it must use little CPU (it used ~1 core) and write few log lines (it wrote ~390k a second),
and once the connections close, a client trains against it as before.

    emfile_test.py --server BIN --client KV_TEST_CLIENT
"""
import argparse
import os
import resource
import socket
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--server", required=True)
ap.add_argument("--client", required=True)
args = ap.parse_args()


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


server = subprocess.Popen([args.server, "--listen=127.0.0.1:0", "--job_id=1", "--workers=1",
                           "--log_level=info"], env=dict(os.environ, POSEIDON_JOB_SECRET="s"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=limit)
lines = []
threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True).start()
try:
    address = None
    for line in server.stdout:
        if "listening on " in line:
            address = line.split("listening on ")[1].strip()
            break
    check(address is not None, "the server started under a 64-descriptor limit")
    host, port = address.rsplit(":", 1)
    conns = []
    for _ in range(150):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect((host, int(port)))  # the kernel completes it; the server cannot accept all
            conns.append(s)
        except OSError:
            s.close()
    time.sleep(0.5)
    before_cpu, before_lines = cpu_seconds(server.pid), len(lines)
    time.sleep(3)
    used, logged = cpu_seconds(server.pid) - before_cpu, len(lines) - before_lines
    print(f"{len(conns)} connections held; in 3 s the server used {used:.2f} s of CPU and "
          f"logged {logged} lines")
    check(used < 0.5, f"out of descriptors, the server does not spin ({used:.2f} s CPU in 3 s)")
    check(logged < 30, f"and logs a little ({logged} lines in 3 s)")
    check(any("Too many open files" in l and "retrying every" in l for l in lines),
          "the back-off is logged with its reason")
    for s in conns:
        s.close()
    time.sleep(1.5)  # the last back-off is at most 1 s
    r = subprocess.run([args.client, f"--server={address}", "--secret=s", "--rule=sum",
                        "--clocks=5", "--workers=1"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 0, f"afterwards a client is served: {r.stdout[-300:]}{r.stderr[-600:]}")
    check(server.poll() is None, "the server is alive")
finally:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
finish("all EMFILE checks passed", on_failure="the server's last lines:\n" + "".join(lines[-15:]))
