#!/usr/bin/python3
"""Elastic workers, issue 18: a rank that dies and is not restarted is removed, and the job goes
on with the ranks left (--min_workers). Four agents train the tiny model by PS on two KV servers
(each key backed up on the other) with --min_workers=3 and no rejoin timeout (restarts
forbidden). In each trial one rank, chosen at random, is SIGKILLed at a random moment: its
training process (its agent then exits), or its agent and the process with it (as a launcher
does).

Checked in every trial:
- the three survivors finish every iteration with exit 0, and every synchronised result is
  exact: the sum over the four ranks' gradients of that iteration until the layer's key left the
  killed rank out, the sum over the three survivors' from then on (poseidon-synth --verify
  --allow_shrink: one rank left out, the same on every layer, never back); every layer left it
  out from the iteration it died in or the next (no key mixes two memberships in one clock, and
  the keys of one iteration differ by at most one clock);
- each survivor's training process learns the world it trains in now (psd_world): its index
  among the three and 3, generation 1;
- every survivor's agent logs that the job goes on with 3 of its 4 workers, and a KV server
  that the killed rank is removed.
Printed: what the death cost the survivors (the longest of their three iterations after the kill,
against their median iteration before; p50, p99 by kind of kill), and the iterations' time before
and after.

The world grows again (--trials more of each kind): with --rejoin_timeout=1s the killed rank is
removed once the servers waited that long, then a replacement agent is started for it with
--rejoin (and a new poseidon-synth on it), as a launcher's restart or a node that returns late
would be. Checked: every rank finishes with every result exact — the survivors' results leave the
rank out from the iteration it died in (or the next) and count it again from one iteration F on
every layer (no clock mixes memberships); the replacement logs that it is readmitted from
iteration F, its process starts there and verifies every result from F on; every process ends
with the world at 4 of 4. Printed: what the return cost the survivors (the longest of their
iterations begun after the replacement started, against their median before; and how long the
replacement's agent took from its start to ready, readmitted).

With --scheme auto (the planner's plan: the FC layers on SFB, ops_shrink_sfb) the same trials
check that the FC layers ran on SFB, and each survivor's agent logs the iteration up to which
the killed rank's factors count on each SFB layer (the live agents pass on its factors of its
last iterations and agree on that iteration); a replacement that comes after the removal asks
the survivors' agents where their SFB layers are, takes up the job past the highest, and every
survivor's agent logs that the rank's SFB factors count again from the iteration it was
readmitted from — the same iteration as its PS layers', every result exact.

With --scheme allreduce (every layer in the Gloo ring, ops_shrink_allreduce) the same trials
check that each survivor's agent connected a ring of the three ranks left (generation 1): the
all-reduces that failed in the ring of four go again there, each from the gradient posted, and
where the killed rank died after some ranks had completed an all-reduce, the others take that
result (every result exact, as above). Its return trials: the replacement asks the survivors'
agents where their all-reduces are, they hold theirs from the iteration after the highest they
started until it names the iteration it takes up, and every survivor's agent logs that the rank
is back in the ring of four from that iteration (a new ring generation), every result exact.

Then --min_workers=4: a rank killed is not removed, and the others fail, naming it. Every process
is killed (and every shared-memory segment removed) on every path."""

import argparse
import os
import random
import re
import signal
import statistics
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rejoin_test  # noqa: E402
from checks import check, finish, p50_p99  # noqa: E402
from metrics_test import ended_after, job_environment, stop_all  # noqa: E402

TOKEN = rejoin_test.TOKEN  # its job: its agents take its secret
SECRET = rejoin_test.SECRET
RANKS = rejoin_test.RANKS
ITERATIONS = rejoin_test.ITERATIONS
LAYERS = 8  # tiny.json


def start_job(args, trial, daemons, segments, min_workers):
    """rejoin_test's job (a coordinator, two servers, RANKS agents) with --min_workers and no
    rejoin timeout; returns (servers, agents)."""
    _, agents = rejoin_test.start_job(args, trial, daemons, segments, "0s",
                                      extra=[f"--min_workers={min_workers}"], name="shrink")
    return [d for d in daemons if d.name.startswith("server ")], agents


def synth(args, rank, segment, daemons):
    return rejoin_test.synth(args, rank, segment, daemons, extra=["--allow_shrink"])


def finished_exact(t, r, s, what):
    """Checks that rank r's poseidon-synth `s` finished every iteration, every result exact."""
    last = (s.lines + s.stderr)[-1:] or ["(nothing)"]
    check(s.proc.returncode == 0 and rejoin_test.summary(s) == (ITERATIONS * LAYERS, 0),
          f"trial {t} ({what}): rank {r} finished every iteration, every result exact "
          f"({last[0][:160]})")


def world_line(s, pattern):
    """The match of `pattern` in its --allow_shrink summary line, or None."""
    return next((re.search(pattern, l) for l in s.lines if "left out rank" in l), None)


def ends(d):
    """[(iteration, time it ended)] from a synth's --print_iterations lines."""
    out = []
    for line in d.lines:
        m = re.search(r"iteration (\d+) ends at ([0-9.]+)", line)
        if m:
            out.append((int(m.group(1)), float(m.group(2))))
    return out


def trial(args, t, rng, kill_agent, pauses, steps):
    daemons, segments = [], []
    try:
        servers, agents = start_job(args, t, daemons, segments, min_workers=3)
        synths = [synth(args, r, segments[r], daemons) for r in range(RANKS)]
        victim = rng.randrange(RANKS)
        synths[victim].wait_for(r"iteration 1 ends at", timeout=60)
        time.sleep(rng.uniform(0.3, 3.0))  # somewhere in the run (about 6 s here)
        killed = time.time()
        what = "agent" if kill_agent else "training process"
        if kill_agent:
            os.kill(agents[victim].proc.pid, signal.SIGKILL)
        os.kill(synths[victim].proc.pid, signal.SIGKILL)
        synths[victim].wait(20)
        agents[victim].wait(20)  # an agent whose process died exits by itself
        died_in = ends(synths[victim])[-1][0] + 1 if ends(synths[victim]) else 1
        print(f"trial {t}: rank {victim}'s {what} killed in its iteration {died_in}", flush=True)
        survivors = [r for r in range(RANKS) if r != victim]
        rejoin_test.wait_all(synths[r] for r in survivors)
        for r in survivors:
            s = synths[r]
            finished_exact(t, r, s, f"{what} of rank {victim} killed")
            m = world_line(s, r"left out rank (\d+) from iterations (\d+) to (\d+) \(by "
                              r"layer\); world now rank (\d+) of (\d+) \(generation (\d+)\)")
            if m is None:
                check(False, f"trial {t}: rank {r}'s results left rank {victim} out "
                             f"({[l for l in s.lines if 'world now' in l]})")
                continue
            gone, first, last_from, live_rank, live_size, generation = map(int, m.groups())
            check(gone == victim and died_in - 1 <= first and last_from <= died_in + 1 and
                  last_from - first <= 1,
                  f"trial {t}: rank {r}'s results left out rank {gone} (killed: {victim}) from "
                  f"iterations {first} to {last_from} by layer (it died in {died_in})")
            check((live_rank, live_size, generation) == (survivors.index(r), RANKS - 1, 1),
                  f"trial {t}: rank {r} trains as rank {live_rank} of {live_size}, generation "
                  f"{generation} (psd_world)")
        for r in survivors:
            log = "\n".join(agents[r].lines + agents[r].stderr)
            check(f"rank {victim} " in log and
                  f"the job goes on with {RANKS - 1} of its {RANKS} workers" in log,
                  f"trial {t}: rank {r}'s agent logs that the job goes on without rank {victim}")
            if args.scheme == "allreduce":
                # The ring of the three left connected, and the all-reduces that failed in the
                # ring of four went again in it (or took the result a rank had completed).
                ring = re.search(rf"the Gloo ring of 3 ranks without rank {victim} \(neighbours: "
                                 rf"ranks \d+ and \d+\) connected \(ring generation 1\)", log)
                check(ring is not None,
                      f"trial {t}: rank {r}'s agent connected the ring of the three ranks left")
                handed = re.findall(r"all-reduce of (\S+) iteration (\d+): rank (\d+) "
                                    r"completed it before the ring lost a rank", log)
                again = log.count("it goes again in the ring of the ranks left")
                print(f"trial {t}: rank {r}: {again} all-reduces went again in the new ring, "
                      f"{len(handed)} took the result another rank had completed before rank "
                      f"{victim} died {sorted(set(handed))}", flush=True)
            elif args.scheme != "ps":
                cuts = re.findall(rf"layer (\d+): rank {victim}'s SFB factors count up to "
                                  rf"iteration (\d+), not after", log)
                check(len(cuts) >= 3,
                      f"trial {t}: rank {r}'s agent agreed on the last iteration of rank "
                      f"{victim}'s factors on each SFB layer ({cuts})")
        if args.scheme == "allreduce":
            ring = [re.search(r"all-reduce: Gloo ring of 4 ranks connected",
                              "\n".join(agents[r].lines + agents[r].stderr)) for r in survivors]
            check(all(ring), f"trial {t}: every survivor ran its layers in the ring of four first")
        elif args.scheme != "ps":
            sfb = [re.search(r"(\d+) on SFB", "\n".join(synths[r].lines)) for r in survivors]
            check(all(m is not None and int(m.group(1)) > 0 for m in sfb),
                  f"trial {t}: layers on SFB as registered, every survivor "
                  f"({[m.group(1) if m else None for m in sfb]})")
        server_log = "\n".join(l for s in servers for l in s.lines + s.stderr)
        # With every layer on the ring the KV servers hold no key: the agents alone remove it.
        check(args.scheme == "allreduce" or f"rank {victim} (" in server_log and "it is removed, the job goes on with 3 of its "
              "4 workers" in server_log,
              f"trial {t}: a KV server logs that rank {victim} is removed")
        if kill_agent and args.scheme != "allreduce":
            # Declared dead on a report of its closed connections (a KV server's ranks_gone; in a
            # job with SFB layers also the agents' peers_gone) once it missed two heartbeats
            # (0.8 s here), not at the end of its 2 s lease.
            coord_log = "\n".join(l for d in daemons if d.name == "coordinator"
                                  for l in d.lines + d.stderr)
            m = re.search(r"declared dead: its connections to (KV server \S+|rank \d+'s agent) "
                          r"closed", coord_log)
            check(m is not None,
                  f"trial {t}: the coordinator declared rank {victim}'s killed agent dead on a "
                  f"report of its closed connections "
                  f"({[l for l in coord_log.splitlines() if 'declared dead' in l]})")
        # What the death cost the survivors: the longest of the three iterations that end after
        # the kill (the one in flight may not need the dead rank's push yet: its pulls overlap
        # the next iteration's compute) against their median iteration before.
        e = ends(synths[survivors[0]])
        gaps = [(a, b) for a, b in zip(e, e[1:]) if b[1] >= killed]
        before = [b[1] - a[1] for a, b in zip(e, e[1:]) if b[1] < killed]
        if gaps and before:
            longest = max(b[1] - a[1] for a, b in gaps[:3])
            pauses.append((what, longest - statistics.median(before)))
            later = [y[1] - x[1] for x, y in gaps[3:]]
            if later:
                steps.append((statistics.median(before), statistics.median(later)))
    except RuntimeError as e:
        check(False, f"trial {t}: {e}")
    finally:
        stop_all(daemons, segments)


def comes_back(args, t, rng, kill_agent, costs, readies):
    """A removed rank's replacement is readmitted: the world grows again."""
    daemons, segments = [], []
    try:
        agent_argv, agents = rejoin_test.start_job(
            args, t, daemons, segments, "1s", extra=["--min_workers=3"], name="regrow")
        servers = [d for d in daemons if d.name.startswith("server ")]
        synths = [synth(args, r, segments[r], daemons) for r in range(RANKS)]
        victim = rng.randrange(RANKS)
        synths[victim].wait_for(r"iteration 1 ends at", timeout=60)
        time.sleep(rng.uniform(0.2, 1.2))  # early enough to come back before the others end
        what = "agent" if kill_agent else "training process"
        if kill_agent:
            os.kill(agents[victim].proc.pid, signal.SIGKILL)
        os.kill(synths[victim].proc.pid, signal.SIGKILL)
        synths[victim].wait(20)
        agents[victim].wait(20)
        # Back once every server removed it (its rejoin timeout ran out: the others went on);
        # with every layer in the ring the servers hold no key: once the survivors' agents did.
        if args.scheme == "allreduce":
            for r in (r for r in range(RANKS) if r != victim):
                agents[r].wait_for(rf"rank {victim} .*the job goes on with {RANKS - 1} of its",
                                   timeout=30)
        else:
            for server in servers:
                server.wait_for(rf"rank {victim} \(.*it is removed", timeout=30)
        returned = time.time()
        agent, back = rejoin_test.replace(args, agent_argv, victim, segments, daemons, "back",
                                          extra=["--allow_shrink"])
        # Started to readmitted: the agent's start, its process's registration, the SFB
        # agents' answers, the servers' readmission and the wait for the others to reach the
        # clock before the one it is readmitted from (its log line, once that is done).
        # With every layer in the ring the servers' keys are idle: the replacement may register
        # before a server removed the rank (it then takes up the iteration the ring names).
        readmitted_line = (r"(?:is readmitted to job 1 from|takes up job 1 at|rejoins job 1 at) "
                           r"iteration (\d+)")
        agent.wait_for(readmitted_line, timeout=60)
        readies.append((what, time.time() - returned))
        synths[victim] = back
        rejoin_test.wait_all(synths)
        log = "\n".join(agent.lines + agent.stderr)
        m = re.search(readmitted_line, log)
        check(m is not None, f"trial {t} ({what} of rank {victim} killed, then back): the "
                             f"replacement logs that it is readmitted")
        readmitted = int(m.group(1)) if m else -1
        started = back.wait_for(r"takes up the job at iteration (\d+)", timeout=1)
        check(int(started.group(1)) == readmitted,
              f"trial {t}: its process starts at iteration {started.group(1)} (readmitted from "
              f"{readmitted})")
        done = rejoin_test.summary(back)
        check(back.proc.returncode == 0 and
              done == ((ITERATIONS - readmitted + 1) * LAYERS, 0),
              f"trial {t}: the replacement verified {done} results, every one exact")
        for r in (r for r in range(RANKS) if r != victim):
            s = synths[r]
            finished_exact(t, r, s, f"{what} of rank {victim} killed, then back")
            m = world_line(s, r"left out rank (\d+) from iterations (\d+) to (\d+) \(by "
                              r"layer\) and counted it again from iterations (\d+) to (\d+); "
                              r"world now rank (\d+) of (\d+) \(generation (\d+)\)")
            if m is None:
                check(False, f"trial {t}: rank {r}'s results left rank {victim} out and counted "
                             f"it again ({[l for l in s.lines if 'world now' in l]})")
                continue
            gone, _, out_last, back_first, back_last, live_rank, live_size, generation = map(
                int, m.groups())
            check(gone == victim and back_first == back_last == readmitted and
                  out_last < readmitted,
                  f"trial {t}: rank {r}'s results left out rank {gone} until iteration "
                  f"{out_last} and counted it again from {back_first} to {back_last} by layer "
                  f"(readmitted from {readmitted})")
            # Its agent may never have seen the rank gone (the replacement registered before the
            # coordinator declared the killed agent dead): generation 0; else 2.
            check((live_rank, live_size) == (r, RANKS) and generation in (0, 2),
                  f"trial {t}: rank {r} ends as rank {live_rank} of {live_size}, generation "
                  f"{generation} (psd_world)")
        if args.scheme == "allreduce":
            for r in (r for r in range(RANKS) if r != victim):
                log = "\n".join(agents[r].lines + agents[r].stderr)
                check(re.search(rf"all-reduce: rank {victim} is back in the Gloo ring of {RANKS} "
                                rf"ranks .*: the all-reduces of iteration {readmitted} on go in "
                                rf"it", log) is not None,
                      f"trial {t}: rank {r}'s agent took rank {victim} back into its ring from "
                      f"iteration {readmitted}")
        elif args.scheme != "ps":
            for r in (r for r in range(RANKS) if r != victim):
                log = "\n".join(agents[r].lines + agents[r].stderr)
                check(f"rank {victim} came back: its SFB factors count again from iteration "
                      f"{readmitted}" in log,
                      f"trial {t}: rank {r}'s agent counts rank {victim}'s SFB factors again from "
                      f"iteration {readmitted}, as its PS layers")
        e = ends(synths[(victim + 1) % RANKS])
        # Iterations begun before the replacement started include the wait for the killed rank
        # (the rejoin timeout, until the servers removed it): not the return's cost.
        before = [b[1] - a[1] for a, b in zip(e, e[1:]) if b[1] < returned]
        after = [b[1] - a[1] for a, b in zip(e, e[1:]) if a[1] >= returned]
        if before and after:
            costs.append((what, max(after) - statistics.median(before)))
    except RuntimeError as e:
        check(False, f"trial {t}: {e}")
    finally:
        stop_all(daemons, segments)


def too_few(args):
    """--min_workers=4: a killed rank cannot be removed; the others fail, naming it."""
    daemons, segments = [], []
    try:
        _, agents = start_job(args, "few", daemons, segments, min_workers=4)
        synths = [synth(args, r, segments[r], daemons) for r in range(RANKS)]
        synths[2].wait_for(r"iteration 1 ends at", timeout=60)
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(synths[2].proc.pid, signal.SIGKILL)
        out = ended_after(synths[0], killed, "rank 2's kill", timeout=60)
        check(synths[0].proc.poll() not in (None, 0),
              "--min_workers=4 of 4: a killed rank is not removed, the others fail")
        check("rank 2" in out, f"and the error names rank 2: {out[-200:]}")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        stop_all(daemons, segments)


def report(samples, what):
    """Prints p50, p99 and range of (kind of kill, seconds) samples: all, then by kind."""
    for kind in ("all", "training process", "agent"):
        values = [v for how, v in samples if kind in ("all", how)]
        if values:
            p50, p99 = p50_p99(values)
            print(f"{kind} {what} p50 {p50:.2f} s, p99 {p99:.2f} s (range {min(values):.2f} - "
                  f"{max(values):.2f} s) over {len(values)} trials")


def main():
    ap = argparse.ArgumentParser()
    for flag in ("coordinator", "server", "agent", "synth", "model"):
        ap.add_argument(f"--{flag}", required=True)
    ap.add_argument("--trials", type=int, default=1, help="per kind of kill")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--scheme", choices=("ps", "sfb", "auto", "allreduce"), default="ps",
                    help="the agents' --scheme (auto: the FC layers on SFB; allreduce: every "
                         "layer in the Gloo ring)")
    args = ap.parse_args()
    job_environment(TOKEN, SECRET)
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"seed {seed}, scheme {args.scheme}")
    rng = random.Random(seed)
    pauses, steps = [], []
    for t in range(2 * args.trials):
        trial(args, t, rng, kill_agent=t % 2 == 1, pauses=pauses, steps=steps)
    costs, readies = [], []
    for t in range(2 * args.trials):
        comes_back(args, f"back{t}", rng, kill_agent=t % 2 == 1, costs=costs, readies=readies)
    report(pauses, "killed: the longest of the survivors' three iterations after the kill took "
                   "longer than their median iteration by")
    report(costs, "killed, then back: the longest of the survivors' iterations begun after the "
                  "replacement started took longer than their median before by")
    report(readies, "killed, then back: the replacement's agent was readmitted after")
    if steps:
        print("iteration time before / after the world shrank (median per trial): " +
              ", ".join(f"{a * 1000:.1f} / {b * 1000:.1f} ms" for a, b in steps))
    too_few(args)
    back = ("every all-reduce left in the ring of four went again in the ring of the ranks "
            "left, or took the result a rank had completed; a replacement that comes later "
            "comes back into the ring, and the world grows again"
            if args.scheme == "allreduce" else
            "a replacement that comes later is readmitted and the world grows again"
            if args.scheme == "ps" else
            "the live agents agree on each SFB layer's last iteration that counts it; a "
            "replacement that comes later is readmitted, its SFB layers from the same iteration "
            "as its PS layers, and the world grows again")
    finish(f"PASS: a killed rank (or agent) not restarted is removed and the job goes on with the "
           f"ranks left, every result exact; {back}; with too few left the others fail naming it")


if __name__ == "__main__":
    main()
