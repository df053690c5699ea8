#!/usr/bin/python3
"""Issue 17: a KV server lost while the agents register the job on it costs nothing with
backups. Four agents train the tiny model by PS on three KV servers through a coordinator, each
key backed up on the next server (--replicas=1, the default). One server is reached through a
proxy that passes the data-plane frames on until it sees the job's table registration from the
(k + 1)-th agent: then the server "dies" there — the proxy closes every connection and its
listener, and the server is SIGKILLed. So k agents registered the job on it (they find it lost
at their first request and fail over, clock 0) and the others lose it in the middle of their
own registration, or cannot connect to it any more (they start its keys at the backup, epoch
1). Each trial takes another k in 0 … 3.

Then the same with a *frozen* server (--freeze_at): at the (k + 1)-th registration the server is
SIGSTOPped instead and the proxy goes on passing frames, so its connections stay open and new
ones are still accepted (by the kernel) — it just answers nothing. The agents (and servers:
--peer_timeout=2s) take it as lost once it said nothing for that long (the registration pings it: KvClient::
WaitAlive), not after the registration's 30 s, and say that it is silent.

Checked in every trial: every rank finishes every iteration with exit 0, and every synchronised
result equals the exact sum over the four ranks' gradients of that iteration (--verify): the
fault-free run's; every agent whose registration was cut says that the server was lost while it
registered the job, and where its keys start. Every process is killed (and every shared-memory
segment removed) on every path."""

import argparse
import os
import random
import re
import signal
import socket
import struct
import sys
import threading

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rejoin_test  # noqa: E402
from checks import check, finish  # noqa: E402
from metrics_test import Daemon, job_environment, stop_all  # noqa: E402

RANKS = 4
SERVERS = 3
ITERATIONS = 30
LAYERS = 8  # tiny.json
HEADER = 64  # docs/wire.md "Frame"
REGISTER_TABLES = 6
REGISTER_TABLES_ACK = 7


class CuttingProxy:
    """Passes TCP connections on to `target`; at the (let_through + 1)-th REGISTER_TABLES frame
    from a client, once the earlier ones were answered, it calls `on_cut` and closes every
    connection and its listener: to everyone the server is gone from then on. With `freeze` it
    only calls `on_cut` (which stops the server) and passes every frame on as before."""

    def __init__(self, let_through, on_cut, freeze=False):
        self.let_through = let_through
        self.on_cut = on_cut
        self.freeze = freeze
        self.registrations = 0
        self.acks = 0
        self.cut = False
        self.lock = threading.Lock()
        self.answered = threading.Condition(self.lock)
        self.sockets = []
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"

    def start(self, target):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed by the cut
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                if self.cut and not self.freeze:
                    client.close()
                    server.close()
                    return
                self.sockets += [client, server]
            threading.Thread(target=self._frames, args=(client, server, True),
                             daemon=True).start()
            threading.Thread(target=self._frames, args=(server, client, False),
                             daemon=True).start()

    def _cut(self):
        with self.lock:
            if self.cut:
                return
            self.cut = True
            sockets = list(self.sockets)
        self.on_cut()
        if self.freeze:
            return
        for s in sockets + [self.listener]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    @staticmethod
    def _read(sock, n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def _frames(self, src, dst, from_client):
        """One direction, frame by frame (64-byte header, then its payload)."""
        try:
            while True:
                header = self._read(src, HEADER)
                length = struct.unpack_from("<Q", header, 48)[0]
                if from_client and header[6] == REGISTER_TABLES:
                    with self.lock:
                        self.registrations += 1
                        if self.registrations > self.let_through:
                            # The agents before it had their answers: they registered the job.
                            self.answered.wait_for(lambda: self.acks >= self.let_through, 10)
                            cut = True
                        else:
                            cut = False
                    if cut:
                        self._cut()
                        if not self.freeze:
                            return
                dst.sendall(header)
                left = length
                while left > 0:
                    chunk = src.recv(min(left, 1 << 20))
                    if not chunk:
                        raise OSError("closed")
                    dst.sendall(chunk)
                    left -= len(chunk)
                if not from_client and header[6] == REGISTER_TABLES_ACK:
                    with self.lock:
                        self.acks += 1
                        self.answered.notify_all()
        except OSError:
            # shutdown, not only close: the other direction's thread may be blocked reading one
            # of them, which would keep the socket open.
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


def show(daemons):
    for d in daemons:
        if d.name.startswith(("agent", "rank 0", "server")):
            print(f"--- {d.name}:\n" + "\n".join((d.lines + d.stderr)[-10:]))


def trial(args, t, let_through, rng, freeze=False):
    daemons, segments = [], []
    try:
        coord = Daemon("coordinator", [args.coordinator, "--listen=127.0.0.1:0", "--job_id=1",
                                       "--liveness_timeout=2s", f"--min_servers={SERVERS}"])
        daemons.append(coord)
        addr = coord.wait_for(r"poseidon-coordinator listening on (\S+)").group(1)
        lost = rng.randrange(SERVERS)
        servers = []

        def kill_lost():
            os.kill(servers[lost].proc.pid, signal.SIGSTOP if freeze else signal.SIGKILL)

        proxy = CuttingProxy(let_through, kill_lost, freeze)
        for s in range(SERVERS):
            # The plan lists the servers in the order they registered: one at a time.
            advertise = [f"--advertise={proxy.address}"] if s == lost else []
            # Frozen: the servers replicating to it give it up as soon as the agents do.
            silence = ["--peer_timeout=2s"] if freeze else []
            servers.append(Daemon(f"server {s}", [args.server, "--listen=127.0.0.1:0",
                                                  "--job_id=1", f"--coordinator={addr}",
                                                  *advertise, *silence]))
            daemons.append(servers[-1])
            real = servers[-1].wait_for(r"poseidon-server listening on (\S+)").group(1)
            if s == lost:
                proxy.start(real)
        agents = []
        for rank in range(RANKS):
            segment = f"/psd-ops-regloss-{os.getpid()}-{t}-{rank}"
            segments.append(segment)
            agents.append(Daemon(f"agent {rank}", [
                args.agent, "--job_id=1", f"--secret={rejoin_test.SECRET}", f"--rank={rank}",
                f"--world_size={RANKS}", f"--coordinator={addr}", "--listen=127.0.0.1:0",
                f"--segment={segment}", "--scheme=ps", "--probe_bytes=0", "--fusion=off",
                "--connect_timeout=5s", "--sync_timeout=60s",
                *(["--peer_timeout=2s"] if freeze else [])]))
            daemons.append(agents[-1])
        for agent in agents:
            agent.wait_for(r"poseidon-agent ready")
        synths = []
        for rank in range(RANKS):
            synths.append(Daemon(f"rank {rank}", [
                args.synth, f"--segment={segments[rank]}", f"--model={args.model}", "--batch=8",
                f"--iterations={ITERATIONS}", "--compute_scale=10000", "--timeout_ms=120000",
                "--verify"]))
            daemons.append(synths[-1])
        print(f"trial {t}: server behind the proxy {proxy.address}, "
              f"{'frozen' if freeze else 'cut'} at registration {let_through + 1}", flush=True)
        rejoin_test.wait_all(synths, timeout=120)
        check(proxy.cut, f"trial {t}: the server was lost at registration {let_through + 1}")
        for r, s in enumerate(synths):
            last = (s.lines + s.stderr)[-1:] or ["(nothing)"]
            check(s.proc.returncode == 0 and
                  rejoin_test.summary(s) == (ITERATIONS * LAYERS, 0),
                  f"trial {t}: rank {r} finished every iteration, every result exact "
                  f"({last[0][:400]})")
        cut = registered = 0
        for r, a in enumerate(agents):
            log = "\n".join(a.lines + a.stderr)
            if "lost while it registered the job" in log:
                cut += 1
                check("its keys start at server" in log,
                      f"trial {t}: agent {r}, whose registration was cut, says where the lost "
                      f"server's keys start")
                if freeze:
                    line = next(x for x in log.splitlines() if "lost while it registered" in x)
                    check("is silent: nothing on its connection for 2" in line,
                          f"trial {t}: agent {r} took the frozen server as lost after its "
                          f"--peer_timeout of silence ({line[-300:]})")
            elif "cannot be reached at start" not in log:
                registered += 1
                check(re.search(r"the keys first held by server \d+ \(\S+\) move to server", log),
                      f"trial {t}: agent {r}, which registered the job on the lost server, "
                      f"moved its keys on at its first request")
        check(registered == let_through and 1 <= cut <= RANKS - let_through,
              f"trial {t}: {registered} agent(s) registered the job on the server before it was "
              f"lost, {cut} lost it while they registered")
        if any(s.proc.returncode != 0 for s in synths):
            show(daemons)
    except RuntimeError as e:
        check(False, f"trial {t}: {e}")
        show(daemons)
    finally:
        stop_all(daemons, segments)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("coordinator", "server", "agent", "synth", "model"):
        parser.add_argument(f"--{flag}", required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--let_through", default=",".join(str(k) for k in range(RANKS)),
                        help="one trial per number of agents that register before the loss")
    parser.add_argument("--freeze_at", default="0,2",
                        help="then one trial per number of agents that register before the "
                        "server freezes")
    args = parser.parse_args()
    job_environment(rejoin_test.TOKEN, rejoin_test.SECRET)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    cuts = [int(k) for k in args.let_through.split(",") if k]
    freezes = [int(k) for k in args.freeze_at.split(",") if k]
    for t, let_through in enumerate(cuts):
        trial(args, t, let_through, rng)
    for t, let_through in enumerate(freezes, start=len(cuts)):
        trial(args, t, let_through, rng, freeze=True)
    finish("a KV server lost (or frozen) while the agents register the job costs nothing with "
           "backups")


if __name__ == "__main__":
    main()
