#!/usr/bin/python3
"""Merges the per-rank timelines of poseidon-agent (--timeline) into one Chrome trace / Perfetto
file: every rank is a process, every layer a track.

    tools/timeline_merge.py -o merged.json timeline-0.json timeline-1.json ...
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("inputs", nargs="+")
    args = ap.parse_args()
    events = []
    for path in args.inputs:
        try:
            with open(path) as f:
                events.extend(json.load(f)["traceEvents"])
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"timeline_merge: {path}: {e}")
    with open(args.output, "w") as f:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, f)
    print(f"{len(events)} events from {len(args.inputs)} ranks -> {args.output}")


if __name__ == "__main__":
    main()
