#!/usr/bin/env bash
# A real Slurm cluster (munged, slurmctld, slurmd: Debian's slurm-wlm and munge) made for this test in a temporary
# directory, launching real corpc programs with srun and sbatch. Every task finds rank 0 through Slurm's own
# variables (SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, SLURM_JOB_ID: no MASTER_ADDR or
# MASTER_PORT); the batch script is the one docs/launching.md shows. Skipped (exit 77, which Meson reports as SKIP)
# when not root, when Slurm or munge is not installed, or when the daemons do not start (their logs are printed).
#   tests/slurm.sh RPC_HELLO DDP_TRAIN DDP_FAULT_TOLERANT PIPELINE_REPLICAS               one node (this host)
#   tests/slurm.sh --two-nodes RPC_HELLO DDP_TRAIN DDP_FAULT_TOLERANT PIPELINE_REPLICAS   two nodes: slurmctld and the clients in one
#       network namespace, a slurmd in each of two others, on a bridge (10.214.x.0/24; test_multihost's way), with
#       the node names in an /etc/hosts of this test's own mount namespace (needs iproute2 too)
set -uo pipefail
two=
if [[ ${1:-} == --two-nodes ]]; then two=1; shift; fi
hello=$1 ddp=$2 ft=$3 replicas=$4
name="slurm test${two:+ (two nodes)}"
skip() { echo "$name: skipped ($*)"; exit 77; }
fail() { echo "$name: FAIL: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || skip "the daemons need root"
for c in munged slurmctld slurmd srun sbatch sinfo scontrol python3 ${two:+ip unshare nsenter}; do
  command -v "$c" >/dev/null || skip "no $c: Debian's slurm-wlm and munge${two:+ (and iproute2)} are not installed"
done
# Two nodes: the whole test in a mount namespace of its own, where the nodes' names are bound into /etc/hosts.
if [[ -n $two && -z ${CORPC_SLURM_UNSHARED:-} ]]; then
  exec unshare --mount --propagation private env CORPC_SLURM_UNSHARED=1 "$0" --two-nodes "$@"
fi

work=$(mktemp -d /tmp/slurm-test.XXXXXX)
chmod 755 "$work"
# Every process the test starts (the daemons, slurmstepd, the clients, the tasks; not this shell) carries
# CORPC_SLURM_TEST=$work: what is left after the test is found by it.
mark=(env "CORPC_SLURM_TEST=$work")
leftovers() { grep -lsz "^CORPC_SLURM_TEST=$work\$" /proc/[0-9]*/environ | cut -d/ -f3 | grep -vx "$$" || true; }
daemons=()
namespaces=()
# The daemons stop in the reverse order of their start (slurmd and slurmctld still reach munged as they stop), each
# given 10 s; then whatever is left is killed.
teardown() {
  local i pid
  for ((i = ${#daemons[@]} - 1; i >= 0; i--)); do
    pid=${daemons[i]}
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null && echo "$name: daemon $pid did not stop on SIGTERM within 10 s: killed"
    wait "$pid" 2>/dev/null
  done
  daemons=()
  for pid in $(leftovers); do kill -KILL "$pid" 2>/dev/null; done
  for _ in $(seq 50); do [[ -z $(leftovers) ]] && break; sleep 0.1; done
  local n
  for n in "${namespaces[@]}"; do ip netns del "$n" 2>/dev/null; done
  namespaces=()
}
cleanup() {
  local status=$?
  teardown
  local left
  left=$(leftovers)
  if [[ -n $left ]]; then
    ps -o pid,args -p "${left//$'\n'/,}"
    echo "$name: FAIL: processes left after the test" >&2
    status=1
  fi
  rm -rf "$work"
  exit $status
}
trap cleanup EXIT
logs() { for f in "$work"/*.log; do echo "== $f"; tail -20 "$f"; done; }

# Whether exactly N lines of the last run's output match PREFIX (a sed pattern) followed by "parameter checksum X", all
# with one X: the workers that should hold the same parameters do.
same_checksums() {
  local n=$1 prefix=$2 sums
  sums=$(sed -n "s/^$prefix.*parameter checksum //p" "$work/out")
  [[ $(wc -l <<<"$sums") == "$n" && $(sort -u <<<"$sums" | wc -l) == 1 ]]
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# slurmctld runs only where its host name is SlurmctldHost's. One node: the node is named after this host too, ranks
# dial the first name in the node list, which must resolve to the node (as on a real cluster); NodeAddr is where
# slurmctld reaches slurmd. Two nodes: node1 and node2, at their namespaces' addresses.
host=$(hostname -s)
ctl_addr=127.0.0.1
in_ctl=()      # how a client or slurmctld runs: in the controller's namespace with two nodes
nodes=("$host")
node_lines="NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN"
if [[ -n $two ]]; then
  subnet=$((RANDOM % 250 + 1))
  prefix=corpc-slurm-$$
  addr() { echo "10.214.$subnet.$1"; }
  ctl_addr=$(addr 1)
  set -e
  {
    ip netns add "$prefix-sw" && namespaces+=("$prefix-sw")
    ip -n "$prefix-sw" link add br0 type bridge
    ip -n "$prefix-sw" link set br0 up
    i=0
    for ns in ctl node1 node2; do
      i=$((i + 1))
      ip netns add "$prefix-$ns" && namespaces+=("$prefix-$ns")
      ip -n "$prefix-$ns" link set lo up
      ip link add "cs$$-$i" type veth peer name eth0 netns "$prefix-$ns"
      ip link set "cs$$-$i" netns "$prefix-sw"
      ip -n "$prefix-sw" link set "cs$$-$i" master br0 up
      ip -n "$prefix-$ns" addr add "$(addr $i)/24" dev eth0
      ip -n "$prefix-$ns" link set eth0 up
    done
  } >"$work/netns.log" 2>&1 || { set +e; cat "$work/netns.log"; skip "cannot make network namespaces and veth pairs here"; }
  set +e
  { cat /etc/hosts; echo "$(addr 2) node1"; echo "$(addr 3) node2"; } >"$work/hosts"
  mount --bind "$work/hosts" /etc/hosts || skip "cannot bind an /etc/hosts of the test's own"
  # nsenter, not `ip netns exec`: that mounts a new /sys, without the cgroup file system slurmd needs.
  in_ctl=(nsenter --net=/run/netns/"$prefix-ctl")
  nodes=(node1 node2)
  extra_conf="SlurmdTimeout=10"
  node_lines="NodeName=node1 NodeAddr=$(addr 2) CPUs=4 State=UNKNOWN
NodeName=node2 NodeAddr=$(addr 3) CPUs=4 State=UNKNOWN"
fi
mkdir -p "$work/munge" "$work/state" "$work/spool"
chmod 700 "$work/munge"
head -c 1024 /dev/urandom >"$work/munge/munge.key"
chmod 400 "$work/munge/munge.key"
cat >"$work/slurm.conf" <<EOF
ClusterName=corpctest
SlurmctldHost=$host($ctl_addr)
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
${extra_conf:-}
$node_lines
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
"${mark[@]}" "${in_ctl[@]}" slurmctld -D -f "$work/slurm.conf" >"$work/slurmctld.out.log" 2>&1 &
daemons+=($!)
declare -A slurmd_pid
start_slurmd() {
  local node=$1 in_node=()
  # Each node its own host name too (a UTS namespace): Gloo, under DDP, finds its address by resolving it.
  [[ -n $two ]] && in_node=(nsenter --net=/run/netns/"$prefix-$node" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$node")
  mkdir -p "$work/spool/$node"
  "${mark[@]}" "${in_node[@]}" slurmd -D -N "$node" -f "$work/slurm.conf" >>"$work/slurmd-$node.out.log" 2>&1 &
  daemons+=($!)
  slurmd_pid[$node]=$!
}
# Whether every node is idle within 60 s.
nodes_idle() {
  local want
  want=$(printf 'idle\n%.0s' "${nodes[@]}")
  for _ in $(seq 300); do
    [[ $("${in_ctl[@]}" timeout 10 sinfo -h -N -o '%t' 2>/dev/null) == "$want" ]] && return 0
    for pid in "${daemons[@]}"; do kill -0 "$pid" 2>/dev/null || return 1; done  # a daemon that gave up
    sleep 0.2
  done
  return 1
}
for node in "${nodes[@]}"; do start_slurmd "$node"; done
ready=
nodes_idle && ready=1
[[ -n $ready ]] || {
  logs
  "${in_ctl[@]}" timeout 10 sinfo -N -l
  skip "slurmctld and slurmd did not bring the nodes up within 60 s"
}

export CORPC_SECRET=$RANDOM$RANDOM$RANDOM
# srun with a bound on the whole step (--time is in minutes: timeout ends the client, Slurm then the step).
run_srun() { "${mark[@]}" "${in_ctl[@]}" timeout 180 srun --time=3 "$@"; }

echo "$name: the nodes are idle ($SECONDS s)"
if [[ -n $two ]]; then
  # rpc_hello, 3 tasks on 2 nodes (block distribution: tasks 0 and 1 on node1, task 2 on node2): the answers, every
  # task exits 0, each where Slurm said.
  run_srun -N 2 -n 3 sh -c '"$0"; echo "task $SLURM_PROCID on $SLURMD_NODENAME exited $?"' "$hello" >"$work/out" 2>&1 ||
    { cat "$work/out"; logs; fail "rpc_hello under srun on two nodes"; }
  grep -q '^add on worker1: 5$' "$work/out" && grep -q '^counter on worker2: 15$' "$work/out" ||
    { cat "$work/out"; fail "rpc_hello's answers on two nodes"; }
  for t in "0 node1" "1 node1" "2 node2"; do
    grep -q "^task ${t% *} on ${t#* } exited 0$" "$work/out" || { cat "$work/out"; fail "task ${t% *} on ${t#* }"; }
  done
  echo "$name: srun rpc_hello ($SECONDS s)"

  # DDP (examples/ddp_train), 2 tasks on each node.
  run_srun -N 2 -n 4 "$ddp" 5 >"$work/out" 2>&1 || { cat "$work/out"; fail "ddp_train under srun on two nodes"; }
  grep -q '^ddp_train: 4 ranks, 5 steps, .*parameters identical$' "$work/out" || { cat "$work/out"; fail "ddp_train's output"; }
  echo "$name: srun ddp_train ($SECONDS s)"

  # Pipeline replicas (2 replicas of a 2-stage 1F1B pipeline, 5 tasks on the two nodes: srun's block distribution
  # puts the last task, a worker of position 1, on node2): each position's stage averaged over its replicas, the
  # workers at each position end with equal parameters.
  run_srun -N 2 -n 5 sh -c 'echo "task $SLURM_PROCID on $SLURMD_NODENAME"; exec "$0" "$@"' "$replicas" --replicas 2 \
    --stages 2 --steps 20 >"$work/out" 2>&1 || { cat "$work/out"; fail "pipeline_replicas under srun on two nodes"; }
  grep -q '^task 3 on node1$' "$work/out" && grep -q '^task 4 on node2$' "$work/out" ||
    { cat "$work/out"; fail "pipeline_replicas: the tasks are not where the test expects them"; }
  grep -q '^coordinator: 20 steps committed' "$work/out" || { cat "$work/out"; fail "pipeline_replicas' commits"; }
  for position in 0 1; do
    same_checksums 2 "worker [1-4] (replica [01], position $position): done, 20 steps committed, " ||
      { cat "$work/out"; fail "pipeline_replicas: the replicas' stage $position differs"; }
  done
  echo "$name: srun pipeline_replicas ($SECONDS s)"

  # The batch script of docs/launching.md on two nodes.
  cat >"$work/job.sh" <<EOF
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks=3
#SBATCH --time=5
export CORPC_SECRET=\$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')
srun $hello
EOF
  "${mark[@]}" "${in_ctl[@]}" timeout 180 sbatch --wait -o "$work/batch.out" "$work/job.sh" >"$work/out" 2>&1 ||
    { cat "$work/out" "$work/batch.out"; fail "the batch job on two nodes"; }
  grep -q '^counter on worker2: 15$' "$work/batch.out" || { cat "$work/batch.out"; fail "the batch job's output"; }
  echo "$name: sbatch ($SECONDS s)"

  # A node that fails (every process in node2's network namespace killed: its slurmd, slurmstepd, tasks) while
  # fault-tolerant DDP without replacements runs there: 4 tasks, block distribution (tasks 0-2 on node1, 3 on
  # node2), 400 steps of 50 ms or more. slurmctld would mark node2 down once it stops answering (SlurmdTimeout, 10 s
  # here, and its ping period: about 30 s in all); the test marks it down itself (scontrol, reason "failed") at once
  # after the kill, which takes the path slurmctld's detection takes (the jobs on the node are killed, unless
  # --no-kill), and saves that wait.
  node2_net=$(stat -L -c %i /run/netns/"$prefix-node2")
  fail_node2_during() {  # srun's extra flags: runs the job, kills node2 once every trainer ran a step, waits for srun
    "${mark[@]}" "${in_ctl[@]}" timeout 300 srun --time=5 -N 2 -n 4 "$@" "$ft" --trainers 3 --steps 400 \
      --pause-ms 50 --no-replacements >"$work/out" 2>&1 &
    local srun_pid=$! p
    for _ in $(seq 600); do [[ $(grep -c '^trainer [123]: step 0, epoch 1' "$work/out") == 3 ]] && break; sleep 0.1; done
    for p in /proc/[0-9]*; do
      [[ $(readlink "$p/ns/net" 2>/dev/null) == "net:[$node2_net]" ]] && kill -KILL "${p#/proc/}" 2>/dev/null
    done
    wait "${slurmd_pid[node2]}"  # no longer a daemon to stop (nodes_idle would take it for one that gave up)
    local alive=()
    for p in "${daemons[@]}"; do [[ $p == "${slurmd_pid[node2]}" ]] || alive+=("$p"); done
    daemons=("${alive[@]}")
    "${in_ctl[@]}" timeout 10 scontrol update NodeName=node2 State=DOWN Reason=failed
    down_while_running=
    while kill -0 $srun_pid 2>/dev/null; do
      if [[ $("${in_ctl[@]}" timeout 10 sinfo -h -N -n node2 -o '%t' 2>/dev/null) == down* ]]; then
        down_while_running=1
        break
      fi
      sleep 0.5
    done
    wait $srun_pid
  } 2>/dev/null  # bash's own "Killed" line for node2's slurmd
  # srun's defaults: slurmctld cancels the step when it marks node2 down, and the survivors on node1 with it.
  fail_node2_during
  status=$?
  [[ $status != 0 ]] || { cat "$work/out"; fail "a node failure with srun's defaults gave status 0"; }
  grep -q 'CANCELLED AT .* DUE TO NODE FAILURE' "$work/out" || { cat "$work/out"; fail "the step was not cancelled for the node"; }
  grep -q '^coordinator: 400 steps committed' "$work/out" && { cat "$work/out"; fail "the job ran to its end"; }
  echo "$name: a failed node, srun's defaults: the step is cancelled ($SECONDS s)"
  # --no-kill: the step keeps its survivors, which train on to step 400 without the lost node's trainer.
  start_slurmd node2  # ReturnToService=2: the node is idle again once its slurmd registers
  nodes_idle || { logs; fail "node2 did not come back"; }
  fail_node2_during --no-kill
  status=$?
  [[ -n $down_while_running ]] || { cat "$work/out"; fail "the job ended before slurmctld marked node2 down (status $status)"; }
  grep -q '^coordinator: 400 steps committed' "$work/out" || { cat "$work/out"; fail "the survivors did not reach step 400 (status $status)"; }
  same_checksums 2 "trainer [123]: done, 400 steps committed, " ||
    { cat "$work/out"; fail "not two survivors with equal parameters at step 400 (status $status)"; }
  echo "$name: a failed node, --no-kill: the survivors train on, srun's status $status ($SECONDS s)"

  # A missing node: three nodes asked of this two-node cluster; with --immediate srun gives up at once.
  run_srun --immediate -N 3 -n 3 "$hello" >"$work/out" 2>&1 &&
    { cat "$work/out"; fail "three nodes of a two-node cluster gave status 0"; }
  grep -q 'Unable to allocate resources' "$work/out" || { cat "$work/out"; fail "srun's refusal"; }
  echo "$name: a missing node ($SECONDS s)"
  teardown
  echo "$name: passed ($SECONDS s)"
  exit 0
fi
# rpc_hello, 3 tasks: the right answers once (one job, not one per task), every task exits 0.
run_srun -n 3 sh -c '"$0"; echo "task $SLURM_PROCID exited $?"' "$hello" >"$work/out" 2>&1 ||
  { cat "$work/out"; logs; fail "rpc_hello under srun"; }
grep -q '^add on worker1: 5$' "$work/out" && grep -q '^counter on worker2: 15$' "$work/out" ||
  { cat "$work/out"; fail "rpc_hello's answers under srun"; }
[[ $(grep -c 'counter on worker2: 15' "$work/out") == 1 ]] || { cat "$work/out"; fail "one job, not one per task"; }
for r in 0 1 2; do grep -q "^task $r exited 0$" "$work/out" || { cat "$work/out"; fail "task $r's exit status"; }; done

echo "$name: srun rpc_hello ($SECONDS s)"
# DDP (examples/ddp_train), 4 tasks: every task's parameters equal rank 0's (the program checks), status 0.
run_srun -n 4 "$ddp" 5 >"$work/out" 2>&1 || { cat "$work/out"; fail "ddp_train under srun"; }
grep -q '^ddp_train: 4 ranks, 5 steps, .*parameters identical$' "$work/out" || { cat "$work/out"; fail "ddp_train's output"; }

echo "$name: srun ddp_train ($SECONDS s)"
# Fault-tolerant DDP (examples/ddp_fault_tolerant): a coordinator and 3 trainers, 20 steps, no faults.
run_srun -n 4 "$ft" --trainers 3 --steps 20 >"$work/out" 2>&1 || { cat "$work/out"; fail "ddp_fault_tolerant under srun"; }
grep -q '^coordinator: 20 steps committed' "$work/out" || { cat "$work/out"; fail "ddp_fault_tolerant's output"; }
[[ $(grep -c '^trainer [123]: done, 20 steps committed' "$work/out") == 3 ]] || { cat "$work/out"; fail "the trainers' ends"; }

echo "$name: srun ddp_fault_tolerant ($SECONDS s)"
# Fault-tolerant DDP with a trainer lost and not replaced (srun starts no task again): trainer 2 kills itself at step
# 20, the coordinator and the two survivors train on to step 40 and exit 0, the survivors' parameters equal; srun's
# defaults leave the other tasks running and its status is the killed task's.
run_srun -n 4 "$ft" --trainers 3 --steps 40 --kill-every 20 --no-replacements >"$work/out" 2>&1
status=$?
[[ $status != 0 ]] || { cat "$work/out"; fail "a step with a killed trainer gave status 0"; }
grep -q '^trainer 2: killing itself at the start of step 20$' "$work/out" || { cat "$work/out"; fail "trainer 2 was not killed"; }
grep -q 'task 2: Killed' "$work/out" || { cat "$work/out"; fail "srun does not report the killed task"; }
grep -q '^coordinator: 40 steps committed' "$work/out" || { cat "$work/out"; fail "the coordinator did not commit 40 steps"; }
same_checksums 2 "trainer [13]: done, 40 steps committed, " ||
  { cat "$work/out"; fail "the survivors did not both end at step 40 with equal parameters"; }
grep -q '^trainer 2: done' "$work/out" && { cat "$work/out"; fail "the killed trainer came back"; }

echo "$name: srun ddp_fault_tolerant, a trainer lost, the survivors train on ($SECONDS s)"
# The batch script docs/launching.md shows (the program's path aside), through sbatch --wait.
cat >"$work/job.sh" <<EOF
#!/bin/bash
#SBATCH --ntasks=3
#SBATCH --time=5
export CORPC_SECRET=\$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')
srun $hello
EOF
"${mark[@]}" "${in_ctl[@]}" timeout 180 sbatch --wait -o "$work/batch.out" "$work/job.sh" >"$work/out" 2>&1 || { cat "$work/out" "$work/batch.out"; fail "the batch job"; }
grep -q '^counter on worker2: 15$' "$work/batch.out" || { cat "$work/batch.out"; fail "the batch job's output"; }

echo "$name: sbatch ($SECONDS s)"
# A wrong task count: 2 tasks of a 3-rank program fail at once, naming Slurm's variable.
run_srun -n 2 "$hello" >"$work/out" 2>&1 && { cat "$work/out"; fail "SLURM_NTASKS=2 for a 3-rank program gave status 0"; }
grep -q 'SLURM_NTASKS=2 ranks; start it with 3' "$work/out" || { cat "$work/out"; fail "the task count mismatch is not named"; }

# A missing node: two nodes asked of this one-node cluster. Slurm queues such a job (a node may come); with
# --immediate srun gives up at once, and nothing starts.
run_srun --immediate -N 2 -n 3 "$hello" >"$work/out" 2>&1 &&
  { cat "$work/out"; fail "two nodes of a one-node cluster gave status 0"; }
grep -q 'Unable to allocate resources' "$work/out" || { cat "$work/out"; fail "srun's refusal"; }

echo "$name: a wrong task count, a missing node ($SECONDS s)"
# A rank 0 that never comes up (task 0 sleeps instead of starting corpc): the other tasks give up within their init
# timeout (CORPC_INIT_TIMEOUT_MS, 3 s here; srun passes the environment on), naming where rank 0's address came
# from; -K1 ends the step at the first one (the other may not have said it yet), the sleeping task included.
CORPC_INIT_TIMEOUT_MS=3000 run_srun -n 3 --kill-on-bad-exit=1 sh -c '[ "$SLURM_PROCID" = 0 ] && exec sleep 100; exec "$0"' \
  "$hello" >"$work/out" 2>&1 && { cat "$work/out"; fail "a job whose rank 0 never came up gave status 0"; }
grep -q "^rpc_hello: rank [12]: could not reach rank 0 at $host:[0-9]* (the first host of SLURM_STEP_NODELIST, a port derived from SLURM_JOB_ID) within the init timeout" "$work/out" ||
  { cat "$work/out"; fail "no task says that rank 0 never came up, naming Slurm's variables"; }

echo "$name: a rank 0 that never comes up ($SECONDS s)"
# A task that fails, with srun's defaults: the other tasks run on to their own end (here 2 s), srun then fails with
# the failed task's status. (A corpc rank lost after rendezvous fails its peers' calls to it with ConnectionError;
# one lost before leaves them waiting up to init_timeout: docs/launching.md.)
run_srun -n 3 sh -c 'if [ "$SLURM_PROCID" = 1 ]; then exit 3; fi; sleep 2; echo "task $SLURM_PROCID ran on"' \
  >"$work/out" 2>&1
status=$?
[[ $status == 3 ]] || { cat "$work/out"; fail "srun's status for a task that exited 3: $status"; }
[[ $(grep -c '^task [02] ran on$' "$work/out") == 2 ]] || { cat "$work/out"; fail "the other tasks did not run on"; }
grep -q 'task 1: Exited with exit code 3' "$work/out" || { cat "$work/out"; fail "srun's report of the failed task"; }

echo "$name: a failed task, srun's defaults ($SECONDS s)"
# A task that dies (task 1 killed before it starts corpc), with --kill-on-bad-exit: srun ends the step and fails.
run_srun -n 3 --kill-on-bad-exit=1 sh -c '[ "$SLURM_PROCID" = 1 ] && kill -KILL $$; exec "$0"' "$hello" >"$work/out" 2>&1 &&
  { cat "$work/out"; fail "a step with a killed task gave status 0"; }
grep -q 'task 1: Killed' "$work/out" || { cat "$work/out"; fail "the killed task is not reported"; }

echo "$name: a killed task ($SECONDS s)"
# --no-kill is about nodes: a task that dies still ends the step when --kill-on-bad-exit asks for it (the two-node
# test shows what --no-kill does for a failed node).
run_srun -n 3 --no-kill --kill-on-bad-exit=1 sh -c '[ "$SLURM_PROCID" = 1 ] && kill -KILL $$; exec sleep 60' \
  >"$work/out" 2>&1 && { cat "$work/out"; fail "--no-kill -K1 with a killed task gave status 0"; }
grep -q 'task 1: Killed' "$work/out" && grep -q 'STEP .* CANCELLED AT' "$work/out" ||
  { cat "$work/out"; fail "--no-kill -K1 let the step run on"; }

echo "$name: a killed task, --no-kill --kill-on-bad-exit=1 ($SECONDS s)"
teardown
echo "$name: passed ($SECONDS s)"
