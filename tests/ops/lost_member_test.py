#!/usr/bin/python3
"""Failure detection without the launcher: two agents train the tiny model through a coordinator
(--liveness_timeout=2s); rank 1's agent is frozen (SIGSTOP). The coordinator declares it dead when
its lease runs out, rank 0's agent learns it from its next heartbeat and fails the waiting layers
at once: rank 0's training process exits with an error naming rank 1, its host and why, long
before the 60 s sync timeout.

Then a frozen KV server (issue 17): three servers, two agents, every key with a backup; one
server is SIGSTOPped while training runs. The coordinator declares it dead when its lease (4 s:
the agents' own leases must hold under a loaded CI) runs out, and each agent fails its requests
there at once and goes on at the next server of their keys' chains, as when it finds a loss
itself, long before its own check would (--peer_timeout=12s on agents and servers: they ping
every 4 s, so a stalled agent is not taken for a silent one): every iteration runs, every result
exact (poseidon-synth --verify), and each agent moved the server's keys on at the coordinator's
word, not at its own finding that the server is silent; so did the server before it in the ring,
which gives it up as its keys' backup (HeartbeatResponse.lost_servers).

Every process is killed (and every shared-memory segment removed) on every path."""

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from metrics_test import (Daemon, coordinated_job, ended_after, job_environment,  # noqa: E402
                          stop_all)

TOKEN = "ops-lost-member-token"


SERVERS, ITERATIONS, LAYERS = 3, 100, 8  # tiny.json's layers


def thaw_and_stop(daemons, segments):
    """Every exit path: a frozen daemon is let go on (SIGCONT), then every one is killed."""
    for d in daemons:
        try:
            os.kill(d.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    stop_all(daemons, segments)


def frozen_server(args):
    """A KV server frozen while training runs: the coordinator's word moves its keys on."""
    daemons, segments = [], []
    try:
        coord = Daemon("poseidon-coordinator", [args.coordinator, "--listen=127.0.0.1:0",
                                                "--job_id=1", f"--min_servers={SERVERS}",
                                                "--liveness_timeout=4s", "--log_level=warn"])
        daemons.append(coord)
        addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
        servers = []
        for s in range(SERVERS):
            # Their own peer_timeout gives up a frozen backup of their keys' replicas.
            servers.append(Daemon(f"server {s}", [args.server, "--listen=127.0.0.1:0",
                                                  "--job_id=1", f"--coordinator={addr}",
                                                  "--peer_timeout=12s", "--log_level=warn"]))
            daemons.append(servers[-1])
            servers[-1].wait_for(r"poseidon-server listening on")  # one at a time: plan order
        agents, synths = [], []
        for rank in range(2):
            segment = f"/psd-ops-lost-server-{os.getpid()}-{rank}"
            segments.append(segment)
            agents.append(Daemon(f"agent {rank}", [
                args.agent, "--job_id=1", "--secret=ops-lost-member-secret", f"--rank={rank}",
                "--world_size=2", f"--coordinator={addr}", "--listen=127.0.0.1:0",
                f"--segment={segment}", "--scheme=ps", "--replicas=1", "--fusion=off",
                "--block_bytes=65536", "--peer_timeout=12s", "--sync_timeout=60s",
                "--log_level=warn"]))
            daemons.append(agents[-1])
        for agent in agents:
            agent.wait_for(r"poseidon-agent ready")
        for rank, segment in enumerate(segments):
            synths.append(Daemon(f"synth {rank}", [
                args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
                f"--iterations={ITERATIONS}", "--compute_scale=20000", "--verify",
                "--timeout_ms=120000", *(["--print_iterations"] if rank == 0 else [])]))
            daemons.append(synths[-1])
        synths[0].wait_for(r"iteration 2 ends", timeout=60)
        victim = random.randrange(SERVERS)
        print(f"server {victim} frozen after iteration 2", flush=True)
        os.kill(servers[victim].proc.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        for rank, synth in enumerate(synths):
            code = synth.wait(120)
            # A figure, not a check: the lease (4 s) and the rest of the run are in it.
            print(f"rank {rank} finished {time.monotonic() - frozen_at:.1f} s after the freeze",
                  flush=True)
            out = "\n".join(synth.lines + synth.stderr)
            good = code == 0 and f"verified {ITERATIONS * LAYERS} results, 0 mismatches" in out
            if not good:
                print(out[-1500:])
            check(good, f"rank {rank} ran every iteration with server {victim} frozen, every "
                        "result exact")
        for rank, agent in enumerate(agents):
            log = "\n".join(agent.lines + agent.stderr)
            check(re.search(r"server \S+ \(host .*\) declared dead by the coordinator \(", log)
                  is not None and
                  re.search(rf"the keys first held by server {victim} .* move to server .*"
                            r"declared dead by the coordinator", log) is not None,
                  f"agent {rank} moved server {victim}'s keys on at the coordinator's word")
        # The server before it in the ring replicates its keys to it: it gives it up as a
        # backup at the coordinator's word too, not at its own --peer_timeout.
        before = (victim + SERVERS - 1) % SERVERS
        log = "\n".join(servers[before].lines + servers[before].stderr)
        gave_up = re.search(rf"backup server {victim} \(\S+\) given up \(.*KV server {victim} .*"
                            r"declared dead by the coordinator", log)
        if gave_up is None:
            print("\n".join(line for line in log.splitlines() if "given up" in line or
                            "declared dead" in line)[-1500:])
        check(gave_up is not None,
              f"server {before} gave up server {victim} as its keys' backup at the coordinator's "
              "word")
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        check(False, f"a frozen server: {e}")
    finally:
        thaw_and_stop(daemons, segments)


def main():
    ap = argparse.ArgumentParser()
    for flag in ("coordinator", "server", "agent", "synth", "model"):
        ap.add_argument(f"--{flag}", required=True)
    args = ap.parse_args()
    job_environment(TOKEN, "ops-lost-member-secret")
    frozen_server(args)
    daemons, segments, agents, synths = [], [], [], []
    try:
        _, agents = coordinated_job(args, "lost", "ops-lost-member-secret", daemons, segments,
                                    coordinator_flags=["--liveness_timeout=2s"],
                                    agent_flags=["--sync_timeout=60s"])
        for rank, segment in enumerate(segments):
            synth = Daemon(f"synth {rank}", [
                args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
                "--iterations=1000000", "--compute_scale=10000", "--timeout_ms=120000"])
            daemons.append(synth)
            synths.append(synth)
        time.sleep(2)  # training
        os.kill(agents[1].proc.pid, signal.SIGSTOP)
        # Well inside the 60 s sync timeout.
        out = ended_after(synths[0], time.monotonic(), "the freeze")
        check(synths[0].proc.poll() not in (None, 0),
              "rank 0's training process fails while rank 1's agent is frozen")
        check("rank 1" in out and "declared" in out and "dead" in out,
              "its error names rank 1 as declared dead")
        check("host " in out and "no heartbeat" in out, "and the host and why")
        agent_log = "\n".join(agents[0].lines + agents[0].stderr)
        check("rank 1 (host" in agent_log and "declared dead" in agent_log,
              "rank 0's agent logs it")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        thaw_and_stop(daemons, segments)
    finish("PASS: a frozen agent is declared dead and named to the other rank's training "
           "process; a frozen server's keys go on at their backups at the coordinator's word",
           on_failure="\n".join(l for d in daemons for l in d.stderr[-10:]))


if __name__ == "__main__":
    main()
