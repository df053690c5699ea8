#!/usr/bin/env bash
# The whole test suite: installs what it needs, builds everything with clang under
# AddressSanitizer + UndefinedBehaviorSanitizer with -Werror (and the libFuzzer targets), then
# runs every test: unit, conformance, multi-process, fault, fuzz smoke and benchmark smoke; then
# the agent's, server's and transport's tests once more under ThreadSanitizer (build/tsan).
# Arguments go to the first ctest (and skip the ThreadSanitizer stage).
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

# The thread model checked (docs/thread_model.md): the agent's, the server's and the transport's
# tests, and the multi-process runs of their daemons, again under ThreadSanitizer (a race aborts
# the process: TSAN_OPTIONS halt_on_error). POSEIDON_SKIP_TSAN=1 skips this stage.
if [[ "${POSEIDON_SKIP_TSAN:-0}" != 1 && $# -eq 0 ]]; then
  TSAN_BUILD=${POSEIDON_TSAN_BUILD_DIR:-build/tsan}
  cmake -S . -B "$TSAN_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DPOSEIDON_TSAN=ON -DPOSEIDON_WERROR=ON -DPOSEIDON_WITH_CUDA=OFF
  TSAN_TARGETS=(agent_unit_test agent_telemetry_reporter_test server_unit_test
    server_multiprocess_test kv_test_client transport_unit_test transport_conformance_test
    transport_tls_test
    agent_e2e_test poseidon-agent poseidon-server poseidon-synth poseidon-coordinator poseidon)
  # The RDMA backend's tests carry the transport label too: built where libibverbs is (every
  # test labelled below must be built, or ctest reports it "Not Run"); ops_rdma_fabric runs the
  # daemons on the test provider's libibverbs.so.1 (poseidon_fake_ibverbs).
  # (The target list is read whole first: under pipefail, `ninja ... | grep -q` fails whenever
  # grep exits before ninja has written everything and ninja dies of SIGPIPE.)
  ALL_TSAN_TARGETS=$(ninja -C "$TSAN_BUILD" -t targets all)
  for t in transport_rdma_test transport_set_test transport_conformance_rdma_hw \
           poseidon_fake_ibverbs transport_fake_verbs_process_test fake_verbs_peer; do
    if grep -q "^$t:" <<<"$ALL_TSAN_TARGETS"; then TSAN_TARGETS+=("$t"); fi
  done
  cmake --build "$TSAN_BUILD" -j "${JOBS:-2}" --target "${TSAN_TARGETS[@]}"
  TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp} \
    ctest --test-dir "$TSAN_BUILD" --output-on-failure -j "${JOBS:-2}" \
    -L '^(agent|server|transport)$' -E '^server_matches_torch_optim$'
fi
