#!/bin/sh
# kill_process.sh VICTIM PATTERN MPIRUN... -- COMMAND...: runs COMMAND in every process of an MPI
# job started by MPIRUN with --enable-recovery (so that mpirun leaves the others running when one
# dies; a launcher named srun is left as it is: srun without --kill-on-bad-exit does not end the
# others, though under --mpi=pmix Slurm's PMIx plugin cancels the step once a task dies),
# and kills (SIGKILL) process VICTIM once another process has printed a line matching the
# extended regular expression PATTERN (or after 60 s without one). Every other process prints
# "process P exited with status S", and the script "process VICTIM was killed S s before the job
# ended"; it exits with the highest of those statuses (mpirun's own is 0 under --enable-recovery),
# or 1 when none was recorded.
set -u
if [ "$1" = "--inner" ]; then  # in each process, started by mpirun
  victim=$2 pattern=$3 work=$4
  shift 4
  rank=${OMPI_COMM_WORLD_RANK:-$SLURM_PROCID}
  if [ "$rank" = "$victim" ]; then
    (
      waited=0
      while [ ! -f "$work/go" ] && [ "$waited" -lt 600 ]; do
        sleep 0.1
        waited=$((waited + 1))
      done
      date +%s >"$work/killed"
      kill -9 $$
    ) &
    exec "$@"  # the same process id: the kill reaches COMMAND
  fi
  { "$@"; echo "$?" >"$work/$rank"; } 2>&1 | while IFS= read -r line; do
    printf '%s\n' "$line"
    if printf '%s\n' "$line" | grep -Eq -- "$pattern"; then touch "$work/go"; fi
  done
  status=$(cat "$work/$rank" 2>/dev/null || echo 1)
  echo "process $rank exited with status $status"
  exit "$status"
fi
victim=$1 pattern=$2
shift 2
work=$(mktemp -d)
n=$#
recovery=--enable-recovery
for arg; do
  [ "$arg" = "--" ] && break
  case $arg in srun | */srun) recovery="" ;; esac
done
for arg; do  # "--" becomes the inner call of this script
  if [ "$arg" = "--" ]; then
    # shellcheck disable=SC2086
    set -- "$@" $recovery sh "$0" --inner "$victim" "$pattern" "$work"
  else
    set -- "$@" "$arg"
  fi
done
shift "$n"
"$@"
[ -f "$work/killed" ] && echo "process $victim was killed $(($(date +%s) - $(cat "$work/killed"))) s before the job ended"
worst=""
for file in "$work"/[0-9]*; do
  [ -f "$file" ] || continue
  status=$(cat "$file")
  if [ -z "$worst" ] || [ "$status" -gt "$worst" ]; then worst=$status; fi
done
rm -rf "$work"
exit "${worst:-1}"
