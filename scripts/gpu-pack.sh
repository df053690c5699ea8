#!/bin/bash
# Packs what scripts/gpu-check.sh needs on a GPU machine that lacks this project's Debian
# packages: the release binaries (built here with CUDA) and the shared libraries they use that
# are neither glibc/libstdc++ nor CUDA's own, into .devpack/pack.tar.xz (git-ignored through
# .git/info/exclude). Usage: scripts/gpu-pack.sh [build/release]
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build/release}
bins=(server/poseidon-server agent/poseidon-agent coordinator/poseidon-coordinator
      agent/libposeidon_cuda_stager.so bench/poseidon-synth bench/cuda_bench
      agent/cuda_stager_test tests/agent_e2e_test
      libclient/python/libposeidon.so tools/poseidon)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/devlibs"
for b in "${bins[@]}"; do
  mkdir -p "$stage/$(dirname "$b")"
  cp "$B/$b" "$stage/$b"
  strip --strip-debug "$stage/$b" 2>/dev/null || true
  ldd "$B/$b" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
      libcuda.so*|libcudart.so*|libcublas*.so*|libnvidia*) ;;
      *) cp -Ln "$lib" "$stage/devlibs/" 2>/dev/null || true ;;
    esac
  done
done
mkdir -p .devpack
grep -qx '/.devpack/' .git/info/exclude 2>/dev/null || echo '/.devpack/' >> .git/info/exclude
tar -C "$stage" -cJf .devpack/pack.tar.xz .
ls -la .devpack/pack.tar.xz
