#!/usr/bin/python3
"""Plans that change while training runs: two agents (each first probing its server link, which
the first plan uses) train the tiny model with poseidon-synth
--verify through a coordinator; the operator moves fc2.weight to SFB and back to PS with
`poseidon plan --set` while they run. Both ranks must switch at the same iteration, each time,
every synchronised result must equal the exact sum (0 mismatches), and `poseidon status` must show
the plan epoch each agent runs. Every process is killed (and every shared-memory segment removed)
on every path."""

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from metrics_test import Daemon, coordinated_job, job_environment, stop_all  # noqa: E402

TOKEN = "ops-plan-change-token"
LAYER = "fc2.weight"


def status(args, env):
    p = subprocess.run([args.cli, "status", "--json"], capture_output=True, text=True, timeout=30,
                       env=env)
    return json.loads(p.stdout) if p.returncode == 0 else None


def agent_iterations(doc):
    return [n["iteration"] for n in doc["nodes"] if n["role"] == "agent"] if doc else []


def set_scheme(args, addr, scheme):
    p = subprocess.run([args.cli, "plan", f"--coordinator={addr}", "--job=1", f"--token={TOKEN}",
                        f"--set={LAYER}={scheme}"], capture_output=True, text=True, timeout=30)
    print(f"$ poseidon plan --set {LAYER}={scheme} -> rc {p.returncode}\n{p.stdout}{p.stderr}")
    check(p.returncode == 0, f"poseidon plan --set {LAYER}={scheme} exits 0")
    return p


def wait_switch(synths, scheme, after=0, timeout=60):
    """The iteration each rank's synth reports for LAYER switching to `scheme` (the first one
    later than `after`)."""
    pattern = re.compile(rf"layer \d+ \({re.escape(LAYER)}\) runs {scheme} from iteration (\d+)")
    found = []
    for s in synths:
        deadline = time.monotonic() + timeout
        while True:
            its = [int(m.group(1)) for m in map(pattern.search, list(s.lines)) if m]
            its = [i for i in its if i > after]
            if its:
                found.append(its[0])
                break
            if time.monotonic() > deadline or s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} never switched {LAYER} to {scheme} after "
                                   f"iteration {after}: " + "\n".join(s.lines[-5:] + s.stderr[-5:]))
            time.sleep(0.1)
    return found


def main():
    ap = argparse.ArgumentParser()
    for flag in ("cli", "coordinator", "server", "agent", "synth", "model"):
        ap.add_argument(f"--{flag}", required=True)
    args = ap.parse_args()
    env = job_environment(TOKEN, "ops-plan-change-secret")
    daemons, segments, synths, agents = [], [], [], []
    try:
        addr, agents = coordinated_job(
            args, "plan", "ops-plan-change-secret", daemons, segments,
            coordinator_flags=["--log_level=info"],
            agent_flags=["--telemetry_interval=200ms", "--log_level=info"])
        for agent in agents:
            # The first plan from a measurement: each agent probed its server link first.
            agent.wait_for(r"server \S+ \(\S+\): [0-9.e+]+ Gbit/s measured by a \d+-byte probe",
                           timeout=5)
        for rank, segment in enumerate(segments):
            # ~4 ms of emulated compute per iteration: long enough for two plan changes.
            synth = Daemon(f"synth {rank}", [
                args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
                "--iterations=600", "--compute_scale=10000", "--verify", "--print_switches"])
            daemons.append(synth)
            synths.append(synth)
        jenv = dict(env, POSEIDON_COORDINATOR=addr, POSEIDON_JOB_ID="1", POSEIDON_TOKEN=TOKEN)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            its = agent_iterations(status(args, jenv))
            if len(its) == 2 and min(its) >= 20:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("the agents never reported 20 iterations")
        set_scheme(args, addr, "ps")  # whatever the cost model chose: PS now
        time.sleep(1)
        set_scheme(args, addr, "sfb")
        to_sfb = wait_switch(synths, "SFB")
        print(f"to SFB at iterations {to_sfb}")
        check(len(set(to_sfb)) == 1, f"both ranks run {LAYER} by SFB from the same iteration")
        set_scheme(args, addr, "ps")
        to_ps = wait_switch(synths, "PS", after=to_sfb[0])
        print(f"back to PS at iterations {to_ps}")
        check(len(set(to_ps)) == 1 and to_ps[0] > to_sfb[0],
              f"both ranks run {LAYER} by PS again from the same, later iteration")
        # The epoch every agent runs, as status shows it, is the job's.
        doc = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            doc = status(args, jenv)
            job = [j for j in (doc or {}).get("jobs", []) if j["job_id"] == "1"]
            epochs = [n.get("plan_epoch", 0) for n in (doc or {}).get("nodes", [])
                      if n["role"] == "agent"]
            if job and len(epochs) == 2 and all(e == job[0]["plan_epoch"] for e in epochs):
                break
            time.sleep(0.3)
        else:
            check(False, "status shows every agent running the job's plan epoch: "
                  + json.dumps(doc)[:2000])
        for s in synths:
            s.wait(120)
        for s in synths:
            out = "\n".join(s.lines + s.stderr)
            m = re.search(r"verified (\d+) results, (\d+) mismatches", out)
            check(s.proc.returncode == 0 and m and int(m.group(1)) > 0 and m.group(2) == "0",
                  f"{s.name}: every result exact across both switches (exit {s.proc.returncode}: "
                  f"{out[-1500:]})")
        for a in agents:
            a.wait_for(rf"plan epoch \d+: layer \d+ \({re.escape(LAYER)}\) runs SFB from "
                       rf"iteration {to_sfb[0]}", timeout=5)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        check(False, str(e))
    finally:
        stop_all(daemons, segments)
    finish("PASS: plan changes switch every rank at the same iteration, results exact",
           on_failure="\n".join(l for d in daemons for l in d.stderr[-15:]))


if __name__ == "__main__":
    main()
