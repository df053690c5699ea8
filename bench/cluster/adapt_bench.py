#!/usr/bin/python3
"""Plans that change while training runs, on the emulated cluster (issue 12's benchmark).

N hosts (network namespaces on a tbf-shaped bridge, bench/cluster/run_cluster.py's Cluster) run
one job through a poseidon-coordinator (in the switch namespace, on an address of the bridge):
a poseidon-server, a poseidon-agent (--coordinator) and a poseidon-synth worker per host. After a
warm-up at the high rate every link's tbf rate is changed (`tc qdisc change`, both directions) to
the low rate, later back to the high rate. Recorded: every iteration's end (synth
--print_iterations), the scheme switches (synth --print_switches), the coordinator's plan epochs
(its log) and the links' bandwidth samples (`poseidon status --json`, polled). Then, in the same
invocation, the static plans: the job at each rate from the start, the boundary layers forced to
PS and to SFB (`poseidon plan --set`), so the plan the cost model makes for that rate and the
other one are measured on the same machine minutes apart.

    sudo bench/cluster/adapt_bench.py --build build/perf                 # N = 2, ~6 minutes
    sudo bench/cluster/adapt_bench.py --build build/perf --hosts 2,4

The model (default): VGG19 plus an FC layer bottleneck.weight [216, 32] after fc8 (a low-rank
adapter, rank 32 = K). Its factors are larger than its gradient, so Poseidon's byte rule puts it
on PS at every bandwidth; the coordinator's time rule (docs/planner.md, "Scheme rule") puts it on
SFB while the latency SFB saves outweighs the extra bytes: (SFB - PS volume) / (2 B) is 3.3 us at
10 Gbit/s and 33 us at 1 Gbit/s (N = 2), on either side of the ~10 us one-way latency measured
here (so the flip point is ~3.6 Gbit/s). Scaling
(docs/cluster.md) keeps both sides' bytes over bandwidth, so the decision is the unscaled one.
Servers run on hosts of their own, agents' chunks are 32 MiB unscaled, telemetry every 2 s: why,
in docs/cluster.md, "Plans that change while training runs".

Exit code 77 when namespaces or tc are not permitted (root needed). Every namespace, process and
shared-memory segment is removed on every exit path (run_cluster's teardown).
"""
import argparse
import datetime
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run_cluster as rc  # noqa: E402

TOKEN = "adapt-bench-token"
SECRET = "adapt-bench-secret"


def log(msg):
    rc.log(msg)


# ---------------------------------------------------------------------------------------------
# The model


def bottleneck_spec(base, after, shape, batch):
    """`base` with an FC layer `bottleneck.weight` of `shape` [M, r] inserted after its layer
    `after` (FLOPs per sample: 2 x parameters forward, 4 x backward, as an FC layer's)."""
    spec = rc.load_spec(base)
    layers = []
    p = shape[0] * shape[1]
    for l in spec["layers"]:
        layers.append(l)
        if l["name"] == after:
            layers.append({"name": "bottleneck.weight", "kind": "LAYER_KIND_FC", "shape": shape,
                           "element_type": "ELEMENT_TYPE_F32", "batch_per_worker": batch,
                           "forward_flops": 2 * p, "backward_flops": 4 * p})
    m, r = shape
    return dict(spec, layers=layers, name=f"{base}-bottleneck{m}x{r}",
                description=f"{base} with an FC layer [{m}, {r}] after {after} (bench/cluster/"
                            "adapt_bench.py): near the PS/SFB boundary of the time rule.")


def sfb_minus_ps_seconds(shape, batch, n, bandwidth_Bps):
    """The time rule's comparison for one FC layer (docs/planner.md "Time"), servers on hosts of
    their own, P1 = P2 = n: (SFB volume - PS volume) / (2 bandwidth), PS's volume the busier of a
    worker's 2MN and a server's 2 P1 MN / P2 (equal here); SFB is chosen while this is <= the
    latency (SFB pays one latency, PS two)."""
    m, k = shape
    ps = 4 * 2 * m * k
    sfb = 4 * 2 * batch * (n - 1) * (m + k)
    return (sfb - ps) / (2 * bandwidth_Bps)


def boundary_layers(spec, batch, n, high_Bps, low_Bps):
    """FC layers whose time-rule margin changes sign between the two rates for some latency."""
    out = []
    for l in spec["layers"]:
        if rc.is_fc(l):
            hi = sfb_minus_ps_seconds(l["shape"], batch, n, high_Bps)
            lo = sfb_minus_ps_seconds(l["shape"], batch, n, low_Bps)
            if lo > 0:
                out.append((l["name"], hi, lo))
    return out


# ---------------------------------------------------------------------------------------------
# One job on the emulated cluster


def read_logs(rec, tails, ctail):
    """What the workers' and the coordinator's logs added since the last call, into `rec`:
    iterations, scheme switches, installed plans."""
    for r, tail in enumerate(tails):
        for line in tail.lines():
            m = ITER_RE.search(line)
            if m:
                rec["iterations"].setdefault(r, []).append(
                    (int(m.group(2)), float(m.group(3)), float(m.group(4))))
                continue
            m = SWITCH_RE.search(line)
            if m:
                rec["switches"].append({"rank": r, "layer": m.group(3), "scheme": m.group(4),
                                        "iteration": int(m.group(5)), "at": time.time()})
    for line in ctail.lines():
        m = PLAN_RE.search(line)
        if m:
            rec["plans"].append({"epoch": int(m.group(1)), "effective": int(m.group(2)),
                                 "why": m.group(3), "sfb_layers": int(m.group(5)),
                                 "bandwidth": m.group(6), "latency_us": float(m.group(7)),
                                 "at": time.time()})


class Tail:
    """Reads the lines a process appended to its log since the last call."""

    def __init__(self, path):
        self.path, self.pos, self.buf = path, 0, ""

    def lines(self):
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return []
        self.buf += data
        *done, self.buf = self.buf.split("\n")
        return done


ITER_RE = re.compile(r"poseidon-synth rank (\d+): iteration (\d+) ends at ([0-9.]+) \(([0-9.]+) s\)")
SWITCH_RE = re.compile(r"poseidon-synth rank (\d+): layer (\d+) \((\S+)\) runs (SFB|PS) from "
                       r"iteration (\d+)")
PLAN_RE = re.compile(r"job \S+: plan epoch (\d+) from iteration (\d+) \((.*)\): (\d+) layers, (\d+) "
                     r"on SFB, bandwidth (.+?), latency ([0-9.e+-]+)us")
OVERRIDE_RE = re.compile(r"new epoch (\d+).*?iteration (\d+)")


def cli(args, cluster, *argv, timeout=20):
    """tools/poseidon, run in the switch namespace (where the coordinator listens)."""
    env = dict(os.environ, POSEIDON_COORDINATOR=args.coord_addr, POSEIDON_JOB_ID="1",
               POSEIDON_TOKEN=TOKEN)
    return subprocess.run(["ip", "netns", "exec", cluster.sw, os.path.join(args.build, "tools",
                                                                           "poseidon"), *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)


def poll_status(args, cluster):
    try:
        p = cli(args, cluster, "status", "--json", timeout=10)
    except subprocess.TimeoutExpired:
        return None
    if p.returncode != 0:
        return None
    try:
        return json.loads(p.stdout)
    except ValueError:
        return None


def link_samples(doc):
    """The bandwidth (bytes/s) the planner takes from each fresh link sample, and whether it is a
    capacity sample (no lower bound), as `poseidon status --json` shows them."""
    out = []
    for node in (doc or {}).get("nodes", []):
        for link in node.get("links", []) or []:
            bw = link.get("bandwidth_bytes_per_second")
            if bw:
                out.append({"from": node.get("node_id"), "to": link.get("peer_node_id"),
                            "role": node.get("role"), "bandwidth": bw,
                            "lower_bound": bool(link.get("lower_bound")),
                            "latency_ns": link.get("latency_ns")})
    return out


def run_job(args, n, rate0, iterations, changes, force, logdir, label):
    """One job. changes: [(iteration of worker 0, rate_bps)], applied when worker 0 reports that
    iteration's end. force: {layer: 'ps'|'sfb'} set with `poseidon plan --set` once the job
    trains. Returns everything recorded."""
    # Servers on hosts n..2n-1 of their own: a server in a worker's namespace would be reached
    # over loopback, and the agent's capacity estimate of that link measures loopback, not the
    # shaped link (see docs/cluster.md, "Plans that change").
    cluster = rc.Cluster(2 * n, rate0, args.subnet, False, burst_min=args.burst_min)
    rc.LIVE.append(cluster)
    os.makedirs(logdir, exist_ok=True)
    b = args.build
    env = dict(rc.coordinated_env(TOKEN), POSEIDON_JOB_SECRET=SECRET)
    rec = {"label": label, "n": n, "rate0_bps": rate0, "changes": [], "iterations": {},
           "switches": [], "status": [], "plans": [], "force": force}
    try:
        cluster.up()
        args.coord_addr = rc.start_coordinator(
            cluster, b, args.subnet, logdir, env,
            [f"--bandwidth={int(args.high_scaled)}bit", "--colocated=false",
             f"--latency={args.latency}", f"--block_size={args.agent_sizes['block_bytes']}",
             f"--replan_min_interval={args.replan_min_interval}",
             f"--plan_lead_time={args.plan_lead_time}", f"--plan_lead={args.plan_lead}"],
            log_level="debug")
        coord = cluster.procs[-1]
        servers = []
        for h in range(n, 2 * n):
            servers.append(cluster.start(h, f"server{h - n}", [
                os.path.join(b, "server", "poseidon-server"), f"--listen={cluster.addr(h)}:7100",
                "--job_id=1", f"--coordinator={args.coord_addr}", "--log_level=warn"], logdir,
                env=env))
        for p in servers:
            rc.wait_for(p, "listening on", 60)
        agents = []
        for r in range(n):
            seg = f"/{rc.PREFIX}-seg-{r}"
            cluster.segments.append(seg)
            p = cluster.start(r, f"agent{r}", [
                os.path.join(b, "agent", "poseidon-agent"), "--job_id=1", f"--secret={SECRET}",
                f"--rank={r}", f"--world_size={n}", f"--coordinator={args.coord_addr}",
                f"--listen={cluster.addr(r)}:7200", "--colocated=false",
                # The nominal (scaled) rate: the agents' start-up probes take turns by it.
                f"--bandwidth={int(args.high_scaled)}bit",
                f"--telemetry_interval={args.telemetry_interval}",
                *[f"--{k}={v}" for k, v in sorted(args.agent_sizes.items())],
                f"--segment={seg}", "--log_level=info"], logdir, env=env)
            agents.append((p, seg))
        for p, _ in agents:
            rc.wait_for(p, "poseidon-agent ready", 120)
        workers = []
        for r, (_, seg) in enumerate(agents):
            workers.append(cluster.start(r, f"worker{r}", [
                os.path.join(b, "bench", "poseidon-synth"), f"--model={args.spec_path}",
                f"--batch={args.batch_scaled}", f"--iterations={iterations}",
                f"--compute_scale={args.compute_scale:.6f}", f"--gpu={args.gpu}",
                f"--segment={seg}", f"--timeout_ms={args.layer_timeout_ms}", "--print_switches",
                "--print_iterations"], logdir))
        tails = [Tail(w.log) for w in workers]
        ctail = Tail(coord.log)
        pending = sorted(changes)
        forced = not force
        t0 = time.time()
        rec["t0"] = t0
        next_poll = 0
        deadline = t0 + args.run_timeout
        while any(w.poll() is None for w in workers):
            rc.check_running(cluster, workers, deadline, args.run_timeout)
            read_logs(rec, tails, ctail)
            done0 = rec["iterations"].get(0, [])
            last = done0[-1][0] if done0 else 0
            # Not before the coordinator has the job's iteration rate (heartbeats over > 1 s):
            # an override before any progress report takes effect at iteration plan_lead, which
            # a rank may already have passed.
            if not forced and last >= args.force_at:
                spec = ",".join(f"{k}={v}" for k, v in sorted(force.items()))
                p = cli(args, cluster, "plan", f"--coordinator={args.coord_addr}", "--job=1",
                        f"--token={TOKEN}", f"--set={spec}", "--reason=adapt_bench static plan")
                if p.returncode != 0:
                    raise RuntimeError(f"poseidon plan --set {spec}: {p.stdout} {p.stderr}")
                m = OVERRIDE_RE.search(p.stdout)
                rec["forced_from"] = int(m.group(2)) if m else None
                # The schemes in force from then on, as the CLI's layer table prints them (an
                # override that changes no scheme: the first plan had them already).
                rec["forced_schemes"] = {
                    name: scheme.upper() for name, scheme in re.findall(
                        r"^(\S+)\s+(ps|sfb)\b", p.stdout, re.M) if name in force}
                forced = True
            while pending and last >= pending[0][0]:
                it, rate = pending.pop(0)
                cluster.set_rate(rate)
                rec["changes"].append({"after_iteration": last, "rate_bps": rate,
                                       "at": time.time()})
                log(f"{label}: iteration {last}: links now {rate / 1e6:.2f} Mbit/s")
            if time.time() >= next_poll:
                doc = poll_status(args, cluster)
                if doc is not None:
                    rec["status"].append({"at": time.time(), "links": link_samples(doc),
                                          "jobs": [{k: j.get(k) for k in ("plan_epoch",
                                                                          "effective_iteration")}
                                                   for j in doc.get("jobs", [])]})
                next_poll = time.time() + args.poll_interval
            time.sleep(0.05)
        read_logs(rec, tails, ctail)  # the last lines
        for w in workers:
            if w.returncode != 0:
                raise RuntimeError(f"{w.name} exit {w.returncode}: "
                                   f"{open(w.log, errors='replace').read()[-800:]}")
        return rec
    finally:
        cluster.down()
        if cluster in rc.LIVE:
            rc.LIVE.remove(cluster)


# ---------------------------------------------------------------------------------------------
# Analysis


def job_iterations(rec):
    """[(iteration, end time, seconds)] of the job: per iteration the slowest rank's end (BSP:
    the job is as far as its last rank)."""
    per = {}
    for r, its in rec["iterations"].items():
        for t, end, _ in its:
            per.setdefault(t, []).append(end)
    out, prev = [], None
    for t in sorted(per):
        if len(per[t]) < rec["n"]:
            continue
        end = max(per[t])
        out.append((t, end, end - prev if prev is not None else None))
        prev = end
    return out


def throughput(its, first, last):
    """Iterations per second over iterations first..last (their ends)."""
    sel = [(t, e) for t, e, _ in its if first <= t <= last]
    if len(sel) < 2:
        return None
    return (sel[-1][0] - sel[0][0]) / (sel[-1][1] - sel[0][1])


def iteration_at(its, when):
    """The iteration running at wall time `when` (the first whose end is later)."""
    for t, end, _ in its:
        if end >= when:
            return t
    return its[-1][0] if its else None


def rate_name(bps, scale):
    return f"{bps * scale * scale / 1e9:g} Gbit/s"


def plot(out_png, result, layers):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing (python3-matplotlib): no plot")
        return None
    runs = result["dynamic"]
    fig, axes = plt.subplots(4, len(runs), figsize=(8 * len(runs), 10), squeeze=False,
                             sharex="col")
    for col, d in enumerate(runs):
        rec = d["record"]
        t0 = rec["t0"]
        its = job_iterations(rec)
        ax = axes[0][col]
        ax.plot([e - t0 for _, e, dt in its if dt], [dt for _, e, dt in its if dt], ".-", ms=3,
                lw=0.8)
        ax.set_ylabel("iteration time (s)")
        ax.set_title(f"N = {rec['n']}, {result['model']}: "
                     f"{rate_name(result['high_bps'], result['scale'])} -> "
                     f"{rate_name(result['low_bps'], result['scale'])} -> back", fontsize=10)
        for c in rec["changes"]:
            for a in axes[:, col]:
                a.axvline(c["at"] - t0, color="r", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
        # Scheme per boundary layer (rank 0's switches), as a step line.
        ax = axes[1][col]
        ends = {t: e for t, e, _ in its}
        for k, name in enumerate(layers):
            first_scheme = d["initial_schemes"].get(name, "PS")
            pts = [(0, first_scheme)]
            for s in sorted((s for s in rec["switches"] if s["rank"] == 0 and s["layer"] == name),
                            key=lambda s: s["iteration"]):
                when = ends.get(s["iteration"] - 1, ends.get(s["iteration"]))
                pts.append((when - t0 if when else 0, s["scheme"]))
            xs, ys = [], []
            for x, sch in pts:
                y = k + (0.8 if sch == "SFB" else 0.0)
                if xs:
                    xs.append(x)
                    ys.append(ys[-1])
                xs.append(x)
                ys.append(y)
            xs.append(its[-1][1] - t0)
            ys.append(ys[-1])
            ax.plot(xs, ys, lw=2, label=name)
        ax.set_yticks([k + v for k in range(len(layers)) for v in (0, 0.8)])
        ax.set_yticklabels([f"{n} {s}" for n in layers for s in ("PS", "SFB")], fontsize=7)
        ax.set_ylabel("scheme")
        ax.grid(alpha=0.3)
        ax = axes[2][col]
        xs = [s["at"] - t0 for s in rec["status"]]
        med = [statistics.median([l["bandwidth"] for l in s["links"]]) * 8 * result["scale"] ** 2
               / 1e9 if s["links"] else float("nan") for s in rec["status"]]
        ax.plot(xs, med, "-", label="median of link samples (unscaled)")
        link_rate = []
        rate = rec["rate0_bps"]
        changes = sorted(rec["changes"], key=lambda c: c["at"])
        for s in rec["status"]:
            while changes and changes[0]["at"] <= s["at"]:
                rate = changes.pop(0)["rate_bps"]
            link_rate.append(rate * result["scale"] ** 2 / 1e9)
        ax.plot(xs, link_rate, "k:", label="tbf rate (unscaled)")
        for p in rec["plans"]:
            ax.axvline(p["at"] - t0, color="g", lw=0.6)
        pts = sorted((p["at"] - t0, float(p["bandwidth"].split()[0]) * result["scale"] ** 2)
                     for p in rec["plans"] if p["bandwidth"].endswith("Gbit/s"))
        if pts:
            ax.plot([x for x, _ in pts] + [xs[-1]], [y for _, y in pts] + [pts[-1][1]],
                    drawstyle="steps-post", color="g", label="the plan's bandwidth (unscaled)")
        ax.set_yscale("log")
        ax.set_ylabel("Gbit/s")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax = axes[3][col]
        pts = sorted((p["at"] - t0, p["latency_us"]) for p in rec["plans"])
        if pts:
            ax.plot([x for x, _ in pts] + [xs[-1]], [y for _, y in pts] + [pts[-1][1]],
                    drawstyle="steps-post", color="g", label="the plan's latency")
        ax.set_yscale("log")
        ax.set_ylabel("latency (us)")
        ax.set_xlabel("seconds since the workers started (red: rate change, green: new plan)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    return out_png


def analyse_dynamic(rec, layers, settle):
    """Per rate change: the iteration it happened in; the flip = the first switch of a boundary
    layer in the direction the time rule predicts (to PS after a drop, to SFB after a rise) on
    rank 0, before the next change; the lag in iterations; the switches in the phase (flapping);
    the throughput from the flip (+ settle) to the next change."""
    its = job_iterations(rec)
    out = []
    changes = sorted(rec["changes"], key=lambda c: c["at"])
    for i, c in enumerate(changes):
        at_it = iteration_at(its, c["at"])
        nxt = iteration_at(its, changes[i + 1]["at"]) if i + 1 < len(changes) else its[-1][0]
        want = "PS" if c["rate_bps"] < rec["rate0_bps"] else "SFB"
        phase = sorted((x for x in rec["switches"] if x["rank"] == 0 and x["layer"] in layers
                        and at_it < x["iteration"] <= nxt), key=lambda x: x["iteration"])
        flips = [x for x in phase if x["scheme"] == want]
        flip = flips[0]["iteration"] if flips else None
        before = [x for x in rec["switches"] if x["rank"] == 0 and x["layer"] in layers
                  and x["iteration"] <= at_it]
        running = max(before, key=lambda x: x["iteration"])["scheme"] if before else "SFB"
        by = {}
        for x in rec["switches"]:
            if at_it < x["iteration"] <= nxt:
                by.setdefault((x["layer"], x["scheme"]), []).append(x["iteration"])
        same = all(len(set(v)) * rec["n"] == len(v) for v in by.values())
        start = (flip if flip is not None else at_it) + settle
        row = {"rate_bps": c["rate_bps"], "change_iteration": at_it, "flip_iteration": flip,
               "running_at_change": running, "expected": want,
               "lag_iterations": None if flip is None else flip - at_it,
               "switches_in_phase": [(x["layer"], x["scheme"], x["iteration"]) for x in phase],
               "ranks_switch_at_same_iteration": same, "window": [start, nxt],
               "throughput": throughput(its, start, nxt)}
        plans = [p for p in rec["plans"] if p["at"] >= c["at"] and
                 (i + 1 >= len(changes) or p["at"] < changes[i + 1]["at"])]
        if plans:
            row["plan_seconds_after_change"] = plans[0]["at"] - c["at"]
        out.append(row)
    return out


def report(result, out):
    """The table (results.md), the JSON and the plot, from the records (also --from_json)."""
    s = result["scale"]
    high_scaled = result["high_bps"]
    for d in result["dynamic"]:
        layers = [b["layer"] for b in result["boundary"][str(d["n"])]]
        d["analysis"] = analyse_dynamic(d["record"], layers, result["settings"]["settle"])
    # Table
    def unscaled(text):
        m = re.match(r"([0-9.e+-]+) Gbit/s", text)
        return f"{float(m.group(1)) * s * s:.3g} Gbit/s" if m else text

    fmt = lambda v, f="{:.3f}": "–" if v is None else f.format(v)
    lines = ["| N | change | at iteration | plan flip at | iterations to flip | s to new plan | "
             "later switches in the phase | it/s after flip | static PS it/s | static SFB it/s | "
             "ratio to best static |",
             "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for d in result["dynamic"]:
        n = d["n"]
        for row in d["analysis"]:
            which = "low" if row["rate_bps"] < high_scaled else "high"
            st = {x["scheme"]: x["throughput"] for x in result["static"]
                  if x["n"] == n and x["rate"] == which and x["throughput"]}
            best = max(st.values()) if st else None
            row["static"] = st
            row["ratio"] = row["throughput"] / best if best and row["throughput"] else None
            frm = rate_name(high_scaled if which == "low" else result["low_bps"], s)
            later = ", ".join(f"{sch} at {it}" for _, sch, it in row["switches_in_phase"]
                              if row["flip_iteration"] is not None and it > row["flip_iteration"])
            lines.append(
                f"| {n} | {frm} -> {rate_name(row['rate_bps'], s)} | {row['change_iteration']} | "
                f"{fmt(row['flip_iteration'], '{}') if row['flip_iteration'] is not None or row['running_at_change'] != row['expected'] else 'already ' + row['expected']} | "
                f"{fmt(row['lag_iterations'], '{}')} | "
                f"{fmt(row.get('plan_seconds_after_change'), '{:.1f}')} | "
                f"{later or 'none'} | {fmt(row['throughput'])} | {fmt(st.get('PS'))} | {fmt(st.get('SFB'))} | "
                f"{fmt(row['ratio'])} |")
    lines += ["", "Plan epochs installed (coordinator log), per dynamic run:", ""]
    for d in result["dynamic"]:
        t0 = d["record"]["t0"]
        for c in d["record"]["changes"]:
            lines.append(f"- N = {d['n']}: {c['at'] - t0:.1f} s: links -> "
                         f"{rate_name(c['rate_bps'], s)} (after iteration {c['after_iteration']})")
        for p in d["record"]["plans"]:
            lines.append(f"- N = {d['n']}: {p['at'] - t0:.1f} s: epoch {p['epoch']} from iteration "
                         f"{p['effective']}, {p['sfb_layers']} layers on SFB, planned at "
                         f"{unscaled(p['bandwidth'])}, latency {p['latency_us']:.0f} us ({p['why']})")
    md = "\n".join(lines)
    print(md, flush=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    png = None
    if result["dynamic"]:
        layers = [b["layer"] for b in result["boundary"][str(result["dynamic"][0]["n"])]]
        png = plot(os.path.join(out, "adapt.png"), result, layers)
    print(f"results in {out} (results.md, results.json{', adapt.png' if png else ''})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", default=os.path.join(rc.ROOT, "build", "release"))
    ap.add_argument("--hosts", default="2")
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--high", default="10Gbit", help="the unscaled links' rate before and after")
    ap.add_argument("--low", default="1Gbit", help="the unscaled links' rate in the middle phase")
    ap.add_argument("--batch", type=int, default=32, help="unscaled per-worker batch K")
    ap.add_argument("--base", default="vgg19", help="the model the bottleneck layer is added to")
    ap.add_argument("--insert_after", default="fc8.weight", help="the layer it follows")
    ap.add_argument("--bottleneck", default="216x32",
                    help="the added FC layer's shape MxN (unscaled; both divisible by --scale)")
    ap.add_argument("--model", default=None, help="a spec instead of --base + --bottleneck")
    ap.add_argument("--latency", default="10us",
                    help="the coordinator's nominal latency (the first plan's, before pings)")
    ap.add_argument("--burst_min", type=int, default=16 << 10,
                    help="the tbf bucket's floor, bytes (run_cluster: 64 KiB; also >= 10 ms)")
    ap.add_argument("--gpu", default="titanx")
    ap.add_argument("--warmup", type=int, default=30, help="iterations at the high rate first")
    ap.add_argument("--low_iterations", type=int, default=60,
                    help="iterations at the low rate (the change back after them)")
    ap.add_argument("--after", type=int, default=40, help="iterations at the high rate after")
    ap.add_argument("--static_iterations", type=int, default=40)
    ap.add_argument("--static_rates", default="low,high",
                    help="which rates get static-plan runs (low, high)")
    ap.add_argument("--settle", type=int, default=3,
                    help="iterations after a switch (or a static run's start) left out of "
                         "throughput")
    ap.add_argument("--telemetry_interval", default="2s", help="agents' --telemetry_interval")
    ap.add_argument("--replan_min_interval", default="2s", help="coordinator's flag")
    ap.add_argument("--plan_lead_time", default="300ms", help="coordinator's flag")
    ap.add_argument("--plan_lead", type=int, default=2, help="coordinator's flag (iterations)")
    ap.add_argument("--poll_interval", type=float, default=0.5, help="poseidon status period, s")
    ap.add_argument("--run_timeout", type=float, default=400)
    ap.add_argument("--layer_timeout_ms", type=int, default=120000)
    ap.add_argument("--force_at", type=int, default=6,
                    help="static runs: force the schemes when worker 0 ended this iteration")
    ap.add_argument("--skip_static", action="store_true")
    ap.add_argument("--keep_logs", action="store_true")
    ap.add_argument("--from_json", metavar="RESULTS_JSON", default=None,
                    help="no run: redo the table and the plot of a results.json (next to it)")
    ap.add_argument("--out", default=None)
    for name, default in rc.AGENT_SIZE_DEFAULTS.items():
        # 32 MiB chunks (512 KiB emulated): with the default 4 MiB (64 KiB emulated) a pull
        # response often sits whole in the socket buffer before the agent reads its header, and
        # the capacity estimate reads 100x the link (docs/cluster.md, "Plans that change").
        ap.add_argument(f"--{name}", default="32MiB" if name == "block_bytes" else None,
                        help=f"the agents' --{name}, unscaled (passed / s^2)")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            report(json.load(f), os.path.dirname(os.path.abspath(args.from_json)))
        return 0
    args.build = os.path.abspath(args.build)
    for rel in ("server/poseidon-server", "agent/poseidon-agent", "bench/poseidon-synth",
                "coordinator/poseidon-coordinator", "tools/poseidon"):
        if not os.access(os.path.join(args.build, rel), os.X_OK):
            sys.exit(f"adapt_bench: {os.path.join(args.build, rel)} missing (build it first)")
    if os.geteuid() != 0:
        print("adapt_bench: SKIP: needs root for network namespaces", flush=True)
        return rc.SKIP
    why = rc.permitted()
    if why:
        print(f"adapt_bench: SKIP: network namespaces / tc not permitted here ({why})", flush=True)
        return rc.SKIP
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, rc.on_signal)
    import atexit
    atexit.register(rc.teardown_all)

    s = args.scale
    args.agent_sizes = rc.scaled_sizes(args, s)
    high, low = rc.parse_rate(args.high), rc.parse_rate(args.low)
    args.high_scaled, args.low_scaled = high / (s * s), low / (s * s)
    args.batch_scaled = max(1, args.batch // s)
    spec = rc.load_spec(args.model) if args.model else bottleneck_spec(
        args.base, args.insert_after, [int(x) for x in args.bottleneck.split("x")], args.batch)
    scaled = rc.scale_spec(spec, s)
    for l in scaled["layers"]:
        if "batch_per_worker" in l:
            l["batch_per_worker"] = args.batch_scaled
    args.compute_scale = (rc.total_flops(spec) * args.batch /
                          (rc.total_flops(scaled) * args.batch_scaled))
    out = args.out or os.path.join(rc.ROOT, "bench", "cluster", "results",
                                   "adapt-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    args.spec_path = os.path.join(out, f"{scaled['name']}.json")
    with open(args.spec_path, "w") as f:
        json.dump(scaled, f, indent=1)
    with open(os.path.join(out, f"{spec['name']}.json"), "w") as f:
        json.dump(spec, f, indent=1)
    pid = os.getpid()
    args.subnet = f"10.{200 + (pid >> 8) % 50}.{pid % 256}"
    logroot = tempfile.mkdtemp(prefix=f"{rc.PREFIX}-adapt-logs-")
    hosts = [int(x) for x in args.hosts.split(",") if x]
    print(f"adapt_bench: {spec['name']}, s = {s}, links {high / 1e9:g} -> {low / 1e9:g} -> "
          f"{high / 1e9:g} Gbit/s (emulated {args.high_scaled / 1e6:.2f} / "
          f"{args.low_scaled / 1e6:.2f} Mbit/s), K = {args.batch} -> {args.batch_scaled}; "
          f"agents --telemetry_interval={args.telemetry_interval}; coordinator "
          f"--replan_min_interval={args.replan_min_interval} --plan_lead_time="
          f"{args.plan_lead_time} --plan_lead={args.plan_lead}; build {args.build}", flush=True)
    result = {"command": sys.argv, "model": spec["name"], "scale": s, "high_bps": args.high_scaled,
              "low_bps": args.low_scaled, "batch": args.batch, "dynamic": [], "static": [],
              "settings": {k: getattr(args, k) for k in (
                  "telemetry_interval", "replan_min_interval", "plan_lead_time", "plan_lead",
                  "warmup", "low_iterations", "after", "static_iterations", "settle")},
              "agent_sizes": args.agent_sizes, "rows": []}
    failed = False
    try:
        for n in hosts:
            cand = boundary_layers(spec, args.batch, n, high / 8, low / 8)
            layers = [name for name, _, _ in cand]
            result.setdefault("boundary", {})[str(n)] = [
                {"layer": name, "sfb_minus_ps_us_high": hi * 1e6, "sfb_minus_ps_us_low": lo * 1e6}
                for name, hi, lo in cand]
            log(f"N = {n}: layers near the boundary (SFB - PS, us, at high / low rate): " +
                ", ".join(f"{nm} {hi * 1e6:.0f} / {lo * 1e6:.0f}" for nm, hi, lo in cand))
            total = args.warmup + args.low_iterations + args.after
            try:
                rec = run_job(args, n, args.high_scaled, total,
                              [(args.warmup, args.low_scaled),
                               (args.warmup + args.low_iterations, args.high_scaled)], {},
                              os.path.join(logroot, f"dynamic-n{n}"), f"dynamic N={n}")
            except RuntimeError as e:
                log(f"dynamic N={n} failed: {e}")
                failed = True
                continue
            # The first plan's schemes of the boundary layers (before rank 0's first switch).
            first = {}
            for x in sorted((x for x in rec["switches"] if x["rank"] == 0),
                            key=lambda x: x["iteration"]):
                first.setdefault(x["layer"], "SFB" if x["scheme"] == "PS" else "PS")
            dyn = {"n": n, "record": rec, "initial_schemes": first,
                   "analysis": analyse_dynamic(rec, layers, args.settle)}
            result["dynamic"].append(dyn)
            if args.skip_static:
                continue
            for which in [w for w in args.static_rates.split(",") if w]:
                rate = args.low_scaled if which == "low" else args.high_scaled
                for scheme in ("ps", "sfb"):
                    force = {l: scheme for l in layers}
                    label = f"static N={n} {which} {scheme}"
                    try:
                        srec = run_job(args, n, rate, args.static_iterations, [], force,
                                       os.path.join(logroot, f"static-n{n}-{which}-{scheme}"),
                                       label)
                    except RuntimeError as e:
                        log(f"{label} failed: {e}")
                        failed = True
                        continue
                    its = job_iterations(srec)
                    start = max(srec.get("forced_from") or 1, 1) + args.settle
                    sw = [x for x in srec["switches"] if x["rank"] == 0]
                    if sw:
                        start = max(start, max(x["iteration"] for x in sw) + args.settle)
                    # The schemes the override left in force (the first plan's where it changed
                    # nothing), then the switches the ranks reported.
                    final = {l: srec.get("forced_schemes", {}).get(l, "SFB") for l in layers}
                    for x in sorted(sw, key=lambda x: x["iteration"]):
                        final[x["layer"]] = x["scheme"]
                    if any(final[l] != scheme.upper() for l in layers):
                        log(f"{label}: the forced schemes never took effect ({final})")
                        failed = True
                        continue
                    tp = throughput(its, start, its[-1][0])
                    result["static"].append({"n": n, "rate": which, "rate_bps": rate,
                                             "scheme": scheme.upper(), "layers": layers,
                                             "window": [start, its[-1][0]], "throughput": tp,
                                             "record": srec})
                    log(f"{label}: {tp:.3f} it/s from iteration {start}")
    finally:
        pass
    report(result, out)
    if failed or args.keep_logs:
        log(f"logs kept in {logroot}")
    else:
        shutil.rmtree(logroot, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        rc.teardown_all()
    sys.exit(code)
