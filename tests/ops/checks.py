"""The ops tests' checks: each prints "ok" or "FAIL" with what it checked; finish() exits 1 if any
failed (with an optional last word, e.g. the daemon's log), else prints the passing line."""
import sys

failures = []


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
