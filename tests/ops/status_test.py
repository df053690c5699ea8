#!/usr/bin/python3
"""`poseidon status` against a live coordinator with one poseidon-server registered: the table and
--json list the server as alive with its endpoint; a wrong token and an unreachable coordinator
each give exit code 2 and one line on stderr. With --agent and --synth, two agents join through the
coordinator (--telemetry_interval=200ms) and train the tiny model with poseidon-synth: status then
shows non-zero bytes/s on their links and names a slowest rank and layer; the server's own
telemetry (--telemetry_interval=200ms) shows its links to both ranks with non-zero bytes/s, and the
agents' links to the server a measured round-trip latency. Every process is killed (and every
shared-memory segment removed) on every path."""

import argparse
import json
import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from metrics_test import Daemon, free_port, stop_all  # noqa: E402

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


def training_status(args, addr, jenv, daemons, segments):
    """Two agents joined through the coordinator, each with a poseidon-synth training the tiny
    model; their telemetry (every 200ms) must reach `poseidon status`. By PS (at 2 ranks the
    time rule would put every layer on ring all-reduce, and the server's links must be busy)."""
    agents = []
    for rank in range(2):
        segment = f"/psd-ops-status-{os.getpid()}-{rank}"
        segments.append(segment)
        agent = Daemon(f"agent {rank}", [
            args.agent, "--job_id=1", "--secret=ops-status-secret", f"--rank={rank}",
            "--world_size=2", f"--coordinator={addr}", "--listen=127.0.0.1:0",
            f"--segment={segment}", "--telemetry_interval=200ms", "--scheme=ps",
            "--log_level=warn"])
        daemons.append(agent)
        agents.append(agent)
    for agent in agents:
        agent.wait_for(r"poseidon-agent ready")
    for rank, segment in enumerate(segments):
        # Long enough to outlast the polling below; killed at the end.
        daemons.append(Daemon(f"synth {rank}", [
            args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
            "--iterations=1000000", "--compute_scale=0"]))

    doc = None
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        p = subprocess.run([args.cli, "status", "--json"], capture_output=True, text=True,
                           timeout=30, env=jenv)
        if p.returncode == 0:
            doc = json.loads(p.stdout)
            agent_nodes = [n for n in doc["nodes"] if n["role"] == "agent"]
            server_nodes = [n for n in doc["nodes"] if n["role"] == "server"]
            busy = [l for n in agent_nodes for l in n["links"] if l["bytes_per_second"] > 0]
            server_busy = {l.get("peer_rank") for n in server_nodes for l in n["links"]
                           if l["peer_role"] == "agent" and l["bytes_per_second"] > 0}
            pinged = [l for n in agent_nodes for l in n["links"]
                      if l["peer_role"] == "server" and l["latency_ns"] > 0]
            jobs = [j for j in doc["jobs"] if j["job_id"] == "1"]
            if (len(agent_nodes) == 2 and busy and server_busy == {0, 1} and pinged
                    and jobs and jobs[0]["slowest_layer"]
                    and jobs[0]["slowest_rank"] is not None
                    and all(n["iteration"] > 0 and n["slowest_layer"] for n in agent_nodes)):
                break
        time.sleep(0.3)
    else:
        check(False, "status never showed busy links (agents' and the server's), a latency to "
              "the server and a slowest rank and layer: " + json.dumps(doc)[:3000])
        return
    print(json.dumps(doc, indent=1)[:4000])
    agent_nodes = [n for n in doc["nodes"] if n["role"] == "agent"]
    job = [j for j in doc["jobs"] if j["job_id"] == "1"][0]
    layer_names = [l["name"] for l in job["layers"]]
    check(job["slowest_layer"] in layer_names, "the slowest layer is one of the plan's layers")
    check(job["slowest_rank"] in (0, 1), "the slowest rank is rank 0 or 1")
    check(all(l["window_ns"] > 0 for n in agent_nodes for l in n["links"]),
          "every link reports its window")
    check(any(l["peer_role"] == "server" and l["bytes_per_second"] > 0
              for n in agent_nodes for l in n["links"]) or
          any(l["peer_role"] == "agent" and l["bytes_per_second"] > 0
              for n in agent_nodes for l in n["links"]),
          "some link to a server or a peer moved bytes")
    check(all(n["sync_seconds"] > 0 for n in agent_nodes), "every agent reports its sync time")
    server_links = [l for n in doc["nodes"] if n["role"] == "server" for l in n["links"]]
    check(all(l["peer_role"] == "agent" and l["peer_job_id"] == "1" and l["window_ns"] > 0
              and l["lower_bound"] for l in server_links),
          "the server's links name job 1's ranks, with their window, as lower bounds")
    check(all(n["bytes_per_second"] > 0 for n in doc["nodes"] if n["role"] == "server"),
          "the server row has a non-zero bytes/s")
    check(all(l["latency_ns"] > 0 for n in agent_nodes for l in n["links"]
              if l["peer_role"] == "server"),
          "every agent link to the server has a latency")

    p = run_status(args.cli, env=jenv)
    check(p.returncode == 0, "status (table) exits 0 while training")
    check("LINK FROM" in p.stdout and "BYTES/S" in p.stdout, "the table has the links")
    check("slowest rank" in p.stdout and "slowest layer" in p.stdout,
          "the table names the slowest rank and layer")
    link_rows = [l for l in p.stdout.splitlines() if l.startswith("job 1 rank ")]
    check(any(("kB/s" in l or "MB/s" in l) for l in link_rows),
          "a link row shows a non-zero rate")
    check("LATENCY" in p.stdout, "the link table has a LATENCY column")
    # LATENCY is the last column: "-" when not measured, else "<n> us" / "<n> ms".
    check(any(" server " in l and l.split()[-1] in ("us", "ms") for l in link_rows),
          "an agent's link row to the server shows its latency")
    server_rows = [l for l in p.stdout.splitlines()
                   if l.startswith("server ") and "job 1 rank " in l]
    check(len(server_rows) == 2 and all(("kB/s" in l or "MB/s" in l) for l in server_rows),
          "the server's link rows to ranks 0 and 1 show non-zero rates")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--agent")
    ap.add_argument("--synth")
    ap.add_argument("--model", help="model spec for poseidon-synth (tests/models/tiny.json)")
    args = ap.parse_args()
    env = dict(os.environ, POSEIDON_JOB_TOKEN=TOKEN, POSEIDON_COORDINATOR_TOKEN=TOKEN,
               POSEIDON_JOB_SECRET="ops-status-secret")
    for k in ["POSEIDON_TOKEN", "POSEIDON_JOB_ID", "POSEIDON_COORDINATOR", "POSEIDON_CONFIG"]:
        env.pop(k, None)
    os.environ.clear()
    os.environ.update(env)
    daemons = []
    segments = []
    try:
        coord = Daemon("poseidon-coordinator", [args.coordinator, "--listen=127.0.0.1:0",
                                                "--job_id=1", "--log_level=warn"])
        daemons.append(coord)
        addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
        server = Daemon("poseidon-server", [args.server, "--listen=127.0.0.1:0", "--job_id=1",
                                            f"--coordinator={addr}",
                                            "--telemetry_interval=200ms"])
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

        if args.agent and args.synth and args.model:
            training_status(args, addr, jenv, daemons, segments)
    except RuntimeError as e:
        check(False, str(e))
    finally:
        stop_all(daemons, segments)

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
