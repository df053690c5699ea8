#!/usr/bin/python3
"""Elastic workers, issue 18: a rank that dies is restarted and takes up the running job where it
stopped, and nobody rolls back. Four agents train the tiny model by PS (or, with --scheme auto,
by the planner's plan, whose FC layers go by SFB; and with --cli, once the restarted rank is back,
`poseidon plan --set` moves fc1.weight to the other scheme: every rank must switch at the same
job iteration) on two KV servers (each key backed up on the other) through a coordinator that declares a silent agent dead after 2 s; every
agent has --rejoin_timeout. In each trial one rank, chosen at random, is SIGKILLed at a random
moment: its training process (its agent then exits), or its agent (and with it the process, as a
launcher does). A new agent is started for that rank with --rejoin, and a new poseidon-synth on
it; the synth learns from the agent the iteration it takes up (psd_start_iteration). Every fourth
trial starts the replacement on another GPU (as a requeue on another node would): the coordinator
gives it the rank only once it has declared the killed agent dead, and it asks until then.

Checked in every trial: every rank finishes every iteration with exit 0, and every synchronised
result of every rank (the survivors' and the rejoined one's from its first iteration on) equals
the exact sum over the four ranks' gradients of that iteration (--verify): the fault-free run's.
Printed: the time from the kill to the first iteration the rejoined rank completed (p50, p99).

With --scheme allreduce every layer goes in the Gloo ring, in a job that may shrink
(--min_workers=4: a ring takes a rank back only there; with 4 of 4 none is removed): the killed
rank's ring breaks, and its replacement asks the survivors' agents where their all-reduces are;
it takes up the highest iteration any completed (a survivor that completed it hands the result
over in the new ring) and every survivor's agent logs that the rank is back in a ring of four.

Then a rank that is killed and not restarted: once --rejoin_timeout has run out the others fail,
naming it. Every process is killed (and every shared-memory segment removed) on every path."""

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
from checks import check, finish, p50_p99  # noqa: E402
from metrics_test import Daemon, ended_after, job_environment, stop_all  # noqa: E402

TOKEN = "ops-rejoin-token"
SECRET = "ops-rejoin-secret"
RANKS = 4
ITERATIONS = 120


def start_job(args, trial, daemons, segments, rejoin_timeout, extra=(), name="rejoin"):
    """A coordinator, two servers ("server 0", "server 1" in `daemons`) and RANKS agents with
    `extra` arguments (each rank's segment appended to `segments`); returns (agent argv maker,
    agents)."""
    coord = Daemon("coordinator", [args.coordinator, "--listen=127.0.0.1:0", "--job_id=1",
                                   "--liveness_timeout=2s", "--min_servers=2",
                                   # Plans change only when the test says (--cli), not
                                   # from telemetry: each rank's scheme switches are counted.
                                   "--plan_lead_time=200ms", "--replan_min_interval=1h"])
    daemons.append(coord)
    addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
    for s in range(2):
        daemons.append(Daemon(f"server {s}", [args.server, "--listen=127.0.0.1:0", "--job_id=1",
                                              f"--coordinator={addr}"]))
        daemons[-1].wait_for(r"poseidon-server listening on (\S+)")

    def agent_argv(rank, segment, rejoin=False, gpu=0):
        return [args.agent, "--job_id=1", f"--secret={SECRET}", f"--rank={rank}",
                f"--local_rank={gpu}",
                f"--world_size={RANKS}", f"--coordinator={addr}", "--listen=127.0.0.1:0",
                f"--segment={segment}", f"--scheme={getattr(args, 'scheme', 'ps')}", "--probe_bytes=0",
                f"--rejoin_timeout={rejoin_timeout}", "--sync_timeout=60s", *extra,
                *(["--rejoin"] if rejoin else [])]

    agent_argv.coordinator = addr
    agents = []
    for rank in range(RANKS):
        segment = f"/psd-ops-{name}-{os.getpid()}-{trial}-{rank}"
        segments.append(segment)
        agents.append(Daemon(f"agent {rank}", agent_argv(rank, segment)))
        daemons.append(agents[-1])
    for agent in agents:
        agent.wait_for(r"poseidon-agent ready")
    return agent_argv, agents


def synth(args, rank, segment, daemons, extra=()):
    d = Daemon(f"rank {rank}", [
        args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
        f"--iterations={ITERATIONS}", "--compute_scale=10000", "--timeout_ms=120000", "--verify",
        "--print_iterations", *extra])
    daemons.append(d)
    return d


def replace(args, agent_argv, victim, segments, daemons, suffix, gpu=0, extra=()):
    """Rank `victim`'s replacement: a new agent with --rejoin (a new segment: the killed one's
    may be left behind) and, once it is ready, a new poseidon-synth on it; returns (agent,
    synth)."""
    segment = f"{segments[victim]}-{suffix}"
    segments.append(segment)
    agent = Daemon(f"agent {victim} ({suffix})", agent_argv(victim, segment, rejoin=True, gpu=gpu))
    daemons.append(agent)
    agent.wait_for(r"poseidon-agent ready")
    return agent, synth(args, victim, segment, daemons, extra)


def wait_all(synths, timeout=90):
    """Waits for every process to end (how each ended is checked by the caller)."""
    for s in synths:
        try:
            s.wait(timeout)
        except Exception:  # noqa: BLE001 - checked by the caller
            pass


def summary(d):
    """(verified, mismatches) from a synth's last line, or None."""
    for line in reversed(d.lines):
        m = re.search(r"verified (\d+) results, (\d+) mismatches", line)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def ring_extra(args):
    """The agents' arguments a ring that takes a rank back needs (a job that may shrink)."""
    return [f"--min_workers={RANKS}"] if args.scheme == "allreduce" else []


def fault_free(args):
    """The same job without a kill: how long its ranks take (the reference for the time lost)."""
    daemons, segments = [], []
    try:
        start_job(args, "clean", daemons, segments, "30s", extra=ring_extra(args))
        started = time.monotonic()
        synths = [synth(args, r, segments[r], daemons) for r in range(RANKS)]
        for s in synths:
            s.wait(90)
        took = time.monotonic() - started
        check(all(s.proc.returncode == 0 for s in synths) and
              all(summary(s) == (ITERATIONS * 8, 0) for s in synths),
              f"the fault-free run: every result exact ({took:.2f} s)")
        return took
    except Exception as e:  # noqa: BLE001
        check(False, f"the fault-free run: {e}")
        return None
    finally:
        stop_all(daemons, segments)


def trial(args, t, rng, kill_agent, recoveries, durations, elsewhere=False):
    daemons, segments = [], []
    try:
        agent_argv, agents = start_job(args, t, daemons, segments, "30s",
                                       extra=ring_extra(args))
        started = time.monotonic()
        synths = [synth(args, r, segments[r], daemons) for r in range(RANKS)]
        victim = rng.randrange(RANKS)
        # Somewhere in the run (120 iterations take about 6 s here), once it has begun (a slow
        # build may take a while to register).
        synths[victim].wait_for(r"iteration 1 ends at", timeout=60)
        time.sleep(rng.uniform(0.3, 3.0))
        killed = time.time()
        what = "agent" if kill_agent else "training process"
        if kill_agent:
            os.kill(agents[victim].proc.pid, signal.SIGKILL)
            # Its process notices within 5 s; a launcher stops it at once.
            os.kill(synths[victim].proc.pid, signal.SIGKILL)
        else:
            os.kill(synths[victim].proc.pid, signal.SIGKILL)
        synths[victim].wait(20)
        code = agents[victim].wait(20)  # an agent whose process died exits by itself
        if synths[victim].lines and "ends at" in synths[victim].lines[-1]:
            done_before = int(re.search(r"iteration (\d+)", synths[victim].lines[-1]).group(1))
        else:
            done_before = 0
        print(f"trial {t}: rank {victim}'s {what} killed after its iteration {done_before} "
              f"(agent exit {code})", flush=True)
        # The replacement. On another GPU (another node after a requeue): the coordinator gives
        # it the rank once it has declared the killed agent dead (--liveness_timeout), not before.
        agent, rejoined = replace(args, agent_argv, victim, segments, daemons, "rejoined",
                                  gpu=7 if elsewhere else 0)
        synths[victim] = rejoined
        switched = None
        if args.cli:
            # A plan epoch after the rank came back: the restarted agent counts its process's
            # iterations from 1, and must still switch at the job's iteration the others do.
            took = int(rejoined.wait_for(r"takes up the job at iteration (\d+)", timeout=60)
                       .group(1))
            # Once the job runs again (the coordinator plans ahead by the iterations' rate).
            rejoined.wait_for(rf"iteration {took + 1} ends at", timeout=60)
            # The coordinator knows that rate once the job's progress reports span a second;
            # before, it plans an epoch 200 iterations ahead (past this job's end): a kill early
            # in the run is back before then.
            began = re.search(r"iteration 1 ends at ([0-9.]+)",
                              "\n".join(synths[(victim + 1) % RANKS].lines))
            time.sleep(max(0.0, float(began.group(1)) + 2.0 - time.time()))
            plan = ["plan", f"--coordinator={agent_argv.coordinator}", "--job=1", f"--token={TOKEN}"]
            shown = subprocess.run([args.cli, *plan], capture_output=True, text=True, timeout=30)
            now = re.search(r"^fc1\.weight\s+(\w+)", shown.stdout, re.M)
            to = "ps" if now and now.group(1) == "sfb" else "sfb"
            p = subprocess.run([args.cli, *plan, f"--set=fc1.weight={to}"],
                               capture_output=True, text=True, timeout=30)
            switched = p.returncode == 0
            check(switched, f"trial {t}: poseidon plan --set fc1.weight={to} exits 0 "
                            f"({p.stderr.strip()})")
        wait_all(synths)
        durations.append(time.monotonic() - started)
        took = None
        first = rejoined.wait_for(r"takes up the job at iteration (\d+)", timeout=1)
        first = int(first.group(1))
        # Its second iteration's backward began after the first one's results came back: the
        # first iteration completed by the rank that came back.
        ends = [float(m.group(1)) for m in
                (re.search(r"ends at ([0-9.]+)", l) for l in rejoined.lines) if m]
        if len(ends) >= 2:
            took = ends[1] - killed
            recoveries.append(took)
        ok = all(s.proc.returncode == 0 for s in synths)
        results = [summary(s) for s in synths]
        exact = all(r is not None and r[1] == 0 and r[0] > 0 for r in results)
        expected = (ITERATIONS - first + 1) * 8  # tiny: 8 layers
        check(ok and exact and first > 1 and results[victim][0] == expected,
              f"trial {t} ({what} of rank {victim} killed"
              f"{', replaced on another GPU' if elsewhere else ''}): every rank finished, every "
              f"result exact; the rank rejoined at iteration {first} and verified {results[victim]} "
              f"results ({expected} expected); first iteration back "
              f"{'%.2f s' % took if took is not None else '?'} after the kill")
        if switched:
            counts = [re.search(r"(\d+) scheme switches", "\n".join(s.lines)) for s in synths]
            check(all(c is not None and c.group(1) == "1" for c in counts),
                  f"trial {t}: every rank, the restarted one too, switched fc1.weight at the plan "
                  f"epoch's iteration (scheme switches: "
                  f"{[c.group(1) if c else None for c in counts]})")
        if args.scheme == "allreduce":
            for r in (r for r in range(RANKS) if r != victim):
                log = "\n".join(agents[r].lines + agents[r].stderr)
                check(re.search(rf"all-reduce: rank {victim} is back in the Gloo ring of {RANKS} "
                                rf"ranks .*: the all-reduces of iteration {first} on go in it",
                                log) is not None,
                      f"trial {t}: rank {r}'s agent took rank {victim} back into a ring of "
                      f"{RANKS} from iteration {first}")
        elif args.scheme != "ps":
            sfb = [re.search(r"(\d+) on SFB", "\n".join(s.lines)) for s in synths]
            check(all(m is not None and int(m.group(1)) > 0 for m in sfb),
                  f"trial {t}: layers on SFB as registered, every rank "
                  f"({[m.group(1) if m else None for m in sfb]})")
        if elsewhere:
            log = "\n".join(agent.lines + agent.stderr)
            check("is still held by the agent this one replaces" in log,
                  f"trial {t}: the replacement on another GPU waited for the coordinator to "
                  f"declare the killed agent dead")
        if not (ok and exact):
            for s in synths:
                print(f"--- {s.name} exit {s.proc.returncode}:\n" +
                      "\n".join((s.lines + s.stderr)[-6:]))
            print("--- rejoined agent:\n" + "\n".join(agent.stderr[-15:]))
    except RuntimeError as e:
        check(False, f"trial {t}: {e}")
    finally:
        stop_all(daemons, segments)


def not_restarted(args):
    """A rank killed and never restarted: the others fail once --rejoin_timeout is over, naming it."""
    daemons, segments = [], []
    try:
        _, agents = start_job(args, "gone", daemons, segments, "3s", extra=ring_extra(args))
        synths = [synth(args, r, segments[r], daemons) for r in range(RANKS)]
        synths[2].wait_for(r"iteration 1 ends at", timeout=60)
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(synths[2].proc.pid, signal.SIGKILL)
        out = ended_after(synths[0], killed, "rank 2's kill", timeout=60)
        check(synths[0].proc.poll() not in (None, 0),
              "a rank that is not restarted: the others fail once the rejoin timeout is over")
        if args.scheme == "allreduce":  # no KV server waits for it: the agents name it
            check("rank 2 (host" in out and "left the job with an error" in out,
                  "its error names rank 2 (the training process gets the first 128 bytes)")
        else:
            check("rank 2 (127.0.0.1:" in out and "is gone" in out,
                  "its error names rank 2 (the training process gets the first 128 bytes)")
            log = "\n".join(agents[0].lines + agents[0].stderr)
            check("did not rejoin within 3s" in log,
                  "and rank 0's agent logs that it did not rejoin")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        stop_all(daemons, segments)


def main():
    ap = argparse.ArgumentParser()
    for flag in ("coordinator", "server", "agent", "synth", "model"):
        ap.add_argument(f"--{flag}", required=True)
    ap.add_argument("--trials", type=int, default=2, help="per kind of kill")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--scheme", choices=("ps", "sfb", "auto", "allreduce"), default="ps",
                    help="sfb, auto: FC layers by SFB, the others send the restarted rank their "
                         "factors; allreduce: every layer in the Gloo ring (--min_workers=4), "
                         "the restarted rank comes into a new ring with the others")
    ap.add_argument("--cli", default=None,
                    help="the poseidon CLI: once the restarted rank is back, a plan epoch moves "
                         "fc1.weight to the other scheme (with --scheme auto)")
    args = ap.parse_args()
    job_environment(TOKEN, SECRET)
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"seed {seed}, scheme {args.scheme}")
    rng = random.Random(seed)
    recoveries, durations = [], []
    clean = fault_free(args)
    for t in range(2 * args.trials):
        trial(args, t, rng, kill_agent=t % 2 == 1, recoveries=recoveries, durations=durations,
              elsewhere=t % 4 == 3)
    if recoveries:
        p50, p99 = p50_p99(recoveries)
        print(f"kill to the first iteration the rejoined rank completed: p50 {p50:.2f} s, p99 "
              f"{p99:.2f} s over {len(recoveries)} trials")
    if durations and clean:
        p50, p99 = p50_p99([d - clean for d in durations])
        print(f"time lost by a run of {ITERATIONS} iterations with one kill, against the "
              f"fault-free run's {clean:.2f} s: p50 {p50:.2f} s, p99 {p99:.2f} s")
    not_restarted(args)
    finish("PASS: a killed rank (or agent) restarted with --rejoin takes up the running job, every "
           "result exact; one not restarted is named once the rejoin timeout is over")


if __name__ == "__main__":
    main()
