#!/usr/bin/env bash
# Builds the API reference with Doxygen (docs/Doxyfile) from the public headers under include/mgpu
# into build/docs/html (open build/docs/html/index.html). Fails, printing them, on any Doxygen
# warning (build/docs/warnings.txt). Installs doxygen through scripts/setup.sh when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v doxygen >/dev/null || scripts/setup.sh
rm -rf build/docs
mkdir -p build/docs
start=$SECONDS
status=0
doxygen docs/Doxyfile || status=$?
if [ -s build/docs/warnings.txt ] || [ "$status" -ne 0 ]; then
  cat build/docs/warnings.txt >&2 2>/dev/null || true
  echo "docs: Doxygen warned about the public API (above); build/docs/html is incomplete" >&2
  exit 1
fi
echo "docs: build/docs/html/index.html ($((SECONDS - start)) s)"
