#!/usr/bin/python3
"""A shared server fleet (docs/operations.md): one poseidon-server holds the secrets of jobs 7 and
8 (--secrets_file) and registers with the coordinator as a cluster-wide server for those two
(--coordinator_token is the cluster token). One agent of each job joins; each trains through the
shared server and verifies its sums (poseidon-synth --verify); job 9's world gets no server (its
agent gives up naming what it waited for). Every process is killed and every segment removed on
every path."""

import argparse
import os
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from metrics_test import Daemon, stop_all  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    for flag in ("coordinator", "server", "agent", "synth", "model"):
        ap.add_argument(f"--{flag}", required=True)
    args = ap.parse_args()
    for k in ["POSEIDON_TOKEN", "POSEIDON_JOB_ID", "POSEIDON_COORDINATOR", "POSEIDON_CONFIG",
              "POSEIDON_SECRET", "POSEIDON_JOB_SECRET", "POSEIDON_COORDINATOR_TOKEN"]:
        os.environ.pop(k, None)
    daemons, segments = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tokens = os.path.join(tmp, "tokens")
        with open(os.open(tokens, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("7 token-7\n8 token-8\n9 token-9\n")
        secrets = os.path.join(tmp, "secrets")
        with open(os.open(secrets, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("7 secret-7\n8 secret-8\n")
        try:
            coord = Daemon("poseidon-coordinator", [
                args.coordinator, "--listen=127.0.0.1:0", f"--tokens_file={tokens}",
                "--min_servers=1"], env=dict(os.environ, POSEIDON_CLUSTER_TOKEN="cluster-token"))
            daemons.append(coord)
            addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
            server = Daemon("poseidon-server", [
                args.server, "--listen=127.0.0.1:0", f"--secrets_file={secrets}",
                f"--coordinator={addr}"],
                env=dict(os.environ, POSEIDON_COORDINATOR_TOKEN="cluster-token"))
            daemons.append(server)
            server.wait_for(r"poseidon-server listening on (\S+)")
            synths = {}
            for job in (7, 8):
                segment = f"/psd-ops-shared-{os.getpid()}-{job}"
                segments.append(segment)
                agent = Daemon(f"agent of job {job}", [
                    args.agent, f"--job_id={job}", "--rank=0", "--world_size=1",
                    f"--coordinator={addr}", "--listen=127.0.0.1:0", f"--segment={segment}"],
                    env=dict(os.environ, POSEIDON_SECRET=f"secret-{job}",
                             POSEIDON_COORDINATOR_TOKEN=f"token-{job}"))
                daemons.append(agent)
                agent.wait_for(r"poseidon-agent ready")
                synth = Daemon(f"synth of job {job}", [
                    args.synth, f"--segment={segment}", f"--model={args.model}", "--batch=8",
                    "--iterations=5", "--verify", "--timeout_ms=60000"])
                daemons.append(synth)
                synths[job] = synth
            for job, synth in synths.items():
                code = synth.wait(timeout=120)
                out = "\n".join(synth.lines + synth.stderr)
                check(code == 0 and "0 mismatches" in out,
                      f"job {job} trains through the shared server and its sums verify")
            # Job 9's agent: the coordinator has no server for it, so its world never forms.
            segment = f"/psd-ops-shared-{os.getpid()}-9"
            segments.append(segment)
            nine = Daemon("agent of job 9", [
                args.agent, "--job_id=9", "--rank=0", "--world_size=1", f"--coordinator={addr}",
                "--listen=127.0.0.1:0", f"--segment={segment}", "--connect_timeout=3s"],
                env=dict(os.environ, POSEIDON_SECRET="secret-9",
                         POSEIDON_COORDINATOR_TOKEN="token-9"))
            daemons.append(nine)
            code = nine.wait(timeout=60)
            out = "\n".join(nine.lines + nine.stderr)
            check(code not in (None, 0), "job 9's agent finds no server and exits with an error")
            check("servers: 0 of the 1 required" in out, "and says it waited for a server")
        except RuntimeError as e:
            check(False, str(e))
        finally:
            stop_all(daemons, segments)
    finish("PASS: a server shared by two jobs serves both (and no third one)")


if __name__ == "__main__":
    main()
