#!/usr/bin/env bash
# A real one-node Slurm cluster (munged, slurmctld, slurmd: Debian's slurm-wlm and munge) made for this test in a
# temporary directory, launching real corpc programs with srun and sbatch. Every task finds rank 0 through Slurm's own
# variables (SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, SLURM_JOB_ID: no MASTER_ADDR or
# MASTER_PORT); the batch script is the one docs/launching.md shows. Skipped (exit 77, which Meson reports as SKIP)
# when not root, when Slurm or munge is not installed, or when the daemons do not start (their logs are printed).
#   tests/slurm.sh RPC_HELLO DDP_TRAIN DDP_FAULT_TOLERANT
set -uo pipefail
hello=$1 ddp=$2 ft=$3
skip() { echo "slurm test: skipped ($*)"; exit 77; }
fail() { echo "slurm test: FAIL: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || skip "the daemons need root"
for c in munged slurmctld slurmd srun sbatch sinfo scontrol python3; do
  command -v "$c" >/dev/null || skip "no $c: Debian's slurm-wlm and munge are not installed"
done

work=$(mktemp -d /tmp/slurm-test.XXXXXX)
chmod 755 "$work"
# Every process the test starts (the daemons, slurmstepd, the clients, the tasks; not this shell) carries
# CORPC_SLURM_TEST=$work: what is left after the test is found by it.
mark=(env "CORPC_SLURM_TEST=$work")
leftovers() { grep -lsz "^CORPC_SLURM_TEST=$work\$" /proc/[0-9]*/environ | cut -d/ -f3 | grep -vx "$$" || true; }
daemons=()
# The daemons stop in the reverse order of their start (slurmd and slurmctld still reach munged as they stop), each
# given 10 s; then whatever is left is killed.
teardown() {
  local i pid
  for ((i = ${#daemons[@]} - 1; i >= 0; i--)); do
    pid=${daemons[i]}
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null && echo "slurm test: daemon $pid did not stop on SIGTERM within 10 s: killed"
    wait "$pid" 2>/dev/null
  done
  daemons=()
  for pid in $(leftovers); do kill -KILL "$pid" 2>/dev/null; done
  for _ in $(seq 50); do [[ -z $(leftovers) ]] && break; sleep 0.1; done
}
cleanup() {
  local status=$?
  teardown
  local left
  left=$(leftovers)
  if [[ -n $left ]]; then
    ps -o pid,args -p "${left//$'\n'/,}"
    echo "slurm test: FAIL: processes left after the test" >&2
    status=1
  fi
  rm -rf "$work"
  exit $status
}
trap cleanup EXIT
logs() { for f in "$work"/*.log; do echo "== $f"; tail -20 "$f"; done; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# The node is named after this host: ranks dial the first name in the node list, which must resolve to the node (as
# on a real cluster); its NodeAddr is where slurmctld reaches slurmd.
host=$(hostname -s)
mkdir -p "$work/munge" "$work/state" "$work/spool"
chmod 700 "$work/munge"
head -c 1024 /dev/urandom >"$work/munge/munge.key"
chmod 400 "$work/munge/munge.key"
cat >"$work/slurm.conf" <<EOF
ClusterName=corpctest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/munge.sock
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool/%n
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd-%n.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$work/slurm.conf
# The tasks find rank 0 through Slurm alone.
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK

"${mark[@]}" munged -F -f --key-file="$work/munge/munge.key" --socket="$work/munge/munge.sock" --pid-file="$work/munge/munged.pid" \
  --seed-file="$work/munge/seed" >"$work/munged.log" 2>&1 &
daemons+=($!)
for _ in $(seq 100); do [[ -S $work/munge/munge.sock ]] && break; sleep 0.1; done
[[ -S $work/munge/munge.sock ]] || { logs; skip "munged did not start"; }
"${mark[@]}" slurmctld -D -f "$work/slurm.conf" >"$work/slurmctld.out.log" 2>&1 &
daemons+=($!)
"${mark[@]}" slurmd -D -N "$host" -f "$work/slurm.conf" >"$work/slurmd.out.log" 2>&1 &
daemons+=($!)
# Ready when the node is idle (bounded: 60 s).
ready=
for _ in $(seq 300); do
  if [[ $(timeout 10 sinfo -h -N -o '%t' 2>/dev/null) == idle ]]; then ready=1; break; fi
  sleep 0.2
done
[[ -n $ready ]] || { logs; skip "slurmctld and slurmd did not bring the node up within 60 s"; }

export CORPC_SECRET=$RANDOM$RANDOM$RANDOM
# srun with a bound on the whole step (--time is in minutes: timeout ends the client, Slurm then the step).
run_srun() { "${mark[@]}" timeout 180 srun --time=3 "$@"; }

echo "slurm test: the node is idle ($SECONDS s)"
# rpc_hello, 3 tasks: the right answers once (one job, not one per task), every task exits 0.
run_srun -n 3 sh -c '"$0"; echo "task $SLURM_PROCID exited $?"' "$hello" >"$work/out" 2>&1 ||
  { cat "$work/out"; logs; fail "rpc_hello under srun"; }
grep -q '^add on worker1: 5$' "$work/out" && grep -q '^counter on worker2: 15$' "$work/out" ||
  { cat "$work/out"; fail "rpc_hello's answers under srun"; }
[[ $(grep -c 'counter on worker2: 15' "$work/out") == 1 ]] || { cat "$work/out"; fail "one job, not one per task"; }
for r in 0 1 2; do grep -q "^task $r exited 0$" "$work/out" || { cat "$work/out"; fail "task $r's exit status"; }; done

echo "slurm test: srun rpc_hello ($SECONDS s)"
# DDP (examples/ddp_train), 4 tasks: every task's parameters equal rank 0's (the program checks), status 0.
run_srun -n 4 "$ddp" 5 >"$work/out" 2>&1 || { cat "$work/out"; fail "ddp_train under srun"; }
grep -q '^ddp_train: 4 ranks, 5 steps, .*parameters identical$' "$work/out" || { cat "$work/out"; fail "ddp_train's output"; }

echo "slurm test: srun ddp_train ($SECONDS s)"
# Fault-tolerant DDP (examples/ddp_fault_tolerant): a coordinator and 3 trainers, 20 steps, no faults.
run_srun -n 4 "$ft" --trainers 3 --steps 20 >"$work/out" 2>&1 || { cat "$work/out"; fail "ddp_fault_tolerant under srun"; }
grep -q '^coordinator: 20 steps committed' "$work/out" || { cat "$work/out"; fail "ddp_fault_tolerant's output"; }
[[ $(grep -c '^trainer [123]: done, 20 steps committed' "$work/out") == 3 ]] || { cat "$work/out"; fail "the trainers' ends"; }

echo "slurm test: srun ddp_fault_tolerant ($SECONDS s)"
# The batch script docs/launching.md shows (the program's path aside), through sbatch --wait.
cat >"$work/job.sh" <<EOF
#!/bin/bash
#SBATCH --ntasks=3
#SBATCH --time=5
export CORPC_SECRET=\$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')
srun $hello
EOF
"${mark[@]}" timeout 180 sbatch --wait -o "$work/batch.out" "$work/job.sh" >"$work/out" 2>&1 || { cat "$work/out" "$work/batch.out"; fail "the batch job"; }
grep -q '^counter on worker2: 15$' "$work/batch.out" || { cat "$work/batch.out"; fail "the batch job's output"; }

echo "slurm test: sbatch ($SECONDS s)"
# A wrong task count: 2 tasks of a 3-rank program fail at once, naming Slurm's variable.
run_srun -n 2 "$hello" >"$work/out" 2>&1 && { cat "$work/out"; fail "SLURM_NTASKS=2 for a 3-rank program gave status 0"; }
grep -q 'SLURM_NTASKS=2 ranks; start it with 3' "$work/out" || { cat "$work/out"; fail "the task count mismatch is not named"; }

# A missing node: two nodes asked of this one-node cluster. Slurm queues such a job (a node may come); with
# --immediate srun gives up at once, and nothing starts.
run_srun --immediate -N 2 -n 3 "$hello" >"$work/out" 2>&1 &&
  { cat "$work/out"; fail "two nodes of a one-node cluster gave status 0"; }
grep -q 'Unable to allocate resources' "$work/out" || { cat "$work/out"; fail "srun's refusal"; }

echo "slurm test: a wrong task count, a missing node ($SECONDS s)"
# A task that fails, with srun's defaults: the other tasks run on to their own end (here 2 s), srun then fails with
# the failed task's status. (A corpc rank lost after rendezvous fails its peers' calls to it with ConnectionError;
# one lost before leaves them waiting up to init_timeout: docs/launching.md.)
run_srun -n 3 sh -c 'if [ "$SLURM_PROCID" = 1 ]; then exit 3; fi; sleep 2; echo "task $SLURM_PROCID ran on"' \
  >"$work/out" 2>&1
status=$?
[[ $status == 3 ]] || { cat "$work/out"; fail "srun's status for a task that exited 3: $status"; }
[[ $(grep -c '^task [02] ran on$' "$work/out") == 2 ]] || { cat "$work/out"; fail "the other tasks did not run on"; }
grep -q 'task 1: Exited with exit code 3' "$work/out" || { cat "$work/out"; fail "srun's report of the failed task"; }

echo "slurm test: a failed task, srun's defaults ($SECONDS s)"
# A task that dies (task 1 killed before it starts corpc), with --kill-on-bad-exit: srun ends the step and fails.
run_srun -n 3 --kill-on-bad-exit=1 sh -c '[ "$SLURM_PROCID" = 1 ] && kill -KILL $$; exec "$0"' "$hello" >"$work/out" 2>&1 &&
  { cat "$work/out"; fail "a step with a killed task gave status 0"; }
grep -q 'task 1: Killed' "$work/out" || { cat "$work/out"; fail "the killed task is not reported"; }

echo "slurm test: a killed task ($SECONDS s)"
teardown
echo "slurm test: passed ($SECONDS s)"
