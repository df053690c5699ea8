#!/usr/bin/python3
"""The coordinator survives running out of file descriptors (issue 21, item 2): gRPC 1.51's
listener stops for good after one accept fails with EMFILE (grpc/grpc#20418), so a burst of idle
connections beyond the limit left the coordinator deaf to every new client until restarted. Under
a 100-descriptor limit it is sent 150 connections, which close 2 s later; a new client
(`poseidon status`) must then be served (the listener is rebuilt on the same port, with the
registry kept), and the coordinator must say so.

    coordinator_emfile_test.py --coordinator BIN --cli BIN
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
ap.add_argument("--coordinator", required=True)
ap.add_argument("--cli", required=True)
args = ap.parse_args()
TOKEN = "ops-emfile-token"


def limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))


def status(address):
    return subprocess.run([args.cli, "status", f"--coordinator={address}", "--job_id=1",
                           "--timeout=3s"], capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, POSEIDON_TOKEN=TOKEN))


env = {k: v for k, v in os.environ.items() if not k.startswith("POSEIDON_")}
coord = subprocess.Popen([args.coordinator, "--listen=127.0.0.1:0", "--job_id=1"],
                         env=dict(env, POSEIDON_JOB_TOKEN=TOKEN), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=limit)
lines = []
threading.Thread(target=lambda: lines.extend(coord.stderr), daemon=True).start()
try:
    address = None
    for line in coord.stdout:
        if "listening on " in line:
            address = line.split("listening on ")[1].strip()
            break
    check(address is not None, "the coordinator started under a 100-descriptor limit")
    r = status(address)
    check(r.returncode == 0, f"a client is served before the burst: {r.stderr[-300:]}")
    host, port = address.rsplit(":", 1)
    conns = []
    for _ in range(150):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect((host, int(port)))
            conns.append(s)
        except OSError:
            s.close()
    time.sleep(2)
    for s in conns:
        s.close()
    served, tries = False, 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not served:
        tries += 1
        r = status(address)
        served = r.returncode == 0
        if not served:
            time.sleep(0.5)
    print(f"{len(conns)} connections held for 2 s; a new client served after {tries} tries")
    check(served, f"after the burst a new client is served: {r.stdout[-200:]}{r.stderr[-300:]}")
    check(any("restarted it on " + address in l for l in lines),
          "the coordinator says it restarted its listener")
    check(coord.poll() is None, "the coordinator is alive")
finally:
    coord.terminate()
    try:
        coord.wait(timeout=30)
    except subprocess.TimeoutExpired:
        coord.kill()
finish("all coordinator EMFILE checks passed",
       on_failure="the coordinator's last lines:\n" + "".join(l + "\n" for l in lines[-15:]))
