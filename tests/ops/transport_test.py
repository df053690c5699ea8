#!/usr/bin/python3
"""--transport through a coordinator (issue 16): a coordinator, a poseidon-server started with
--transport=tcp and two agents with the default --transport=auto train the tiny model with
poseidon-synth. Each daemon logs its choice once; every endpoint
registered is of a kind its daemon chose (here, without an RDMA device, TCP only; with one, the
agents advertise RDMA too); `poseidon status --json` reports the transport of every link and the
table has a TRANSPORT column; the agents' /metrics count their links by transport
(poseidon_agent_links). Every process is killed and every segment removed on every path."""

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from metrics_test import Daemon, free_port, http_get, stop_all  # noqa: E402

TOKEN = "ops-transport-token"
SECRET = "ops-transport-secret"
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL: " + msg)


def choice_of(daemon):
    lines = [l for l in daemon.lines + daemon.stderr if "transport: " in l]
    check(len(lines) == 1, f"{daemon.name} logs its transport choice once: {lines}")
    return lines[0] if lines else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--agent", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    env = dict(os.environ, POSEIDON_JOB_TOKEN=TOKEN, POSEIDON_COORDINATOR_TOKEN=TOKEN,
               POSEIDON_JOB_SECRET=SECRET)
    for k in ["POSEIDON_TOKEN", "POSEIDON_JOB_ID", "POSEIDON_COORDINATOR", "POSEIDON_CONFIG"]:
        env.pop(k, None)
    daemons, segments = [], []
    try:
        coord = Daemon("poseidon-coordinator", [args.coordinator, "--listen=127.0.0.1:0",
                                                "--job_id=1", "--log_level=warn"], env=env)
        daemons.append(coord)
        addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
        cli_env = dict(env, POSEIDON_COORDINATOR=addr, POSEIDON_JOB_ID="1", POSEIDON_TOKEN=TOKEN)
        server = Daemon("poseidon-server", [
            args.server, "--listen=127.0.0.1:0", "--job_id=1", f"--coordinator={addr}",
            "--transport=tcp", "--telemetry_interval=200ms"], env=env)
        daemons.append(server)
        server.wait_for(r"poseidon-server listening on (\S+)")
        agents, metrics = [], []
        for rank in range(2):
            segment = f"/psd-ops-transport-{os.getpid()}-{rank}"
            segments.append(segment)
            metrics.append(f"127.0.0.1:{free_port()}")
            agent = Daemon(f"agent {rank}", [
                args.agent, "--job_id=1", f"--secret={SECRET}", f"--rank={rank}",
                "--world_size=2", f"--coordinator={addr}", "--listen=127.0.0.1:0",
                f"--segment={segment}", "--telemetry_interval=200ms", "--scheme=ps",
                f"--metrics_listen={metrics[-1]}", "--log_level=info"], env=env)
            daemons.append(agent)
            agents.append(agent)
        for agent in agents:
            agent.wait_for(r"poseidon-agent ready")
        for rank, segment in enumerate(segments):
            # Long enough to outlast the polling below; killed at the end.
            daemons.append(Daemon(f"synth {rank}", [
                args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
                "--iterations=1000000", "--compute_scale=0"], env=env))

        check("transport: tcp (--transport=tcp)" in choice_of(server),
              "the server with --transport=tcp says tcp")
        agent_rdma = []
        for agent in agents:
            line = choice_of(agent)
            check("--transport=auto" in line, f"{agent.name} chose by auto: {line}")
            agent_rdma.append("transport: rdma and tcp" in line)

        # Links are reported every 200 ms while they train: wait (bounded) for every node's.
        doc = None
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            p = subprocess.run([args.cli, "status", "--json"], capture_output=True, text=True,
                               timeout=30, env=cli_env)
            if p.returncode == 0:
                doc = json.loads(p.stdout)
                nodes = [n for n in doc["nodes"] if n["role"] in ("agent", "server")]
                # Every server link connected: an agent reports "none" for a link until then
                # (and for its peers: a plan without SFB or all-reduce never connects them).
                if len(nodes) == 3 and all(
                        n["links"] and all(l["transport"] != "none" for l in n["links"]
                                           if l["peer_role"] == "server")
                        for n in nodes):
                    break
            time.sleep(0.2)  # polling the coordinator for telemetry, not synchronising
        check(doc is not None, "status --json answers")
        if doc:
            for n in doc["nodes"]:
                kinds = sorted(e["transport"] for e in n["endpoints"])
                if n["role"] == "server":
                    check(kinds == ["tcp"], f"the --transport=tcp server advertises tcp only: {kinds}")
                elif n["role"] == "agent":
                    want = ["rdma", "tcp"] if agent_rdma[n["rank"]] else ["tcp"]
                    check(kinds == want, f"agent {n['rank']} advertises {want}: {kinds}")
            links = [l for n in doc["nodes"] for l in n["links"]]
            check(links, "links are reported")
            # The server serves TCP only, so every link to or from it is TCP; the agents' links
            # to each other are not connected (the plan is PS only): "none".
            check(all(l["transport"] == ("tcp" if "server" in (n["role"], l["peer_role"])
                                         else "none")
                      for n in doc["nodes"] for l in n["links"]),
                  f"every server link reports tcp, every unconnected one none: "
                  f"{[(n['role'], l['peer_role'], l['transport']) for n in doc['nodes'] for l in n['links']]}")
        p = subprocess.run([args.cli, "status"], capture_output=True, text=True, timeout=30,
                           env=cli_env)
        print(p.stdout)
        check(p.returncode == 0 and "TRANSPORT" in p.stdout, "the link table has TRANSPORT")
        check(any(l.startswith("job 1 rank ") and " tcp " in l for l in p.stdout.splitlines()),
              "a link row shows tcp")
        for rank, m in enumerate(metrics):
            try:
                _, _, text = http_get(f"http://{m}/metrics")
            except Exception as e:  # noqa: BLE001 - reported as a failure
                check(False, f"agent {rank} /metrics: {e}")
                continue
            tcp = re.search(r'^poseidon_agent_links\{transport="tcp"\} (\S+)$', text, re.M)
            rdma = re.search(r'^poseidon_agent_links\{transport="rdma"\} (\S+)$', text, re.M)
            check(tcp and float(tcp.group(1)) >= 1.0,
                  f"agent {rank}: its link to the TCP-only server counts as tcp: "
                  f"{tcp and tcp.group(0)}")
            check(rdma is not None, f"agent {rank} exports poseidon_agent_links for rdma")
            if not agent_rdma[rank]:
                check(rdma and float(rdma.group(1)) == 0.0, f"agent {rank}: no RDMA link")
    finally:
        stop_all(daemons, segments)
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
