#!/usr/bin/env bash
# Makes, once, a Python virtual environment of the scripts' own in build/venv/NAME, installs the
# pinned requirements of scripts/requirements/NAME.txt into it (when that file exists), and prints
# its interpreter. Nothing is ever installed into the system's Python.
#   py=$(scripts/venv.sh NAME)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: $0 NAME" >&2; exit 2; }
scripts/setup.sh >&2  # python3 and python3-venv
dir=${MGPU_VENV_DIR:-$PWD/build/venv}/$1
requirements=scripts/requirements/$1.txt
[ -x "$dir/bin/python" ] || python3 -m venv "$dir" >&2
if [ -f "$requirements" ] && ! cmp -s "$requirements" "$dir/requirements.txt"; then
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
  cp "$requirements" "$dir/requirements.txt"
fi
echo "$dir/bin/python"
