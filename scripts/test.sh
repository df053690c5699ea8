#!/usr/bin/env bash
# The whole test suite: installs what it needs, builds everything with clang under
# AddressSanitizer + UndefinedBehaviorSanitizer with -Werror (and the libFuzzer targets), then
# runs every test: unit, conformance, multi-process, fault, fuzz smoke and benchmark smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD=${POSEIDON_BUILD_DIR:-build/asan}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
  -DPOSEIDON_SANITIZE=ON -DPOSEIDON_WERROR=ON -DPOSEIDON_FUZZ=ON
cmake --build "$BUILD" -j "${JOBS:-2}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir "$BUILD" --output-on-failure -j "${JOBS:-2}" "$@"
