#!/usr/bin/env bash
# The main job: installs what it needs, builds Poseidon (Release), and trains an MLP on
# scikit-learn's digits with 4 workers on a local cluster (coordinator, 1 KV server, 4 agents) through
# `poseidon run`. Arguments go to the training script (e.g. --epochs 10, --cnn).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD=${POSEIDON_BUILD_DIR:-build/release}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "${JOBS:-2}" --target poseidon poseidon-server poseidon-agent poseidon-coordinator \
  libposeidon_python
export POSEIDON_BUILD_DIR="$PWD/$BUILD"
exec "$BUILD/tools/poseidon" run -n "${WORKERS:-4}" -- /usr/bin/python3 examples/train_digits.py "$@"
