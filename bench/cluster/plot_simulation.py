#!/usr/bin/python3
"""Speed-up against N from `poseidon simulate --json` outputs, one line per file, the ideal line.

    build/release/tools/poseidon simulate --model vgg19-22k ... --json > vgg.json
    bench/cluster/plot_simulation.py vgg.json inception.json --out speedup.png \
        [--label 'VGG19-22K 10GbE' --label 'Inception-V3 10GbE'] [--paper 16:15.5 --paper 32:31.5]
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", action="append", default=[])
    ap.add_argument("--paper", action="append", default=[],
                    help="N:speed-up points to mark (the seed paper's figures)")
    ap.add_argument("--title", default="poseidon simulate: speed-up")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_simulation: matplotlib missing (python3-matplotlib): no plot", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7, 5))
    top = 1
    for i, path in enumerate(args.inputs):
        with open(path) as f:
            data = json.load(f)
        rows = data["rows"]
        xs = [r["workers"] for r in rows]
        ys = [r["speedup"] for r in rows]
        s = data["settings"]
        label = args.label[i] if i < len(args.label) else (
            f"{data['model']} {s['bandwidth_bytes_per_second'] * 8 / 1e9:g} Gbit/s {s['gpu']}")
        ax.plot(xs, ys, marker="o", label=label)
        top = max(top, max(xs))
    ax.plot([1, top], [1, top], "k--", linewidth=0.8, label="ideal")
    for p in args.paper:
        n, su = (float(v) for v in p.split(":"))
        ax.plot([n], [su], "r*", markersize=12)
    if args.paper:
        ax.plot([], [], "r*", markersize=12, label="seed paper (measured)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("machines N")
    ax.set_ylabel("speed-up over N = 1")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
