#!/usr/bin/python3
"""`poseidon status` against a live coordinator with one poseidon-server registered: the table and
--json list the server as alive with its endpoint; a wrong token and an unreachable coordinator
each give exit code 2 and one line on stderr. Every process is killed on every path."""

import argparse
import json
import os
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from metrics_test import Daemon, free_port  # noqa: E402

TOKEN = "ops-status-token"
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL: " + msg)


def run_status(cli, *args, env=None):
    p = subprocess.run([cli, "status", *args], capture_output=True, text=True, timeout=30,
                       env=env)
    print(f"$ poseidon status {' '.join(args)}  -> rc {p.returncode}\n{p.stdout}{p.stderr}")
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--server", required=True)
    args = ap.parse_args()
    env = dict(os.environ, POSEIDON_JOB_TOKEN=TOKEN, POSEIDON_COORDINATOR_TOKEN=TOKEN,
               POSEIDON_JOB_SECRET="ops-status-secret")
    for k in ["POSEIDON_TOKEN", "POSEIDON_JOB_ID", "POSEIDON_COORDINATOR", "POSEIDON_CONFIG"]:
        env.pop(k, None)
    os.environ.clear()
    os.environ.update(env)
    daemons = []
    try:
        coord = Daemon("poseidon-coordinator", [args.coordinator, "--listen=127.0.0.1:0",
                                                "--job_id=1", "--log_level=warn"])
        daemons.append(coord)
        addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
        server = Daemon("poseidon-server", [args.server, "--listen=127.0.0.1:0", "--job_id=1",
                                            f"--coordinator={addr}"])
        daemons.append(server)
        server_addr = server.wait_for(r"poseidon-server listening on (\S+)").group(1)

        p = run_status(args.cli, f"--coordinator={addr}", "--job", "1", f"--token={TOKEN}")
        check(p.returncode == 0, "status exits 0")
        rows = [l.split() for l in p.stdout.splitlines() if server_addr in l]
        check(len(rows) == 1 and rows[0][1] == "alive",
              f"the table shows the server at {server_addr} alive")
        check("membership epoch" in p.stdout, "the table shows the membership epoch")

        # The same through the environment, as JSON.
        jenv = dict(env, POSEIDON_COORDINATOR=addr, POSEIDON_JOB_ID="1", POSEIDON_TOKEN=TOKEN)
        p = run_status(args.cli, "--json", env=jenv)
        check(p.returncode == 0, "status --json exits 0")
        try:
            doc = json.loads(p.stdout)
            servers = [n for n in doc["nodes"] if n["role"] == "server"]
            check(len(servers) == 1 and servers[0]["alive"]
                  and servers[0]["endpoints"][0]["address"] == server_addr,
                  "--json lists the server, alive, with its endpoint")
            check("jobs" in doc and "membership_epoch" in doc, "--json has jobs and epochs")
        except (ValueError, KeyError, IndexError) as e:
            check(False, f"--json output is the documented JSON ({e})")

        p = run_status(args.cli, f"--coordinator={addr}", "--job=1", "--token=wrong")
        check(p.returncode == 2, "a wrong token exits 2")
        check(len(p.stderr.strip().splitlines()) == 1 and "UNAUTHENTICATED" in p.stderr,
              "a wrong token is one line naming UNAUTHENTICATED")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        for d in reversed(daemons):
            d.kill()

    # Nothing listens on a port just freed.
    dead = f"127.0.0.1:{free_port()}"
    p = run_status(args.cli, f"--coordinator={dead}", "--job=1", f"--token={TOKEN}",
                   "--timeout=3s")
    check(p.returncode == 2, "an unreachable coordinator exits 2")
    check(len(p.stderr.strip().splitlines()) == 1 and "unreachable" in p.stderr
          and dead in p.stderr, "an unreachable coordinator is one line naming it")
    if failures:
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
