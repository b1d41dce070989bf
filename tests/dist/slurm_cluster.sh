#!/bin/sh
# slurm_cluster.sh COMMAND...: runs COMMAND in a one-node Slurm cluster on this machine and stops
# the cluster after it (also when COMMAND fails, or the script is interrupted or killed): exits
# with COMMAND's status. The cluster, all under a fresh folder in /tmp (its own munge key and
# socket, ports that were free, its state, spool and logs; nothing under /etc is read or written):
# munged, slurmctld and slurmd run as root, the node "localhost" at 127.0.0.1 with `nproc` CPUs in
# the default partition. COMMAND gets SLURM_CONF (so srun, sbatch and squeue reach this cluster),
# MGPU_SLURM_DIR (the folder) and MGPU_SLURM_CPUS. Exits 77 (ctest: skipped) with the reason
# where no cluster can be started: not root, or Slurm or munge not installed (scripts/setup.sh
# installs slurm-wlm and munge where it can). A daemon that does not start is a failure, with
# its log.
#   sh tests/dist/slurm_cluster.sh bash    # a shell with a cluster, e.g. to try srun --mpi=pmix
#
# Debian 12's slurm-wlm (22.05) without systemd or cgroups runs with ProctrackType=
# proctrack/linuxproc and TaskPlugin=task/none (no binding: host devices are threads of a task);
# EnforcePartLimits=ALL refuses at once a job the node cannot hold (without it a job of more tasks
# than CPUs and no --overcommit waits forever).
set -u
if [ "${1:-}" = "--watch" ]; then  # --watch PID DIR: stops the cluster in DIR once PID is gone
  while kill -0 "$2" 2>/dev/null && [ -d "$3" ]; do sleep 1; done
  [ -d "$3" ] && exec sh "$0" --stop "$3"
  exit 0
fi
if [ "${1:-}" = "--stop" ]; then  # --stop DIR: stops the cluster in DIR and removes DIR
  work=$2
  if [ -f "$work/slurm.conf" ] && command -v squeue >/dev/null 2>&1; then
    # Jobs first, so that no slurmstepd outlives its slurmd.
    export SLURM_CONF="$work/slurm.conf"
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      timeout 10 scancel $jobs 2>/dev/null
      waited=0
      while [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null)" ] && [ "$waited" -lt 20 ]; do
        sleep 0.5
        waited=$((waited + 1))
      done
    fi
  fi
  # The daemons this script started (their pid files), then anything still holding a file in DIR
  # (a slurmstepd, a task): TERM, and KILL after 5 s.
  ours() {
    for name in slurmd slurmctld munged; do
      [ -f "$work/$name.pid" ] && cat "$work/$name.pid"
    done
    for fd in /proc/[0-9]*/fd/* /proc/[0-9]*/cwd; do
      case $(readlink "$fd" 2>/dev/null) in
        "$work"/*) pid=${fd#/proc/}; echo "${pid%%/*}" ;;
      esac
    done
  }
  for signal in TERM KILL; do
    pids=$(ours | grep -vx "$$" | sort -u)
    [ -z "$pids" ] && break
    # shellcheck disable=SC2086
    kill -s "$signal" $pids 2>/dev/null
    waited=0
    while [ "$waited" -lt 50 ]; do
      alive=""
      for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ -z "$alive" ] && break
      sleep 0.1
      waited=$((waited + 1))
    done
    for name in slurmd slurmctld munged; do
      pid=$(cat "$work/$name.pid" 2>/dev/null) && ! kill -0 "$pid" 2>/dev/null && rm -f "$work/$name.pid"
    done
  done
  rm -rf "$work"
  exit 0
fi

skip() { echo "slurm: skipped: $*"; status=77; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "not root (slurmd and munged run as root here)"
for program in munged munge slurmctld slurmd srun sbatch squeue scancel sinfo; do
  command -v "$program" >/dev/null 2>&1 ||
    skip "no $program (Debian: slurm-wlm and munge, in scripts/setup.sh's optional packages)"
done
# munged checks that every folder above its socket is searchable by all: a folder under /tmp.
work=$(mktemp -d /tmp/mgpu-slurm.XXXXXX) || exit 1
chmod 755 "$work"
mkdir -p "$work/munge" "$work/state" "$work/spool" "$work/log" "$work/tmp"
chmod 755 "$work/munge"
setsid sh "$0" --watch $$ "$work" </dev/null >/dev/null 2>&1 &
watcher=$!
status=1
child=""
# shellcheck disable=SC2317  # the trap's
finish() {
  trap - EXIT INT TERM HUP
  [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
  if [ "$status" -ne 0 ] && [ "$status" -ne 77 ]; then
    for name in munged slurmctld slurmd; do  # a daemon's output before it opened its log
      log="$work/log/$name.log"
      [ -s "$log" ] || log="$work/log/$name.out"
      [ -s "$log" ] || continue
      echo "slurm: the last lines of $log:"
      tail -n 20 "$log"
    done
  fi
  sh "$0" --stop "$work"
  kill "$watcher" 2>/dev/null
  echo "slurm: the cluster is stopped"
  exit "$status"
}
trap finish EXIT
trap 'status=130; exit 130' INT
trap 'status=143; exit 143' TERM HUP
fail() { echo "slurm: FAILED: $*"; status=1; exit 1; }

# munge: a key of this cluster's own, its own socket.
head -c 1024 /dev/urandom >"$work/munge/munge.key"
chmod 400 "$work/munge/munge.key"
munged --foreground --key-file="$work/munge/munge.key" --socket="$work/munge/socket" \
  --pid-file="$work/munge/munged.pid" --seed-file="$work/munge/seed" --log-file="$work/log/munged.log" \
  >>"$work/log/munged.out" 2>&1 &
echo $! >"$work/munged.pid"
waited=0
until munge -n -S "$work/munge/socket" 2>/dev/null | unmunge -S "$work/munge/socket" >/dev/null 2>&1; do
  kill -0 "$(cat "$work/munged.pid")" 2>/dev/null || fail "munged exited"
  [ "$waited" -lt 100 ] || fail "munged did not answer within 10 s"
  sleep 0.1
  waited=$((waited + 1))
done

port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
cpus=$(nproc)
cat >"$work/slurm.conf" <<EOF
ClusterName=mgpu
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(port)
SlurmdPort=$(port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge/socket
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
TmpFS=$work/tmp
SlurmctldPidFile=$work/state/slurmctld.pid
SlurmdPidFile=$work/spool/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
EnforcePartLimits=ALL
MpiDefault=none
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$work/slurm.conf"
if ! srun --mpi=list 2>&1 | grep -qw pmix; then
  skip "Slurm has no PMIx plugin (srun --mpi=list: $(srun --mpi=list 2>&1 | tr '\n' ' '))"
fi
# Launched from inside a Slurm job, its variables would point srun at that job.
for variable in $(env | sed -n 's/^\(SLURM_[A-Za-z0-9_]*\)=.*/\1/p'); do
  [ "$variable" = SLURM_CONF ] || unset "$variable"
done
slurmctld -D -f "$SLURM_CONF" >>"$work/log/slurmctld.out" 2>&1 &
echo $! >"$work/slurmctld.pid"
slurmd -D -f "$SLURM_CONF" -N localhost >>"$work/log/slurmd.out" 2>&1 &
echo $! >"$work/slurmd.pid"
waited=0
until [ "$(sinfo -h -n localhost -o %T 2>/dev/null)" = idle ]; do
  for name in slurmctld slurmd; do
    kill -0 "$(cat "$work/$name.pid")" 2>/dev/null || fail "$name exited"
  done
  [ "$waited" -lt 60 ] || fail "the node is not idle after 30 s (sinfo: $(sinfo 2>&1 | tr '\n' ' '))"
  sleep 0.5
  waited=$((waited + 1))
done
echo "slurm: a one-node cluster (localhost, $cpus CPUs, $(slurmd -V)) in $work"
export MGPU_SLURM_DIR="$work" MGPU_SLURM_CPUS="$cpus"
# In the background, so that a signal runs the trap at once (the shell waits for a command in the
# foreground before it runs a trap); on the same standard input.
exec 3<&0
"$@" <&3 3<&- &
child=$!
wait "$child"
status=$?
child=""
exit "$status"
