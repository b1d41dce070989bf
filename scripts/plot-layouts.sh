#!/usr/bin/env bash
# Renders bench_gpt's BM_gpt_layouts rows (its Google Benchmark JSON; the medians when it holds
# repetitions) as a PNG: each layout's peak bytes per device with the memory model's prediction
# (a black mark) where there is one, beside its tokens/s. Uses matplotlib from the scripts' own venv (scripts/venv.sh
# plot, pinned in scripts/requirements/plot.txt; CI does not run this script).
# Usage: scripts/plot-layouts.sh bench_gpt.json layouts.png ["title"]
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 bench_gpt.json layouts.png [title]" >&2; exit 2; }
py=$(cd "$(dirname "$0")/.." && scripts/venv.sh plot)
"$py" - "$1" "$2" "${3:-}" <<'PY'
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

source, target, title = sys.argv[1], sys.argv[2], sys.argv[3]
with open(source) as f:
    rows = [b for b in json.load(f)["benchmarks"] if b["name"].startswith("BM_gpt_layouts/")]
if any(r.get("run_type") == "aggregate" for r in rows):  # repetitions: their medians
    rows = [r for r in rows if r.get("aggregate_name") == "median"]
if not rows:
    sys.exit(f"{source}: no BM_gpt_layouts rows (expected bench_gpt's JSON output)")
labels = [r["label"].split(", ", 1)[1] for r in rows]
peaks = [r["peak_bytes_device"] / 2**20 for r in rows]
speeds = [r["tokens_per_s"] / 1e3 for r in rows]
fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.8), dpi=100, sharey=True)
y = range(len(rows))
left.barh(y, peaks, color="tab:blue", label="measured")
predicted = [(i, r["predicted_peak_bytes_device"] / 2**20) for i, r in enumerate(rows) if "predicted_peak_bytes_device" in r]
if predicted:
    left.scatter([p for _, p in predicted], [i for i, _ in predicted], marker="|", s=200, color="black", label="predicted")
    left.legend(fontsize=7, loc="lower right")
left.set_yticks(list(y), labels, fontsize=8)
left.invert_yaxis()
left.set_xlabel("peak MiB per device (allocator)")
right.barh(y, speeds, color="tab:green")
right.set_xlabel("thousand tokens/s")
for ax in (left, right):
    ax.grid(axis="x", alpha=0.3)
if title:
    fig.suptitle(title, fontsize=10)
fig.tight_layout()
fig.savefig(target)
print(f"wrote {target}")
PY
