#!/bin/sh
# torchrun.sh STARTED WORLD_SIZE -- COMMAND...: starts processes 0 to STARTED-1 of a torchrun-style
# job of WORLD_SIZE processes on this machine (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
# MASTER_ADDR=localhost and a free MASTER_PORT in each one's environment), as torchrun would, and
# waits for them. Exits 0 when every one did; else prints which failed and exits 1. Starting fewer
# than WORLD_SIZE leaves the job waiting for the missing ones (the deadline case).
started=$1
size=$2
shift 3
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
pids=""
rank=0
while [ "$rank" -lt "$started" ]; do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$size LOCAL_WORLD_SIZE=$size MASTER_ADDR=localhost MASTER_PORT=$port \
    "$@" &
  pids="$pids $!"
  rank=$((rank + 1))
done
failed=0
rank=0
for pid in $pids; do
  wait "$pid"
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "torchrun.sh: process $rank exited with status $status"
    failed=1
  fi
  rank=$((rank + 1))
done
exit "$failed"
