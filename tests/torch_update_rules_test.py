#!/usr/bin/python3
"""poseidon-server's server-side update rules against torch.optim, end to end.

Starts poseidon-server and P1 kv_test_client processes (each a rank pushing deterministic
gradients), then replays the same training with torch.optim on the mean gradient (one worker on
the P1-times larger batch) and compares the parameters every rank pulled at the end.
Exit 0 on match, 1 on mismatch, 77 (skipped) where torch is not installed.
"""
import argparse
import os
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("torch is not installed: skipping (apt install python3-torch)")
    sys.exit(77)

SECRET = "torch-test"


def kv_grad(rank, clock, key, n):
    i = torch.arange(n, dtype=torch.int64)
    return ((rank + 1) * 3 + clock * 5 + key * 7 + i % 13 - 40).to(torch.float32)


def kv_init(key, n):
    i = torch.arange(n, dtype=torch.int64)
    return (torch.tensor(0.001, dtype=torch.float32) * ((i + key) % 101).to(torch.float32))


def reference(rule, workers, keys, n, clocks):
    # The same hyperparameters as tests/kv_test_util.h KvSpec.
    lr = 0.01 if rule == "adam" else 0.1
    out = []
    for key in range(keys):
        p = torch.nn.Parameter(kv_init(key, n).clone())
        if rule == "sgd":
            opt = torch.optim.SGD([p], lr=lr, weight_decay=0.001)
        elif rule == "momentum":
            opt = torch.optim.SGD([p], lr=lr, momentum=0.9, weight_decay=0.001)
        else:
            opt = torch.optim.Adam([p], lr=lr, weight_decay=0.001)
        for clock in range(1, clocks + 1):
            total = torch.zeros(n, dtype=torch.float32)
            for r in range(workers):
                total += kv_grad(r, clock, key, n)
            p.grad = total * (1.0 / workers)
            opt.step()
        out.append(p.detach().clone())
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--client", required=True)
    args = ap.parse_args()
    workers, keys, n, clocks = 2, 2, 3001, 8
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rule in ("sgd", "momentum", "adam"):
            server = subprocess.Popen(
                [args.server, "--listen=127.0.0.1:0", "--job_id=1", f"--job_secret={SECRET}",
                 "--log_level=warn"], stdout=subprocess.PIPE, text=True)
            try:
                address = None
                for line in server.stdout:
                    if "listening on " in line:
                        address = line.strip().split("listening on ")[1]
                        break
                if address is None:
                    print("server did not start")
                    return 1
                clients = [subprocess.Popen(
                    [args.client, f"--server={address}", f"--secret={SECRET}", f"--rank={r}",
                     f"--workers={workers}", f"--rule={rule}", f"--keys={keys}",
                     f"--elements={n}", f"--clocks={clocks}",
                     f"--out={os.path.join(tmp, f'{rule}{r}')}"]) for r in range(workers)]
                for c in clients:
                    if c.wait(timeout=120) != 0:
                        print(f"{rule}: a client failed")
                        return 1
            finally:
                server.terminate()
                server.wait(timeout=60)
            expected = reference(rule, workers, keys, n, clocks)
            for r in range(workers):
                with open(os.path.join(tmp, f"{rule}{r}"), "rb") as f:
                    got = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
                err = ((got - expected).abs() / expected.abs().clamp(min=1.0)).max().item()
                ok = got.shape == expected.shape and err <= 1e-5
                print(f"{rule:9s} rank {r}: max relative difference to torch.optim "
                      f"{torch.__version__}: {err:.2e} {'ok' if ok else 'MISMATCH'}")
                failures += 0 if ok else 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
