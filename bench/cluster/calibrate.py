#!/usr/bin/python3
"""Calibrates `poseidon simulate` (sim/simulator.h) on the emulated cluster of run_cluster.py and
validates it there.

1. Measure (root): run_cluster.py's runs, imported (not copied) with poseidon-synth's
   --print_iterations added, for the five models at N = 1, 2, 4, 8 in mode poseidon and at
   N = 2, 4, 8 in modes ps, no-wfbp, allreduce (every layer on Gloo's ring, in the agents'
   all-reduce buckets) and allreduce-per-layer (the same, one collective per layer:
   --allreduce_bucket_bytes 0).
2. Fit, each by a grid over the simulator's own output (`poseidon simulate --json`):
   - jitter: lognormal, one factor per worker and iteration, sigma = the pooled coefficient of
     variation of the N = 1 runs' per-iteration times;
   - the emulation's compute overhead c0 per layer pass (sleep overshoot, gradient writing) from
     the N = 1 runs (no network: nothing else separates them from the spec's compute);
   - alpha, the per-message overhead, from the no-wfbp runs at N = 2 and 4 (the only ones whose
     communication is exposed); beta, the senders' CPU per byte (the emulated links are veth
     pairs through this machine's TCP stack: every byte costs CPU), and c1, the overhead per
     pass each further emulated host adds, from every mode at N = 2 and 4; three times round.
     Every simulation of the fit and the check runs the senders' work (alpha + beta x bytes) of
     all emulated hosts on the machine's CPUs, shared (`--shared_cpus`, os.cpu_count() when
     measured): the 3N processes of an N-host emulation take turns on them.
   - the ring step under load (Gloo's and the threads' work per step of a collective, which the
     agents' idle probe at connection underestimates) and each rank's CPU work per step on the
     shared CPUs, from allreduce-per-layer at N = 2 and 4, given the rest (twice round).
   N = 8 is left out of the fit, and so is every bucketed ring run: they are the check of what
   the fit predicts. c0, c1, beta and the
   shared CPUs are the emulation's (a real cluster has CPUs per host and no sleeps): `poseidon
   simulate` applies them only with --emulation.
3. Write bench/cluster/calibration.json (what `poseidon simulate --calibration` reads: alpha,
   overhead, jitter, and the measurements and validation it came from) and print the validation
   table: measured, simulated, error, for every run.

    sudo nice -n 10 bench/cluster/calibrate.py --build build/helper-sim       # ~5 minutes
    bench/cluster/calibrate.py --from_results bench/cluster/results/calib-<time>   # refit only
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import run_cluster as rc  # noqa: E402

ITER_RE = re.compile(r"poseidon-synth rank (\d+): iteration (\d+) ends at [0-9.]+ \(([0-9.]+) s\)")
MODELS = ["vgg19", "vgg19-22k", "inception-v3", "resnet-152", "googlenet"]
LATENCY = "20us"  # one-way, the order of the agents' measured pings here (docs/cluster.md)
# run_cluster.py's tc tbf bucket, max(64 KiB, 10 ms of the rate) on the scaled links: 10 ms of
# the rate on the unscaled ones (the 64 KiB floor is 4 MiB unscaled, below 10 ms of 10 Gbit/s).
BURST = "10ms"
# run_cluster.py's modes poseidon, ps and no-wfbp run the agents with their default --replicas=1
# (every PS key has a backup on the next server): the simulation replicates the same (--replicas).


def cpu_times():
    """The machine's CPU times (user, nice, system, idle, iowait, ...) from /proc/stat."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def patch_harness():
    """poseidon-synth prints every iteration; collect() keeps every worker's per-iteration s."""
    start, collect = rc.Cluster.start, rc.collect

    def start_with_iterations(self, i, name, argv, logdir, env=None):
        if argv and os.path.basename(argv[0]) == "poseidon-synth":
            argv = list(argv) + ["--print_iterations"]
        return start(self, i, name, argv, logdir, env)

    def collect_iterations(args, cluster, workers):
        before = cpu_times()
        r = collect(args, cluster, workers)
        after = cpu_times()
        total = sum(after) - sum(before)
        idle = (after[3] + after[4]) - (before[3] + before[4])
        r["cpu_busy"] = 1 - idle / total if total > 0 else None  # this machine, all processes
        per_worker = []
        for w in workers:
            lines = ITER_RE.findall(open(w.log, errors="replace").read())
            per_worker.append([float(s) for _, it, s in lines if int(it) >= 2])
        r["worker_iterations"] = per_worker
        return r

    rc.Cluster.start = start_with_iterations
    rc.collect = collect_iterations


def measure(args, out):
    patch_harness()
    load = {"before": os.getloadavg(), "commit": git_commit(), "cpus": os.cpu_count(),
            "build_time": datetime.datetime.fromtimestamp(os.path.getmtime(
                os.path.join(args.build, "agent", "poseidon-agent"))).isoformat()}
    sets = [("poseidon", "1,2,4,8", "poseidon", []), ("modes", "2,4,8", "ps,no-wfbp", []),
            ("ring", "2,4,8", "allreduce", []),
            ("ring-per-layer", "2,4,8", "allreduce", ["--allreduce_bucket_bytes", "0"])]
    for name, hosts, modes, extra in sets:
        sys.argv = ["run_cluster.py", "--build", args.build, "--models", ",".join(args.models),
                    "--hosts", hosts, "--modes", modes, "--sep_models", "",
                    "--iterations", str(args.iterations), "--out", os.path.join(out, name),
                    *extra]
        try:
            code = rc.main()
        finally:
            rc.teardown_all()
        if code == rc.SKIP:
            sys.exit(rc.SKIP)
    load["after"] = os.getloadavg()
    with open(os.path.join(out, "loadavg.json"), "w") as f:
        json.dump(load, f)


def load_rows(out):
    rows = []
    for name in ("poseidon", "modes", "ring", "ring-per-layer"):
        path = os.path.join(out, name, "results.json")
        if name.startswith("ring") and not os.path.exists(path):
            continue  # a measurement from before the ring sets
        with open(path) as f:
            data = json.load(f)
        for r in data["results"]:
            if not r.get("error"):
                r["iterations"] = data["iterations"]
                if name == "ring-per-layer":
                    r["mode"] = "allreduce-per-layer"
                rows.append(r)
    return rows


def is_ring(mode):
    return mode.startswith("allreduce")


def mode_flags(mode):
    """poseidon simulate's flags for a mode of the harness."""
    return {"ps": ["--scheme=ps"], "no-wfbp": ["--wfbp=false"],
            "allreduce": ["--scheme=allreduce"],
            "allreduce-per-layer": ["--scheme=allreduce", "--allreduce_bucket_bytes=0"]}.get(mode, [])


def simulate(cli, run, m):
    """The simulated s/iter of measured run `run` under model settings `m` (a dict: alpha, c0,
    c1, beta, sigma, cpus, replicas, step)."""
    model, mode, n = run["model"], run["mode"], run["n"]
    overhead = m["c0"] + m["c1"] * (n - 1)
    cmd = [cli, "simulate", f"--model={model}", "--batch=32", "--bandwidth=10Gbit",
           f"--cpu_ns_per_byte={m['beta'] * 1e9:.6f}", f"--shared_cpus={m['cpus']}",
           f"--replicas={m['replicas']}",
           f"--latency={LATENCY}", f"--link_burst={BURST}", "--colocated=true", "--gpu=titanx",
           f"--iterations={run['iterations']}", f"--workers={n}", "--json",
           f"--alpha={m['alpha'] * 1e6:.3f}us", f"--compute_overhead={overhead * 1e6:.3f}us",
           "--jitter=lognormal" if m["sigma"] > 0 else "--jitter=none",
           f"--jitter_sigma={m['sigma']}",
           f"--allreduce_step={m.get('step', 0.0) * 1e6:.3f}us",
           f"--allreduce_cpu_per_step={m.get('ring_cpu', 0.0) * 1e6:.3f}us",
           *(mode_flags(mode) or ["--scheme=auto"])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = [r for r in json.loads(out)["rows"] if r["workers"] == n][0]
    return row["iteration_seconds"]


def sim_command(model, mode, n, iterations, replicas):
    extra = "".join(" " + f for f in mode_flags(mode))
    if replicas != 1:  # the simulator's default, as the agents'
        extra += f" --replicas {replicas}"
    return (f"poseidon simulate --model {model} --batch 32 --bandwidth 10Gbit --latency {LATENCY}"
            f" --link_burst {BURST} --iterations {iterations} --workers {n}{extra} --calibration "
            "bench/cluster/calibration.json --emulation")


def grid_fit(values, loss):
    best = min(values, key=loss)
    return best, loss(best)


def fit(args, rows, cpus, pool):
    cli = os.path.join(args.build, "tools", "poseidon")
    n1 = [r for r in rows if r["n"] == 1 and r["mode"] == "poseidon"]
    # Jitter: the pooled coefficient of variation of the N = 1 per-iteration times.
    cvs = []
    for r in n1:
        xs = r["worker_iterations"][0]
        if len(xs) >= 2:
            mean = sum(xs) / len(xs)
            var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
            cvs.append(var / mean ** 2)
    sigma = (sum(cvs) / len(cvs)) ** 0.5 if cvs else 0.0

    # --no_cpu_terms: every host its own CPUs and no CPU per byte (the model before they existed).
    cpus = 0 if args.no_cpu_terms else cpus

    def loss(subset, alpha, c0, c1, beta):
        m = dict(alpha=alpha, c0=c0, c1=c1, beta=beta, sigma=sigma, cpus=cpus,
                 replicas=args.replicas)
        sims = pool.map(lambda r: simulate(cli, r, m), subset)
        err = sum(((s - r["seconds_per_iteration"]) / r["seconds_per_iteration"]) ** 2
                  for s, r in zip(sims, subset))
        return err / max(1, len(subset))

    # The ring's runs fit the ring step alone (below), given the rest.
    ring_rows = [r for r in rows if is_ring(r["mode"])]
    rows = [r for r in rows if not is_ring(r["mode"])]
    # c0: N = 1 has no network, so only the emulation's overhead per pass separates it from the
    # spec's compute.
    c0, _ = grid_fit([i * 5e-6 for i in range(0, 61)], lambda c: loss(n1, 0.0, c, 0.0, 0.0))
    # alpha from the runs whose communication is exposed (no WFBP), beta and c1 (the CPU the
    # emulated hosts share) from every mode, at N = 2 and 4; three times round, each given the
    # others.
    exposed = [r for r in rows if r["mode"] == "no-wfbp" and r["n"] in (2, 4)]
    small = [r for r in rows if r["n"] in (2, 4)]
    alphas = [i * 10e-6 for i in range(0, 41)]
    # per byte of the unscaled model: the emulation moves 1/s^2 of them, so 0.01 ns here is
    # 0.64 ns per byte that crosses an emulated link at s = 8
    betas = [0.0] + ([] if args.no_cpu_terms else [0.001e-9 * 1.25 ** k for k in range(0, 28)])
    c1s = [i * 1e-6 for i in range(0, 31)]
    c1, beta = 0.0, 0.0
    for _ in range(3):
        alpha, _ = grid_fit(alphas, lambda a: loss(exposed, a, c0, c1, beta))
        beta, _ = grid_fit(betas, lambda b: loss(small, alpha, c0, c1, b))
        c1, err = grid_fit(c1s, lambda c: loss(small, alpha, c0, c, beta))
    # The ring step: from the per-layer ring runs at N = 2 and 4 (one collective per layer, each
    # paying its 2 (N - 1) steps), given everything else.
    per_layer = [r for r in ring_rows if r["mode"] == "allreduce-per-layer" and r["n"] in (2, 4)]
    step, ring_cpu = 0.0, 0.0
    if per_layer:
        def ring_loss(st, rc):
            m = dict(alpha=alpha, c0=c0, c1=c1, beta=beta, sigma=sigma, cpus=cpus,
                     replicas=args.replicas, step=st, ring_cpu=rc)
            sims = pool.map(lambda r: simulate(cli, r, m), per_layer)
            return sum(((x - r["seconds_per_iteration"]) / r["seconds_per_iteration"]) ** 2
                       for x, r in zip(sims, per_layer)) / len(per_layer)
        for _ in range(2):
            step, _ = grid_fit([i * 20e-6 for i in range(0, 26)], lambda st: ring_loss(st, ring_cpu))
            ring_cpu, _ = grid_fit([i * 10e-6 for i in range(0, 21)] if cpus else [0.0],
                                   lambda rc: ring_loss(step, rc))
    return {"alpha_seconds": alpha,
            "jitter": {"kind": "lognormal" if sigma > 0 else "none", "iteration_sigma": sigma,
                       "layer_sigma": 0.0},
            "emulation": {"compute_overhead_seconds": c0, "overhead_per_extra_host_seconds": c1,
                          "cpu_seconds_per_byte": beta, "shared_cpus": cpus,
                          "allreduce_step_seconds": step,
                          "allreduce_cpu_seconds_per_step": ring_cpu},
            "fit": {"latency": LATENCY, "link_burst": BURST,
                    "jitter_from": "pooled CV of the per-iteration times, poseidon N = 1",
                    "compute_overhead_from": "poseidon N = 1 (grid 0..300 us, 5 us)",
                    "alpha_from": "no-wfbp N = 2, 4 (grid 0..400 us, 10 us)",
                    "overhead_per_extra_host_from": "all modes N = 2, 4 (grid 0..30 us, 1 us)",
                    "cpu_per_byte_from": "all modes N = 2, 4 (grid 0, 0.001 ns x 1.25^k, k < 28)",
                    "replicas": args.replicas,
                    "shared_cpus_from": "os.cpu_count() of the measuring machine",
                    "allreduce_step_from": "allreduce-per-layer N = 2, 4 (grid 0..500 us, 20 us; "
                                           "with the CPU per step, twice round)",
                    "allreduce_cpu_per_step_from": "allreduce-per-layer N = 2, 4 (grid 0..200 us, "
                                                   "10 us)",
                    "mean_squared_relative_error_n2_n4": err}}, cli, sigma


def validate(cli, rows, cal, sigma, pool):
    table = []
    order = {"poseidon": 0, "ps": 1, "no-wfbp": 2, "allreduce": 3, "allreduce-per-layer": 4}
    e = cal["emulation"]
    settings = dict(alpha=cal["alpha_seconds"], c0=e["compute_overhead_seconds"],
                    c1=e["overhead_per_extra_host_seconds"], beta=e["cpu_seconds_per_byte"],
                    sigma=sigma, cpus=e["shared_cpus"], replicas=cal["fit"]["replicas"],
                    step=e.get("allreduce_step_seconds", 0.0),
                    ring_cpu=e.get("allreduce_cpu_seconds_per_step", 0.0))
    rows = sorted(rows, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 9,
                                       order.get(r["mode"], 9), r["n"]))
    for r, s in zip(rows, pool.map(lambda r: simulate(cli, r, settings), rows)):
        m = r["seconds_per_iteration"]
        # The bucketed ring is a check at every N; the per-layer ring fits the step at N = 2, 4.
        in_fit = r["n"] in (1, 2, 4) and r["mode"] != "allreduce"
        table.append({"model": r["model"], "mode": r["mode"], "n": r["n"], "measured": m,
                      "simulated": s, "error": (s - m) / m, "in_fit": in_fit,
                      "cpu_busy": r.get("cpu_busy"),
                      "command": sim_command(r["model"], r["mode"], r["n"], r["iterations"],
                                             settings["replicas"])})
    return table


def markdown(table):
    lines = ["| model | mode | N | measured s/iter | simulated s/iter | error | CPU busy | |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for t in table:
        flag = "fit" if t["in_fit"] else "check"
        if abs(t["error"]) > 0.10:
            flag += ", **> 10 %**"
        cpu = f"{t['cpu_busy'] * 100:.0f} %" if t.get("cpu_busy") is not None else "–"
        lines.append(f"| {t['model']} | {t['mode']} | {t['n']} | {t['measured']:.3f} | "
                     f"{t['simulated']:.3f} | {t['error'] * 100:+.1f} % | {cpu} | {flag} |")
    return "\n".join(lines)


def git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--from_results", default=None,
                    help="a directory of an earlier measurement: fit and validate only")
    ap.add_argument("--out", default=os.path.join(HERE, "calibration.json"))
    ap.add_argument("--replicas", type=int, default=1,
                    help="backups per key the simulations model (the harness's agents: 1)")
    ap.add_argument("--no_cpu_terms", action="store_true",
                    help="fit without the CPU per byte and the shared CPUs (the earlier model, "
                         "to see what they buy)")
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    args.models = [m for m in args.models.split(",") if m]
    if args.from_results:
        out = os.path.abspath(args.from_results)
    else:
        out = os.path.join(HERE, "results",
                           "calib-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        os.makedirs(out, exist_ok=True)
        measure(args, out)
    rows = load_rows(out)
    cpus = os.cpu_count()
    if os.path.exists(os.path.join(out, "loadavg.json")):
        with open(os.path.join(out, "loadavg.json")) as f:
            cpus = json.load(f).get("cpus") or cpus
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        cal, cli, sigma = fit(args, rows, cpus, pool)
        table = validate(cli, rows, cal, sigma, pool)
    with open(os.path.join(out, "poseidon", "results.json")) as f:
        first = json.load(f)
    cal["measured"] = {"results": os.path.relpath(out, ROOT), "commit": git_commit(),
                       "build": args.build,
                       "date": datetime.date.today().isoformat(),
                       "command": " ".join(first["command"]), "scale": first["scale"],
                       "iterations": first["iterations"], "agent_sizes": first["agent_sizes"]}
    if os.path.exists(os.path.join(out, "loadavg.json")):
        with open(os.path.join(out, "loadavg.json")) as f:
            saved = json.load(f)
        cal["measured"]["commit"] = saved.pop("commit", cal["measured"]["commit"])
        cal["measured"]["build_time"] = saved.pop("build_time", None)
        cal["measured"]["cpus"] = saved.pop("cpus", None)
        cal["measured"]["loadavg"] = saved
    cal["validation"] = table
    with open(args.out, "w") as f:
        json.dump(cal, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "validation.md"), "w") as f:
        f.write(markdown(table) + "\n")
    e = cal["emulation"]
    print(f"alpha {cal['alpha_seconds'] * 1e6:.0f} us, jitter lognormal sigma {sigma:.4f} per "
          f"iteration; emulation: compute overhead {e['compute_overhead_seconds'] * 1e6:.0f} us "
          f"per pass + {e['overhead_per_extra_host_seconds'] * 1e6:.0f} us per extra host, "
          f"{e['cpu_seconds_per_byte'] * 1e9:.4f} ns per byte, on {e['shared_cpus']} shared CPUs, "
          f"ring step {e['allreduce_step_seconds'] * 1e6:.0f} us, "
          f"{e['allreduce_cpu_seconds_per_step'] * 1e6:.0f} us of CPU per step and rank")
    print(markdown(table))
    for name, sel in (("in the fit", True), ("out of the fit", False)):
        errors = [abs(t["error"]) for t in table if t["in_fit"] == sel]
        if errors:
            print(f"{name}: {sum(x <= 0.10 for x in errors)} of {len(errors)} within 10 %, "
                  f"largest {max(errors) * 100:.1f} %, mean |error| "
                  f"{sum(errors) / len(errors) * 100:.1f} %")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
