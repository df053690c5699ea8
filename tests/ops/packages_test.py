#!/usr/bin/python3
"""The Debian packages as an operator gets them (cmake/PoseidonInstall.cmake, docs/operations.md).

Builds every package with cpack from the build tree, then checks: the package set and each one's
files, Depends computed from the linked libraries, that apt resolves them all on this Debian 12
(`apt-get install -s`), the installed units with systemd-analyze (tests/ops/systemd_verify_test.sh
on the extracted tree), the header, pkg-config file and library by compiling and running a C
program against them, and an end-to-end job with the installed layout: the installed `poseidon
run` starts the installed daemons and a rank that imports the installed Python package trains a
model through poseidon.torch.DistributedDataParallel. (In a sanitized build the extracted
libposeidon is instrumented and cannot be loaded by /usr/bin/python3: the rank then loads the
build's uninstrumented copy, and says so.)

    packages_test.py --build BUILD --source SOURCE [--sanitized ON|OFF]
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--build", required=True)
ap.add_argument("--source", required=True)
ap.add_argument("--sanitized", default="OFF")
args = ap.parse_args()


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 300), **kw)


for tool in ("cpack", "dpkg-deb", "apt-get"):
    if run(["sh", "-c", f"command -v {tool}"]).returncode != 0:
        print(f"SKIP: {tool} is not installed")
        sys.exit(77)

with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "debs")
    r = run(["cpack", "-G", "DEB", "-B", out, "--config",
             os.path.join(args.build, "CPackConfig.cmake")], cwd=args.build, timeout=600)
    check(r.returncode == 0, f"cpack builds the packages {r.stderr[-2000:]}")
    debs = {os.path.basename(p).split("_")[0]: p for p in glob.glob(os.path.join(out, "*.deb"))}
    want = {"poseidon-server", "poseidon-coordinator", "poseidon-agent", "poseidon-cli",
            "libposeidon1", "libposeidon-dev", "python3-poseidon"}
    if glob.glob(os.path.join(args.build, "agent", "libposeidon_cuda_stager.so")):
        want.add("poseidon-agent-cuda")
    check(set(debs) == want, f"packages {sorted(debs)} are {sorted(want)}")

    files = {}
    for name, path in debs.items():
        listing = run(["dpkg-deb", "-c", path]).stdout
        files[name] = set()
        for line in listing.splitlines():  # "mode owner size date time ./path [-> target]"
            fields = line.split(" -> ")[0].split()
            files[name].add(fields[-1].lstrip("."))
    expect = {
        "poseidon-server": ["/usr/bin/poseidon-server", "/usr/lib/systemd/system/poseidon-server.service",
                            "/etc/poseidon/server.env"],
        "poseidon-coordinator": ["/usr/bin/poseidon-coordinator", "/etc/poseidon/coordinator.env",
                                 "/usr/lib/systemd/system/poseidon-coordinator.service"],
        "poseidon-agent": ["/usr/bin/poseidon-agent", "/etc/poseidon/agent.env",
                           "/usr/lib/systemd/system/poseidon-agent@.service"],
        "poseidon-cli": ["/usr/bin/poseidon"],
        "libposeidon1": ["/usr/lib/libposeidon.so.1"],
        "libposeidon-dev": ["/usr/include/poseidon/poseidon.h", "/usr/lib/libposeidon.so",
                            "/usr/lib/pkgconfig/poseidon.pc"],
        "python3-poseidon": ["/usr/lib/python3/dist-packages/poseidon/torch.py",
                             "/usr/lib/python3/dist-packages/poseidon/run.py"],
        "poseidon-agent-cuda": ["/usr/lib/poseidon/libposeidon_cuda_stager.so"],
    }
    for name in sorted(want):
        missing = [f for f in expect[name] if f not in files.get(name, ())]
        check(not missing, f"{name} holds {', '.join(expect[name])} (missing: {missing})")
    for name in ("poseidon-server", "poseidon-coordinator", "poseidon-agent"):
        depends = run(["dpkg-deb", "-f", debs.get(name, "/nonexistent"), "Depends"]).stdout
        check("libgrpc++" in depends and "libprotobuf" in depends,
              f"{name} depends on the libraries it links: {depends.strip()[:120]}")
        conffiles = run(["sh", "-c", f"dpkg-deb --ctrl-tarfile {debs.get(name, '/nonexistent')} | "
                                     "tar -xO ./conffiles"]).stdout
        check(f"/etc/poseidon/{name.split('-')[1]}.env" in conffiles,
              f"{name} marks its settings as a conffile")

    r = run(["apt-get", "install", "-s", *sorted(debs.values())])
    check(r.returncode == 0 and "Inst poseidon-server" in r.stdout,
          f"apt resolves every package on this system {r.stdout[-1500:]}{r.stderr[-1500:]}")

    root = os.path.join(tmp, "root")
    for path in debs.values():
        run(["dpkg-deb", "-x", path, root])
    usr = os.path.join(root, "usr")
    r = run([os.path.join(usr, "bin", "poseidon-server"), "--help"])
    check(r.returncode == 0 and "Usage" in r.stdout + r.stderr, "the installed server starts (--help)")
    r = run([os.path.join(usr, "bin", "poseidon"), "plan", "--model", "vgg19-22k", "--workers", "4",
             "--servers", "4", "--batch", "32", "--bandwidth", "10Gbit"])
    check(r.returncode == 0 and "SFB" in r.stdout, f"the installed CLI plans (poseidon plan) {r.stderr}")
    verify = os.path.join(args.source, "tests", "ops", "systemd_verify_test.sh")
    r = run(["/bin/bash", verify, os.path.join(usr, "lib", "systemd", "system")])
    check(r.returncode in (0, 77), f"the installed units verify {r.stdout[-1500:]}")

    # The header, the pkg-config file and the library, as a C program of a user's would use them.
    prog = os.path.join(tmp, "abi.c")
    with open(prog, "w") as f:
        f.write('#include <poseidon/poseidon.h>\n#include <stdio.h>\n'
                'int main(void) { printf("abi %u %u\\n", psd_abi_version(), PSD_ABI_VERSION);'
                ' return 0; }\n')
    pc = run(["pkg-config", "--cflags", "--libs", "poseidon"],
             env=dict(os.environ, PKG_CONFIG_PATH=os.path.join(usr, "lib", "pkgconfig"),
                      PKG_CONFIG_SYSROOT_DIR=root))
    check(pc.returncode == 0 and "-lposeidon" in pc.stdout, f"pkg-config poseidon: {pc.stdout}")
    exe = os.path.join(tmp, "abi")
    # A sanitized build's library needs the sanitizer runtime of the compiler that built it.
    sanitized = args.sanitized.upper() in ("ON", "1", "TRUE", "YES")
    cc = "clang-14 -fsanitize=address,undefined" if sanitized else "cc"
    r = run(["sh", "-c", f"{cc} {prog} -o {exe} {pc.stdout.strip()}"])
    check(r.returncode == 0, f"a C program compiles and links against libposeidon {r.stderr[-800:]}")
    r = run([exe], env=dict(os.environ, LD_LIBRARY_PATH=os.path.join(usr, "lib")))
    # The installed library speaks the installed header's ABI.
    words = r.stdout.split()
    check(len(words) == 3 and words[0] == "abi" and words[1] == words[2] and int(words[1]) >= 3,
          f"and runs: {r.stdout.strip()!r} {r.stderr[-800:]}")

    # A job with the installed layout: the installed CLI finds the installed daemons next to it.
    code = ("import os, torch, poseidon, poseidon.torch; poseidon.init(); "
            "torch.manual_seed(poseidon.rank()); "
            "m = poseidon.torch.DistributedDataParallel(torch.nn.Sequential("
            "torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))); "
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "for step in range(5):\n"
            "    opt.zero_grad(); m(torch.randn(4, 8)).pow(2).mean().backward(); opt.step()\n"
            "print('package', os.path.dirname(poseidon.__file__)); "
            "print('daemons', os.environ['POSEIDON_BIN_DIR']); "
            "print('checksum', round(sum(p.double().sum().item() for p in m.parameters()), 6)); "
            "poseidon.shutdown()")
    env = {k: v for k, v in os.environ.items()
           if k not in ("POSEIDON_BUILD_DIR", "POSEIDON_BIN_DIR", "POSEIDON_LIB", "PYTHONPATH")}
    env.update(PATH=os.path.join(usr, "bin") + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=os.path.join(usr, "lib", "python3", "dist-packages"),
               LD_LIBRARY_PATH=os.path.join(usr, "lib"))
    if sanitized:
        env["POSEIDON_LIB"] = os.path.join(args.build, "libclient", "python", "libposeidon.so")
        print("note: sanitized build: the rank loads the build's uninstrumented libposeidon")
    r = run([os.path.join(usr, "bin", "poseidon"), "run", "-n", "2", "--", "/usr/bin/python3", "-c",
             code], env=env, cwd=tmp, timeout=300)
    text = r.stdout + r.stderr
    check(r.returncode == 0, f"poseidon run trains with the installed layout {text[-3000:]}")
    check(f"[rank 0] package {usr}/lib/python3/dist-packages/poseidon" in text,
          "the rank imported the installed Python package")
    check(f"[rank 0] daemons {usr}/bin" in text, "the launcher ran the installed daemons")
    sums = {line.split()[-1] for line in text.splitlines() if "] checksum " in line}
    check(len(sums) == 1, f"both ranks hold the same parameters: {sums}")

finish("all package checks passed")
