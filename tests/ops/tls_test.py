#!/usr/bin/python3
"""TLS everywhere (issue 19), with a throwaway CA made with the openssl command line (pki.py).
Control plane: a coordinator serving TLS; two poseidon-servers and two poseidon-agents given
coordinator_tls_ca register through it; the same server without TLS, or trusting another CA, is
refused with one line and exit 2 (gRPC's own log lines go to the debug log); `poseidon status`
over TLS lists the servers and the agents under this machine's hostname.
Data plane: the servers and agents also have data_tls settings (the agents from the
environment, POSEIDON_DATA_TLS_*): every push, pull and backup replica (--replicas=1) goes over
TLS, and 20 iterations of the tiny model through poseidon-synth --verify are exact; an agent
without data_tls against those servers, and one trusting another CA, fail naming the reason.

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
from pki import have_openssl, make_pki  # noqa: E402

ap = argparse.ArgumentParser()
for flag in ("cli", "coordinator", "server", "agent", "synth", "model"):
    ap.add_argument(f"--{flag}", required=True)
args = ap.parse_args()


if not have_openssl():
    print("SKIP: openssl is not installed")
    sys.exit(77)

daemons, segments = [], []
with tempfile.TemporaryDirectory() as tmp:
    made, err = make_pki(tmp)
    check(made, f"openssl made the certificates {err}")
    ca, other = os.path.join(tmp, "ca.pem"), os.path.join(tmp, "other-ca.pem")
    data_tls = [f"--data_tls_cert={tmp}/server.pem", f"--data_tls_key={tmp}/server.key",
                f"--data_tls_ca={ca}"]
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

        good = [Daemon(f"server {i}", [args.server, "--listen=127.0.0.1:0", "--job_id=1",
                                       f"--coordinator={addr}", f"--coordinator_tls_ca={ca}",
                                       *data_tls, "--log_level=info"])
                for i in range(2)]
        daemons.extend(good)
        for s in good:
            s.wait_for(r"listening on")
        check(all(s.wait_for(r"transport: .*TCP with TLS \(data_tls\)") for s in good),
              "servers with coordinator_tls_ca register and serve the data plane over TLS")
        server_addr = good[0].wait_for(r"listening on (\S+)").group(1)

        def lone_agent(extra_env):
            """A one-rank agent without a coordinator reaching server 0 by address, and its
            framework (it connects when the framework registers the model)."""
            segment = f"/psd-ops-tls-lone-{os.getpid()}"
            agent = subprocess.Popen([args.agent, "--job_id=1", "--rank=0", "--world_size=1",
                                      f"--servers={server_addr}", "--listen=127.0.0.1:0",
                                      f"--segment={segment}", "--connect_timeout=10s",
                                      "--log_level=warn"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env=dict(env, **extra_env))
            try:
                synth = subprocess.run([args.synth, f"--segment={segment}",
                                        f"--model={args.model}", "--batch=8", "--iterations=2",
                                        "--compute_scale=0", "--verify"], capture_output=True,
                                       text=True, timeout=90)
                out = agent.communicate(timeout=60)[0]
            finally:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait()
            return synth.returncode, agent.returncode, out + synth.stdout + synth.stderr

        rc, arc, out = lone_agent({})
        check(rc != 0 and arc != 0 and "on a TLS listener" in out and "data_tls" in out,
              f"an agent without data_tls is told the servers serve TLS: exits {rc}, {arc}, "
              f"{out[-600:]}")
        rc, arc, out = lone_agent({"POSEIDON_DATA_TLS_CA": other,
                                  "POSEIDON_DATA_TLS_CERT": f"{tmp}/stranger.pem",
                                  "POSEIDON_DATA_TLS_KEY": f"{tmp}/stranger.key"})
        check(rc != 0 and arc != 0 and "certificate verify failed" in out,
              f"an agent trusting another CA refuses the servers: exits {rc}, {arc}, "
              f"{out[-600:]}")

        agents = []
        agent_env = dict(env, POSEIDON_DATA_TLS_CERT=f"{tmp}/server.pem",
                         POSEIDON_DATA_TLS_KEY=f"{tmp}/server.key", POSEIDON_DATA_TLS_CA=ca)
        for rank in range(2):
            segment = f"/psd-ops-tls-{os.getpid()}-{rank}"
            segments.append(segment)
            agent = Daemon(f"agent {rank}", [
                args.agent, "--job_id=1", f"--rank={rank}", "--world_size=2",
                f"--coordinator={addr}", f"--coordinator_tls_ca={ca}", "--listen=127.0.0.1:0",
                f"--segment={segment}", "--replicas=1", "--log_level=info"], env=agent_env)
            daemons.append(agent)
            agents.append(agent)
        for agent in agents:
            agent.wait_for(r"poseidon-agent ready")
        check(all(a.wait_for(r"transport: .*TCP with TLS") for a in agents),
              "the agents take data_tls from the environment")
        synths = [subprocess.Popen([args.synth, f"--segment={s}", f"--model={args.model}",
                                    "--batch=8", "--iterations=20", "--compute_scale=0", "--verify"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for s in segments]
        outs = [p.communicate(timeout=120)[0] for p in synths]
        check(all(p.returncode == 0 for p in synths),
              f"two agents over TLS (control and data plane, with backups) train 20 verified "
              f"iterations {outs[0][-800:]}")

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
