#!/usr/bin/python3
"""Issue 17: a replacement KV server joins the running job and restores the copies a lost one
took with it. Four agents train the tiny model by PS on two KV servers through a coordinator,
each key backed up on the other server (--replicas=1, the default). In each trial one server,
chosen at random, is SIGKILLed at a random moment: the agents go on at the other, which now holds
the only copy of every key (none is left to take one). A replacement server is then started,
as systemd's Restart= or an operator would: it registers with the coordinator, which tells the
agents it joined the job; they register the job there and name it to the surviving server, which
copies every key to it at the key's next clock. Once it holds them, the surviving server is
SIGKILLed too: with two servers and no replacement that would end the job. In every other trial
a rank is then SIGKILLed and restarted with --rejoin: every key lives on the replacement only,
and the restarted agent takes it up before its keys start.

Checked in every trial: every rank finishes every iteration with exit 0, and every synchronised
result equals the exact sum over the four ranks' gradients of that iteration (--verify): the
fault-free run's; the replacement logs that it adopts the keys first held by each of the two
original servers, and that it is now their primary after the second kill. Every other trial
kills the second server only once every agent logged that it took the replacement up; the
others as soon as the replacement holds every key, so that an agent which has not taken it up
yet waits for it at its chain's end (printed: how many did). Printed: the time from the
replacement's start until every agent uses it and it holds a copy of every key (p50, p99). Every process is killed (and every shared-memory segment removed) on every
path."""

import argparse
import os
import random
import re
import signal
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rejoin_test  # noqa: E402
from checks import check, finish, p50_p99  # noqa: E402
from metrics_test import Daemon, job_environment, stop_all  # noqa: E402

# Long enough that a kill, a replacement's join and the copies all fall within the run.
rejoin_test.ITERATIONS = 400
RANKS = rejoin_test.RANKS
LAYERS = 8  # tiny.json


def show(daemons):
    """What the servers and rank 0 said last (after a failed check)."""
    for d in daemons:
        if d.name.startswith(("server", "agent 0", "rank 0")):
            print(f"--- {d.name}:\n" + "\n".join((d.lines + d.stderr)[-12:]))


def trial(args, t, rng, restored):
    daemons, segments = [], []
    try:
        agent_argv, agents = rejoin_test.start_job(args, t, daemons, segments, "30s",
                                                   name="join")
        servers = [d for d in daemons if d.name.startswith("server ")]
        synths = [rejoin_test.synth(args, r, segments[r], daemons) for r in range(RANKS)]
        synths[0].wait_for(r"iteration 2 ends at", timeout=60)
        time.sleep(rng.uniform(0.1, 1.0))
        victim = rng.randrange(2)
        survivor = 1 - victim
        os.kill(servers[victim].proc.pid, signal.SIGKILL)
        servers[victim].wait(20)
        killed_after = rejoin_test.summary(synths[0])
        print(f"trial {t}: server {victim} killed", flush=True)
        # The survivor serves every key now; a replacement comes (the same daemon, started
        # again: another port, as after a restart on another node).
        started = time.monotonic()
        joined = Daemon("server 2 (replacement)", [
            args.server, "--listen=127.0.0.1:0", "--job_id=1",
            f"--coordinator={agent_argv.coordinator}"])
        daemons.append(joined)
        joined.wait_for(r"poseidon-server listening on (\S+)")
        # Every agent walks on to it after a loss once it has taken it up (logged that it
        # joined). Every other trial does not wait for that: an agent that has not taken it up
        # when the last original server dies waits for it at the chain's end
        # (JoinedServers::Park) rather than failing.
        if t % 2 == 0:
            for a in agents:
                a.wait_for(r"joined the running job", timeout=60)
        for first in range(2):
            joined.wait_for(rf"adopts the keys first held by server {first} ", timeout=60)
        # Each key takes its copy at its own next clock: every layer has had one once rank 0
        # ended two more iterations.
        now = max([int(m.group(1)) for m in
                   (re.search(r"iteration (\d+) ends at", l) for l in list(synths[0].lines))
                   if m] or [0])
        synths[0].wait_for(rf"iteration {now + 2} ends at", timeout=60)
        if t % 2 == 0:
            restored.append(time.monotonic() - started)
            print(f"trial {t}: every agent uses the replacement and it holds a copy of every key "
                  f"{restored[-1]:.2f} s after it started", flush=True)
        else:
            took = sum(any("joined the running job" in l for l in a.lines + a.stderr)
                       for a in agents)
            print(f"trial {t}: the replacement holds a copy of every key "
                  f"{time.monotonic() - started:.2f} s after it started; {took} of {RANKS} "
                  f"agents had taken it up", flush=True)
        os.kill(servers[survivor].proc.pid, signal.SIGKILL)
        servers[survivor].wait(20)
        print(f"trial {t}: server {survivor} killed (no original server left)", flush=True)
        expected = [rejoin_test.ITERATIONS * LAYERS] * RANKS
        rejoiner = None
        if t % 2 == 1:
            # A rank dies now and is restarted with --rejoin: every key lives on the replacement
            # only, which its agent takes up before its keys start (the coordinator declared
            # both plan servers dead after --liveness_timeout).
            time.sleep(3)
            rejoiner = rng.randrange(RANKS)
            os.kill(synths[rejoiner].proc.pid, signal.SIGKILL)
            synths[rejoiner].wait(20)
            agents[rejoiner].wait(20)  # an agent whose process died exits by itself
            agent, synths[rejoiner] = rejoin_test.replace(args, agent_argv, rejoiner, segments,
                                                          daemons, "rejoined")
            first = int(agent.wait_for(r"rejoins job 1 at iteration (\d+)", timeout=60).group(1))
            expected[rejoiner] = (rejoin_test.ITERATIONS - first + 1) * LAYERS
            log = "\n".join(agent.lines + agent.stderr)
            check(all(f"KV server {s} (" in log and "declared dead by the coordinator" in log
                      for s in range(2)) and
                  log.count("its keys start at server 2 ") == 2,
                  f"trial {t}: rank {rejoiner}'s replacement started the keys of both dead plan "
                  f"servers at the joined one and took up the job at iteration {first}")
        rejoin_test.wait_all(synths, timeout=120)
        for r, s in enumerate(synths):
            last = (s.lines + s.stderr)[-1:] or ["(nothing)"]
            check(s.proc.returncode == 0 and rejoin_test.summary(s) == (expected[r], 0),
                  f"trial {t}: rank {r}{' (rejoined)' if r == rejoiner else ''} finished every "
                  f"iteration, every result exact ({last[0][:400]})")
        log = "\n".join(joined.lines + joined.stderr)
        check(all(f"is now the primary of the keys first held by server {f} " in log
                  for f in range(2)),
              f"trial {t}: the replacement became the primary of every key after the second "
              f"kill")
        check(killed_after is None,
              f"trial {t}: the first kill came while rank 0 was still training")
        waited = sum(any("waiting for the server that joined" in l for l in a.lines + a.stderr)
                     for a in agents)
        print(f"trial {t}: {waited} agent(s) waited at a chain's end for the replacement to be "
              f"taken up", flush=True)
        if any(s.proc.returncode != 0 for s in synths):
            show(daemons)
    except RuntimeError as e:
        check(False, f"trial {t}: {e}")
        show(daemons)
    finally:
        stop_all(daemons, segments)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--agent", required=True)
    parser.add_argument("--synth", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    args.scheme = "ps"
    job_environment(rejoin_test.TOKEN, rejoin_test.SECRET)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    restored = []
    for t in range(args.trials):
        trial(args, t, rng, restored)
    if restored:
        p50, p99 = p50_p99(restored)
        print(f"replacement server: known to every agent and every key copied to it {p50:.2f} s "
              f"(p50), {p99:.2f} s (p99) after it started ({len(restored)} trials)")
    finish("a replacement server joins the running job and restores the copies")


if __name__ == "__main__":
    main()
