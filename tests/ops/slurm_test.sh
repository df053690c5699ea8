#!/bin/bash
# A real Slurm on this machine (Debian's slurm-wlm and munge): munged, slurmctld and one slurmd on
# 127.0.0.1 in a temporary directory (their own ports, state, sockets and logs), then
# `sbatch --wait -n 2 deploy/slurm/poseidon.sbatch` trains examples/train_chargpt.py with one
# `poseidon run` launcher per task (2 tasks, one rank each: the coordinator forms the world of 2
# only when both launchers' agents joined) and must end with rank 0's final loss; then a second
# job whose rank 1 dies and its task's launcher restarts it alone (--rejoin), which must train
# exactly. Every daemon is stopped on every path. Exit 77 (skip) without Slurm.
#   slurm_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=${1:?usage: slurm_test.sh BUILD_DIR SOURCE_DIR}
source=${2:?usage: slurm_test.sh BUILD_DIR SOURCE_DIR}
for tool in munged slurmctld slurmd sbatch sinfo; do
  command -v "$tool" >/dev/null 2>&1 || { echo "SKIP: $tool not installed (slurm-wlm, munge)"; exit 77; }
done
[ -r /etc/munge/munge.key ] || { echo "SKIP: no /etc/munge/munge.key"; exit 77; }
/usr/bin/python3 -c 'import torch' 2>/dev/null || { echo "SKIP: no python3-torch"; exit 77; }

d=$(mktemp -d /tmp/psd-slurm-XXXXXX)
pids=()
cleanup() {
  scancel --full --quiet --user=root 2>/dev/null || true
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pkill -f "slurmstepd: \[" 2>/dev/null || true
  rm -rf "$d"
}
trap cleanup EXIT
show_logs() {
  for f in "$d"/job.out "$d"/slurmctld.log "$d"/slurmd.log; do
    [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }
  done
}

# Ports below the ephemeral range, free now.
read -r pctl pd pbase < <(/usr/bin/python3 - <<'PY'
import random, socket
def free(p):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p)); return True
        except OSError:
            return False
while True:
    b = random.randrange(20000, 30000, 10)
    if all(free(b + i) for i in range(10)):
        print(b, b + 1, b + 2); break
PY
)
mkdir -p "$d/state" "$d/spool" "$d/bin"
munged -F --force --socket="$d/munge.sock" --key-file=/etc/munge/munge.key \
  --pid-file="$d/munged.pid" --log-file="$d/munged.log" --seed-file="$d/munge.seed" &
pids+=($!)
node=$(hostname -s)
cat > "$d/slurm.conf" <<CONF
ClusterName=poseidontest
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$pctl
SlurmdPort=$pd
AuthType=auth/munge
AuthInfo=socket=$d/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.pid
SlurmctldLogFile=$d/slurmctld.log
SlurmdLogFile=$d/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
export SLURM_CONF=$d/slurm.conf
for _ in $(seq 50); do [ -S "$d/munge.sock" ] && break; sleep 0.1; done
slurmctld -D -f "$d/slurm.conf" -i &
pids+=($!)
slurmd -D -f "$d/slurm.conf" &
pids+=($!)
state=""
for _ in $(seq 150); do
  state=$(sinfo -h -o %t 2>/dev/null || true)
  [ "$state" = "idle" ] && break
  sleep 0.2
done
if [ "$state" != "idle" ]; then
  echo "FAIL: the Slurm node did not come up (state '$state')"; show_logs; exit 1
fi
echo "slurm: node $node idle (slurmctld :$pctl, slurmd :$pd)"

# The daemons in one directory (the batch script's POSEIDON_BIN_DIR), the CLI on PATH.
ln -s "$build/coordinator/poseidon-coordinator" "$build/server/poseidon-server" \
  "$build/agent/poseidon-agent" "$build/tools/poseidon" "$d/bin/"
rc=0
(cd "$d" && PATH="$d/bin:$PATH" POSEIDON_BIN_DIR="$d/bin" POSEIDON_BUILD_DIR="$build" \
  POSEIDON_ADDR=127.0.0.1 POSEIDON_LISTEN_HOST=127.0.0.1 POSEIDON_PORT_BASE=$pbase \
  PYTHONPATH="$source/libclient/python" \
  timeout 240 sbatch --wait --nodes=1 --ntasks-per-node=2 --output="$d/job.out" \
  "$source/deploy/slurm/poseidon.sbatch" /usr/bin/python3 "$source/examples/train_chargpt.py" \
  --steps 20 --width 64 --quiet --sample 40) || rc=$?
fail=0
[ "$rc" -eq 0 ] || { echo "FAIL: sbatch --wait exited with $rc"; fail=1; }
grep -q "2 workers (poseidon)" "$d/job.out" || { echo "FAIL: no world of 2 workers in the output"; fail=1; }
grep -q "\[rank 0\] final loss" "$d/job.out" || { echo "FAIL: rank 0 did not finish training"; fail=1; }
if [ "$fail" -ne 0 ]; then show_logs; exit 1; fi
grep "final loss" "$d/job.out"
echo "PASS: sbatch trained on 2 Slurm tasks"

# Elastic ranks under Slurm (issue 18): each task's launcher restarts its own failed rank alone
# (POSEIDON_RUN_ARGS="--max_restarts 1 --rejoin"). Rank 1 (the second task) dies before step 17
# of the equivalence worker (server-side Adam); its launcher restarts it with --rejoin, it
# takes up the running job at step 16 with the training loop's position (an ElasticState), the
# step (Slurm's) goes on, and rank 0's parameters equal one process on the 2x batch.
rc=0
(cd "$d" && PATH="$d/bin:$PATH" POSEIDON_BIN_DIR="$d/bin" POSEIDON_BUILD_DIR="$build" \
  POSEIDON_ADDR=127.0.0.1 POSEIDON_LISTEN_HOST=127.0.0.1 POSEIDON_PORT_BASE=$((pbase + 3)) \
  POSEIDON_SCHEME=ps POSEIDON_RUN_ARGS="--max_restarts 1 --rejoin" \
  PYTHONPATH="$source/libclient/python" \
  timeout 240 sbatch --wait --nodes=1 --ntasks-per-node=2 --output="$d/job2.out" \
  "$source/deploy/slurm/poseidon.sbatch" /usr/bin/python3 \
  "$source/tests/python/equivalence_worker.py" "$d/params.pt" \
  server-adam,workers=2,crash-at=17,elastic-state) || rc=$?
cp "$d/job2.out" "$d/job.out" 2>/dev/null || true  # (show_logs shows this job's output)
fail=0
[ "$rc" -eq 0 ] || { echo "FAIL: the elastic sbatch --wait exited with $rc"; fail=1; }
grep -q "rank 1 crashes" "$d/job.out" || { echo "FAIL: rank 1 did not crash"; fail=1; }
grep -q "restart 1 of 1: rank 1 rejoins the running job" "$d/job.out" ||
  { echo "FAIL: rank 1 was not restarted alone"; fail=1; }
grep -q "rank 1 takes up at step 16: ElasticState(epoch=3, batch=1)" "$d/job.out" ||
  { echo "FAIL: rank 1 did not take up the job at step 16, epoch 3, batch 1"; fail=1; }
if [ "$fail" -eq 0 ]; then
  PYTHONPATH="$source/libclient/python:$source/tests/python" POSEIDON_BUILD_DIR="$build" \
    /usr/bin/python3 - "$d/params.pt" <<'PY' || fail=1
import sys
import torch
import test_pytorch
got = torch.load(sys.argv[1])
want = test_pytorch.reference(lambda p: torch.optim.Adam(p, lr=0.01), workers=2)
rel = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
print(f"elastic Slurm job against one process on the 2x batch: relative difference {rel:.2e}")
if rel > 1e-5:
    sys.exit("FAIL: the parameters differ from the reference")
PY
fi
if [ "$fail" -ne 0 ]; then show_logs; exit 1; fi
echo "PASS: a rank that died under Slurm restarted alone and the job trained exactly"
