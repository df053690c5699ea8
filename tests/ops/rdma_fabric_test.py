#!/usr/bin/python3
"""The daemons' RDMA path between processes (issue 16), on the test verbs provider: every
poseidon-server and poseidon-agent is the production binary, linked against libibverbs.so.1, and
finds the test provider's build of that library first (LD_LIBRARY_PATH=<build>/transport/fake-verbs),
which carries work requests between processes over unix sockets with the checks and error
completions of an HCA (docs/wire.md, "The test verbs provider").

A coordinator, two KV servers (--transport=rdma; each key backed up on the other) and four agents
(--transport=rdma, --scheme=sfb: the FC layers by SFB between the agents, the rest by PS) train the
tiny model with poseidon-synth --verify.

- Exact: every rank's every synchronised result equals the exact sum over the four ranks (the
  fault-free result); every daemon logs "transport: rdma"; `poseidon status --json` reports every
  link (agent to server, agent to agent) as rdma.
- A server SIGKILLed at a random moment: its keys' backups serve them over RDMA, and every rank
  still finishes every iteration exactly.
- Injected verbs faults in one agent's process (POSEIDON_FAKE_VERBS_FAULT: a QP error half-way
  through an RDMA READ, a remote access error from a corrupted rkey, RNR retries exceeded on a
  SEND, a READ whose completion never comes): the connection it hits fails and a daemon names the
  RDMA failure and its verbs status (the lost completion: the peer named silent once
  --peer_timeout has passed, or the completion timeout). What follows depends on which link the
  work request was on, and both ways are checked: a link to a KV server is survived (its keys'
  backup takes over) and every rank finishes every iteration exactly; an SFB link between agents
  ends the job, every rank's training process with an error. No rank hangs.

Every process is killed and every segment removed on every path."""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from metrics_test import Daemon, job_environment, stop_all  # noqa: E402

TOKEN = "ops-rdma-token"
SECRET = "ops-rdma-secret"
RANKS = 4
ITERATIONS = 150
PEER_TIMEOUT = "4s"

# (POSEIDON_FAKE_VERBS_FAULT, what a daemon must say: one of)
FAULTS = [
    ("qp_error:read:40", ["failed: Work Request Flushed Error (status 5)"]),
    ("remote_access_error:read:40", ["failed: remote access error (status 10)"]),
    ("rnr_retry_exceeded:send:60", ["failed: RNR retry counter exceeded (status 13)"]),
    ("drop_completion:read:10", ["is silent: nothing from it for " + PEER_TIMEOUT,
                                 "(lost completion)"]),
]


def start_job(args, name, daemons, segments, rank_env=None, transport="rdma"):
    """The coordinator, two servers and RANKS agents, all on the test provider and started with
    --transport=`transport`; rank r's agent with rank_env[r] added to its environment. Returns
    (coordinator address, servers, agents)."""
    env = dict(os.environ, LD_LIBRARY_PATH=args.fake_verbs)
    coord = Daemon("coordinator", [args.coordinator, "--listen=127.0.0.1:0", "--job_id=1",
                                   "--liveness_timeout=2s", "--min_servers=2"])
    daemons.append(coord)
    addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
    servers = []
    for s in range(2):
        servers.append(Daemon(f"server {s}", [
            args.server, "--listen=127.0.0.1:0", "--job_id=1", f"--coordinator={addr}",
            f"--transport={transport}", "--telemetry_interval=200ms",
            f"--peer_timeout={PEER_TIMEOUT}"],
            env=env))
        daemons.append(servers[-1])
        servers[-1].wait_for(r"poseidon-server listening on (\S+)")
    agents = []
    for rank in range(RANKS):
        segment = f"/psd-ops-rdma-{os.getpid()}-{name}-{rank}"
        segments.append(segment)
        agent_env = dict(env, **(rank_env or {}).get(rank, {}))
        agents.append(Daemon(f"agent {rank}", [
            args.agent, "--job_id=1", f"--secret={SECRET}", f"--rank={rank}",
            f"--world_size={RANKS}", f"--coordinator={addr}", "--listen=127.0.0.1:0",
            f"--segment={segment}", f"--transport={transport}", "--scheme=sfb", "--probe_bytes=0",
            "--telemetry_interval=200ms", f"--peer_timeout={PEER_TIMEOUT}", "--sync_timeout=60s",
            "--log_level=info"], env=agent_env))
        daemons.append(agents[-1])
    for agent in agents:
        agent.wait_for(r"poseidon-agent ready")
    return addr, servers, agents


def synths(args, segments, daemons, print_rank0=False):
    out = []
    for rank, segment in enumerate(segments):
        out.append(Daemon(f"rank {rank}", [
            args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
            f"--iterations={ITERATIONS}", "--compute_scale=10000", "--timeout_ms=120000",
            "--verify",
            # No agent here is killed or frozen (its loss is seen through its state or its
            # process): in CI's ThreadSanitizer stage on two loaded vCPUs rank 2's training
            # process once found its agent's heartbeat 5 s old while it registered (the default
            # agent timeout), which ended that run.
            "--agent_timeout_ms=30000"] + (["--print_iterations"] if print_rank0 and rank == 0
                                           else [])))
        daemons.append(out[-1])
    return out


def exact(ranks, what):
    for r in ranks:
        try:
            rc = r.wait(150)
        except subprocess.TimeoutExpired:
            rc = None
        last = (r.lines + r.stderr)[-1:] or ["(nothing)"]
        check(rc == 0 and any(f"verified {ITERATIONS * 8} results, 0 mismatches" in l
                              for l in r.lines),
              f"{what}: {r.name} finished every iteration exactly (exit {rc}: {last[0][:200]})")


SERVERS = 2


def links_over_rdma(args, addr, settled=lambda nodes: True):
    """Polls `poseidon status --json` (bounded) until every daemon reports links, every agent its
    link to each server and peer as connected (an agent reports a link's transport once its
    connection is made, after any fall-back: "none" before), and `settled(nodes)`; returns the
    nodes and their links (the last answer's when that never happens)."""
    env = dict(os.environ, POSEIDON_COORDINATOR=addr, POSEIDON_JOB_ID="1", POSEIDON_TOKEN=TOKEN)
    deadline = time.monotonic() + 40
    nodes, links = [], []
    while time.monotonic() < deadline:
        p = subprocess.run([args.cli, "status", "--json"], capture_output=True, text=True,
                           timeout=30, env=env)
        if p.returncode == 0:
            nodes = [n for n in json.loads(p.stdout)["nodes"] if n["role"] in ("agent", "server")]
            links = [(n["role"], l) for n in nodes for l in n["links"]]
            connected = all(
                len(n["links"]) == SERVERS + RANKS - 1 and
                all(l["transport"] != "none" for l in n["links"])
                for n in nodes if n["role"] == "agent")
            if (len(nodes) == RANKS + SERVERS and all(n["links"] for n in nodes) and connected
                    and settled(nodes)):
                return nodes, links
        time.sleep(0.2)  # polling the coordinator for telemetry, not synchronising
    return nodes, links


def exact_run(args):
    daemons, segments = [], []
    try:
        addr, servers, agents = start_job(args, "exact", daemons, segments)
        for d in servers + agents:
            check(any("transport: rdma (--transport=rdma)" in l for l in d.lines + d.stderr),
                  f"{d.name} runs on RDMA (the test provider as libibverbs.so.1)")
        ranks = synths(args, segments, daemons)
        nodes, links = links_over_rdma(args, addr)
        check(len(nodes) == RANKS + SERVERS,
              f"every daemon reports its links ({len(nodes)} of {RANKS + SERVERS})")
        kinds = sorted({l["transport"] for _, l in links})
        check(kinds == ["rdma"], f"every link is RDMA: {kinds} over {len(links)} links")
        check({role for role, _ in links} == {"agent", "server"},
              "agents and servers both report links")
        for n in nodes:
            check(any(e["transport"] == "rdma" for e in n["endpoints"]),
                  f"{n['role']} {n.get('rank', '')} advertises an RDMA endpoint")
        exact(ranks, "over RDMA")
    finally:
        stop_all(daemons, segments)


def mixed_run(args):
    """--transport=auto everywhere, on machines that differ: rank 0 has no device, rank 2's is on
    another fabric (POSEIDON_FAKE_VERBS_FABRIC), ranks 1 and 3 and the servers share one. Each
    link is RDMA exactly where both ends are on one fabric, TCP elsewhere; rank 2 finds out by
    trying (its RDMA connections fail at set-up, TCP to the same peers works) and falls back."""
    daemons, segments = [], []
    rdma_ranks = {1, 3}
    try:
        addr, servers, agents = start_job(
            args, "mixed", daemons, segments, transport="auto",
            rank_env={0: {"POSEIDON_FAKE_VERBS_DEVICES": "0"},
                      2: {"POSEIDON_FAKE_VERBS_FABRIC": "another"}})
        ranks = synths(args, segments, daemons)

        def classify(nodes):
            wrong = []
            count = {"rdma": 0, "tcp": 0}
            for n in nodes:
                for link in n["links"]:
                    if n["role"] == "agent" and link["peer_role"] == "agent":
                        want = n["rank"] in rdma_ranks and link["peer_rank"] in rdma_ranks
                    elif n["role"] == "agent":
                        want = n["rank"] in rdma_ranks
                    elif link["peer_role"] == "agent":
                        want = link["peer_rank"] in rdma_ranks
                    else:
                        want = False  # servers replicate over TCP while every server serves TCP
                    count[link["transport"]] = count.get(link["transport"], 0) + 1
                    if link["transport"] != ("rdma" if want else "tcp"):
                        wrong.append((n["role"], n.get("rank"), link["peer_role"],
                                      link.get("peer_rank"), link["transport"]))
            return wrong, count

        # Until every link is connected and as expected, or the deadline: a server may list a
        # rank 2 connection that is closing (the RDMA try before its fall-back) for a moment.
        nodes, _ = links_over_rdma(args, addr, settled=lambda nodes: not classify(nodes)[0])
        check(len(nodes) == RANKS + SERVERS, f"mixed: every daemon reports its links ({len(nodes)})")
        wrong, count = classify(nodes)
        check(not wrong and count["rdma"] > 0 and count["tcp"] > 0,
              f"mixed: RDMA exactly between ranks 1, 3 and the servers, TCP elsewhere "
              f"({count}; wrong: {wrong})")
        exact(ranks, "mixed transports")
        fell_back = [l for l in agents[2].lines + agents[2].stderr
                     if "RDMA connection failed" in l and "falls back to TCP" in l]
        check(len(fell_back) >= 3 and
              any("transport retry counter exceeded" in l for l in fell_back),
              f"mixed: rank 2 fell back to TCP on its links to RDMA peers, saying why "
              f"({len(fell_back)}: {fell_back[:1]})")
        others = [l for a in (agents[1], agents[3]) for l in a.lines + a.stderr
                  if "falls back to TCP" in l]
        check(len(others) == 2 and all("peer agent of rank 2 " in l for l in others),
              f"mixed: ranks 1 and 3 fell back on their link to rank 2 only: {others}")
    finally:
        stop_all(daemons, segments)


def server_killed(args, rng, trial):
    daemons, segments = [], []
    try:
        _, servers, _ = start_job(args, f"kill{trial}", daemons, segments)
        ranks = synths(args, segments, daemons, print_rank0=True)
        at = rng.uniform(0.5, 4.0)
        # A random moment of the training: counted from rank 0's first iteration, since in CI's
        # ThreadSanitizer stage the ranks may still be registering seconds after they started
        # (a server lost while the agents register its tables fails the job at start-up).
        ranks[0].wait_for(r"iteration 1 ends", timeout=120)
        time.sleep(at)
        victim = servers[trial % 2]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        print(f"trial {trial}: {victim.name} SIGKILLed {at:.2f} s after the first iteration",
              flush=True)
        exact(ranks, f"trial {trial}, {victim.name} killed")
    finally:
        stop_all(daemons, segments)


def injected(args, spec, says):
    daemons, segments = [], []
    try:
        _, servers, agents = start_job(args, "fault", daemons, segments,
                                       rank_env={2: {"POSEIDON_FAKE_VERBS_FAULT": spec}})
        ranks = synths(args, segments, daemons)
        started = time.monotonic()
        codes = []
        for r in ranks:
            try:
                codes.append(r.wait(90))
            except subprocess.TimeoutExpired:
                codes.append(None)
        took = time.monotonic() - started
        survived = [c == 0 and any(f"verified {ITERATIONS * 8} results, 0 mismatches" in l
                                   for l in r.lines) for c, r in zip(codes, ranks)]
        check(None not in codes and (all(survived) or all(c != 0 for c in codes)),
              f"{spec}: no rank hung, and either the job survived the broken link with every "
              f"result exact or every rank ended with an error ({codes}, {took:.1f} s: "
              f"{'survived' if all(survived) else 'failed'})")
        said = [l for d in servers + agents + ranks for l in d.lines + d.stderr
                if any(s in l for s in says)]
        check(bool(said), f"{spec}: a daemon says one of {says}: {said[:1]}")
    finally:
        stop_all(daemons, segments)


def main():
    ap = argparse.ArgumentParser()
    for flag in ("cli", "coordinator", "server", "agent", "synth", "model", "fake_verbs"):
        ap.add_argument(f"--{flag}", required=True)
    ap.add_argument("--kill_trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.fake_verbs, "libibverbs.so.1")):
        print(f"no libibverbs.so.1 in {args.fake_verbs}")
        return 1
    job_environment(TOKEN, SECRET)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    exact_run(args)
    mixed_run(args)
    for t in range(args.kill_trials):
        server_killed(args, rng, t)
    for spec, says in FAULTS:
        injected(args, spec, says)
    finish("ok: the daemons' RDMA path between processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
