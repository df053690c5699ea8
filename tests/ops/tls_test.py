#!/usr/bin/python3
"""TLS on the control plane from every daemon that calls the coordinator (issue 19): a coordinator
serving TLS with a throwaway CA (made with the openssl command line); a poseidon-server and two
poseidon-agents given coordinator_tls_ca register through it (the agents then train the tiny
model with poseidon-synth); the same server without TLS, or trusting another CA, is refused with
one line and exit 2 (gRPC's own log lines go to the debug log); `poseidon status` over TLS
lists the server and the agents under this machine's hostname.

    tls_test.py --cli POSEIDON --coordinator BIN --server BIN --agent BIN --synth BIN --model JSON
"""
import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from metrics_test import Daemon, stop_all  # noqa: E402

ap = argparse.ArgumentParser()
for flag in ("cli", "coordinator", "server", "agent", "synth", "model"):
    ap.add_argument(f"--{flag}", required=True)
args = ap.parse_args()


if subprocess.run(["sh", "-c", "command -v openssl"], capture_output=True).returncode != 0:
    print("SKIP: openssl is not installed")
    sys.exit(77)

daemons, segments = [], []
with tempfile.TemporaryDirectory() as tmp:
    script = (
        "set -e; "
        "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $1; }; "
        "ca() { key $1.key; openssl req -x509 -new -key $1.key -out $1.pem -days 2 -subj /CN=$1; }; "
        "ca ca; ca other-ca; key server.key; "
        "openssl req -new -key server.key -out server.csr -subj /CN=coordinator; "
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext; "
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 2 -extfile server.ext")
    r = subprocess.run(["sh", "-c", script], cwd=tmp, capture_output=True, text=True)
    check(r.returncode == 0, f"openssl made the certificates {r.stderr[-500:]}")
    ca, other = os.path.join(tmp, "ca.pem"), os.path.join(tmp, "other-ca.pem")
    env = dict(os.environ, POSEIDON_JOB_TOKEN="tls-token", POSEIDON_COORDINATOR_TOKEN="tls-token",
               POSEIDON_JOB_SECRET="tls-secret", POSEIDON_SECRET="tls-secret")
    os.environ.update(env)  # Daemon passes this process's environment on
    try:
        coord = Daemon("coordinator", [args.coordinator, "--listen=127.0.0.1:0", "--job_id=1",
                                       f"--tls_cert={tmp}/server.pem", f"--tls_key={tmp}/server.key",
                                       "--log_level=warn"])
        daemons.append(coord)
        addr = coord.wait_for(r"listening on (\S+)").group(1)

        def server(*extra):
            return subprocess.Popen([args.server, "--listen=127.0.0.1:0", "--job_id=1",
                                     f"--coordinator={addr}", "--log_level=warn", *extra],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)

        for what, extra in (("without TLS", ()), ("trusting another CA", (f"--coordinator_tls_ca={other}",))):
            p = server(*extra)
            out, err = p.communicate(timeout=60)
            lines = [l for l in err.splitlines() if l.strip()]
            check(p.returncode == 2 and len(lines) == 1 and "refusing to start" in lines[0],
                  f"a server {what} is refused: exit {p.returncode}, {lines}")

        good = Daemon("server", [args.server, "--listen=127.0.0.1:0", "--job_id=1",
                                 f"--coordinator={addr}", f"--coordinator_tls_ca={ca}",
                                 "--log_level=warn"])
        daemons.append(good)
        good.wait_for(r"listening on")
        check(True, "a server with coordinator_tls_ca registers")

        agents = []
        for rank in range(2):
            segment = f"/psd-ops-tls-{os.getpid()}-{rank}"
            segments.append(segment)
            agent = Daemon(f"agent {rank}", [
                args.agent, "--job_id=1", f"--rank={rank}", "--world_size=2",
                f"--coordinator={addr}", f"--coordinator_tls_ca={ca}", "--listen=127.0.0.1:0",
                f"--segment={segment}", "--log_level=warn"])
            daemons.append(agent)
            agents.append(agent)
        for agent in agents:
            agent.wait_for(r"poseidon-agent ready")
        synths = [subprocess.Popen([args.synth, f"--segment={s}", f"--model={args.model}",
                                    "--batch=8", "--iterations=20", "--compute_scale=0", "--verify"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for s in segments]
        outs = [p.communicate(timeout=120)[0] for p in synths]
        check(all(p.returncode == 0 for p in synths),
              f"two agents registered over TLS train 20 verified iterations {outs[0][-800:]}")

        # The daemons' setting, from the environment (an operator's env file serves the CLI too).
        st = subprocess.run([args.cli, "status", f"--coordinator={addr}", "--job_id=1",
                             "--token=tls-token"], capture_output=True, text=True, timeout=30,
                            env=dict(os.environ, POSEIDON_COORDINATOR_TLS_CA=ca))
        short = subprocess.run([args.cli, "status", f"--coordinator={addr}", "--job_id=1",
                                "--token=tls-token", f"--tls_ca={ca}"], capture_output=True,
                               text=True, timeout=30)
        check(short.returncode == 0, f"the CLI's short --tls_ca works too: {short.stderr}")
        host = re.escape(socket.gethostname())
        check(st.returncode == 0 and re.search(rf"server-\S+\s+alive\s+{host}\s+tcp://", st.stdout)
              and len(re.findall(rf"agent-\S+\s+1\s+\d\s+\w+\s+{host}\s+", st.stdout)) == 2,
              f"poseidon status over TLS names the server's and the agents' host "
              f"{socket.gethostname()!r} (not localhost):\n{st.stdout}{st.stderr}")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        stop_all(daemons, segments)

finish("all TLS checks passed")
