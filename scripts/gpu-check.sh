#!/bin/bash
# The GPU checks of issue 9, in one run on a machine with an NVIDIA GPU (the device tool's H200):
# unpacks .devpack/pack.tar.xz (scripts/gpu-pack.sh, built on Debian 12 with CUDA), then runs
# the CUDA tests, the end-to-end tests on the GPU, the PyTorch CUDA test and the benchmarks,
# writing each log under $OUT (default /tmp/gpu-out) and a summary at the end.
# PYTORCH_TESTS picks the PyTorch cases (default: the whole Cuda class).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
B=$PWD/build/release
mkdir -p "$B" && tar -C "$B" -xJf .devpack/pack.tar.xz || exit 1
export LD_LIBRARY_PATH=$B/devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Fallback for cuBLAS / the runtime: the NVIDIA wheels next to PyTorch.
for d in $(python3 -c 'import site, glob; print(" ".join(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib")))' 2>/dev/null); do
  LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
ldd "$B/agent/poseidon-agent" "$B/bench/cuda_bench" | grep "not found"
# The tests carry the absolute paths of the machine they were built on.
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
export PYTHONUNBUFFERED=1
declare -A result
step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  result[$name]="rc=$rc $((SECONDS - t0))s"
  pkill -f poseidon- 2>/dev/null; rm -f /dev/shm/psd-* /dev/shm/poseidon-* 2>/dev/null
}
nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())'
step cuda_stager_test 45 "$B/agent/cuda_stager_test"
step gpu_e2e 100 "$B/tests/agent_e2e_test" --gtest_filter='*Gpu*:CAbi.*'
step cuda_bench 90 "$B/bench/cuda_bench"
step pytorch_cuda 180 env PYTHONPATH=libclient/python POSEIDON_BUILD_DIR="$B" \
  python3 tests/python/test_pytorch.py -v ${PYTORCH_TESTS:-Cuda}
step pytorch_cuda_zoo 180 env PYTHONPATH=libclient/python POSEIDON_BUILD_DIR="$B" \
  python3 tests/python/test_zoo.py -v CudaZoo
step iteration_split 100 python3 bench/cuda/iteration_split.py --build "$B" --model vgg16 --workers 2
step iteration_split_ps 100 python3 bench/cuda/iteration_split.py --build "$B" --model vgg16 --workers 2 --scheme ps
step launcher_coordinator_gpu 45 env PYTHONPATH=libclient/python POSEIDON_BUILD_DIR="$B" \
  python3 -m poseidon.run -n 2 --scheme auto -- "$B/bench/poseidon-synth" --cuda --verify \
  --model=tests/models/tiny.json --batch=8 --iterations=20
echo "=== summary"
for k in cuda_stager_test gpu_e2e cuda_bench pytorch_cuda iteration_split iteration_split_ps launcher_coordinator_gpu; do
  echo "$k: ${result[$k]:-not run}"
done | tee "$OUT/summary.txt"
