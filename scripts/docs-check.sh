#!/usr/bin/env bash
# Checks that no public header is over a third comment lines (scripts/header-prose.py --check; its
# KNOWN ones are notes), then README.md and docs/ (scripts/docs_check.py): every C++ block compiled
# against the installed package in one translation unit, the programs marked <!-- run --> and the
# shell blocks marked <!-- runnable --> run, every relative link and anchor resolved; a failure
# names FILE.md:LINE.
# Reuses a Release build (MGPU_BUILD_DIR, default build/release, which scripts/test.sh made: its
# examples run the shell blocks) and, when MGPU_PREFIX names one, an mgpu already installed from it
# (CI: the consumers stage's); otherwise installs it into build/docs-check/prefix.
#   scripts/docs-check.sh [--no-run] [--no-compile] [--no-links] [FILE.md ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 scripts/header-prose.py --check
exec python3 scripts/docs_check.py "$@"
