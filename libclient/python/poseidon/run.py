"""poseidon run: start a local Poseidon cluster and a training command on every rank.

    python3 -m poseidon.run -n 4 [--servers 1] [--scheme auto|ps|sfb] -- python3 train.py ...

Starts the KV servers, one poseidon-agent per worker and the command once per worker (with
POSEIDON_SEGMENT, POSEIDON_RANK, POSEIDON_WORLD_SIZE, POSEIDON_LOCAL_RANK set), streams every
process's output prefixed with its name, and stops everything when the job ends. If a rank or a
daemon fails, everything is stopped, and the exit code is non-zero with a message naming it;
except a KV server when the keys have backups (--servers 2 or more, --replicas 1, the default):
the job goes on at the backups, and a new server started in its place joins the running job and
takes copies of the keys short of backups, so that a later loss costs nothing either
(docs/server.md, "Replication and failover").

With --checkpoint_dir the job can stop and resume: every KV server writes the job's state under
it after every --checkpoint_every-th iteration and at the end (rank 0's agent asks, between two
iterations), and `--resume` starts the same job from there (docs/operations.md, "Stop and resume").
With --max_restarts N a failed job starts again by itself, at most N times, from its last
checkpoint (or from the beginning without one); with --rejoin (PS and SFB layers) only the failed
rank starts again and takes up the running job where it stopped, the others waiting for it
(docs/operations.md, "A rank rejoins the running job").
"""
import argparse
import json
import re
import os
import secrets
import signal
import struct
import subprocess
import sys
import threading
import time

from .keys import make_keyring

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


def find_binary(name, subdir):
    dirs = []
    if os.environ.get("POSEIDON_BIN_DIR"):
        dirs.append(os.environ["POSEIDON_BIN_DIR"])
    for build in (os.environ.get("POSEIDON_BUILD_DIR", ""), "build/release", "build/asan"):
        if build:
            base = build if os.path.isabs(build) else os.path.join(ROOT, build)
            dirs.append(os.path.join(base, subdir))
    for d in dirs:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    import shutil
    installed = shutil.which(name)  # the packages' /usr/bin
    if installed:
        return installed
    sys.exit(f"poseidon run: cannot find {name} (build with ./scripts/demo.sh, or set "
             "POSEIDON_BUILD_DIR / POSEIDON_BIN_DIR)")


def _die_with_parent():
    """In the child before exec: SIGTERM it when the launcher dies, even by SIGKILL, so that no
    daemon outlives the job (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


_OUTPUT_LOCK = threading.Lock()  # the processes' output threads print through it


class Proc:
    def __init__(self, name, argv, env=None, watch=None):
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.watch = watch
        self.seen = threading.Event()
        self.tail = []
        self.restored = []  # a KV server's "poseidon-server restored job J at clock C" lines
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if "\r" in line:  # a progress bar redrawn in place: keep its last state
                segments = [seg for seg in line.split("\r") if seg.strip()]
                if not segments:
                    continue
                line = segments[-1]
            self.tail = (self.tail + [line])[-5:]
            if line.startswith("poseidon-server restored job "):
                self.restored.append(line)
            if self.watch and self.watch in line:
                self.seen.set()
                if line.startswith("poseidon-"):
                    continue
            with _OUTPUT_LOCK:  # print() writes the line and its end apart: one at a time
                print(f"[{self.name}] {line}", flush=True)

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def main(argv=None):
    ap = argparse.ArgumentParser(prog="poseidon run", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1,
                    help="backups of every PS key on the next servers (with --servers 2 or "
                         "more): a dead server's keys go on at their backup; 0: none")
    ap.add_argument("--scheme", choices=["auto", "ps", "sfb", "allreduce"], default="auto")
    ap.add_argument("--wire", choices=["plan", "fp32", "bf16", "fp16"], default="plan",
                    help="what PS pushes and pulls and all-reduces carry: plan (each layer's "
                         "wire from the plan: exact unless --lossy_wire allows more), or for "
                         "every layer fp32 (exact), bf16 or fp16 (half the bytes, lossy, with "
                         "error feedback and float32 sums; not with a server-side optimizer)")
    ap.add_argument("--lossy_wire", choices=["none", "bf16", "fp16"], default="none",
                    help="the job allows that lossy 16-bit wire: the planner puts a PS or "
                         "all-reduce layer on it where its cost model says it pays (the local "
                         "coordinator's --plan_lossy_wire); none: every layer exact")
    ap.add_argument("--lowrank", type=int, default=-1, metavar="R",
                    help="low rank (PowerSGD) of the all-reduce layers with a 2-D gradient it "
                         "shrinks: every such layer sent as rank-R factors (lossy, error "
                         "feedback; the first --lowrank_warmup all-reduces exact); 0: off; "
                         "-1 (default): the plan's (exact unless the job allows it)")
    ap.add_argument("--lossy_lowrank", type=int, default=0, metavar="R",
                    help="the job allows low rank R: the planner sends an all-reduce layer's "
                         "2-D gradient as rank-R factors where its cost model says it pays (the "
                         "local coordinator's --plan_lowrank_rank); 0: never")
    ap.add_argument("--lossy_lowrank_layers", default="", metavar="LAYER=R,...",
                    help="per-layer low rank, 'fc6.weight=4,conv1.weight=0': R sends that layer "
                         "by all-reduce at rank R whatever the cost (lossy), 0 keeps it off low "
                         "rank (the local coordinator's --plan_lowrank_layers)")
    ap.add_argument("--lowrank_warmup", type=int, default=10,
                    help="with --lowrank: exact all-reduces of each layer before the factors")
    ap.add_argument("--bandwidth", default="10Gbit", help="link bandwidth the planner assumes")
    ap.add_argument("--allreduce", choices=["auto", "off", "by-cost"], default="auto",
                    help="ring all-reduce: auto (for --scheme allreduce and operator overrides), "
                         "off (no Gloo ring), by-cost (the local coordinator's cost model may "
                         "choose it: --allreduce_by_cost)")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="plan from --bandwidth and the coordinator's nominal latency instead of "
                         "each agent's start-up probe of its server links (a plan that does not "
                         "depend on how loaded this host is)")
    ap.add_argument("--coordinator", default=os.environ.get("POSEIDON_COORDINATOR", ""),
                    help="join an existing cluster: its coordinator (host:port); the KV servers "
                         "are the ones registered there ($POSEIDON_COORDINATOR)")
    ap.add_argument("--token", default=os.environ.get("POSEIDON_TOKEN", ""),
                    help="the job's token on that coordinator ($POSEIDON_TOKEN)")
    ap.add_argument("--job", type=int,
                    default=int(os.environ.get("POSEIDON_JOB_ID") or os.environ.get("SLURM_JOB_ID")
                                or "0"),
                    help="the job id on that coordinator ($POSEIDON_JOB_ID, else $SLURM_JOB_ID)")
    # Several machines, one launcher each (Slurm: one task per node): ranks are
    # node_rank * workers + local rank, the world is nodes * workers.
    ap.add_argument("--nodes", type=int,
                    default=int(os.environ.get("POSEIDON_NODES") or os.environ.get("SLURM_NNODES")
                                or os.environ.get("SLURM_JOB_NUM_NODES") or "1"),
                    help="machines in the job ($POSEIDON_NODES, else $SLURM_NNODES)")
    ap.add_argument("--node-rank", type=int, dest="node_rank",
                    default=int(os.environ.get("POSEIDON_NODE_RANK") or os.environ.get("SLURM_NODEID")
                                or "0"),
                    help="this machine's index ($POSEIDON_NODE_RANK, else $SLURM_NODEID)")
    ap.add_argument("--listen-host", dest="listen_host",
                    default=os.environ.get("POSEIDON_LISTEN_HOST", "127.0.0.1"),
                    help="the address other machines reach this one's agents at")
    ap.add_argument("--checkpoint_dir", default="",
                    help="keep the job's checkpoints here (each KV server under server-<i>): "
                         "taken after every --checkpoint_every-th iteration and at the end of "
                         "training; such a job plans without the start-up probe, so that a "
                         "resumed run lays out the same tables")
    ap.add_argument("--checkpoint_every", type=int, default=0,
                    help="with --checkpoint_dir: also after every N-th iteration (0: only at "
                         "the end)")
    ap.add_argument("--resume", action="store_true",
                    help="start the job of --checkpoint_dir again from its checkpoints (the same "
                         "workers and servers); the ranks read where from "
                         "poseidon.torch.resumed_steps() ($POSEIDON_RESUMED_ITERATION)")
    ap.add_argument("--max_restarts", type=int, default=0,
                    help="a job whose rank, agent or server fails starts again, at most N times: "
                         "from its last checkpoint with --checkpoint_dir (only the iterations "
                         "since are lost), else from the beginning; the ranks see "
                         "$POSEIDON_RESTART_COUNT (a local cluster; joined to one, with --rejoin "
                         "only: this launcher's ranks restart alone, N times in all)")
    ap.add_argument("--rejoin", action="store_true",
                    help="with --max_restarts: a rank whose process or agent fails is restarted "
                         "alone (a new agent with --rejoin) and takes up the running job where "
                         "it stopped, while the others wait for it (--rejoin_timeout); nobody "
                         "rolls back. All-reduce layers (--scheme allreduce, --allreduce "
                         "by-cost) need --min_workers too; and a framework that takes up a "
                         "running job from psd_start_iteration (poseidon-synth; the PyTorch integration: "
                         "a server-side optimizer's state is the servers', a local one's a live "
                         "rank hands over)")
    ap.add_argument("--rejoin_timeout", default="30s",
                    help="with --rejoin: how long the others wait for a failed rank to come "
                         "back before the job fails (or, restarts used up, at once)")
    ap.add_argument("--min_workers", type=int, default=0,
                    help="a rank whose process or agent fails and is not restarted (no --rejoin, "
                         "or its restarts used up) is left out and the job goes on with the "
                         "ranks left, while at least N are: the KV servers sum the ranks left "
                         "from the first clock it did not push, and each process learns its new "
                         "rank and world size (psd_world; poseidon.world()); SFB layers leave "
                         "it out from one iteration the live agents agree on, all-reduce "
                         "layers go on in a ring of the ranks left; 0: a failed rank fails the "
                         "job")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command to run (poseidon run -n 4 -- python3 train.py)")
    if not 1 <= args.workers <= 256 or not 1 <= args.servers <= 64:
        ap.error("workers must be in [1, 256] and servers in [1, 64]")
    if not 0 <= args.replicas <= 8:
        ap.error("replicas must be in [0, 8]")
    # A server may die without ending the job when its keys have a backup.
    survivable = min(args.replicas, args.servers - 1) > 0
    joining = bool(args.coordinator)
    # Joining a cluster starts agents only: its servers run elsewhere (a server image, say).
    server_bin = None if joining else find_binary("poseidon-server", "server")
    agent_bin = find_binary("poseidon-agent", "agent")
    if joining and (not args.token or not args.job):
        ap.error("joining a cluster needs --token and --job (or POSEIDON_TOKEN, POSEIDON_JOB_ID)")
    if joining and args.lossy_wire != "none":
        ap.error("--lossy_wire is the job's setting on its coordinator (poseidon-coordinator "
                 "--plan_lossy_wire); joining, the coordinator's plan decides")
    if joining and args.lossy_lowrank != 0:
        ap.error("--lossy_lowrank is the job's setting on its coordinator (poseidon-coordinator "
                 "--plan_lowrank_rank); joining, the coordinator's plan decides")
    if joining and args.lossy_lowrank_layers:
        ap.error("--lossy_lowrank_layers is the job's setting on its coordinator "
                 "(poseidon-coordinator --plan_lowrank_layers); joining, the coordinator's plan "
                 "decides")
    if not 0 <= args.lossy_lowrank <= 1024:
        ap.error(f"--lossy_lowrank {args.lossy_lowrank} is out of range (0 to 1024)")
    if not -1 <= args.lowrank <= 1024 or args.lowrank_warmup < 0:
        ap.error(f"--lowrank {args.lowrank} (-1 to 1024) or --lowrank_warmup "
                 f"{args.lowrank_warmup} (>= 0) out of range")
    if args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
        ap.error(f"node rank {args.node_rank} is not in [0, {args.nodes})")
    if args.nodes > 1 and not joining:
        ap.error("several nodes share one cluster: give its --coordinator (and --token, --job)")
    world = args.nodes * args.workers
    first_rank = args.node_rank * args.workers
    # As torchrun: where several ranks share the machine each one's intra-op threads (OpenMP,
    # OpenBLAS) default to one; a thread per core in every rank oversubscribes the cores, which
    # the agents and servers need too.
    rank_threads = {}
    if args.workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        rank_threads = {"OMP_NUM_THREADS": "1"}
        print(f"poseidon run: OMP_NUM_THREADS=1 in each rank ({args.workers} ranks share this "
              f"machine, as torchrun sets it); set OMP_NUM_THREADS to choose", file=sys.stderr,
              flush=True)
    if args.checkpoint_every < 0:
        ap.error("--checkpoint_every must be 0 or more")
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        ap.error("--resume and --checkpoint_every need --checkpoint_dir")
    if not 0 <= args.max_restarts <= 100:
        ap.error("--max_restarts must be in [0, 100]")
    if args.max_restarts and joining and not args.rejoin:
        ap.error("--max_restarts alone restarts a local cluster's job; joined to a cluster, a "
                 "failed rank restarts alone with --rejoin (each launcher its own ranks), or "
                 "restart the job from the scheduler (its servers keep their state)")
    if args.rejoin and not args.max_restarts:
        ap.error("--rejoin restarts a failed rank alone: it needs --max_restarts N")
    if args.rejoin and not args.min_workers and (args.scheme == "allreduce" or
                                                 args.allreduce == "by-cost"):
        ap.error("--rejoin with all-reduce layers (--scheme allreduce, --allreduce by-cost) needs "
                 "--min_workers: a ring takes a restarted rank back only in a job that may "
                 "shrink (its ring goes on in new rings)")
    if args.min_workers and not 1 <= args.min_workers <= world:
        ap.error(f"--min_workers needs a value in [1, {world}] (the world size), got "
                 f"{args.min_workers}")
    if not re.fullmatch(r"[0-9]+(ms|s|m)", args.rejoin_timeout):
        ap.error(f"--rejoin_timeout {args.rejoin_timeout!r} is not a duration (30s, 500ms, 2m)")
    if args.checkpoint_dir and joining:
        ap.error("--checkpoint_dir is for a local cluster: a joined cluster's servers keep their "
                 "own (poseidon-server --checkpoint_dir)")
    saved = _job_file(ap, args, world) if args.checkpoint_dir else None
    # Secrets travel in the daemons' environments (POSEIDON_<FLAG>, readable by the owner only),
    # never on command lines (/proc/<pid>/cmdline is world-readable). A local cluster has one
    # token for the control plane and another secret for the data plane; joining, the data-plane
    # secret is $POSEIDON_SECRET, else the token (the servers' job secret on that cluster).
    token = args.token if joining else secrets.token_hex(16)
    secret = os.environ.get("POSEIDON_SECRET") or token if joining else secrets.token_hex(16)

    def env_with(**values):
        return dict(os.environ, **{f"POSEIDON_{k.upper()}": v for k, v in values.items()})

    # The secrets this launcher was given: its agents and ranks get none of them. An agent gets
    # its keyring (its own rank's keys, transport/credentials.h), so a rank's agent cannot speak
    # for another rank; the ranks need no key at all.
    secret_vars = ("POSEIDON_SECRET", "POSEIDON_JOB_SECRET", "POSEIDON_TOKEN", "POSEIDON_JOB_TOKEN",
                   "POSEIDON_COORDINATOR_TOKEN", "POSEIDON_CLUSTER_TOKEN")

    def without_secrets(env):
        return {k: v for k, v in env.items() if k not in secret_vars}

    def agent_env(**values):
        return dict(without_secrets(os.environ),
                    **{f"POSEIDON_{k.upper()}": v for k, v in values.items()})
    job = args.job if joining else saved["job"] if args.resume else os.getpid()
    # job.json also names the servers the job lost (lost_servers): a checkpoint after a loss is
    # written by the servers left, whose files hold copies of the lost ones' keys; a resumed run
    # starts the lost ones afresh and their keys at those copies (agent --lost_servers).
    if saved is not None and not args.resume:
        saved = dict(job=job, workers=world, servers=args.servers, replicas=args.replicas,
                     lost_servers=[])
        _save_job_file(args.checkpoint_dir, saved)
    def attempt(resume, restart):
        """One run of the whole job (servers, agents, ranks): None once every rank finished
        with 0, else what failed (every process stopped)."""
        resumed = 0
        procs = []
        failed = None
        # The servers lost before the checkpoint resumed from; a run from the beginning has all.
        lost = (_lost_before(args.checkpoint_dir, job, args.servers, saved["lost_servers"],
                             copies=survivable)
                if saved is not None and resume else set())
        if saved is not None and not resume and saved.get("lost_servers"):
            saved["lost_servers"] = []
            _save_job_file(args.checkpoint_dir, saved)

        segments = []

        def stop_all(grace=10.0):
            """SIGTERM to every process, SIGKILL to what is still running after `grace` seconds."""
            for p in procs:
                p.stop()
            deadline = time.time() + grace
            for p in procs:
                try:
                    p.proc.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    p.stop(signal.SIGKILL)
                    p.proc.wait()
            # An agent that was killed could not unlink its shared memory: do it for it.
            for segment in segments:
                for name in (segment, segment + ".data"):
                    try:
                        os.unlink("/dev/shm" + name)
                    except FileNotFoundError:
                        pass

        signal.signal(signal.SIGINT, lambda *_: (stop_all(), sys.exit(130)))
        signal.signal(signal.SIGTERM, lambda *_: (stop_all(), sys.exit(143)))
        def address_of(p):
            deadline = time.time() + 30
            while not any("listening on " in l for l in p.tail):
                if p.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{p.name} did not start: {' | '.join(p.tail)}")
                time.sleep(0.02)
            return next(l for l in p.tail if "listening on " in l).split("listening on ")[1].strip()

        servers = []

        def note_lost():
            """Records in job.json every KV server that died with its keys' copies elsewhere:
            its checkpoints stop there, and a resume takes its keys from the others' files (their
            copies), never from its own older one."""
            if saved is None or not survivable:
                return
            dead = {int(p.name.split()[1]) for p in servers
                    if p.name.startswith("server ") and "(replacing" not in p.name and
                    p.proc.poll() is not None}
            if not dead <= set(saved["lost_servers"]):
                saved["lost_servers"] = sorted({*saved["lost_servers"], *dead})
                _save_job_file(args.checkpoint_dir, saved)

        try:
            coordinator = args.coordinator
            if not joining:
                # A whole local cluster: the coordinator, then the servers registering with it.
                coord_bin = find_binary("poseidon-coordinator", "coordinator")
                p = Proc("coordinator", [coord_bin, "--listen=127.0.0.1:0", f"--job_id={job}",
                                         f"--min_servers={args.servers}",
                                         f"--bandwidth={args.bandwidth}", "--log_level=warn",
                                         f"--plan_lossy_wire={args.lossy_wire}",
                                         f"--plan_lowrank_rank={args.lossy_lowrank}",
                                         *([f"--plan_lowrank_layers={args.lossy_lowrank_layers}"]
                                           if args.lossy_lowrank_layers else []),
                                         *(["--allreduce_by_cost"] if args.allreduce == "by-cost"
                                           else []),
                                         # A rank taking up the job is heard of by the others'
                                         # agents at their next heartbeat, which a local
                                         # optimizer's hand-over waits for: every second (not
                                         # liveness_timeout / 5 = 3 s) for these few nodes.
                                         # So is a replacement server (it is used once
                                         # every agent heard of it).
                                         *(["--heartbeat_interval=1s"]
                                           if args.rejoin or survivable else [])],
                         env=env_with(job_token=token))
                procs.append(p)
                servers.append(p)
                coordinator = address_of(p)
                for s in range(args.servers):
                    # Checkpoints are rank 0's agent's to ask for (between iterations), not the
                    # servers' own at exit (a job stopped mid-iteration is not at one).
                    # A lost server starts afresh: its file is older than the others'.
                    ckpt = ([f"--checkpoint_dir={os.path.join(args.checkpoint_dir, f'server-{s}')}",
                             "--checkpoint_on_exit=false"]
                            if args.checkpoint_dir and s not in lost else [])
                    p = Proc(f"server {s}", [server_bin, "--listen=127.0.0.1:0", f"--job_id={job}",
                                             f"--coordinator={coordinator}", "--log_level=warn",
                                             *ckpt],
                             env=env_with(job_secret=secret, coordinator_token=token))
                    procs.append(p)
                    servers.append(p)
                    # One at a time: each has registered once it listens, so server s is the
                    # plan's server s in every run (a resumed job's servers hold their own keys).
                    address_of(p)
                if resume:
                    resumed = _resumed_iteration(servers[1:], job, args.checkpoint_dir, lost)
                    was = ""
                    if lost:
                        who = (f"server {min(lost)} was" if len(lost) == 1 else
                               f"servers {', '.join(map(str, sorted(lost)))} were")
                        was = (f" ({who} lost before it: their keys start at the copies the "
                               "others' checkpoints hold)")
                    print(f"poseidon run: job {job} resumes after iteration {resumed}{was}",
                          file=sys.stderr, flush=True)
            def start_agent(local, segment, rejoin=False):
                r = first_rank + local
                return Proc(f"agent {r}", [agent_bin, f"--job_id={job}", f"--rank={r}",
                                        f"--local_rank={local}",
                                        f"--world_size={world}", f"--coordinator={coordinator}",
                                        f"--listen={args.listen_host}:0",
                                        f"--scheme={args.scheme}", f"--wire={args.wire}",
                                        f"--lowrank_rank={args.lowrank}",
                                        f"--lowrank_warmup={args.lowrank_warmup}",
                                        f"--replicas={args.replicas}",
                                        f"--bandwidth={args.bandwidth}", f"--segment={segment}",
                                        *([] if args.probe and not args.checkpoint_dir
                                          else ["--probe_bytes=0"]),
                                        *([f"--checkpoint_every={args.checkpoint_every}",
                                           "--checkpoint_at_end=true",
                                           f"--resumed_iteration={resumed}"]
                                          if args.checkpoint_dir else []),
                                        *([f"--lost_servers={','.join(map(str, sorted(lost)))}"]
                                          if lost else []),
                                        *(["--allreduce=false"] if args.allreduce == "off" else []),
                                        *([f"--rejoin_timeout={args.rejoin_timeout}"]
                                          if args.rejoin else []),
                                        *(["--rejoin"] if rejoin else []),
                                        *([f"--min_workers={args.min_workers}"]
                                          if args.min_workers else []),
                                        "--log_level=warn"], watch="poseidon-agent ready",
                            env=agent_env(keyring=make_keyring(secret, job, r, world),
                                          coordinator_token=token))

            pythonpath = os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))

            def start_worker(local, segment, restart_count):
                r = first_rank + local
                env = dict(without_secrets(os.environ), POSEIDON_SEGMENT=segment, POSEIDON_RANK=str(r),
                           POSEIDON_WORLD_SIZE=str(world), POSEIDON_LOCAL_RANK=str(local),
                           POSEIDON_RESUMED_ITERATION=str(resumed),
                           POSEIDON_RESTART_COUNT=str(restart_count),
                           POSEIDON_MIN_WORKERS=str(args.min_workers),
                           PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1", **rank_threads)
                return Proc(f"rank {r}", command, env=env)

            agents = []
            for local in range(args.workers):
                segment = f"/poseidon-{job}-{first_rank + local}"
                segments.append(segment)
                p = start_agent(local, segment)
                procs.append(p)
                agents.append(p)
            for p in agents:
                if not p.seen.wait(30):
                    raise RuntimeError(f"{p.name} did not start: {' | '.join(p.tail)}")
            workers = []
            for local in range(args.workers):
                p = start_worker(local, segments[local], restart)
                procs.append(p)
                workers.append(p)

            def stop_rank(local):
                """Rank `local`'s process and agent stop (SIGKILL: whichever is still running
                holds nothing the job needs) and leave the watch list."""
                for p in (workers[local], agents[local]):
                    if p.proc.poll() is None:
                        p.stop(signal.SIGKILL)
                    p.proc.wait()
                    procs.remove(p)

            def rejoin(local, why):
                """--rejoin: rank `local`'s process and agent stop (SIGKILL: whichever is still
                running holds nothing the job needs) and start again, the agent with --rejoin on
                a new segment; the others wait for it. Returns the new worker."""
                nonlocal restart
                restart += 1
                r = first_rank + local
                print(f"poseidon run: {why}; restart {restart} of {args.max_restarts}: rank {r} "
                      f"rejoins the running job", file=sys.stderr, flush=True)
                stop_rank(local)
                segment = f"/poseidon-{job}-{r}-{restart}"
                segments.append(segment)
                agents[local] = start_agent(local, segment, rejoin=True)
                procs.append(agents[local])
                if not agents[local].seen.wait(30):
                    raise RuntimeError(f"{agents[local].name} did not start again: "
                                       f"{' | '.join(agents[local].tail)}")
                workers[local] = start_worker(local, segment, restart)
                procs.append(workers[local])
            dropped = set()  # --min_workers: ranks (local indices) the job goes on without

            def drop(local, why):
                """--min_workers: rank `local`'s process and agent stop (SIGKILL) and the job goes
                on without it (its agent and the KV servers leave it out)."""
                dropped.add(local)
                left = world - len(dropped)
                print(f"poseidon run: {why}; no restart left: the job goes on with {left} of "
                      f"{world} workers (--min_workers {args.min_workers})",
                      file=sys.stderr, flush=True)
                # An agent whose training process died exits by itself within seconds, telling
                # the coordinator it failed (the other agents then go on without it at once);
                # killed, it would be declared dead only once its lease ran out.
                if workers[local].proc.poll() is not None:
                    try:
                        agents[local].proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                stop_rank(local)

            # Watch: every worker must finish with 0; no daemon may die before that (but a server
            # whose keys have backups: said once, and the job goes on).
            survived = set()

            def replace_server(dead):
                """Starts a server in the place of `dead` (its keys went on at their backups):
                it registers with the coordinator, joins the running job, and the keys short of
                backups copy their state to it (a job takes at most 16 such servers)."""
                replacements = sum("(replacing" in p.name for p in servers)
                if joining or replacements >= 16:
                    return
                index = args.servers + replacements
                p = Proc(f"server {index} (replacing {dead.name})",
                         [server_bin, "--listen=127.0.0.1:0", f"--job_id={job}",
                          f"--coordinator={coordinator}", "--log_level=warn"],
                         env=env_with(job_secret=secret, coordinator_token=token))
                procs.append(p)
                servers.append(p)
                print(f"poseidon run: started server {index} in place of {dead.name}: it joins "
                      f"the running job, and the keys short of backups take copies there",
                      file=sys.stderr, flush=True)
            while True:
                for local, p in enumerate(workers):
                    code = p.proc.poll()
                    if code not in (None, 0) and local not in dropped:
                        failed = f"{p.name} failed with exit code {code}"
                        break
                if (args.rejoin or args.min_workers) and not failed:
                    # A rank whose agent died while it ran fails with it (an agent exits 0 once
                    # its worker detached, which may still be exiting).
                    for local, p in enumerate(agents):
                        code = p.proc.poll()
                        if (code not in (None, 0) and workers[local].proc.poll() is None and
                                local not in dropped):
                            failed = f"{p.name} died (exit code {code}): {' | '.join(p.tail[-2:])}"
                            break
                if failed and args.rejoin and restart < args.max_restarts:
                    local = next(i for i, (w, a) in enumerate(zip(workers, agents))
                                 if failed.startswith((f"{w.name} ", f"{a.name} ")))
                    rejoin(local, failed)
                    failed = None
                    continue
                if failed and args.min_workers and world - len(dropped) - 1 >= args.min_workers:
                    local = next(i for i, (w, a) in enumerate(zip(workers, agents))
                                 if failed.startswith((f"{w.name} ", f"{a.name} ")))
                    drop(local, failed)
                    failed = None
                    continue
                if failed:
                    break
                for p in procs:
                    if p in workers:
                        continue
                    code = p.proc.poll()
                    # An agent exits 0 when its worker detaches; anything else while a worker still
                    # runs is a failure.
                    if code not in (None, 0) or (code == 0 and p in servers):
                        if survivable and p.name.startswith("server ") and p.name not in survived:
                            survived.add(p.name)
                            print(f"poseidon run: {p.name} died (exit code {code}); its keys go on "
                                  f"at their backups", file=sys.stderr, flush=True)
                            note_lost()
                            replace_server(p)
                            continue
                        if p.name in survived:
                            continue
                        if any(w.proc.poll() is None for w in workers):
                            failed = f"{p.name} died (exit code {code}): {' | '.join(p.tail[-2:])}"
                            break
                if failed or all(w.proc.poll() == 0 for i, w in enumerate(workers)
                                 if i not in dropped):
                    break
                time.sleep(0.05)
        except RuntimeError as e:
            failed = str(e)
        # Before anything is stopped: a server that died in the same poll as a rank is lost too.
        note_lost()
        if failed:
            time.sleep(0.2)  # let the failing process's last lines through
            # Said at once, not after the others stopped: a server finishing its clock on SIGTERM
            # takes a while, and the job is over anyway (so they get 3 s, not 10).
            print(f"poseidon run: {failed}; stopping every process", file=sys.stderr, flush=True)
            started = time.time()
            # The KV servers and the coordinator hold nothing to save (this launcher's servers
            # write no checkpoint at exit), and a server would wait for the clock in flight:
            # killed at once, so that a restart (--max_restarts) does not wait for them.
            for p in servers:
                p.stop(signal.SIGKILL)
            stop_all(grace=3.0)
        else:
            stop_all()
        for p in procs:
            p.thread.join(timeout=2)
        if failed:
            print(f"poseidon run: stopped every process ({time.time() - started:.1f} s)",
                  file=sys.stderr, flush=True)
            return failed, restart
        return None, restart


    # --max_restarts: a failed job starts again, from its servers' last checkpoint when it has
    # one (--checkpoint_dir), else from the beginning; the ranks see $POSEIDON_RESTART_COUNT.
    resume, restart = args.resume, 0
    while True:
        failed, restart = attempt(resume, restart)
        if failed is None:
            return 0
        if restart >= args.max_restarts:
            if args.max_restarts:
                print(f"poseidon run: {failed}: no restart left (--max_restarts "
                      f"{args.max_restarts} used); the job failed", file=sys.stderr, flush=True)
            return 1
        if joining:  # the job's servers and coordinator are the scheduler's to restart
            print(f"poseidon run: {failed}: joined to a cluster, only a failed rank restarts "
                  "(--rejoin), not the job; the job failed", file=sys.stderr, flush=True)
            return 1
        restart += 1
        resume = bool(args.checkpoint_dir) and _has_checkpoint(args.checkpoint_dir, job)
        print(f"poseidon run: restart {restart} of {args.max_restarts}: job {job} starts again from "
              f"{'its last checkpoint' if resume else 'the beginning (no checkpoint yet)'}",
              file=sys.stderr, flush=True)


def _has_checkpoint(checkpoint_dir, job):
    """Whether a KV server of the job wrote a checkpoint under checkpoint_dir."""
    return any(os.path.exists(os.path.join(checkpoint_dir, d, f"job-{job}.ckpt"))
               for d in (os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else ())
               if d.startswith("server-"))


def _job_file(ap, args, world):
    """--checkpoint_dir's job.json: what a resumed run must match (read for --resume; a new job
    refuses a directory that holds one)."""
    path = os.path.join(args.checkpoint_dir, "job.json")
    if not args.resume:
        if os.path.exists(path):
            ap.error(f"{args.checkpoint_dir} holds the checkpoints of an earlier job: pass "
                     "--resume to go on with it, or give another --checkpoint_dir")
        return {}
    try:
        with open(path) as f:
            saved = json.load(f)
        job, workers, servers = (int(saved[k]) for k in ("job", "workers", "servers"))
    except FileNotFoundError:
        ap.error(f"--resume: {args.checkpoint_dir} holds no job to resume (no job.json)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--resume: {path} is unreadable: {e}")
    if job <= 0 or (workers, servers) != (world, args.servers):
        ap.error(f"--resume: job {job} ran {workers} workers and {servers} servers; this run has "
                 f"{world} and {args.servers}: give the same -n and --servers")
    lost = saved.get("lost_servers", [])  # absent in the job.json of an older launcher
    if not isinstance(lost, list) or not all(type(s) is int and 0 <= s < servers for s in lost):
        ap.error(f"--resume: {path}: lost_servers must be a list of server indices below "
                 f"{servers}, got {lost!r}")
    saved["lost_servers"] = sorted(set(lost))
    return saved


def _save_job_file(checkpoint_dir, saved):
    """Writes job.json atomically (a launcher killed while writing leaves the old one)."""
    os.makedirs(checkpoint_dir, mode=0o700, exist_ok=True)
    path = os.path.join(checkpoint_dir, "job.json")
    with open(path + ".tmp", "w") as f:
        json.dump(saved, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _checkpoint_label(checkpoint_dir, server, job):
    """The iteration of KV server `server`'s checkpoint of `job`, from its header (magic,
    version, length, job, clock: server/checkpoint.cc); None when it has none, or not a whole
    one of that job. The server checks the rest (the checksum, every count) when it restores."""
    header = struct.Struct("<8sIIQQQ")
    try:
        with open(os.path.join(checkpoint_dir, f"server-{server}", f"job-{job}.ckpt"), "rb") as f:
            head, size = f.read(header.size), os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(head) < header.size:
        return None
    magic, version, _, total, of_job, clock = header.unpack(head)
    if magic != b"PSDCKPT1" or version not in (1, 2) or total != size or of_job != job:
        return None
    return clock


def _lost_before(checkpoint_dir, job, servers, died, copies=False):
    """The servers a resume starts afresh, their keys at the copies the others' checkpoints
    hold: those of `died` (job.json's lost_servers) whose checkpoint is older than the others'
    (it stopped when they died) or missing. One that died after writing the others' iteration
    restores its own. The others must agree (checked once they restored).

    With `copies` (every key has a backup) any server whose checkpoint is older than the newest
    or missing is lost too: one the agents gave up while its process still ran (frozen, cut
    off), whose checkpoints stopped there, or one whose last write failed. The newest files
    hold copies of its keys (a clock is on a key's backups before it is answered); a key whose
    every copy is in older files fails the agents' registration, naming its servers."""
    labels = {s: _checkpoint_label(checkpoint_dir, s, job) for s in range(servers)}
    if copies:
        newest = max((l for l in labels.values() if l is not None), default=None)
        if newest is not None:
            return {s for s in range(servers) if labels[s] != newest}
    others = {labels[s] for s in range(servers) if s not in died}
    if not others:  # every server died once: the newest is the job's
        others = {max((l for l in labels.values() if l is not None), default=None)}
    if len(others) != 1 or None in others:
        return set(died)  # no set to resume from: said once the others restored
    return {s for s in died if labels[s] not in others}


def _resumed_iteration(servers, job, checkpoint_dir, lost=()):
    """The iteration every KV server restored the job at (they must agree); a lost server
    (started afresh) is not asked."""
    at = {}
    for s, p in enumerate(servers):
        if s in lost:
            continue
        lines = [l for l in p.restored if l.startswith(f"poseidon-server restored job {job} ")]
        if not lines:
            raise RuntimeError(f"server {s} has no checkpoint of job {job} in "
                               f"{os.path.join(checkpoint_dir, f'server-{s}')}: nothing to resume")
        at[s] = int(lines[0].split(" at clock ")[1].split()[0])
    if len(set(at.values())) != 1:
        which = ", ".join(f"server {s} after iteration {c}" for s, c in sorted(at.items()))
        raise RuntimeError(f"the servers' checkpoints of job {job} are of different iterations "
                           f"({which}): no consistent set to resume from")
    if not at:
        raise RuntimeError(f"every server of job {job} was lost: nothing to resume")
    return next(iter(at.values()))


if __name__ == "__main__":
    sys.exit(main())
