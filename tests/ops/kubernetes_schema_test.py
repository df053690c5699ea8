#!/usr/bin/python3
"""ops_kubernetes_schema: deploy/kubernetes/*.yaml against the API schema of Kubernetes 1.33.0
and against the images docker/ builds (tests/ops/k8s-validate/validate.js says what is checked).

Installs the validator's npm packages (exact versions, tests/ops/k8s-validate/package-lock.json)
with `npm ci` into CACHE (under the build tree), once per lock file: a stamp holds the lock's
hash, so later runs install nothing and need no network. Then runs validate.js --self-test (broken
copies of the manifests must fail, a consistent GPU variant must pass) and the real check.

Exit 77 (skip) when node/npm are missing or npm cannot reach its registry; any other failure,
including one of npm's own, fails the test.

    kubernetes_schema_test.py SOURCE_DIR CACHE_DIR
"""

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys

SKIP = 77
NETWORK = re.compile(r"\b(ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ENETUNREACH|"
                     r"EHOSTUNREACH|ESOCKETTIMEDOUT|ERR_SOCKET_TIMEOUT|network request to|"
                     r"request to \S+ failed|getaddrinfo|proxy)\b", re.I)


def main():
    root, cache = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    here = os.path.join(root, "tests", "ops", "k8s-validate")
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        print("SKIP: node and npm are needed for the Kubernetes schema check (Debian: apt install nodejs npm)")
        return SKIP
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(here, "package-lock.json"), "rb") as f:
        lock = f.read()
    with open(os.path.join(here, "package.json"), "rb") as f:
        want = hashlib.sha256(lock + f.read()).hexdigest()
    stamp = os.path.join(cache, "installed.sha256")
    with open(os.path.join(cache, ".lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # two runs of the same build tree install once
        have = open(stamp).read().strip() if os.path.exists(stamp) else ""
        if have != want or not os.path.isdir(os.path.join(cache, "node_modules")):
            for name in ("package.json", "package-lock.json"):
                shutil.copyfile(os.path.join(here, name), os.path.join(cache, name))
            if os.path.exists(stamp):
                os.unlink(stamp)
            cmd = [npm, "ci", "--no-audit", "--no-fund", "--prefer-offline", "--ignore-scripts",
                   "--fetch-retries=1", "--fetch-timeout=30000", "--loglevel=error"]
            print("installing the validator:", " ".join(cmd[1:]), "in", cache, flush=True)
            try:
                p = subprocess.run(cmd, cwd=cache, capture_output=True, text=True, timeout=240)
            except subprocess.TimeoutExpired:
                print("SKIP: npm ci did not finish in 240 s (registry unreachable?)")
                return SKIP
            out = (p.stdout + p.stderr).strip()
            if p.returncode != 0:
                print(out)
                if NETWORK.search(out):
                    print("SKIP: npm cannot reach its registry to install the pinned validator "
                          "(kubernetes-models 4.5.1, js-yaml 4.1.0, typescript 5.9.3); "
                          "the manifests were NOT checked")
                    return SKIP
                print("FAIL: npm ci of tests/ops/k8s-validate failed")
                return 1
            with open(stamp, "w") as f:
                f.write(want + "\n")
    p = subprocess.run([node, os.path.join(here, "validate.js"), "--modules", cache, "--root", root,
                        "--self-test"], timeout=240)
    if p.returncode != 0:
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
