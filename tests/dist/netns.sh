#!/bin/sh
# netns.sh MPIEXEC PROGRAM ARGS...: "another server" on one machine. Makes two network namespaces
# joined by a veth pair (each its own address, nothing else shared on the network), starts mpirun
# in the first with one process per namespace (OpenMPI's rsh launcher, whose agent enters the second
# namespace instead of ssh-ing into a server), MPI over TCP only, and runs PROGRAM ARGS there.
# With MPIEXEC "torchrun" it starts PROGRAM ARGS as a torchrun-style job instead, process 0 in the
# first namespace (MASTER_ADDR its address), process 1 in the second: the rendezvous and Gloo over
# the veth pair.
# Passes when the job passes and its two processes ran in different namespaces. Exits 77 (ctest:
# skipped) with the reason where namespaces cannot be made (not root, no iproute2, no permission).
set -u
mpiexec=$1
shift
if ! command -v ip >/dev/null 2>&1; then
  echo "netns: skipped: no ip command (Debian: iproute2)"
  exit 77
fi
id=$$
a=mgpu_a$id
b=mgpu_b$id
work=$(mktemp -d)
cleanup() {
  ip netns del "$a" 2>/dev/null
  ip netns del "$b" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
if ! ip netns add "$a" 2>"$work/error"; then
  echo "netns: skipped: cannot make a network namespace here: $(cat "$work/error")"
  exit 77
fi
subnet=10.213.$((id % 250)).0/24
prefix=10.213.$((id % 250))
set -e
ip netns add "$b"
ip link add "va$id" type veth peer name "vb$id"
ip link set "va$id" netns "$a"
ip link set "vb$id" netns "$b"
ip -n "$a" addr add "$prefix.1/24" dev "va$id"
ip -n "$b" addr add "$prefix.2/24" dev "vb$id"
for ns in "$a" "$b"; do
  ip -n "$ns" link set lo up
done
ip -n "$a" link set "va$id" up
ip -n "$b" link set "vb$id" up
# The launcher's agent: called as `agent HOST COMMAND...` for the second "server", it runs the
# command line (which OpenMPI quotes for a remote shell) in that server's namespace.
cat >"$work/agent" <<EOF
#!/bin/sh
shift
exec ip netns exec $b sh -c "\$*"
EOF
chmod +x "$work/agent"
set +e
if [ "$mpiexec" = torchrun ]; then
  for rank in 0 1; do
    ns=$a
    [ "$rank" = 1 ] && ns=$b
    RANK=$rank LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 MASTER_ADDR=$prefix.1 MASTER_PORT=29500 \
      ip netns exec "$ns" sh -c 'echo "netns: process in network namespace $(readlink /proc/self/ns/net)"; exec "$@"' sh "$@" \
      >"$work/out$rank" 2>&1 &
    eval "pid$rank=\$!"
  done
  status=0
  # shellcheck disable=SC2154
  wait "$pid0" || status=$?
  # shellcheck disable=SC2154
  wait "$pid1" || status=$?
  output=$(cat "$work/out0" "$work/out1")
else
output=$(ip netns exec "$a" "$mpiexec" --allow-run-as-root --oversubscribe -np 2 --host "$prefix.1,$prefix.2" \
  --mca plm_rsh_agent "$work/agent" --mca btl tcp,self --mca btl_tcp_if_include "$subnet" \
  --mca oob_tcp_if_include "$subnet" \
  sh -c 'echo "netns: process in network namespace $(readlink /proc/self/ns/net)"; exec "$@"' sh "$@" 2>&1)
status=$?
fi
printf '%s\n' "$output"
if [ "$status" -ne 0 ]; then
  echo "netns: FAILED: the job exited with status $status"
  exit 1
fi
namespaces=$(printf '%s\n' "$output" | sed -n 's/^netns: process in network namespace //p' | sort -u | wc -l)
if [ "$namespaces" -ne 2 ]; then
  echo "netns: FAILED: the processes ran in $namespaces network namespace(s) (expected 2)"
  exit 1
fi
echo "netns: passed: 2 processes in 2 network namespaces, $([ "$mpiexec" = torchrun ] && echo "the rendezvous and Gloo" || echo MPI) over TCP between $prefix.1 and $prefix.2"
