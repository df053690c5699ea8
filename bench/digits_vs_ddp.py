#!/usr/bin/python3
"""The main job's model against PyTorch DDP over gloo, in one run, on this machine.

Trains the digits MLP of examples/train_digits.py (64-256-128-10, SGD with momentum 0.9, lr 0.05,
cosine schedule, per-worker batch K, the same shuffle, a test evaluation after every epoch) with
the same training loop twice: through `poseidon run -n W` (poseidon.torch.distribute, exactly as
examples/train_digits.py calls it) and through torch.nn.parallel.DistributedDataParallel over
gloo on loopback (W processes, the same loop). Prints samples/s of each and Poseidon / DDP.
Runs alternate (Poseidon, DDP, Poseidon, DDP, ...) so that both see the same machine; the
figure of each side is the median over --repeats. Both sides' ranks run with the environment
torchrun gives DDP's: OMP_NUM_THREADS=1 unless it is set (`poseidon run` does the same);
`OMP_NUM_THREADS=2 bench/digits_vs_ddp.py` runs both with two threads per rank.

    bench/digits_vs_ddp.py                          # W = 4, K = 16, 30 epochs, build/perf
    bench/digits_vs_ddp.py --repeats 3 --main_job   # also examples/train_digits.py itself
    bench/digits_vs_ddp.py --timeline /tmp/tl       # agents write /tmp/tl/t-<rank>.json
                                                    # (--other's: /tmp/tl/other-t-<rank>.json)
    bench/digits_vs_ddp.py --synth --other /tmp/bin-old  # the C++ path alone (poseidon-synth)
    bench/digits_vs_ddp.py --other /tmp/bin-old     # also Poseidon with the daemons in that
                                                    # directory (POSEIDON_BIN_DIR): before/after

Worker mode (--worker poseidon|ddp) is what the launcher runs; it prints one RESULT line.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PY = "/usr/bin/python3"


# ---------------------------------------------------------------------------------------------
# Worker: one training loop for both systems


def train(args, rank, world, wrap):
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.manual_seed(1234 + rank)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10))
    model, optimizer, base = wrap(model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(base, args.epochs)
    global_batch = args.batch * world
    steps = len(x_train) // global_batch
    generator = torch.Generator().manual_seed(7)
    start = time.time()
    first_epoch_end = None
    test_acc = 0.0
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for step in range(steps):
            batch = order[step * global_batch:(step + 1) * global_batch]
            mine = batch[rank * args.batch:(rank + 1) * args.batch]
            out = model(x_train[mine])
            loss = torch.nn.functional.cross_entropy(out, y_train[mine])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()
        scheduler.step()
        with torch.no_grad():
            test_acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        if first_epoch_end is None:
            first_epoch_end = time.time()
    end = time.time()
    samples = args.epochs * steps * global_batch
    after_first = (args.epochs - 1) * steps * global_batch / max(end - first_epoch_end, 1e-9)
    if rank == 0:
        print(f"RESULT samples_per_second={samples / (end - start):.1f} "
              f"after_first_epoch={after_first:.1f} steps={args.epochs * steps} "
              f"test_acc={test_acc:.4f}", flush=True)


def worker_poseidon(args):
    import poseidon
    import poseidon.torch

    poseidon.init()
    rank, world = poseidon.rank(), poseidon.size()

    def wrap(model):
        import torch
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        opt = poseidon.torch.distribute(model, opt, batch_size=args.batch)
        return model, opt, opt._optimizer

    train(args, rank, world, wrap)
    poseidon.shutdown()


def worker_ddp(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)

    def wrap(model):
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        return ddp, opt, opt

    train(args, args.rank, args.world, wrap)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Launcher


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_result(text, what):
    m = re.search(r"RESULT samples_per_second=([0-9.]+) after_first_epoch=([0-9.]+) steps=(\d+) "
                  r"test_acc=([0-9.]+)", text)
    if not m:
        raise RuntimeError(f"{what}: no RESULT line; output tail:\n{text[-2000:]}")
    return float(m.group(1)), float(m.group(2)), int(m.group(3)), float(m.group(4))


def run_poseidon(args, env):
    argv = [os.path.join(args.build, "tools", "poseidon"), "run", "-n", str(args.workers), "--",
            PY, os.path.abspath(__file__), "--worker", "poseidon", "--batch", str(args.batch),
            "--epochs", str(args.epochs), "--lr", str(args.lr)]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"poseidon run exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    return parse_result(r.stdout + r.stderr, "poseidon")


def run_ddp(args, env):
    port = free_port()
    if args.workers > 1 and "OMP_NUM_THREADS" not in env:
        env = dict(env, OMP_NUM_THREADS="1")  # as torchrun launches them (and poseidon run)
    procs, outs = [], []
    for r in range(args.workers):
        out = tempfile.TemporaryFile(mode="w+")
        outs.append(out)
        procs.append(subprocess.Popen(
            [PY, os.path.abspath(__file__), "--worker", "ddp", "--rank", str(r), "--world",
             str(args.workers), "--port", str(port), "--batch", str(args.batch), "--epochs",
             str(args.epochs), "--lr", str(args.lr)], stdout=out, stderr=subprocess.STDOUT,
            env=env))
    deadline = time.time() + args.timeout
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError("ddp workers timed out")
    texts = []
    for out in outs:
        out.seek(0)
        texts.append(out.read())
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"ddp worker failed:\n{''.join(texts)[-3000:]}")
    return parse_result(texts[0], "ddp")


def run_main_job(args, env):
    argv = [os.path.join(args.build, "tools", "poseidon"), "run", "-n", str(args.workers), "--",
            PY, os.path.join(ROOT, "examples", "train_digits.py"), "--epochs", str(args.epochs),
            "--batch", str(args.batch)]  # it checks its accuracy: give it >= 20 epochs
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"train_digits exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    rates = re.findall(r"([0-9]+) samples/s", r.stdout)
    if not rates:
        raise RuntimeError(f"train_digits printed no samples/s:\n{r.stdout[-2000:]}")
    return float(rates[-1])


DIGITS_SPEC = {
    "name": "digits-mlp",
    "description": "examples/train_digits.py's MLP (bench/digits_vs_ddp.py --synth)",
    "layers": [
        {"name": n, "kind": k, "shape": sh, "element_type": "ELEMENT_TYPE_F32"}
        for n, k, sh in (("0.weight", "LAYER_KIND_FC", [256, 64]), ("0.bias", "LAYER_KIND_BIAS", [256]),
                         ("2.weight", "LAYER_KIND_FC", [128, 256]), ("2.bias", "LAYER_KIND_BIAS", [128]),
                         ("4.weight", "LAYER_KIND_FC", [10, 128]), ("4.bias", "LAYER_KIND_BIAS", [10]))]}


def other_env(args, env):
    """--other's daemons (POSEIDON_BIN_DIR), their timelines apart from ours."""
    e = dict(env, POSEIDON_BIN_DIR=os.path.abspath(args.other))
    if args.timeline:
        e["POSEIDON_TIMELINE"] = os.path.join(os.path.abspath(args.timeline), "other-t-{rank}.json")
    return e


def run_synth(args, env):
    """The C++ path alone: poseidon-synth posts the digits MLP's layers with no compute (every
    layer ready at once, then waited for, as a framework would), through poseidon run."""
    spec = os.path.join(tempfile.mkdtemp(prefix="psd-digits-"), "digits-mlp.json")
    with open(spec, "w") as f:
        json.dump(DIGITS_SPEC, f)
    argv = [os.path.join(args.build, "tools", "poseidon"), "run", "-n", str(args.workers), "--",
            os.path.join(args.build, "bench", "poseidon-synth"), f"--model={spec}",
            f"--batch={args.batch}", f"--iterations={args.synth_iterations}", "--compute_scale=0"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    # Each rank's total over its iterations (the per-iteration figure it prints has 100 µs steps).
    times = [float(t) / int(n) for n, t in re.findall(r"(\d+) iterations of \S+ \(.*?\) in ([0-9.]+) s",
                                                      r.stdout)]
    if r.returncode != 0 or len(times) != args.workers:
        raise RuntimeError(f"synth exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    return max(times)


def main_synth(args, env):
    variants = [("poseidon", env)]
    if args.other:
        variants.append((f"poseidon ({args.other})", other_env(args, env)))
    got = {name: [] for name, _ in variants}
    print(f"digits MLP layers through poseidon-synth (no compute, no Python), {args.workers} "
          f"workers, K = {args.batch}, {args.synth_iterations} iterations, build {args.build}",
          flush=True)
    for i in range(args.repeats):
        for name, e in variants:
            t = run_synth(args, e)
            got[name].append(t)
            print(f"  run {i + 1}: {name} {t * 1e6:.0f} µs per iteration (slowest rank)", flush=True)
    print("\n| system | µs per iteration (median) |\n|---|---:|")
    for name, ts in got.items():
        print(f"| {name} | {statistics.median(ts) * 1e6:.0f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", choices=["poseidon", "ddp"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=4, help="W")
    ap.add_argument("--batch", type=int, default=16, help="per-worker batch K")
    ap.add_argument("--epochs", type=int, default=30, help="as examples/train_digits.py")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating")
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "perf"))
    ap.add_argument("--main_job", action="store_true",
                    help="also run examples/train_digits.py through poseidon run (its own figure)")
    ap.add_argument("--timeline", default=None,
                    help="a directory: the agents write Chrome-trace timelines there "
                         "(POSEIDON_TIMELINE=<dir>/t-{rank}.json)")
    ap.add_argument("--other", default=None,
                    help="a directory of other poseidon-agent/-server/-coordinator binaries "
                         "(POSEIDON_BIN_DIR), run as a third system in the same alternation")
    ap.add_argument("--synth", action="store_true",
                    help="instead: the C++ path alone (poseidon-synth, no compute, no Python)")
    ap.add_argument("--synth_iterations", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    if args.worker == "poseidon":
        return worker_poseidon(args)
    if args.worker == "ddp":
        return worker_ddp(args)

    args.build = os.path.abspath(args.build)
    if not os.access(os.path.join(args.build, "tools", "poseidon"), os.X_OK):
        sys.exit(f"digits_vs_ddp: {args.build}/tools/poseidon missing (build it first)")
    env = dict(os.environ, POSEIDON_BUILD_DIR=args.build)
    env.pop("POSEIDON_TIMELINE", None)
    penv = dict(env)
    if args.timeline:
        os.makedirs(args.timeline, exist_ok=True)
        penv["POSEIDON_TIMELINE"] = os.path.join(os.path.abspath(args.timeline), "t-{rank}.json")
    if args.synth:
        return main_synth(args, penv)
    rows = {"poseidon": [], "ddp": [], "main job": [], f"poseidon ({args.other})": []}
    print(f"digits MLP, {args.workers} workers, K = {args.batch}, {args.epochs} epochs, "
          f"{os.cpu_count()} CPUs, build {args.build}", flush=True)
    for i in range(args.repeats):
        p = run_poseidon(args, penv)
        rows["poseidon"].append(p)
        print(f"  run {i + 1}: poseidon {p[0]:8.0f} samples/s (after the first epoch "
              f"{p[1]:.0f}), test acc {p[3]:.3f}", flush=True)
        d = run_ddp(args, env)
        rows["ddp"].append(d)
        print(f"  run {i + 1}: ddp-gloo {d[0]:8.0f} samples/s (after the first epoch "
              f"{d[1]:.0f}), test acc {d[3]:.3f}", flush=True)
        if args.other:
            o = run_poseidon(args, other_env(args, penv))
            rows[f"poseidon ({args.other})"].append(o)
            print(f"  run {i + 1}: poseidon ({args.other}) {o[0]:8.0f} samples/s (after the first "
                  f"epoch {o[1]:.0f}), test acc {o[3]:.3f}", flush=True)
        if args.main_job:
            m = run_main_job(args, env)
            rows["main job"].append((m, m, 0, 0))
            print(f"  run {i + 1}: examples/train_digits.py {m:8.0f} samples/s", flush=True)
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
           for k, v in rows.items() if v}
    print()
    print("| system | samples/s | after the first epoch | / DDP-gloo |")
    print("|---|---:|---:|---:|")
    for k, (a, b) in med.items():
        print(f"| {k} | {a:.0f} | {b:.0f} | {a / med['ddp'][0]:.2f} |")
    print(f"\nPoseidon / DDP-gloo: {med['poseidon'][0] / med['ddp'][0]:.2f} "
          f"(median of {args.repeats} run(s) each, alternating)")


if __name__ == "__main__":
    sys.exit(main())
