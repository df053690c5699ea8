#!/usr/bin/python3
"""Checks the deploy/ files an operator applies as they are: the Kubernetes manifests parse and
hold what docs/operations.md promises (coordinator Deployment + Service, servers StatefulSet +
headless Service, a training pod whose agent sidecar shares an in-memory /dev/shm), the Grafana
dashboard is JSON whose queries use only exported metrics (or say "NOT YET EXPORTED"), and
prometheus.yml passes `promtool check config`. Exit 77 (skip) without python3-yaml."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

try:
    import yaml
except ImportError:
    print("SKIP: python3-yaml not installed")
    sys.exit(77)

ROOT = sys.argv[1]
DEPLOY = os.path.join(ROOT, "deploy")
failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


def exported_metrics():
    """Metric names the daemons register (string literals in their metric code)."""
    names = set()
    for path in ["server/server_main.cc", "coordinator/service_metrics.cc", "agent/agent.cc"]:
        with open(os.path.join(ROOT, path)) as f:
            names |= set(re.findall(r'"(poseidon_[a-z0-9_]+)"', f.read()))
    return names


DAEMON_SOURCES = {"coordinator": "coordinator/coordinator_main.cc",
                  "server": "server/server_main.cc", "agent": "agent/agent_main.cc"}


def settings(source):
    """The setting names of a daemon (its ConfigSchema fields), plus `config`."""
    with open(os.path.join(ROOT, source)) as f:
        return set(re.findall(r'Field\(\s*"([a-z0-9_]+)"', f.read())) | {"config"}


def check_kubernetes():
    docs = []
    for path in sorted(glob.glob(os.path.join(DEPLOY, "kubernetes", "*.yaml"))):
        with open(path) as f:
            docs += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    kinds = {(d["kind"], d["metadata"]["name"]): d for _, d in docs}
    for want in [("Deployment", "poseidon-coordinator"), ("Service", "poseidon-coordinator"),
                 ("StatefulSet", "poseidon-server"), ("Service", "poseidon-server"),
                 ("Job", "poseidon-train")]:
        if want not in kinds:
            fail(f"kubernetes: no {want[0]} {want[1]}")
    for (kind, name), d in kinds.items():
        if d.get("apiVersion") is None or d["metadata"].get("namespace", "poseidon") != "poseidon":
            fail(f"kubernetes: {kind} {name}: apiVersion or namespace")
    if ("Service", "poseidon-server") in kinds:
        if kinds[("Service", "poseidon-server")]["spec"].get("clusterIP") != "None":
            fail("kubernetes: the servers' Service must be headless (clusterIP: None)")
    if ("StatefulSet", "poseidon-server") in kinds:
        if kinds[("StatefulSet", "poseidon-server")]["spec"].get("serviceName") != "poseidon-server":
            fail("kubernetes: StatefulSet serviceName must be the headless Service")
    job = kinds.get(("Job", "poseidon-train"))
    if job:
        pod = job["spec"]["template"]["spec"]
        shm = [v["name"] for v in pod.get("volumes", [])
               if v.get("emptyDir", {}).get("medium") == "Memory"]
        containers = {c["name"]: c for c in pod["containers"]}
        if "agent" not in containers or len(containers) < 2:
            fail("kubernetes: the training pod needs an agent sidecar and a training container")
        for name, c in containers.items():
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            if mounts.get("/dev/shm") not in shm:
                fail(f"kubernetes: container {name} does not mount the in-memory /dev/shm")
        if not pod.get("shareProcessNamespace"):
            fail("kubernetes: agent and trainer check each other's process: shareProcessNamespace")
    # Every POSEIDON_* variable a daemon container sets must be one of that daemon's settings.
    for (kind, name), d in kinds.items():
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            if c["name"] not in DAEMON_SOURCES:
                continue
            known = settings(DAEMON_SOURCES[c["name"]])
            for e in c.get("env", []):
                if e["name"].startswith("POSEIDON_") and e["name"][9:].lower() not in known:
                    fail(f"kubernetes: {kind} {name}: {c['name']} has no setting {e['name']}")
    print(f"kubernetes: {len(docs)} objects: " + ", ".join(f"{k} {n}" for k, n in kinds))


def check_dashboard():
    with open(os.path.join(DEPLOY, "grafana", "poseidon-dashboard.json")) as f:
        dash = json.load(f)
    exported = exported_metrics()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    missing_ok = 0
    for p in panels:
        used = set()
        for t in p.get("targets", []):
            used |= set(re.findall(r"\b(poseidon_[a-z0-9_]+?)(?:_bucket|_sum|_count)?\b", t["expr"]))
        unknown = {m for m in used if m not in exported}
        if unknown and not p.get("description", "").startswith("NOT YET EXPORTED"):
            fail(f"dashboard panel {p['title']!r}: {sorted(unknown)} not exported by any daemon "
                 "and not marked NOT YET EXPORTED")
        if unknown:
            missing_ok += 1
    for want in ["throughput", "latency", "per link", "scheme", "alive"]:
        if not any(want in p["title"].lower() for p in panels):
            fail(f"dashboard: no panel about {want!r}")
    print(f"dashboard: {len(panels)} panels, {missing_ok} waiting for metrics not yet exported")


def check_prometheus_config():
    promtool = shutil.which("promtool")
    if not promtool:
        print("prometheus.yml: promtool missing, not checked")
        return
    p = subprocess.run([promtool, "check", "config",
                        os.path.join(DEPLOY, "prometheus", "prometheus.yml")],
                       capture_output=True, text=True, timeout=30)
    print((p.stdout + p.stderr).strip())
    if p.returncode != 0:
        fail("prometheus.yml: promtool check config")


check_kubernetes()
check_dashboard()
check_prometheus_config()
if failures:
    sys.exit(1)
print("PASS")
