#!/usr/bin/python3
"""The container images of docker/ built and run for real, with podman (docs/operations.md).

No registry: the base image `debian:12` is made here from Debian's own packages (mmdebstrap
minbase bookworm, imported), in a podman store of the test's own (--root under WORK, so that the
machine's images are never touched and the tag shadows nothing). Then:
  - every docker/Dockerfile.* builds (`podman build --isolation=chroot`: the default isolation
    fails on hybrid cgroups); they share one build stage, built once;
  - in every image, every binary's shared libraries resolve (ldd inside the image);
  - the coordinator, server and train images run together on a podman network of their own: the
    server registers with the coordinator, `poseidon run` in the train image starts two agents
    and ranks that join through the coordinator and train an MLP (every layer by PS, so through
    the server container) with poseidon.torch.DistributedDataParallel
    (tests/ops/containers_train.py); the ranks end with the same parameters, equal to one plain
    PyTorch process on the 2x batch.
Containers run with runc and explicit --ulimit values: crun refuses hybrid cgroups, and podman's
default RLIMIT_NOFILE / RLIMIT_NPROC are above what a root without CAP_SYS_RESOURCE may set.
The network, the containers and the store are removed at the end, pass or fail; the base image's
tarball stays in WORK as a cache. Podman's networks belong to the machine, not to the store: a
network left by a run that was killed before its cleanup (its process is gone) is removed at the
start, and the subnet is podman's pick of a free one, never a fixed or random one that a host
route or another network may already use.

    containers_test.py --source SOURCE --work WORK

Exit 77 (skip) when podman, runc or mmdebstrap is missing, or when Debian's mirror cannot be
reached (mmdebstrap or an apt-get inside a build failed to fetch): the images need it.
"""
import argparse
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--source", required=True)
ap.add_argument("--work", required=True)
ap.add_argument("--store", default="",
                help="use (and keep) this podman store instead of a throwaway one: its layer "
                     "cache makes a rerun after a small change fast")
args = ap.parse_args()
SOURCE = os.path.abspath(args.source)
WORK = os.path.abspath(args.work)
IMAGES = ("coordinator", "server", "agent", "train")
FETCH_FAILED = ("Failed to fetch", "Temporary failure resolving", "Could not resolve",
                "Unable to fetch some archives", "Connection timed out")

for tool in ("podman", "runc", "mmdebstrap"):
    if shutil.which(tool) is None:
        print(f"SKIP: {tool} is not installed (scripts/install-deps.sh installs it)")
        sys.exit(77)

os.makedirs(WORK, exist_ok=True)
store = os.path.abspath(args.store) if args.store else tempfile.mkdtemp(prefix="store-", dir=WORK)
runroot = "" if args.store else tempfile.mkdtemp(prefix="poseidon-podman-run-")
PODMAN = ["podman", "--root", store] + (["--runroot", runroot] if runroot else []) + [
    "--runtime", "runc"]
RUN_OPTS = ["--ulimit", "nofile=8192:8192", "--ulimit", "nproc=4096:4096"]
tag = f"poseidon-ci-{os.getpid()}"
network = tag


def need(ok, what, output=""):
    """A check the rest depends on: on failure, its output is shown and the test ends here."""
    if not check(ok, what):
        print(output[-3000:])
        finish("")


def podman(*argv, timeout=300, **kw):
    return subprocess.run(PODMAN + list(argv), capture_output=True, text=True, timeout=timeout, **kw)


def skip_if_offline(text, what):
    if any(s in text for s in FETCH_FAILED):
        print(f"SKIP: {what} could not reach Debian's mirror:\n{text[-1500:]}")
        sys.exit(77)  # the finally below cleans up


def wait_listening(name, timeout=60):
    """Waits until container `name` prints its "listening on" line (a server's comes after its
    registration with the coordinator); False if it exits or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if " listening on " in podman("logs", name).stdout:
            return True
        state = podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
        if state != "true":
            return False
        time.sleep(0.2)
    return False


def remove_networks_of_killed_runs():
    """Removes the networks of runs of this test whose process is gone (killed before cleanup)."""
    r = podman("network", "ls", "--format", "{{.Name}}", timeout=60)
    for name in r.stdout.split():
        m = re.fullmatch(r"poseidon-ci-(\d+)", name)
        if m and name != network and not os.path.exists(f"/proc/{m.group(1)}"):
            gone = podman("network", "rm", "--force", name, timeout=60)
            print(f"removed the network {name} of a killed run" if gone.returncode == 0 else
                  f"could not remove the network {name} of a killed run: {gone.stderr.strip()}")


def build_stage(dockerfile):
    """The instructions of a Dockerfile's first stage (the build stage every image shares),
    without comments and blank lines."""
    with open(dockerfile) as f:
        text = f.read()
    start = text.index("FROM debian:12 AS build")
    lines = text[start:text.index("\nFROM ", start)].splitlines()
    return "\n".join(l for l in lines if l.strip() and not l.lstrip().startswith("#"))


def cleanup():
    for name in ("coordinator", "server", "train"):
        podman("rm", "--force", "--time", "2", f"{tag}-{name}", timeout=120)
    podman("network", "rm", "--force", network, timeout=60)
    if args.store:
        return
    # Images first (their overlay layers), then the store's directory. (Not `podman system
    # reset`: it would remove the machine's networks too.)
    podman("rmi", "--all", "--force", timeout=300)
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(runroot, ignore_errors=True)


try:
    # The base: Debian's packages only, with the same suites as this machine's apt.
    base = os.path.join(WORK, "debian-12-minbase.tar")
    if not os.path.isfile(base):
        started = time.monotonic()
        part = os.path.join(WORK, "debian-12-minbase.part.tar")  # mmdebstrap: format by suffix
        for leftover in (base, part):
            if os.path.isdir(leftover):
                shutil.rmtree(leftover)
        r = subprocess.run(
            ["mmdebstrap", "--variant=minbase", "--mode=root", "--format=tar", "bookworm", part,
             "deb http://deb.debian.org/debian bookworm main",
             "deb http://deb.debian.org/debian bookworm-updates main",
             "deb http://deb.debian.org/debian-security bookworm-security main"],
            capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            skip_if_offline(r.stdout + r.stderr, "mmdebstrap")
        need(r.returncode == 0, "mmdebstrap makes a Debian 12 base", r.stderr)
        os.rename(part, base)
        print(f"base image made in {time.monotonic() - started:.0f} s")
    r = podman("import", base, "docker.io/library/debian:12")
    need(r.returncode == 0, "podman imports the base as debian:12", r.stderr)

    # One build stage for the four images (an engine builds it once): it must stay the same text.
    stages = {n: build_stage(os.path.join(SOURCE, "docker", f"Dockerfile.{n}")) for n in IMAGES}
    check(len(set(stages.values())) == 1,
          "the Dockerfiles' build stages are the same text (else each image compiles it again)")

    for name in IMAGES:
        started = time.monotonic()
        r = podman("build", "--pull=never", "--isolation=chroot", *RUN_OPTS,
                   "-f", os.path.join(SOURCE, "docker", f"Dockerfile.{name}"),
                   "-t", f"poseidon/{name}:latest", SOURCE, timeout=3000)
        if r.returncode != 0:
            skip_if_offline(r.stdout + r.stderr, f"docker/Dockerfile.{name}")
        need(r.returncode == 0, f"docker/Dockerfile.{name} builds", r.stdout + r.stderr)
        print(f"docker/Dockerfile.{name} built in {time.monotonic() - started:.0f} s")

    # Every binary and library of the images finds its shared libraries there.
    binaries = {"coordinator": ["/usr/local/bin/poseidon-coordinator"],
                "server": ["/usr/local/bin/poseidon-server"],
                "agent": ["/usr/local/bin/poseidon-agent"],
                "train": ["/usr/local/bin/poseidon", "/usr/local/bin/poseidon-agent",
                          "/usr/local/lib/libposeidon.so"]}
    for name, files in binaries.items():
        for f in files:
            r = podman("run", "--rm", *RUN_OPTS, "--user", "0", "--entrypoint", "ldd",
                       f"poseidon/{name}:latest", f)
            ok = r.returncode == 0 and "not found" not in r.stdout
            check(ok, f"poseidon/{name}: {f}'s shared libraries resolve in the image")
            if not ok:
                print(r.stdout[-1500:], r.stderr[-500:])
    r = podman("run", "--rm", *RUN_OPTS, "poseidon/agent:latest", "--help")
    need(r.returncode == 0 and "--server" in r.stdout + r.stderr,
         "poseidon/agent runs its entry point (--help)", r.stdout + r.stderr)

    # A job: coordinator, one KV server and a train container with two ranks, on a network of
    # their own with fixed addresses.
    remove_networks_of_killed_runs()
    r = podman("network", "create", network)
    need(r.returncode == 0, f"a podman network {network} on a free subnet", r.stderr)
    r = podman("network", "inspect", network)
    subnets = json.loads(r.stdout)[0].get("subnets", []) if r.returncode == 0 else []
    need(len(subnets) == 1, f"the network {network} has one subnet", r.stdout + r.stderr)
    subnet = ipaddress.ip_network(subnets[0]["subnet"])
    need(subnet.num_addresses >= 16, f"its subnet {subnet} has room for three hosts")
    coord, server, train = (str(subnet.network_address + i) for i in (10, 11, 12))
    job, token, secret = "7", os.urandom(16).hex(), os.urandom(16).hex()
    r = podman("run", "-d", "--name", f"{tag}-coordinator", "--network", network, "--ip", coord,
               *RUN_OPTS, "-e", f"POSEIDON_JOB_TOKEN={token}", "poseidon/coordinator:latest",
               f"--listen={coord}:7070", f"--job_id={job}", "--min_servers=1")
    need(r.returncode == 0 and wait_listening(f"{tag}-coordinator"),
         "the coordinator image starts and listens within 60 s",
         r.stderr + podman("logs", f"{tag}-coordinator").stderr)
    r = podman("run", "-d", "--name", f"{tag}-server", "--network", network, "--ip", server,
               *RUN_OPTS, "-e", f"POSEIDON_JOB_SECRET={secret}",
               "-e", f"POSEIDON_COORDINATOR_TOKEN={token}", "poseidon/server:latest",
               "--listen=0.0.0.0:7100", f"--advertise={server}:7100", f"--job_id={job}",
               f"--coordinator={coord}:7070")
    need(r.returncode == 0 and wait_listening(f"{tag}-server"),
         "the server image starts, registers with the coordinator and listens within 60 s",
         r.stderr + podman("logs", f"{tag}-server").stderr)
    script = os.path.join(SOURCE, "tests", "ops", "containers_train.py")
    r = podman("run", "--rm", "--name", f"{tag}-train", "--network", network, "--ip", train,
               *RUN_OPTS, "-e", f"POSEIDON_TOKEN={token}", "-e", f"POSEIDON_SECRET={secret}",
               "-v", f"{script}:/workspace/train.py:ro", "poseidon/train:latest",
               "poseidon", "run", "-n", "2", "--scheme", "ps", "--coordinator", f"{coord}:7070",
               "--job", job,
               "--listen-host", train, "--", "python3", "/workspace/train.py", timeout=600)
    text = r.stdout + r.stderr
    logs = {n: podman("logs", f"{tag}-{n}").stderr[-2000:] for n in ("coordinator", "server")}
    need(r.returncode == 0, "poseidon run in the train image trains through the server image",
         f"{text}\ncoordinator: {logs['coordinator']}\nserver: {logs['server']}")
    sums = {line.split()[-1] for line in text.splitlines() if "] checksum " in line}
    check(len(sums) == 1, f"both ranks end with the same parameters: {sums}")
    diffs = [line for line in text.splitlines() if "reference maxdiff" in line]
    check(len(diffs) == 1 and "workers 2" in diffs[0], f"rank 0 compared with one process: {diffs}")
    if diffs:
        diff = float(diffs[0].split("maxdiff")[1].split()[0])
        check(diff < 1e-5, f"equal to one process on the 2x batch (max difference {diff:g})")
    r = podman("inspect", f"{tag}-server")
    state = json.loads(r.stdout)[0]["State"] if r.returncode == 0 else {}
    running = state.get("Running") is True
    check(running, "the server container still runs after the job" + ("" if running else f": {state}"))
finally:
    cleanup()

finish("the images build, and a job trains across the coordinator, server and train containers")
