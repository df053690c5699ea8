#!/usr/bin/python3
"""A coordinator restarted during a failover (issue 17): four KV servers and four agents train the
tiny model through a coordinator, every key with a backup (--replicas=1); one server is SIGKILLed
while training runs and, right after, the coordinator too, which starts again on the same address
(empty: nodes register again). Every rank must run every iteration with every result exactly the
sum over the ranks (poseidon-synth --verify), every agent must exit 0, and the live servers must
register again with the new coordinator (same node ids), and so must every agent (its rank), which
`poseidon status` then lists. Every agent registers its model again with the plan it runs, which
the new coordinator then serves (`poseidon plan`: epoch 1); in the first trial an override there
(`poseidon plan --set`) installs epoch 2, which every agent runs; in the second a rank is then
killed and restarted with --rejoin, and takes the job up without waiting for the server lost
before the restart (its agents told the new coordinator); in the third a replacement server
started after the restart joins the running job at every agent; in the fourth every layer goes in
the Gloo ring (--scheme allreduce, a job that may shrink) and a rank killed after the restart
and restarted with --rejoin comes back into the ring through the new coordinator's rendezvous
store (the old one's is lost with it). No process is left behind (every daemon is killed, every
segment removed, on every path). Trials at random moments."""

import argparse
import json
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
from metrics_test import Daemon, free_port, job_environment, stop_all  # noqa: E402

TOKEN = "ops-coordinator-restart-token"
SECRET = "ops-coordinator-restart-secret"
SERVERS, RANKS, ITERATIONS = 4, 4, 150
LAYERS = 8  # tiny.json


def coordinator(args, address):
    return Daemon("poseidon-coordinator", [args.coordinator, f"--listen={address}", "--job_id=1",
                                           f"--min_servers={SERVERS}", "--log_level=warn",
                                           "--liveness_timeout=5s", "--plan_lead_time=200ms"])


def status(args, address):
    """`poseidon status --json` of job 1: (document, process)."""
    p = subprocess.run([args.cli, "status", f"--coordinator={address}", "--job_id=1",
                        "--json", "--timeout=5s"], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, POSEIDON_TOKEN=TOKEN))
    return (json.loads(p.stdout) if p.returncode == 0 else {"nodes": []}), p


def trial(args, rng, number):
    daemons, segments = [], []
    # The first trial's plan change comes after the restart: at most 200 iterations ahead (the
    # coordinator has not learned the job's rate yet), before its end; the second trial's rank
    # dies after the restart and rejoins before the end, the third's replacement server joins.
    iterations = 350 if number < 2 else ITERATIONS
    ring = number == 3
    try:
        address = f"127.0.0.1:{free_port()}"
        daemons.append(coordinator(args, address))
        daemons[-1].wait_for(r"poseidon-coordinator listening on")
        servers = []
        for s in range(SERVERS):
            server = Daemon(f"server {s}", [args.server, "--listen=127.0.0.1:0", "--job_id=1",
                                            f"--coordinator={address}", "--log_level=warn",
                                            "--peer_timeout=2s"])
            daemons.append(server)
            servers.append(server)
            server.wait_for(r"poseidon-server listening on")  # one at a time: a stable order
        def agent_argv(rank, segment):
            return [args.agent, "--job_id=1", f"--secret={SECRET}", f"--rank={rank}",
                    f"--world_size={RANKS}", f"--coordinator={address}", "--listen=127.0.0.1:0",
                    f"--segment={segment}", "--replicas=1", "--fusion=off", "--block_bytes=65536",
                    "--peer_timeout=2s",
                    # The first trial's plan change moves fc1.weight between PS and SFB; the
                    # fourth runs every layer in the ring (which takes a rank back in a job that
                    # may shrink).
                    f"--scheme={'auto' if number == 0 else 'allreduce' if ring else 'ps'}",
                    "--log_level=warn",
                    *([f"--min_workers={RANKS}"] if ring else []),
                    # The second and fourth trials' rank rejoins after the restart.
                    *(["--rejoin_timeout=30s"] if number in (1, 3) else [])]

        def synth_argv(rank, segment):
            return [args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
                    f"--iterations={iterations}", "--compute_scale=20000", "--verify",
                    *(["--print_iterations"] if rank == 0 else [])]

        agents = []
        for rank in range(RANKS):
            segment = f"/psd-ops-crestart-{os.getpid()}-{number}-{rank}"
            segments.append(segment)
            agent = Daemon(f"agent {rank}", agent_argv(rank, segment))
            daemons.append(agent)
            agents.append(agent)
        for agent in agents:
            agent.wait_for(r"poseidon-agent ready")
        synths = []
        for rank, segment in enumerate(list(segments)):
            synth = Daemon(f"synth {rank}", synth_argv(rank, segment))
            daemons.append(synth)
            synths.append(synth)
        synths[0].wait_for(r"iteration 2 ends", timeout=60)
        victim = rng.randrange(SERVERS)
        delay = rng.uniform(0, 0.5)
        gap = rng.uniform(0, 0.3)
        print(f"trial {number}: server {victim} killed {delay:.2f} s after iteration 2, the "
              f"coordinator {gap:.2f} s later", flush=True)
        time.sleep(delay)
        os.kill(servers[victim].proc.pid, signal.SIGKILL)
        time.sleep(gap)
        os.kill(daemons[0].proc.pid, signal.SIGKILL)
        daemons[0].wait(10)
        time.sleep(0.5)
        daemons[0] = coordinator(args, address)  # again, on the same address
        daemons[0].wait_for(r"poseidon-coordinator listening on")
        ok = True
        # While the job runs, every agent registers again as its rank, and `poseidon status`
        # against the new coordinator lists all of them and the live servers.
        for agent in agents:
            agent.wait_for(r"registered again with the coordinator as \S+",
                           timeout=20)
        for s, server in enumerate(servers):
            if s != victim:
                server.wait_for(r"registered again with the coordinator", timeout=20)
        doc, p = status(args, address)
        # The killed server may be listed too, as dead: the agents tell the new coordinator.
        roles = [n.get("role") for n in doc.get("nodes", []) if n.get("alive")]
        ok &= check(roles.count("agent") == RANKS and roles.count("server") == SERVERS - 1,
                    f"trial {number}: status on the new coordinator lists {RANKS} live agents "
                    f"and {SERVERS - 1} live servers (got {roles}; rc {p.returncode} "
                    f"{p.stderr[-300:]})")
        # The job's plan too: every agent registers its model again with the plan it runs, and
        # the new coordinator serves that plan (before it registered, it had none) and plans on
        # from its epoch.
        for agent in agents:
            agent.wait_for(r"registered the model again with the coordinator, running plan "
                           r"epoch 1", timeout=20)
        plan = [args.cli, "plan", f"--coordinator={address}", "--job=1", f"--token={TOKEN}"]
        env = dict(os.environ, POSEIDON_TOKEN=TOKEN)
        shown = subprocess.run(plan, capture_output=True, text=True, timeout=30, env=env)
        ok &= check(shown.returncode == 0 and "job 1: plan epoch 1," in shown.stdout,
                    f"trial {number}: the new coordinator serves the running job's plan, epoch 1 "
                    f"(rc {shown.returncode} {shown.stdout[:200]}{shown.stderr[-300:]})")
        if number == 0:
            # An override on the new coordinator: every agent runs its epoch 2 from the
            # iteration it names, and every result stays exact across the switch.
            time.sleep(2)  # the new coordinator learns the job's rate from its progress reports
            now = re.search(r"^fc1\.weight\s+(\w+)", shown.stdout, re.M)
            to = "ps" if now and now.group(1) == "sfb" else "sfb"
            p = subprocess.run(plan + [f"--set=fc1.weight={to}"], capture_output=True, text=True,
                               timeout=30, env=env)
            ok &= check(p.returncode == 0 and "new plan epoch 2" in p.stdout,
                        f"trial {number}: poseidon plan --set fc1.weight={to} on the new "
                        f"coordinator installs epoch 2 ({p.stdout[:200]}{p.stderr[-300:]})")
            epochs = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                doc, _ = status(args, address)
                epochs = [n.get("plan_epoch") for n in doc.get("nodes", [])
                          if n.get("role") == "agent"]
                if epochs == [2] * RANKS:
                    break
                time.sleep(0.2)
            ok &= check(epochs == [2] * RANKS,
                        f"trial {number}: every agent runs plan epoch 2 (got {epochs})")
        verified = [iterations * LAYERS] * RANKS
        if number == 2:
            # A replacement server after the restart joins the running job: the new coordinator
            # lists it to the agents (it knows the job's plan servers from them), and each takes
            # it up.
            joined = Daemon("server (replacement)", [
                args.server, "--listen=127.0.0.1:0", "--job_id=1", f"--coordinator={address}",
                "--log_level=warn", "--peer_timeout=2s"])
            daemons.append(joined)
            joined.wait_for(r"poseidon-server listening on")
            took = 0
            for agent in agents:
                try:
                    agent.wait_for(r"joined the running job: the keys short of backups",
                                   timeout=20)
                    took += 1
                except RuntimeError:
                    pass
            ok &= check(took == RANKS, f"trial {number}: a server started after the restart "
                                       f"joined the running job at {took} of {RANKS} agents")
        if number in (1, 3):
            # A rank dies after the restart and is restarted with --rejoin: the new coordinator
            # gives it the job's plan, and lists the server lost before the restart as dead
            # (the agents said they lost it), so the rejoining agent does not wait for it. In a
            # ring (the fourth trial) it asks the others' agents where their all-reduces are
            # through the new coordinator's rendezvous store, and they take it back.
            rank = rng.randrange(1, RANKS)  # rank 0 prints the iterations the trial waits on
            os.kill(synths[rank].proc.pid, signal.SIGKILL)
            synths[rank].wait(20)
            agents[rank].wait(20)  # an agent whose process died exits by itself
            segment = f"{segments[rank]}-rejoined"
            segments.append(segment)
            agents[rank] = Daemon(f"agent {rank} (rejoined)", agent_argv(rank, segment) +
                                  ["--rejoin"])
            daemons.append(agents[rank])
            agents[rank].wait_for(r"poseidon-agent ready")
            synths[rank] = Daemon(f"synth {rank} (rejoined)", synth_argv(rank, segment))
            daemons.append(synths[rank])
            first = int(agents[rank].wait_for(r"rejoins job 1 at iteration (\d+)", timeout=60)
                        .group(1))
            log = "\n".join(agents[rank].lines + agents[rank].stderr)
            if ring:
                for r in (r for r in range(RANKS) if r != rank):
                    back = agents[r].wait_for(
                        rf"all-reduce: rank {rank} is back in the Gloo ring of {RANKS} ranks "
                        r".*: the all-reduces of iteration (\d+) on go in it", timeout=30)
                    ok &= check(int(back.group(1)) == first,
                                f"trial {number}: rank {r}'s agent took rank {rank} back into "
                                f"a ring of {RANKS} from iteration {back.group(1)} (it rejoined "
                                f"at {first}), through the restarted coordinator")
            else:
                ok &= check(f"KV server {victim} (" in log and "declared dead by the "
                            "coordinator: lost before this coordinator started" in log,
                            f"trial {number}: rank {rank} rejoined at iteration {first} after "
                            f"the restart, without waiting for server {victim}, lost before it")
            verified[rank] = (iterations - first + 1) * LAYERS
        for rank, synth in enumerate(synths):
            code = synth.wait(120)
            out = "\n".join(synth.lines + synth.stderr)
            good = (code == 0 and f"verified {verified[rank]} results, 0 mismatches" in out)
            if not good:
                print(out[-1500:])
            ok &= check(good, f"trial {number}: rank {rank} ran every iteration, every result "
                              "exact")
        if os.environ.get("POSEIDON_VERBOSE"):
            for agent in agents[:1] + servers:
                print("\n".join(agent.stderr[-15:]))
        for rank, agent in enumerate(agents):
            code = agent.wait(30)
            if code != 0:
                print("\n".join(agent.stderr[-20:]))
            ok &= check(code == 0, f"trial {number}: agent {rank} exited 0")
        return ok
    finally:
        stop_all(daemons, segments)


def main():
    ap = argparse.ArgumentParser()
    for flag in ("coordinator", "server", "agent", "synth", "model", "cli"):
        ap.add_argument(f"--{flag}", required=True)
    ap.add_argument("--trials", type=int, default=int(os.environ.get("POSEIDON_TRIALS", "4")))
    args = ap.parse_args()
    job_environment(TOKEN, SECRET)
    seed = random.randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    for number in range(args.trials):
        try:
            if not trial(args, rng, number):
                break
        except RuntimeError as e:
            check(False, f"trial {number}: {e}")
            break
    finish("PASS: a coordinator restarted during a failover costs the job nothing")


if __name__ == "__main__":
    main()
