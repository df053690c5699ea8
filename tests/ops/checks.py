"""The ops tests' checks: each prints "ok" or "FAIL" with what it checked; finish() exits 1 if any
failed (with an optional last word, e.g. the daemon's log), else prints the passing line."""
import statistics
import sys

failures = []


def p50_p99(values):
    """The median and the 99th percentile (nearest rank) of a benchmark's samples."""
    values = sorted(values)
    return statistics.median(values), values[min(len(values) - 1, int(0.99 * len(values)))]


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def finish(passed, on_failure=None):
    if failures:
        if on_failure:
            print(on_failure)
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print(passed)
