#!/usr/bin/python3
"""Emulated GPU cluster: N hosts as network namespaces on a shaped bridge, a poseidon-server, a
poseidon-agent and a poseidon-synth worker on every host; throughput, speed-up and scaling
efficiency per (model, mode, N) against the bound max(compute, best-plan communication).

Scaling (docs/cluster.md): layer channel dimensions and the batch K are divided by s, the link rate
by s^2, the compute time is kept (--compute_scale), so communication and compute times are those of
the unscaled cluster.

    bench/cluster/run_cluster.py --quick [--build build/release]      # <= 3 minutes, smoke test
    bench/cluster/run_cluster.py [--models vgg19,...] [--hosts 1,2,4] [--modes poseidon,ps,no-wfbp,ddp]
    bench/cluster/run_cluster.py --compare bench/cluster/baseline.json  # the recorded set, against
                                                                        # the record
    bench/cluster/run_cluster.py --baseline_set --record bench/cluster/baseline.json  # re-record

Sizes the agents get (--bucket_bytes, --block_bytes, --credit_bytes) are the unscaled cluster's and
are passed divided by s^2, like the bytes they bound. Without --bucket_bytes the agents fuse as the
plan says (--fusion=plan: the planner sizes buckets from the emulated, scaled bandwidth); with it,
--fusion=bytes.

Modes: poseidon (--scheme auto), bf16 (poseidon with --wire=bf16: PS in bfloat16), lossy (poseidon
where the job allows bfloat16 and each layer's wire is the plan's: --plan_lossy_wire=bf16), no-replicas
(poseidon with --replicas=0: no backups of the PS keys), tls (poseidon with TLS on every
data-plane connection: data_tls, one throwaway certificate), ps (--scheme ps),
no-wfbp (synth --wfbp=false), no-priority
(agents synchronise layers in the order they become ready: --priority=false), sep-servers
(servers on N hosts of their own, or --sep_servers; --sep_models), coord-auto (the
coordinator's plan, the ring weighed by cost: --allreduce_by_cost) and coord-auto-sep (the same
with servers on hosts of their own, --sep_servers of them), ddp (PyTorch DDP with gloo, ddp_worker.py),
allreduce and allreduce-bf16 (every layer by all-reduce through a coordinator, float32 or
bfloat16), allreduce-lowrank (the same, every matrix it shrinks as rank-4 factors: PowerSGD,
--lowrank_rank=4 --lowrank_warmup=1: the first, unmeasured iteration exact), ddp-fp16 (DDP with its fp16 compression hook). DDP's PowerSGD hook cannot
run on gloo in PyTorch 1.13 (docs/cluster.md, "Low rank").

Exit code 77 when network namespaces or tc tbf are not permitted here (the test is skipped).
Needs root. Everything (namespaces, links, processes, shared-memory segments) is removed on every
exit path.
"""
import argparse
import atexit
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODELS_DIR = os.path.join(ROOT, "coordinator", "models")
GPU_RATES = {"titanx": 6.1e12}  # FLOP/s; bench/synth uses the same Titan X-class rate
ALL_MODELS = ["vgg19", "vgg19-22k", "inception-v3", "resnet-152", "googlenet"]
MODES = {
    # name: (agent scheme, synth wfbp, servers on separate hosts, through a coordinator)
    "poseidon": ("auto", True, False, False),
    "ps": ("ps", True, False, False),
    # SFB for every FC layer (the rest PS), whatever the cost model says.
    "sfb": ("sfb", True, False, False),
    "no-wfbp": ("auto", False, False, False),
    "no-priority": ("auto", True, False, False),  # arrival order (--priority=false)
    "bf16": ("auto", True, False, False),  # PS pushes and pulls in bfloat16 (--wire=bf16)
    # The plan's wire where the job allows bfloat16 (--plan_lossy_wire=bf16: the agents' own
    # plans, from the emulated bandwidth, put a PS layer on it where it pays).
    "lossy": ("auto", True, False, False),
    # Poseidon without replicas of the PS keys (--replicas=0): what replication costs.
    "no-replicas": ("auto", True, False, False),
    # Poseidon with TLS on every data-plane connection (data_tls; one throwaway certificate for
    # the cluster's name, tests/ops/pki.py): what encryption costs.
    "tls": ("auto", True, False, False),
    "sep-servers": ("auto", True, True, False),
    # Ring all-reduce (Gloo) for every layer; its rendezvous needs the coordinator.
    "allreduce": ("allreduce", True, False, True),
    # The same on a bfloat16 wire (--wire=bf16: each rank sums its shard in float32).
    "allreduce-bf16": ("allreduce", True, False, True),
    # The same with every matrix it shrinks sent as rank-4 factors (PowerSGD: --lowrank_rank=4;
    # only the first all-reduce, of the unmeasured first iteration, exact).
    "allreduce-lowrank": ("allreduce", True, False, True),
    # The coordinator's plan (its time rule: PS, SFB or ring all-reduce per layer, the ring
    # weighed by the agents' measured step: --allreduce_by_cost), on the nominal network (no
    # start-up probes: the plan does not depend on this host's load).
    "coord-auto": ("auto", True, False, True),
    # The same with the servers on hosts of their own (--sep_servers of them: P2 < P1 is where
    # PS's busiest interface is a server's and the ring can win).
    "coord-auto-sep": ("auto", True, True, True),
    "ddp": (None, True, False, False),  # PyTorch DDP, gloo: bench/cluster/ddp_worker.py
    # DDP with its fp16 compression hook (fp16_compress_hook: gloo has no bfloat16 all-reduce,
    # so DDP's bf16 hook cannot run on it).
    "ddp-fp16": (None, True, False, False),
}
# A coordinator in the switch namespace, on <subnet>.SW_HOST of the bridge (adapt_bench too).
COORD_TOKEN = "run-cluster-token"
COORD_PORT = 7000
SW_HOST = 254
DDP_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_worker.py")
# The agent's defaults (agent/agent.h, AgentConfig) for the unscaled cluster; the harness passes
# each divided by s^2 (a byte size bounds bytes, which scale by 1/s^2).
AGENT_SIZE_DEFAULTS = {"bucket_bytes": 512 << 10, "block_bytes": 4 << 20, "credit_bytes": 64 << 20,
                       "allreduce_bucket_bytes": 25 << 20}
AGENT_SIZE_FLOORS = {"bucket_bytes": 0, "block_bytes": 4096, "credit_bytes": 4096,
                     "allreduce_bucket_bytes": 0}  # the agent's limits
# The quick set recorded in bench/cluster/baseline.json (--baseline_set, --compare).
BASELINE_SET = {"models": "inception-v3,vgg19-22k", "hosts": "1,4", "modes": "poseidon,ddp",
                "iterations": 10}
SKIP = 77
PREFIX = f"psd-{os.getpid()}"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Scaling


def parse_rate(text):
    """'10Gbit', '156Mbit', '1e9' -> bits/s."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgG]?)(bit|bps)?\s*", text)
    if not m:
        raise ValueError(f"bad rate {text!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]


def load_spec(model):
    path = model if os.path.exists(model) else os.path.join(MODELS_DIR, f"{model}.json")
    with open(path) as f:
        return json.load(f)


def numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def scale_shape(shape, s):
    """Divide the channel dimensions (FC: [M, N]; conv: [out, in, kh, kw]; bias/bn: [C]) by s,
    keeping at least 1; kernel spatial dimensions are kept."""
    shape = [int(d) for d in shape]
    return [max(1, d // s) if i < 2 else d for i, d in enumerate(shape)]


def scale_spec(spec, s):
    """The scaled spec; per-layer FLOPs scale like the layer's parameters (a conv's per-sample
    FLOPs are in*out*kh*kw*H*W, an FC's M*N, a bias/bn's C*H*W)."""
    out = dict(spec)
    out["name"] = f"{spec['name']}-s{s}"
    out["description"] = f"{spec.get('description', '')} Scaled by s={s} (bench/cluster)."
    layers = []
    for l in spec["layers"]:
        l2 = dict(l)
        l2["shape"] = scale_shape(l["shape"], s)
        ratio = numel(l2["shape"]) / numel(l["shape"])
        for k in ("forward_flops", "backward_flops"):
            if k in l:
                l2[k] = max(1, int(round(int(l[k]) * ratio)))
        layers.append(l2)
    out["layers"] = layers
    return out


def total_flops(spec):
    return sum(int(l.get("forward_flops", 0)) + int(l.get("backward_flops", 0))
               for l in spec["layers"])


def is_fc(l):
    return l.get("kind") == "LAYER_KIND_FC" and len(l["shape"]) == 2


def comm_bound_seconds(spec, batch, n, rate_bps, colocated=True, servers=None):
    """Per-iteration communication time of the best plan (HybComm cost model, DESIGN.md) on
    full-duplex links of rate_bps: the busiest direction of the busiest NIC carries half of the
    sent+received bytes per machine. Not colocated: `servers` hosts of their own (default n)."""
    if n <= 1:
        return 0.0
    total = 0.0
    for l in spec["layers"]:
        elem = 4
        mn = numel(l["shape"])
        if colocated:
            ps = 2 * mn * (n + n - 2) / n
        else:
            # per worker 2*MN; a server host moves 2*P1*MN/P2 (2*MN when P2 = P1)
            ps = 2 * mn * max(1, n / (servers or n))
        best = ps
        if is_fc(l):
            m_, n_ = l["shape"]
            sfb = 2 * batch * (n - 1) * (m_ + n_)
            best = min(ps, sfb)
        total += best * elem
    return (total / 2) / (rate_bps / 8)


def compute_seconds(spec, batch, gpu_rate):
    return total_flops(spec) * batch / gpu_rate


def parse_bytes(text):
    """'512KiB', '4MiB', '32768' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmMgG]?)(i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"bad byte size {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def scaled_sizes(args, s):
    """The agent's byte-size flags for the emulated cluster: the unscaled sizes / s^2 (0 stays 0,
    never below the agent's floor)."""
    out = {}
    for name, default in AGENT_SIZE_DEFAULTS.items():
        given = getattr(args, name)
        if name == "bucket_bytes" and given is None:
            continue  # the plan's buckets (--fusion=plan): sized from the emulated bandwidth
        unscaled = default if given is None else parse_bytes(given)
        out[name] = 0 if unscaled == 0 else max(AGENT_SIZE_FLOORS[name] or 1, unscaled // (s * s))
    return out


# ---------------------------------------------------------------------------------------------
# The emulated cluster


class Cluster:
    """Namespaces <PREFIX>-sw (the bridge) and <PREFIX>-h<i> (hosts), veth pairs, tbf on both
    directions of every host link (the switch port's egress too, so incast is limited as on a
    real switch). Teardown is idempotent."""

    def __init__(self, hosts, rate_bps, subnet, slow_start_after_idle=False, burst_min=64 * 1024):
        self.slow_start_after_idle = slow_start_after_idle
        self.burst_min = burst_min  # tbf bucket: at least this, at least 10 ms at the rate
        self.hosts = hosts
        self.rate_bps = rate_bps
        self.subnet = subnet  # "10.x.y"
        self.sw = f"{PREFIX}-sw"
        self.namespaces = []
        self.procs = []
        self.segments = []

    def ns(self, i):
        return f"{PREFIX}-h{i}"

    def addr(self, i):
        return f"{self.subnet}.{i + 1}"

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def _tbf(self, ns, dev, action="add"):
        rate = int(self.rate_bps)
        burst = max(self.burst_min, rate // 8 // 100)  # >= one GSO packet, >= 10 ms at the rate
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", action, "dev", dev, "root", "tbf",
                        "rate", f"{rate}bit", "burst", str(burst), "latency", "200ms"],
                       check=True, capture_output=True, timeout=30)

    def set_rate(self, rate_bps):
        """Change every link's rate while the cluster runs (tc qdisc change, both directions:
        each host's eth0 and its bridge port)."""
        self.rate_bps = rate_bps
        for i in range(self.hosts):
            self._tbf(self.ns(i), "eth0", "change")
            self._tbf(self.sw, f"p{i}", "change")

    def up(self):
        self._ip("netns", "add", self.sw)
        self.namespaces.append(self.sw)
        self._ip("-n", self.sw, "link", "set", "lo", "up")
        self._ip("-n", self.sw, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.sw, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns = self.ns(i)
            self._ip("netns", "add", ns)
            self.namespaces.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", self.sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
                     "netns", ns)
            self._ip("-n", self.sw, "link", "set", f"p{i}", "master", "br0")
            self._ip("-n", self.sw, "link", "set", f"p{i}", "up")
            self._ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._tbf(ns, "eth0")
            if not self.slow_start_after_idle:
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                                "net.ipv4.tcp_slow_start_after_idle=0"], capture_output=True,
                               timeout=30)
            self._tbf(self.sw, f"p{i}")

    def start(self, i, name, argv, logdir, env=None):
        path = os.path.join(logdir, f"{name}.log")
        f = open(path, "w")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], stdout=f,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        f.close()
        p.log = path
        p.name = name
        self.procs.append(p)
        return p

    def stop_procs(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
        self.procs = []
        for seg in self.segments:
            for suffix in ("", ".data"):
                try:
                    os.unlink("/dev/shm" + seg + suffix)
                except OSError:
                    pass
        self.segments = []

    def down(self):
        self.stop_procs()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces = []


LIVE = []


def teardown_all():
    while LIVE:
        c = LIVE.pop()
        try:
            c.down()
        except Exception as e:  # keep tearing down the rest
            log(f"teardown: {e}")
    # Anything of ours left behind (a crash between 'netns add' and bookkeeping).
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX + "-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def on_signal(sig, _frame):
    raise SystemExit(128 + sig)


def wait_for(p, text, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(p.log, errors="replace") as f:
            if text in f.read():
                return
        if p.poll() is not None:
            break
        time.sleep(0.05)
    with open(p.log, errors="replace") as f:
        tail = f.read()[-600:]
    raise RuntimeError(f"{p.name} did not print {text!r}: {tail}")


def permitted():
    probe = f"{PREFIX}-probe"
    try:
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=20)
        if r.returncode != 0:
            return f"ip netns add: {r.stderr.decode(errors='replace').strip()}"
        r = subprocess.run(["ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name",
                            "vb"], capture_output=True, timeout=20)
        if r.returncode != 0:
            return f"veth: {r.stderr.decode(errors='replace').strip()}"
        r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "va", "root",
                            "tbf", "rate", "1mbit", "burst", "64kb", "latency", "50ms"],
                           capture_output=True, timeout=20)
        if r.returncode != 0:
            return f"tc tbf: {r.stderr.decode(errors='replace').strip()}"
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


# ---------------------------------------------------------------------------------------------
# One run


def coordinated_env(token):
    """The environment of a job's daemons through a coordinator with one token for everything."""
    env = dict(os.environ, POSEIDON_JOB_TOKEN=token, POSEIDON_COORDINATOR_TOKEN=token)
    for k in ("POSEIDON_TOKEN", "POSEIDON_JOB_ID", "POSEIDON_COORDINATOR", "POSEIDON_CONFIG"):
        env.pop(k, None)
    return env


def tls_flags(logdir):
    """data_tls flags for every daemon: one certificate for the cluster's name (the hosts'
    addresses are verified as that name: data_tls_server_name)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "ops"))
    from pki import make_pki  # noqa: E402
    tls_dir = os.path.join(logdir, "tls")
    os.makedirs(tls_dir, exist_ok=True)
    made, err = make_pki(tls_dir)
    if not made:
        raise RuntimeError(f"openssl could not make the cluster's certificate: {err}")
    return [f"--data_tls_cert={tls_dir}/server.pem", f"--data_tls_key={tls_dir}/server.key",
            f"--data_tls_ca={tls_dir}/ca.pem", "--data_tls_server_name=localhost"]


def start_coordinator(cluster, build, subnet, logdir, env, flags, log_level="warn"):
    """poseidon-coordinator for job 1 in the switch namespace, reachable from every host; returns
    its address once it listens."""
    cluster._ip("-n", cluster.sw, "addr", "add", f"{subnet}.{SW_HOST}/24", "dev", "br0")
    address = f"{subnet}.{SW_HOST}:{COORD_PORT}"
    coord = subprocess.Popen(
        ["ip", "netns", "exec", cluster.sw, os.path.join(build, "coordinator",
                                                         "poseidon-coordinator"),
         f"--listen={address}", "--job_id=1", *flags, f"--log_level={log_level}"],
        stdout=open(os.path.join(logdir, "coordinator.log"), "w"), stderr=subprocess.STDOUT,
        env=env, start_new_session=True)
    coord.log, coord.name = os.path.join(logdir, "coordinator.log"), "coordinator"
    cluster.procs.append(coord)
    wait_for(coord, "listening on", 60)
    return address


def run_one(args, spec_path, spec_scaled, n, mode, compute_scale, batch_scaled, rate_bps, subnet,
            logroot):
    scheme, wfbp, separate, coordinated = MODES[mode]
    k = args.sep_servers or n  # servers on hosts of their own
    hosts = n + k if separate else n
    cluster = Cluster(hosts, rate_bps, subnet, args.slow_start_after_idle)
    LIVE.append(cluster)
    logdir = os.path.join(logroot, f"{spec_scaled['name']}-{mode}-n{n}")
    os.makedirs(logdir, exist_ok=True)
    job, secret = 1, os.urandom(8).hex()
    b = args.build
    try:
        cluster.up()
        if scheme is None:
            return run_ddp(args, cluster, spec_path, n, compute_scale, batch_scaled, logdir,
                           hook="fp16" if mode == "ddp-fp16" else "none")
        server_hosts = list(range(n, n + k)) if separate else list(range(n))
        tls = tls_flags(logdir) if mode == "tls" else []
        env, joined = None, []
        if coordinated:
            env = dict(coordinated_env(COORD_TOKEN), POSEIDON_JOB_SECRET=secret)
            address = start_coordinator(
                cluster, b, subnet, logdir, env,
                [f"--bandwidth={int(rate_bps)}bit", f"--colocated={'false' if separate else 'true'}",
                 f"--block_size={args.agent_sizes['block_bytes']}",
                 f"--min_servers={len(server_hosts)}",
                 *(["--allreduce_by_cost"] if mode.startswith("coord-auto") else [])],
                log_level="info" if args.keep_logs else "warn")
            joined = [f"--coordinator={address}"]
        servers = []
        for j, h in enumerate(server_hosts):
            p = cluster.start(h, f"server{j}", [
                os.path.join(b, "server", "poseidon-server"), f"--listen={cluster.addr(h)}:7100",
                f"--job_id={job}", *(joined or [f"--job_secret={secret}"]), *tls,
                "--log_level=warn"],
                logdir, env=env)
            servers.append(p)
        for p in servers:
            wait_for(p, "listening on", 60)
        server_list = ",".join(f"{cluster.addr(h)}:7100" for h in server_hosts)
        peers = ",".join(f"{cluster.addr(i)}:7200" for i in range(n))
        agents = []
        for r in range(n):
            seg = f"/{PREFIX}-seg-{r}"
            cluster.segments.append(seg)
            p = cluster.start(r, f"agent{r}", [
                os.path.join(b, "agent", "poseidon-agent"), f"--job_id={job}", f"--secret={secret}",
                f"--rank={r}", f"--world_size={n}",
                *(joined + ["--probe_bytes=0", "--telemetry_interval=500ms"] if coordinated
                  else [f"--servers={server_list}", f"--peers={peers}"]),
                f"--listen={cluster.addr(r)}:7200", f"--scheme={scheme}",
                f"--bandwidth={int(rate_bps)}bit", f"--colocated={'false' if separate else 'true'}",
                f"--priority={'false' if mode == 'no-priority' else 'true'}",
                *({"bf16": ["--wire=bf16"], "allreduce-bf16": ["--wire=bf16"],
                   "allreduce-lowrank": ["--wire=fp32", "--lowrank_rank=4", "--lowrank_warmup=1"],
                   "lossy": ["--wire=plan", "--plan_lossy_wire=bf16"]}.get(mode, ["--wire=fp32"])),
                f"--replicas={0 if mode == 'no-replicas' else 1}",
                *[f"--{k}={v}" for k, v in sorted(args.agent_sizes.items())],
                f"--fusion={'bytes' if 'bucket_bytes' in args.agent_sizes else 'plan'}",
                *tls, f"--segment={seg}", "--log_level=warn"], logdir, env=env)
            agents.append((p, seg))
        for p, _ in agents:
            wait_for(p, "poseidon-agent ready", 120)
        workers = []
        for r, (_, seg) in enumerate(agents):
            p = cluster.start(r, f"worker{r}", [
                os.path.join(b, "bench", "poseidon-synth"), f"--model={spec_path}",
                f"--batch={batch_scaled}", f"--iterations={args.iterations}",
                f"--compute_scale={compute_scale:.6f}", f"--gpu={args.gpu}",
                f"--wfbp={'true' if wfbp else 'false'}", f"--segment={seg}",
                f"--timeout_ms={args.layer_timeout_ms}"] + (["--verify"] if args.verify else []),
                logdir)
            workers.append(p)
        return collect(args, cluster, workers)
    finally:
        cluster.down()
        if cluster in LIVE:
            LIVE.remove(cluster)


def run_ddp(args, cluster, spec_path, n, compute_scale, batch_scaled, logdir, hook="none"):
    gpu_rate = GPU_RATES.get(args.gpu) or float(args.gpu)
    bucket_mb = 25.0 / (args.scale * args.scale)  # DDP's default bucket, scaled like the bytes
    workers = []
    for r in range(n):
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
        workers.append(cluster.start(r, f"ddp{r}", [
            "/usr/bin/python3", DDP_WORKER, f"--spec={spec_path}", f"--rank={r}",
            f"--world_size={n}", f"--master={cluster.addr(0)}", f"--batch={batch_scaled}",
            f"--compute_scale={compute_scale:.6f}", f"--gpu_flops={gpu_rate}",
            f"--iterations={args.iterations}", f"--bucket_mb={bucket_mb}",
            f"--comm_hook={hook}"], logdir, env=env))
    return collect(args, cluster, workers)


def check_running(cluster, workers, deadline, run_timeout):
    """RuntimeError naming the first daemon (a process that is not a worker) that died, or the
    run's timeout once `deadline` passed."""
    dead = [p for p in cluster.procs if p not in workers and p.poll() not in (None, 0)]
    if dead:
        raise RuntimeError(f"{dead[0].name} died (exit code {dead[0].returncode}): "
                           f"{open(dead[0].log, errors='replace').read()[-600:]}")
    if time.time() > deadline:
        raise RuntimeError(f"timed out after {run_timeout} s")


def collect(args, cluster, workers):
    """Wait for the workers (failing when a daemon dies), parse their per-iteration times."""
    deadline = time.time() + args.run_timeout
    while any(w.poll() is None for w in workers):
        check_running(cluster, workers, deadline, args.run_timeout)
        time.sleep(0.1)
    per_iter, sfb_layers, mismatches = [], None, 0
    for w in workers:
        text = open(w.log, errors="replace").read()
        m = re.search(r"\(\d+ layers, (\d+) on SFB\).* ([0-9.]+) s per iteration after the first"
                      r"(?:; \d+ scheme switches)?(?:; verified \d+ results, (\d+) mismatches)?", text)
        if w.returncode != 0 or not m:
            raise RuntimeError(f"{w.name} exit {w.returncode}: {text[-600:]}")
        sfb_layers = int(m.group(1))
        per_iter.append(float(m.group(2)))
        mismatches += int(m.group(3) or 0)
    if mismatches:
        raise RuntimeError(f"--verify: {mismatches} synchronised results differ from the sum")
    return {"seconds_per_iteration": max(per_iter), "sfb_layers": sfb_layers,
            "mismatches": mismatches}


# ---------------------------------------------------------------------------------------------
# Report


def table(results):
    lines = ["| model | mode | N | s/iter | iter/s | samples/s | speed-up | efficiency | compute s "
             "| comm bound s | bound s | iter/bound | SFB layers |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['mode']} | {r['n']} | failed: "
                         f"{r['error'][:80].replace('|', '/')} |||||||||")
            continue
        su = f"{r['speedup']:.2f}" if r.get("speedup") is not None else "–"
        ef = f"{r['efficiency']:.2f}" if r.get("efficiency") is not None else "–"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['n']} | {r['seconds_per_iteration']:.3f} | "
            f"{r['iterations_per_second']:.2f} | {r['samples_per_second']:.0f} | {su} | {ef} | "
            f"{r['compute_seconds']:.3f} | {r['comm_bound_seconds']:.3f} | {r['bound_seconds']:.3f} "
            f"| {r['iteration_over_bound']:.2f} | {r['sfb_layers']} |")
    return "\n".join(lines)


FIGURES = ("seconds_per_iteration", "samples_per_second", "efficiency")


def git_commit():
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no",
                                "--", "agent", "server", "transport", "common", "coordinator",
                                "bench/synth", "bench/cluster"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head, bool(dirty)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", True


def ddp_ratio(results, model, n):
    """Poseidon's throughput over DDP-gloo's, both measured in this run."""
    rows = {r["mode"]: r for r in results if r["model"] == model and r["n"] == n
            and not r.get("error")}
    if "poseidon" in rows and "ddp" in rows:
        return rows["poseidon"]["samples_per_second"] / rows["ddp"]["samples_per_second"]
    return None


def record(args, results, path):
    """A small baseline: the settings of this run, the commit, every figure of every row."""
    head, dirty = git_commit()
    if args.build_commit:
        head, dirty = args.build_commit, False
    rows = []
    for r in results:
        if r.get("error"):
            continue
        row = {"model": r["model"], "mode": r["mode"], "n": r["n"]}
        for k in FIGURES:
            if r.get(k) is not None:
                row[k] = round(r[k], 4)
        rows.append(row)
    ratios = []
    for model in sorted({r["model"] for r in results}):
        for n in sorted({r["n"] for r in results}):
            q = ddp_ratio(results, model, n)
            if q is not None:
                ratios.append({"model": model, "n": n, "poseidon_over_ddp": round(q, 3)})
    settings = {k: getattr(args, k) for k in ("models", "hosts", "modes", "iterations", "scale",
                                               "bandwidth", "batch", "gpu")}
    for k in AGENT_SIZE_DEFAULTS:
        if getattr(args, k) is not None:
            settings[k] = getattr(args, k)
    doc = {"commit": head, "uncommitted_data_path_changes": dirty,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
           "machine": f"{os.cpu_count()} CPUs, {os.uname().release}",
           "command": "bench/cluster/run_cluster.py " + shlex.join(sys.argv[1:]),
           "settings": settings, "agent_sizes_scaled": args.agent_sizes,
           "figures": rows, "poseidon_over_ddp": ratios}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def compare(baseline, results, tolerance=0.10):
    """Every figure of this run against the record; '!' marks a change beyond the tolerance in
    the worse direction (slower, lower efficiency, a lower ratio to DDP)."""
    rec = {(r["model"], r["mode"], r["n"]): r for r in baseline["figures"]}
    lines = [f"Against {baseline.get('commit', '?')[:12]} ({baseline.get('date', '?')}), "
             f"'!' = more than {tolerance:.0%} worse:",
             "| model | mode | N | s/iter rec | s/iter now | now/rec | efficiency rec | "
             "efficiency now | |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    worse = 0
    for r in results:
        key = (r["model"], r["mode"], r["n"])
        b = rec.get(key)
        if r.get("error"):
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | failed |||||| ! |")
            worse += 1
            continue
        if b is None:
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | – | "
                         f"{r['seconds_per_iteration']:.3f} | – | – | "
                         f"{r.get('efficiency') or 0:.2f} | not recorded |")
            continue
        t_ratio = r["seconds_per_iteration"] / b["seconds_per_iteration"]
        e_now, e_rec = r.get("efficiency"), b.get("efficiency")
        bad = t_ratio > 1 + tolerance or (e_now is not None and e_rec is not None
                                          and e_now < e_rec * (1 - tolerance))
        worse += bad
        fmt = lambda e: "–" if e is None else f"{e:.2f}"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {b['seconds_per_iteration']:.3f} | "
                     f"{r['seconds_per_iteration']:.3f} | {t_ratio:.2f} | {fmt(e_rec)} | "
                     f"{fmt(e_now)} | {'!' if bad else ''} |")
    rec_q = {(q["model"], q["n"]): q["poseidon_over_ddp"] for q in baseline.get(
        "poseidon_over_ddp", [])}
    qlines = []
    for (model, n), q_rec in sorted(rec_q.items()):
        q = ddp_ratio(results, model, n)
        if q is None:
            continue
        bad = q < q_rec * (1 - tolerance)
        worse += bad
        qlines.append(f"| {model} | {n} | {q_rec:.2f} | {q:.2f} | {'!' if bad else ''} |")
    if qlines:
        lines += ["", "Poseidon throughput / DDP-gloo throughput (both measured in the same run):",
                  "| model | N | recorded | now | |", "|---|---:|---:|---:|---|"] + qlines
    lines.append(f"{worse} figure(s) more than {tolerance:.0%} worse than the record")
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing (apt-get install python3-matplotlib): no plot")
        return None
    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results if r["model"] == model and r.get("speedup") is not None]
        ns = sorted({r["n"] for r in rows}) or [1]
        ax.plot(ns, ns, "k--", label="ideal")
        for mode in sorted({r["mode"] for r in rows}):
            pts = sorted((r["n"], r["speedup"]) for r in rows if r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=mode)
        ax.set_title(model)
        ax.set_xlabel("hosts N")
        ax.set_ylabel("speed-up vs N=1")
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--quick", action="store_true",
                    help="alexnet, N = 1, 2, poseidon mode, 3 iterations (<= 3 minutes)")
    ap.add_argument("--models", default=",".join(ALL_MODELS))
    ap.add_argument("--hosts", default="1,2,4")
    ap.add_argument("--modes", default="poseidon,ps,no-wfbp,ddp")
    ap.add_argument("--sep_models", default="vgg19-22k",
                    help="models also run with servers on separate hosts (mode sep-servers)")
    ap.add_argument("--keep_logs", action="store_true",
                    help="keep every run's logs (daemons, workers), not only failed runs'")
    ap.add_argument("--sep_servers", type=int, default=0,
                    help="modes with servers on hosts of their own (sep-servers, coord-auto-sep): "
                         "this many server hosts (0: as many as workers)")
    ap.add_argument("--scale", type=int, default=8, help="s: dimensions and K / s, bandwidth / s^2")
    ap.add_argument("--bandwidth", default="10Gbit", help="the unscaled cluster's link rate")
    ap.add_argument("--batch", type=int, default=32, help="the unscaled per-worker batch K")
    ap.add_argument("--gpu", default="titanx")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--slow_start_after_idle", action="store_true",
                    help="keep the kernel default net.ipv4.tcp_slow_start_after_idle=1 in the "
                         "host namespaces (default: 0, as tuned clusters run)")
    ap.add_argument("--verify", action="store_true", help="synth --verify (slower)")
    ap.add_argument("--run_timeout", type=float, default=300)
    ap.add_argument("--layer_timeout_ms", type=int, default=120000)
    ap.add_argument("--out", default=None, help="output directory (default bench/cluster/results/"
                                                "<timestamp>)")
    for name, default in AGENT_SIZE_DEFAULTS.items():
        ap.add_argument(f"--{name}", default=None,
                        help=f"the agents' --{name} on the unscaled cluster (default {default}, the "
                             f"agent's); passed / s^2")
    ap.add_argument("--baseline_set", action="store_true",
                    help="the recorded quick set: " + ", ".join(f"{k} {v}" for k, v in
                                                                BASELINE_SET.items()))
    ap.add_argument("--compare", metavar="BASELINE_JSON", default=None,
                    help="run the set recorded in this file (its models, hosts, modes, iterations, "
                         "sizes, unless given) and print every figure against the record")
    ap.add_argument("--record", metavar="BASELINE_JSON", default=None,
                    help="write the figures of this run as a baseline (with the git commit)")
    ap.add_argument("--build_commit", default=None,
                    help="with --record: the commit --build was built from, when it is not this "
                         "checkout's HEAD (e.g. a clean export: git archive HEAD)")
    args = ap.parse_args()
    baseline = None
    # Options given on the command line win over a recorded or the baseline set.
    given = {a.split("=")[0].lstrip("-") for a in sys.argv[1:] if a.startswith("--")}
    preset = None
    if args.compare:
        with open(args.compare) as f:
            baseline = json.load(f)
        preset = baseline["settings"]
        args.quick = False
    elif args.baseline_set:
        preset = BASELINE_SET
    if preset is not None:
        for k, v in preset.items():
            if k not in given and hasattr(args, k):
                setattr(args, k, v)
        if "sep_models" not in given:
            args.sep_models = ""
    if args.quick:
        args.models, args.hosts, args.modes, args.sep_models = "alexnet", "1,2", "poseidon", ""
        args.iterations = min(args.iterations, 3)
        args.verify = True
    args.build = os.path.abspath(args.build)
    for rel in ("server/poseidon-server", "agent/poseidon-agent", "bench/poseidon-synth"):
        if not os.access(os.path.join(args.build, rel), os.X_OK):
            sys.exit(f"run_cluster: {os.path.join(args.build, rel)} missing (build it first)")
    if os.geteuid() != 0:
        print("run_cluster: SKIP: needs root for network namespaces", flush=True)
        return SKIP
    why = permitted()
    if why:
        print(f"run_cluster: SKIP: network namespaces / tc not permitted here ({why})", flush=True)
        return SKIP

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    atexit.register(teardown_all)

    s = args.scale
    args.agent_sizes = scaled_sizes(args, s)
    rate_unscaled = parse_rate(args.bandwidth)
    rate = rate_unscaled / (s * s)
    gpu_rate = GPU_RATES.get(args.gpu) or float(args.gpu)
    batch_scaled = max(1, args.batch // s)
    hosts = [int(x) for x in args.hosts.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    if any(m.startswith("ddp") for m in modes):
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            log("run_cluster: python3-torch missing: modes ddp, ddp-fp16 left out")
            modes = [m for m in modes if not m.startswith("ddp")]
    for m in modes:
        if m not in MODES:
            sys.exit(f"run_cluster: unknown mode {m} (have {', '.join(MODES)})")
    out = args.out or os.path.join(ROOT, "bench", "cluster", "results",
                                   datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    specdir = os.path.join(out, "specs")
    os.makedirs(specdir, exist_ok=True)
    logroot = tempfile.mkdtemp(prefix=f"{PREFIX}-logs-")
    pid = os.getpid()
    subnet = f"10.{200 + (pid >> 8) % 50}.{pid % 256}"

    plan = []  # (model, mode, n)
    for model in args.models.split(","):
        for mode in modes:
            for n in hosts:
                plan.append((model, mode, n))
        if model in args.sep_models.split(","):
            for n in hosts:
                if n >= 2:
                    plan.append((model, "sep-servers", n))
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bar = tqdm(total=len(plan), desc="cluster runs", unit="run", file=sys.stderr) if tqdm else None

    print(f"Emulated cluster: s = {s}, link {rate_unscaled / 1e9:g} Gbit/s -> {rate / 1e6:.1f} "
          f"Mbit/s per host and direction (tbf), K = {args.batch} -> {batch_scaled}, GPU "
          f"{args.gpu} ({gpu_rate / 1e12:g} TFLOP/s), {args.iterations} iterations per run; "
          f"agents {' '.join(f'--{k}={v}' for k, v in sorted(args.agent_sizes.items()))}; "
          f"build {args.build}", flush=True)
    results = []
    specs = {}
    t_start = time.time()
    try:
        for model, mode, n in plan:
            if model not in specs:
                spec = load_spec(model)
                scaled = scale_spec(spec, s)
                path = os.path.join(specdir, f"{scaled['name']}.json")
                with open(path, "w") as f:
                    json.dump(scaled, f, indent=1)
                # Compute time kept: FLOPs(unscaled) * K == scale * FLOPs(scaled) * K/s.
                cs = total_flops(spec) * args.batch / (total_flops(scaled) * batch_scaled)
                specs[model] = (spec, scaled, path, cs)
            spec, scaled, path, cs = specs[model]
            if bar:
                bar.set_postfix_str(f"{model} {mode} N={n}")
            colocated = not MODES[mode][2]
            compute = compute_seconds(spec, args.batch, gpu_rate)
            comm = comm_bound_seconds(spec, args.batch, n, rate_unscaled, colocated,
                                      args.sep_servers or None)
            row = {"model": model, "mode": mode, "n": n, "scale": s, "compute_scale": cs,
                   "compute_seconds": compute, "comm_bound_seconds": comm,
                   "bound_seconds": max(compute, comm),
                   "comm_bound_seconds_scaled_check": comm_bound_seconds(
                       scaled, batch_scaled, n, rate, colocated, args.sep_servers or None)}
            try:
                r = run_one(args, path, scaled, n, mode, cs, batch_scaled, rate, subnet, logroot)
                row.update(r)
                t = r["seconds_per_iteration"]
                row["iterations_per_second"] = 1 / t
                row["samples_per_second"] = n * args.batch / t
                row["iteration_over_bound"] = t / row["bound_seconds"]
            except RuntimeError as e:
                row["error"] = str(e)
                log(f"run failed: {model} {mode} N={n}: {e}")
            results.append(row)
            if bar:
                bar.update(1)
    finally:
        if bar:
            bar.close()
    # Speed-up against N = 1 of the same model (mode's own N=1 run; sep-servers against poseidon).
    for r in results:
        if r.get("error"):
            continue
        base_mode = "poseidon" if r["mode"] == "sep-servers" else r["mode"]
        base = [b for b in results if b["model"] == r["model"] and b["mode"] == base_mode
                and b["n"] == 1 and not b.get("error")]
        if base:
            r["speedup"] = r["samples_per_second"] / base[0]["samples_per_second"]
            r["efficiency"] = r["speedup"] / r["n"]
    md = table(results)
    header = (f"s = {s}; link {rate_unscaled / 1e9:g} Gbit/s (emulated at {rate / 1e6:.1f} Mbit/s); "
              f"K = {args.batch} (emulated {batch_scaled}); GPU {args.gpu}; "
              f"{args.iterations} iterations; wall {time.time() - t_start:.0f} s")
    print(header)
    print(md, flush=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(header + "\n\n" + md + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"command": sys.argv, "scale": s, "bandwidth_bps": rate_unscaled,
                   "emulated_bandwidth_bps": rate, "batch": args.batch,
                   "emulated_batch": batch_scaled, "gpu": args.gpu, "gpu_flops": gpu_rate,
                   "iterations": args.iterations, "agent_sizes": args.agent_sizes,
                   "results": results}, f, indent=1)
    if baseline is not None:
        print(compare(baseline, results), flush=True)
    if args.record:
        record(args, results, args.record)
        print(f"baseline written to {args.record}", flush=True)
    png = plot(results, os.path.join(out, "speedup.png"))
    print(f"results in {out} (results.md, results.json{', speedup.png' if png else ''})",
          flush=True)
    if args.keep_logs or any(r.get("error") for r in results):
        log(f"logs of the runs kept in {logroot}")
    else:
        shutil.rmtree(logroot, ignore_errors=True)
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        teardown_all()
    sys.exit(code)
