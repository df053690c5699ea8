#!/usr/bin/python3
"""Failure detection without the launcher: two agents train the tiny model through a coordinator
(--liveness_timeout=2s); rank 1's agent is frozen (SIGSTOP). The coordinator declares it dead when
its lease runs out, rank 0's agent learns it from its next heartbeat and fails the waiting layers
at once: rank 0's training process exits with an error naming rank 1, its host and why, long
before the 60 s sync timeout. Every process is killed (and every shared-memory segment removed) on
every path."""

import argparse
import os
import signal
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from metrics_test import (Daemon, coordinated_job, ended_after, job_environment,  # noqa: E402
                          stop_all)

TOKEN = "ops-lost-member-token"


def main():
    ap = argparse.ArgumentParser()
    for flag in ("coordinator", "server", "agent", "synth", "model"):
        ap.add_argument(f"--{flag}", required=True)
    args = ap.parse_args()
    job_environment(TOKEN, "ops-lost-member-secret")
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
        for agent in agents:
            try:
                os.kill(agent.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_all(daemons, segments)
    finish("PASS: a frozen agent is declared dead and named to the other rank's training process",
           on_failure="\n".join(l for d in daemons for l in d.stderr[-10:]))


if __name__ == "__main__":
    main()
