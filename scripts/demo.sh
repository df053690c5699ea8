#!/usr/bin/env bash
# The main job: installs what it needs, builds Poseidon (Release) and runs it.
# Today the main job is the transport benchmark (poseidon-bench-transport); the training demo
# replaces it when the agent and the PyTorch integration land.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD=${POSEIDON_BUILD_DIR:-build/release}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "${JOBS:-2}" --target poseidon-bench-transport
exec "$BUILD/bench/poseidon-bench-transport" "$@"
