#!/usr/bin/python3
"""Metrics an operator scrapes: poseidon-coordinator and poseidon-server (registered with it) run
on loopback with --metrics_listen; their /metrics must pass `promtool check metrics`
(`--mode exposition`), and a real Prometheus must scrape them and answer queries
(`--mode prometheus`). Every process is killed on every path. Exit 77 (skip) when promtool or
prometheus is missing (Debian package prometheus)."""

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

SKIP = 77
JOB_ID = "1"
TOKEN = "ops-test-coordinator-token"
SECRET = "ops-test-job-secret"


class Daemon:
    """A child process whose stdout/stderr are collected; `wait_for` waits for a stdout line."""

    def __init__(self, name, argv, env=None):
        self.name = name
        self.lines = []
        self.stderr = []
        self.cond = threading.Condition()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True, env=env)
        self.readers = [threading.Thread(target=self._read, args=(stream, sink), daemon=True)
                        for stream, sink in ((self.proc.stdout, self.lines),
                                             (self.proc.stderr, self.stderr))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, sink):
        for line in stream:
            with self.cond:
                sink.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pattern, timeout=30):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines + self.stderr:
                    m = re.search(pattern, line)
                    if m:
                        return m
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                       + "\n".join(self.stderr[-20:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name}: no line matching {pattern!r} in {timeout}s:\n"
                                       + "\n".join(self.lines[-10:] + self.stderr[-20:]))
                self.cond.wait(min(left, 0.5))

    def wait(self, timeout):
        """Waits for the process to exit and for its output to be read to the end (the last lines
        may still be in the pipe when the process is gone). subprocess.TimeoutExpired if it runs
        on past `timeout`."""
        self.proc.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout=10)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()


def stop_all(daemons, segments=()):
    """Kills the daemons (last started first) and removes the agents' shared-memory segments
    (control and data): every ops test's exit path."""
    for d in reversed(daemons):
        d.kill()
    for segment in segments:
        for name in (segment, segment + ".data"):
            try:
                os.unlink("/dev/shm" + name)
            except FileNotFoundError:
                pass


def ended_after(synth, since, what, timeout=50):
    """Waits (at most `timeout` s) for a training process expected to fail; prints how long after
    `since` (time.monotonic()) it ended and the tail of what it said, which it returns."""
    try:
        synth.wait(timeout)
    except Exception:  # noqa: BLE001 - a timeout is the failure the callers check
        pass
    took = time.monotonic() - since
    out = "\n".join(synth.lines + synth.stderr)
    print(f"{synth.name}'s training process ended {took:.1f} s after {what}:\n{out[-800:]}")
    return out


def job_environment(token, secret):
    """This process's environment for a job's daemons: the coordinator token and the data-plane
    secret in the environment (never on a command line), nothing inherited that names another
    coordinator or job."""
    env = dict(os.environ, POSEIDON_JOB_TOKEN=token, POSEIDON_COORDINATOR_TOKEN=token,
               POSEIDON_JOB_SECRET=secret)
    for k in ["POSEIDON_TOKEN", "POSEIDON_JOB_ID", "POSEIDON_COORDINATOR", "POSEIDON_CONFIG"]:
        env.pop(k, None)
    os.environ.clear()
    os.environ.update(env)
    return env


def coordinated_job(args, name, secret, daemons, segments, ranks=2, coordinator_flags=(),
                    agent_flags=()):
    """A coordinator of job 1, a server registered with it and `ranks` agents joined through it
    (args.coordinator, args.server, args.agent name the binaries); every daemon is appended to
    `daemons` and every agent's segment to `segments` as soon as it exists, so that stop_all
    cleans up on any failure. Returns the coordinator's address and the agents, once ready."""
    coord = Daemon("poseidon-coordinator", [args.coordinator, "--listen=127.0.0.1:0",
                                            "--job_id=1", *coordinator_flags])
    daemons.append(coord)
    addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
    daemons.append(Daemon("poseidon-server", [args.server, "--listen=127.0.0.1:0", "--job_id=1",
                                              f"--coordinator={addr}"]))
    daemons[-1].wait_for(r"poseidon-server listening on (\S+)")
    agents = []
    for rank in range(ranks):
        segment = f"/psd-ops-{name}-{os.getpid()}-{rank}"
        segments.append(segment)
        agent = Daemon(f"agent {rank}", [
            args.agent, "--job_id=1", f"--secret={secret}", f"--rank={rank}",
            f"--world_size={ranks}", f"--coordinator={addr}", "--listen=127.0.0.1:0",
            f"--segment={segment}", *agent_flags])
        daemons.append(agent)
        agents.append(agent)
    for agent in agents:
        agent.wait_for(r"poseidon-agent ready")
    return addr, agents


def free_port():
    """A loopback port free now, below the ephemeral range (32768+): no outgoing connection can
    take it before the daemon we hand it to binds it (Prometheus cannot bind port 0 and say)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def start_cluster(args, daemons):
    coord = Daemon("poseidon-coordinator", [
        args.coordinator, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
        f"--job_id={JOB_ID}", "--log_level=warn"])
    daemons.append(coord)
    coord_addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
    coord_metrics = coord.wait_for(r"poseidon-coordinator metrics on (\S+)").group(1)
    server = Daemon("poseidon-server", [
        args.server, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
        f"--job_id={JOB_ID}", f"--coordinator={coord_addr}"])
    daemons.append(server)
    server.wait_for(r"poseidon-server listening on (\S+)")
    server_metrics = server.wait_for(r"metrics on ([0-9.]+:[0-9]+)").group(1)
    endpoints = {"coordinator": coord_metrics, "server": server_metrics}
    if args.agent:
        # An agent serves its metrics while it waits for its training process.
        agent = Daemon("poseidon-agent", [
            args.agent, f"--job_id={JOB_ID}", "--rank=0", "--world_size=1",
            "--metrics_listen=127.0.0.1:0", f"--segment=/poseidon-ops-{os.getpid()}",
            "--log_level=warn"])
        daemons.append(agent)
        endpoints["agent"] = agent.wait_for(r"poseidon-agent metrics on (\S+)").group(1)
    return endpoints


def check_exposition(args, endpoints):
    failures = 0
    for name, addr in endpoints.items():
        status, ctype, body = http_get(f"http://{addr}/metrics")
        if status != 200 or "poseidon_" not in body:
            print(f"FAIL: {name} /metrics: HTTP {status}, no poseidon_ metric")
            failures += 1
            continue
        if not ctype.startswith("text/plain"):
            print(f"FAIL: {name} /metrics: Content-Type {ctype!r}")
            failures += 1
        # promtool: exit 1 on parse errors, 3 on lint problems only (reported, not fatal).
        p = subprocess.run([args.promtool, "check", "metrics"], input=body, text=True,
                           capture_output=True, timeout=30)
        report = (p.stdout + p.stderr).strip()
        families = sorted(set(re.findall(r"^# TYPE (\S+)", body, re.M)))
        print(f"== {name} ({addr}): {len(families)} families, promtool rc {p.returncode}")
        for f in families:
            print(f"   {f}")
        if report:
            print("   promtool: " + report.replace("\n", "\n   promtool: "))
        if p.returncode not in (0, 3):
            print(f"FAIL: {name}: promtool check metrics found errors")
            failures += 1
        elif p.returncode == 3:
            print(f"WARNING: {name}: promtool lint problems (above)")
    return failures


def query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    _, _, body = http_get(url)
    answer = json.loads(body)
    if answer.get("status") != "success":
        raise RuntimeError(f"query {expr}: {body}")
    return answer["data"]["result"]


def check_prometheus(args, endpoints, daemons, tmp):
    port = free_port()
    config = os.path.join(tmp, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n"
                "  - job_name: poseidon-coordinator\n"
                f"    static_configs: [{{targets: ['{endpoints['coordinator']}']}}]\n"
                "  - job_name: poseidon-server\n"
                f"    static_configs: [{{targets: ['{endpoints['server']}']}}]\n")
    prom = Daemon("prometheus", [
        args.prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp}/tsdb",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"])
    daemons.append(prom)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 40
    last = None
    while time.monotonic() < deadline:
        if prom.proc.poll() is not None:
            raise RuntimeError("prometheus exited:\n" + "\n".join(prom.stderr[-20:]))
        try:
            up = {r["metric"]["job"]: r["value"][1] for r in query(base, "up")}
            nodes = query(base, 'poseidon_coordinator_nodes{role="server",state="alive"}')
            conns = query(base, "poseidon_server_connections")
            last = (up, nodes, conns)
            if (up.get("poseidon-coordinator") == "1" and up.get("poseidon-server") == "1"
                    and nodes and conns):
                print(f"== prometheus on {base}: up = {up}")
                print(f"   poseidon_coordinator_nodes{{role=server,state=alive}} = "
                      f"{nodes[0]['value'][1]}")
                if nodes[0]["value"][1] != "1":
                    print("FAIL: the coordinator should count exactly one alive server")
                    return 1
                return 0
        except (OSError, ValueError, RuntimeError) as e:
            last = e
        time.sleep(0.5)
    print(f"FAIL: prometheus did not scrape both targets within 40s; last answer: {last}")
    print("\n".join(prom.stderr[-20:]))
    return 1


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", choices=["exposition", "prometheus"], required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--agent", default="")
    ap.add_argument("--promtool", default=shutil.which("promtool"))
    ap.add_argument("--prometheus", default=shutil.which("prometheus"))
    args = ap.parse_args()
    needed = args.promtool if args.mode == "exposition" else args.prometheus
    if not needed:
        print("SKIP: promtool/prometheus not installed (Debian package prometheus)")
        return SKIP
    # Secrets travel through the environment, as in deployment (never on a command line).
    os.environ["POSEIDON_JOB_TOKEN"] = TOKEN
    os.environ["POSEIDON_COORDINATOR_TOKEN"] = TOKEN
    os.environ["POSEIDON_JOB_SECRET"] = SECRET
    os.environ["POSEIDON_SECRET"] = SECRET  # the agent's name for it
    daemons = []
    tmp = tempfile.mkdtemp(prefix="poseidon-ops-")
    try:
        endpoints = start_cluster(args, daemons)
        if args.mode == "exposition":
            failures = check_exposition(args, endpoints)
        else:
            failures = check_prometheus(args, endpoints, daemons, tmp)
    except RuntimeError as e:
        print(f"FAIL: {e}")
        failures = 1
    finally:
        for d in reversed(daemons):
            d.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
