#!/bin/sh
# kill_process.sh VICTIM SECONDS MPIRUN... -- COMMAND...: runs COMMAND in every process of an MPI
# job started by MPIRUN with --enable-recovery (so that mpirun leaves the others running when one
# dies), and kills (SIGKILL) process VICTIM SECONDS after it starts. Every other process prints
# "process P exited with status S"; the script exits with the highest of those statuses (mpirun's
# own is 0 under --enable-recovery), or 1 when none was recorded.
set -u
if [ "$1" = "--inner" ]; then  # in each process, started by mpirun
  victim=$2 seconds=$3 statuses=$4
  shift 4
  if [ "$OMPI_COMM_WORLD_RANK" = "$victim" ]; then
    (sleep "$seconds" && kill -9 $$) &
    exec "$@"  # the same process id: the kill reaches COMMAND
  fi
  "$@"
  status=$?
  echo "process $OMPI_COMM_WORLD_RANK exited with status $status"
  echo "$status" >"$statuses/$OMPI_COMM_WORLD_RANK"
  exit "$status"
fi
victim=$1 seconds=$2
shift 2
statuses=$(mktemp -d)
n=$#
for arg; do  # "--" becomes the inner call of this script
  if [ "$arg" = "--" ]; then
    set -- "$@" --enable-recovery sh "$0" --inner "$victim" "$seconds" "$statuses"
  else
    set -- "$@" "$arg"
  fi
done
shift "$n"
"$@"
worst=""
for file in "$statuses"/*; do
  [ -f "$file" ] || continue
  status=$(cat "$file")
  if [ -z "$worst" ] || [ "$status" -gt "$worst" ]; then worst=$status; fi
done
rm -rf "$statuses"
exit "${worst:-1}"
