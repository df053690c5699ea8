#!/usr/bin/python3
"""Calibrates `poseidon simulate` (sim/simulator.h) on the emulated cluster of run_cluster.py and
validates it there.

1. Measure (root): run_cluster.py's runs, imported (not copied) with poseidon-synth's
   --print_iterations added, for the five models at N = 1, 2, 4, 8 in mode poseidon and at
   N = 2, 4, 8 in modes ps, no-wfbp, allreduce (every layer on Gloo's ring, in the agents'
   all-reduce buckets) and allreduce-per-layer (the same, one collective per layer:
   --allreduce_bucket_bytes 0).
2. Fit, each by a grid over the simulator's own output (`poseidon simulate --json`):
   - jitter: lognormal, one factor per worker and iteration, sigma = the median over the models
     of the coefficient of variation of the N = 1 runs' per-iteration times;
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
import bisect
import concurrent.futures
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import run_cluster as rc  # noqa: E402

ITER_RE = re.compile(r"poseidon-synth rank (\d+): iteration (\d+) ends at [0-9.]+ \(([0-9.]+) s\)")
END_RE = re.compile(r"poseidon-synth rank \d+: iteration (\d+) ends at ([0-9.]+) ")
MODELS = ["vgg19", "vgg19-22k", "inception-v3", "resnet-152", "googlenet"]
LATENCY = "20us"  # one-way, the order of the agents' measured pings here (docs/cluster.md)
# run_cluster.py's tc tbf bucket, max(64 KiB, 10 ms of the rate) on the scaled links: 10 ms of
# the rate on the unscaled ones (the 64 KiB floor is 4 MiB unscaled, below 10 ms of 10 Gbit/s).
BURST = "10ms"
# The emulated links' framing: veth's MTU, and the 14 bytes of Ethernet header tc tbf counts per
# packet (no FCS, preamble or gap on a veth).
MTU = 1500
FRAME_OVERHEAD = 14
# run_cluster.py's modes poseidon, ps and no-wfbp run the agents with their default --replicas=1
# (every PS key has a backup on the next server): the simulation replicates the same (--replicas).


def cpu_times():
    """The machine's CPU times (user, nice, system, idle, iowait, ...) from /proc/stat."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


class CpuSampler:
    """Samples the machine's busy CPU time (/proc/stat) every `period` s while a run goes, to
    tell the CPU seconds spent between two moments of it (the steady iterations)."""

    def __init__(self, period=0.02):
        self.period, self.samples, self.stop = period, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def busy_seconds(self):
        t = cpu_times()
        return (sum(t) - t[3] - t[4]) / os.sysconf("SC_CLK_TCK")

    def run(self):
        while True:
            self.samples.append((time.time(), self.busy_seconds()))
            if self.stop.wait(self.period):
                self.samples.append((time.time(), self.busy_seconds()))
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def at(self, t):
        """Busy CPU seconds at time t, interpolated between the samples around it."""
        s = self.samples
        if not s or t < s[0][0] or t > s[-1][0]:
            return None
        i = bisect.bisect_left(s, (t,))
        if i == 0:
            return s[0][1]
        (t0, b0), (t1, b1) = s[i - 1], s[i]
        return b0 if t1 == t0 else b0 + (b1 - b0) * (t - t0) / (t1 - t0)


def steady_cpu(sampler, logs, cpus):
    """The machine's CPU seconds per iteration, and its busy fraction, from the end of iteration
    2 to the end of the last one (the mean over the workers of each end time): the iterations
    bench/synth times, without the start-up and the first iteration."""
    ends = {}
    for text in logs:
        for it, at in END_RE.findall(text):
            ends.setdefault(int(it), []).append(float(at))
    if 2 not in ends:
        return None, None
    last = max(ends)
    if last <= 2:
        return None, None
    t0, t1 = sum(ends[2]) / len(ends[2]), sum(ends[last]) / len(ends[last])
    b0, b1 = sampler.at(t0), sampler.at(t1)
    if b0 is None or b1 is None or t1 <= t0:
        return None, None
    return (b1 - b0) / (last - 2), (b1 - b0) / ((t1 - t0) * cpus)


def patch_harness():
    """poseidon-synth prints every iteration; collect() keeps every worker's per-iteration s and
    the machine's CPU seconds per steady iteration."""
    start, collect = rc.Cluster.start, rc.collect

    def start_with_iterations(self, i, name, argv, logdir, env=None):
        if argv and os.path.basename(argv[0]) == "poseidon-synth":
            argv = list(argv) + ["--print_iterations"]
        return start(self, i, name, argv, logdir, env)

    def collect_iterations(args, cluster, workers):
        cpus = os.cpu_count() or 1
        with CpuSampler() as sampler:
            r = collect(args, cluster, workers)
        (t0, b0), (t1, b1) = sampler.samples[0], sampler.samples[-1]
        # this machine, all processes, the whole run
        r["cpu_busy"] = (b1 - b0) / ((t1 - t0) * cpus) if t1 > t0 else None
        per_worker, logs = [], []
        for w in workers:
            logs.append(open(w.log, errors="replace").read())
            lines = ITER_RE.findall(logs[-1])
            per_worker.append([float(s) for _, it, s in lines if int(it) >= 2])
        r["worker_iterations"] = per_worker
        r["cpu_seconds_per_iteration"], r["cpu_busy_steady"] = steady_cpu(sampler, logs, cpus)
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


def sim_row(cli, run, m):
    """The simulation of measured run `run` under model settings `m` (a dict: alpha, c0, c1,
    beta, sigma, cpus, replicas, step, ring_cpu, pass_cpu): its row of `poseidon simulate
    --json`."""
    model, mode, n = run["model"], run["mode"], run["n"]
    overhead = m["c0"] + m["c1"] * (n - 1)
    cmd = [cli, "simulate", f"--model={model}", "--batch=32", "--bandwidth=10Gbit",
           f"--cpu_ns_per_byte={m['beta'] * 1e9:.6f}", f"--shared_cpus={m['cpus']}",
           f"--replicas={m['replicas']}", f"--mtu={MTU}", f"--frame_overhead={FRAME_OVERHEAD}",
           f"--latency={LATENCY}", f"--link_burst={BURST}", "--colocated=true", "--gpu=titanx",
           f"--iterations={run['iterations']}", f"--workers={n}", "--json",
           f"--alpha={m['alpha'] * 1e6:.3f}us", f"--compute_overhead={overhead * 1e6:.3f}us",
           "--jitter=lognormal" if m["sigma"] > 0 else "--jitter=none",
           f"--jitter_sigma={m['sigma']}",
           f"--allreduce_step={m.get('step', 0.0) * 1e6:.3f}us",
           f"--allreduce_cpu_per_step={m.get('ring_cpu', 0.0) * 1e6:.3f}us",
           f"--pass_cpu={m.get('pass_cpu', 0.0) * 1e6:.3f}us",
           f"--host_cpu_load={m.get('host_load', 0.0):.6f}",
           *(mode_flags(mode) or ["--scheme=auto"])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [r for r in json.loads(out)["rows"] if r["workers"] == n][0]


def simulate(cli, run, m):
    """The simulated s/iter of measured run `run` under model settings `m` (sim_row)."""
    return sim_row(cli, run, m)["iteration_seconds"]


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


# The CPU terms of the simulation (--cpu_terms_from cpu), each with the unit cpu_features
# simulates it at.
CPU_TERMS = [("alpha", 1e-6), ("beta", 1e-9), ("pass_cpu", 1e-6), ("ring_cpu", 1e-6)]


def cpu_features(cli, rows, cpus, replicas, pool):
    """Per run, the simulation's CPU seconds per iteration for one unit of each CPU term alone
    (alpha: its messages; beta: its bytes at both ends; pass_cpu: its layer passes; ring_cpu:
    its ranks' ring steps), and the run's host-seconds per iteration (N x measured s/iter: what
    a constant load per emulated host would cost)."""
    zero = dict(alpha=0.0, c0=0.0, c1=0.0, beta=0.0, sigma=0.0, cpus=cpus, replicas=replicas,
                step=0.0, ring_cpu=0.0, pass_cpu=0.0)
    columns = []
    for name, unit in CPU_TERMS:
        m = dict(zero, **{name: unit})
        columns.append(list(pool.map(
            lambda r: sim_row(cli, r, m)["cpu_seconds_per_iteration"] / unit, rows)))
    columns.append([r["n"] * r["seconds_per_iteration"] for r in rows])
    return [list(x) for x in zip(*columns)]


def nonnegative_least_squares(x, y):
    """min |X c - y| over c >= 0, for a handful of columns: every subset of them by least
    squares, the best whose coefficients are all >= 0."""
    import numpy as np  # python3-numpy, with python3-torch
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    k = x.shape[1]
    best_err, best = None, np.zeros(k)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        coef = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        if (coef < 0).any():
            continue
        full = np.zeros(k)
        full[cols] = coef
        err = float(((x @ full - y) ** 2).sum())
        if best_err is None or err < best_err:
            best_err, best = err, full
    return [float(c) for c in best]


def fit_cpu(cli, rows, cpus, replicas, pool):  # --cpu_terms_from cpu
    """The CPU terms from the machine's measured CPU seconds per steady iteration of the runs
    at N <= 4 (relative least squares, every term >= 0). Returns the terms and the constant
    load per emulated host (CPU seconds per second)."""
    fitted = [r for r in rows if r["n"] <= 4 and r.get("cpu_seconds_per_iteration")]
    feats = cpu_features(cli, fitted, cpus, replicas, pool)
    x = [[v / r["cpu_seconds_per_iteration"] for v in f] for r, f in zip(fitted, feats)]
    coef = nonnegative_least_squares(x, [1.0] * len(fitted))
    return {name: c for (name, _), c in zip(CPU_TERMS, coef)}, coef[-1]


def fit(args, rows, cpus, pool):
    cli = os.path.join(args.build, "tools", "poseidon")
    n1 = [r for r in rows if r["n"] == 1 and r["mode"] == "poseidon"]
    # Jitter: the median over the models of the N = 1 per-iteration times' coefficient of
    # variation. Not pooled: one hiccup of the VM in one run (GoogLeNet's 2 of 9 iterations at
    # +18 % on 2026-12-07) made the pooled figure ten times the others.
    cvs = []
    for r in n1:
        xs = r["worker_iterations"][0]
        if len(xs) >= 2:
            mean = sum(xs) / len(xs)
            var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
            cvs.append(var ** 0.5 / mean)
    sigma = statistics.median(cvs) if cvs else 0.0

    # --no_cpu_terms: every host its own CPUs and no CPU per byte (the model before they existed).
    cpus = 0 if args.no_cpu_terms else cpus
    base = dict(alpha=0.0, c0=0.0, c1=0.0, beta=0.0, sigma=sigma, cpus=cpus,
                replicas=args.replicas, step=0.0, ring_cpu=0.0, pass_cpu=0.0, host_load=0.0)

    def loss(subset, **changes):
        m = dict(base, **changes)
        sims = pool.map(lambda r: simulate(cli, r, m), subset)
        err = sum(((s - r["seconds_per_iteration"]) / r["seconds_per_iteration"]) ** 2
                  for s, r in zip(sims, subset))
        return err / max(1, len(subset))

    ring_rows = [r for r in rows if is_ring(r["mode"])]
    plain = [r for r in rows if not is_ring(r["mode"])]
    small = [r for r in plain if r["n"] in (2, 4)]
    per_layer = [r for r in ring_rows if r["mode"] == "allreduce-per-layer" and r["n"] in (2, 4)]
    measured_cpu = args.cpu_terms_from == "cpu" and not args.no_cpu_terms and all(
        r.get("cpu_seconds_per_iteration") for r in rows if r["n"] <= 4)
    how = {}
    if measured_cpu:
        # The CPU the emulation spends is measured: the terms that spend it are fitted to it,
        # not to the times (the times then only fit what is not CPU: the sleeps' overshoot).
        terms, base["host_load"] = fit_cpu(cli, rows, cpus, args.replicas, pool)
        base.update(terms)
        for name in ("alpha", "beta", "pass_cpu", "ring_cpu", "host_load"):
            how[name] = ("the measured CPU seconds per steady iteration, every run at N <= 4 "
                         "(relative least squares, terms >= 0)")
    # c0: N = 1 has no network, so only the emulation's overhead per pass separates it from the
    # spec's compute.
    base["c0"], _ = grid_fit([i * 5e-6 for i in range(0, 61)], lambda c: loss(n1, c0=c))
    how["c0"] = "poseidon N = 1 (grid 0..300 us, 5 us)"
    c1s = [i * 1e-6 for i in range(0, 31)]
    if not measured_cpu:
        # A measurement without CPU seconds: alpha from the runs whose communication is exposed
        # (no WFBP), beta and c1 from every mode at N = 2 and 4; three times round.
        exposed = [r for r in plain if r["mode"] == "no-wfbp" and r["n"] in (2, 4)]
        alphas = [i * 10e-6 for i in range(0, 41)]
        # per byte of the unscaled model: the emulation moves 1/s^2 of them, so 0.01 ns here
        # is 0.64 ns per byte that crosses an emulated link at s = 8
        betas = [0.0] + ([] if args.no_cpu_terms else [0.001e-9 * 1.25 ** k for k in range(28)])
        for _ in range(3):
            base["alpha"], _ = grid_fit(alphas, lambda a: loss(exposed, alpha=a))
            base["beta"], _ = grid_fit(betas, lambda b: loss(small, beta=b))
            base["c1"], _ = grid_fit(c1s, lambda c: loss(small, c1=c))
        how["alpha"] = "no-wfbp N = 2, 4 (grid 0..400 us, 10 us)"
        how["beta"] = "all modes N = 2, 4 (grid 0, 0.001 ns x 1.25^k, k < 28)"
    else:
        base["c1"], _ = grid_fit(c1s, lambda c: loss(small, c1=c))
    how["c1"] = "modes poseidon, ps, no-wfbp N = 2, 4 (grid 0..30 us, 1 us)"
    err = loss(small)
    # The ring step: from the per-layer ring runs at N = 2 and 4 (one collective per layer, each
    # paying its 2 (N - 1) steps), given everything else (and the CPU per step, when measured).
    if per_layer:
        steps = [i * 20e-6 for i in range(0, 26)]
        if measured_cpu:
            base["step"], _ = grid_fit(steps, lambda st: loss(per_layer, step=st))
        else:
            for _ in range(2):
                base["step"], _ = grid_fit(steps, lambda st: loss(per_layer, step=st))
                base["ring_cpu"], _ = grid_fit([i * 10e-6 for i in range(0, 21)] if cpus
                                               else [0.0], lambda rc: loss(per_layer, ring_cpu=rc))
            how["ring_cpu"] = "allreduce-per-layer N = 2, 4 (grid 0..200 us, 10 us)"
        how["step"] = "allreduce-per-layer N = 2, 4 (grid 0..500 us, 20 us)"
    return {"alpha_seconds": base["alpha"],
            "jitter": {"kind": "lognormal" if sigma > 0 else "none", "iteration_sigma": sigma,
                       "layer_sigma": 0.0},
            "emulation": {"compute_overhead_seconds": base["c0"],
                          "overhead_per_extra_host_seconds": base["c1"],
                          "cpu_seconds_per_byte": base["beta"], "shared_cpus": cpus,
                          "cpu_seconds_per_pass": base["pass_cpu"],
                          "host_cpu_load": base["host_load"],
                          "frame_overhead_bytes": FRAME_OVERHEAD,
                          "allreduce_step_seconds": base["step"],
                          "allreduce_cpu_seconds_per_step": base["ring_cpu"]},
            "fit": {"latency": LATENCY, "link_burst": BURST, "mtu": MTU,
                    "jitter_from": "median over the models of the CV of the per-iteration times, poseidon N = 1",
                    "compute_overhead_from": how["c0"],
                    "alpha_from": how.get("alpha"),
                    "overhead_per_extra_host_from": how["c1"],
                    "cpu_per_byte_from": how.get("beta"),
                    "cpu_per_pass_from": how.get("pass_cpu", "not fitted (0)"),
                    "replicas": args.replicas,
                    "shared_cpus_from": "os.cpu_count() of the measuring machine",
                    "allreduce_step_from": how.get("step", "not fitted (0)"),
                    "allreduce_cpu_per_step_from": how.get("ring_cpu", "not fitted (0)"),
                    "host_cpu_load_from": how.get("host_load", "not fitted (0)"),
                    "mean_squared_relative_error_n2_n4": err}}, cli, sigma


def validate(cli, rows, cal, sigma, pool):
    table = []
    order = {"poseidon": 0, "ps": 1, "no-wfbp": 2, "allreduce": 3, "allreduce-per-layer": 4}
    e = cal["emulation"]
    settings = dict(alpha=cal["alpha_seconds"], c0=e["compute_overhead_seconds"],
                    c1=e["overhead_per_extra_host_seconds"], beta=e["cpu_seconds_per_byte"],
                    sigma=sigma, cpus=e["shared_cpus"], replicas=cal["fit"]["replicas"],
                    step=e.get("allreduce_step_seconds", 0.0),
                    ring_cpu=e.get("allreduce_cpu_seconds_per_step", 0.0),
                    pass_cpu=e.get("cpu_seconds_per_pass", 0.0),
                    host_load=e.get("host_cpu_load", 0.0))
    rows = sorted(rows, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 9,
                                       order.get(r["mode"], 9), r["n"]))
    for r, sim in zip(rows, pool.map(lambda r: sim_row(cli, r, settings), rows)):
        m, s = r["seconds_per_iteration"], sim["iteration_seconds"]
        # The bucketed ring is a check at every N; the per-layer ring fits the step at N = 2, 4.
        in_fit = r["n"] in (1, 2, 4) and r["mode"] != "allreduce"
        table.append({"model": r["model"], "mode": r["mode"], "n": r["n"], "measured": m,
                      "simulated": s, "error": (s - m) / m, "in_fit": in_fit,
                      "cpu_busy": r.get("cpu_busy_steady", r.get("cpu_busy")),
                      "cpu_measured": r.get("cpu_seconds_per_iteration"),
                      # the hosts' constant load is not in the simulation's CPU seconds
                      "cpu_simulated": sim["cpu_seconds_per_iteration"]
                      + r["n"] * settings["host_load"] * s,
                      "command": sim_command(r["model"], r["mode"], r["n"], r["iterations"],
                                             settings["replicas"])})
    return table


def markdown(table):
    lines = ["| model | mode | N | measured s/iter | simulated s/iter | error | CPU busy | "
             "CPU s/iter measured | simulated | |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in table:
        flag = "fit" if t["in_fit"] else "check"
        if abs(t["error"]) > 0.10:
            flag += ", **> 10 %**"
        busy = f"{t['cpu_busy'] * 100:.0f} %" if t.get("cpu_busy") is not None else "–"
        cpu = f"{t['cpu_measured']:.3f}" if t.get("cpu_measured") else "–"
        lines.append(f"| {t['model']} | {t['mode']} | {t['n']} | {t['measured']:.3f} | "
                     f"{t['simulated']:.3f} | {t['error'] * 100:+.1f} % | {busy} | {cpu} | "
                     f"{t.get('cpu_simulated', 0.0):.3f} | {flag} |")
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
    ap.add_argument("--cpu_terms_from", choices=["cpu", "times"], default="times",
                    help="times (the default): alpha, the CPU per byte, the ring's step and "
                         "its CPU per step fitted to the iteration times; cpu: alpha, the CPU "
                         "per byte, per layer pass and per ring step and each host's constant "
                         "load fitted to the machine's measured CPU seconds per iteration "
                         "(docs/cluster.md compares them)")
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
          f"{e['allreduce_cpu_seconds_per_step'] * 1e6:.0f} us of CPU per step and rank, "
          f"{e['cpu_seconds_per_pass'] * 1e6:.0f} us of CPU per layer pass, a constant load of "
          f"{e['host_cpu_load']:.3f} CPU per emulated host")
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
