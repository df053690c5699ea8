#!/usr/bin/python3
"""Where a layer's ready -> done time goes, from the agents' timelines (--timeline, one file per
rank; every rank's clock is this machine's, so the ranks' events can be compared).

    bench/timeline_breakdown.py /tmp/tl/t-*.json [--layer NAME] [--skip 20]

For every layer (or the one named) and every rank and iteration, the agent's events split
ready -> done into stages; the table shows the median (and p90) over ranks and iterations:

PS (and fused buckets: the bucket's first member carries its push+pull):
  agent queue     ready -> the sync thread starts the push (a bucket: also the other members)
  other ranks     -> the last rank's push of this layer and clock started (BSP: the server can
                     answer only then)
  server + wire   -> our pull's answer is in (push, aggregation, answer, read)
  done            -> the agent posted done
SFB:
  agent queue     ready -> our factors are being sent
  other ranks     -> the last rank started sending its factors
  wire + rebuild  -> the rebuild started (factors in, rebuild task queued and picked up)
  rebuild         the GEMMs
  done            -> the agent posted done
"""
import argparse
import collections
import json
import statistics
import sys


def load(paths):
    ev = []
    for p in paths:
        text = open(p).read().rstrip()
        if not text.endswith("]}"):  # an agent killed before closing the JSON
            text = text.rstrip(",") + "\n]}"
        ev += [e for e in json.loads(text)["traceEvents"] if e.get("ph") in ("X", "i")]
    return ev


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--layer", default=None, help="only this layer (its name)")
    ap.add_argument("--skip", type=int, default=20, help="leave out the first iterations")
    args = ap.parse_args()
    ev = load(args.files)
    names = {}
    by = collections.defaultdict(dict)  # (layer, it, rank) -> {event name: (ts, dur)}
    for e in ev:
        it = e.get("args", {}).get("iteration", 0)
        if it <= args.skip:
            continue
        key = (e["tid"], it, e["pid"])
        if "layer" in e.get("args", {}):
            names[e["tid"]] = e["args"]["layer"]
        by[key].setdefault(e["name"], (e["ts"], e.get("dur", 0)))
    # Per (layer, it): the latest start of the push (PS) or of the sends (SFB) over the ranks.
    last_start = collections.defaultdict(float)
    for (layer, it, rank), d in by.items():
        if "push+pull" in d:
            last_start[(layer, it)] = max(last_start[(layer, it)], d["push+pull"][0])
        elif "send factors" in d:
            last_start[(layer, it)] = max(last_start[(layer, it)], d["send factors"][0])
    stages = collections.defaultdict(lambda: collections.defaultdict(list))
    kinds = {}
    for (layer, it, rank), d in by.items():
        if "sync" not in d or "ready" not in d:
            continue
        ready, (s0, sdur) = d["ready"][0], d["sync"]
        done = s0 + sdur
        st = stages[layer]
        if "push+pull" in d:
            kinds[layer] = "PS"
            p0, pdur = d["push+pull"]
            last = last_start[(layer, it)]
            st["agent queue"].append(p0 - ready)
            st["other ranks"].append(max(0.0, last - p0))
            st["server + wire"].append(p0 + pdur - max(last, p0))
            st["done"].append(done - (p0 + pdur))
        elif "send factors" in d and "rebuild" in d:
            kinds[layer] = "SFB"
            f0 = d["send factors"][0]
            r0, rdur = d["rebuild"]
            last = last_start[(layer, it)]
            st["agent queue"].append(f0 - ready)
            st["other ranks"].append(max(0.0, last - f0))
            st["wire + rebuild queue"].append(r0 - max(last, f0))
            st["rebuild"].append(rdur)
            st["done"].append(done - (r0 + rdur))
        else:
            continue
        st["ready -> done"].append(done - ready)
    if not stages:
        sys.exit("no complete layer in these timelines (--skip too large?)")
    print("| layer | scheme | stage | median µs | p90 µs |")
    print("|---|---|---|---:|---:|")
    for layer in sorted(stages):
        name = names.get(layer, str(layer))
        if args.layer and name != args.layer:
            continue
        for stage, xs in stages[layer].items():
            print(f"| {name} | {kinds[layer]} | {stage} | {statistics.median(xs):.0f} | "
                  f"{pct(xs, 0.9):.0f} |")
        print(f"| | | (samples: {len(stages[layer]['ready -> done'])}) | | |")


if __name__ == "__main__":
    main()
