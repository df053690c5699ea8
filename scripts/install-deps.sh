#!/usr/bin/env bash
# Installs the Debian 12 packages Poseidon builds, tests and runs with. Idempotent: when every
# package is already present it returns at once without touching apt.
#   install-deps.sh          everything: build, tests, benchmarks, the demo (README's two commands)
#   install-deps.sh --build  only what compiling the daemons, libposeidon and the CLI needs (the
#                            build stage of docker/: no PyTorch, Slurm, Prometheus or podman)
set -euo pipefail

BUILD_PACKAGES=(
  build-essential cmake ninja-build pkg-config make
  clang-14
  libboost-dev
  libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  libabsl-dev libspdlog-dev prometheus-cpp-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libibverbs-dev libopenblas-dev libgloo-dev
  python3
)
PACKAGES=(
  "${BUILD_PACKAGES[@]}" git libclang-rt-14-dev
  python3-torch python3-torchvision python3-sklearn python3-tqdm python3-matplotlib
  iproute2 procps openssl
  prometheus systemd python3-yaml
  slurmctld slurmd slurm-client munge
  # The container tests (tests/ops/containers_test.py): images built and run with podman from a
  # base made by mmdebstrap; runc, since crun refuses this kernel's hybrid cgroups.
  podman buildah mmdebstrap runc uidmap
)
case "${1:-}" in
  "") ;;
  --build) PACKAGES=("${BUILD_PACKAGES[@]}") ;;
  *) echo "usage: $0 [--build]" >&2; exit 2 ;;
esac

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages: ${missing[*]}; run as root (or: sudo $0)" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
