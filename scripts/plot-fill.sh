#!/usr/bin/env bash
# Renders the fill experiment's CSV (schedule_jobs --experiment fill --csv FILE) as a PNG: the
# unallocated GPU share against the arrived GPU demand, one line per policy (and tie rule, when
# the CSV has several), the migration policies dash-dotted and the offline bound as a dashed line. Uses matplotlib from the scripts' own venv (scripts/venv.sh plot, pinned in
# scripts/requirements/plot.txt; CI does not run this script).
# Usage: scripts/plot-fill.sh fill.csv fill.png ["title"]
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 fill.csv fill.png [title]" >&2; exit 2; }
py=$(cd "$(dirname "$0")/.." && scripts/venv.sh plot)
"$py" - "$1" "$2" "${3:-}" <<'PY'
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

source, target, title = sys.argv[1], sys.argv[2], sys.argv[3]
lines = {}
with open(source, newline="") as f:
    rows = list(csv.DictReader(f))
if not rows:
    sys.exit(f"{source}: no rows (expected the CSV of schedule_jobs --experiment fill)")
ties = {r["tie"] for r in rows}
for r in rows:
    label = r["policy"] if len(ties - {"-"}) <= 1 or r["policy"] == "bound" else f'{r["policy"]} ({r["tie"]})'
    lines.setdefault(label, ([], []))
    lines[label][0].append(100 * float(r["arrived"]))
    lines[label][1].append(100 * float(r["unallocated"]))
fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
for label, (x, y) in lines.items():
    if label.startswith("bound"):  # the offline bound: no placement can leave less
        ax.plot(x, y, "k--", label="bound (no placement leaves less)", linewidth=1.6)
    elif "+migration" in label:
        ax.plot(x, y, "-.", label=label, linewidth=2.2)
    else:
        ax.plot(x, y, label=label, linewidth=2.2 if label.startswith("fgd") else 1.2)
ax.set_xlabel("arrived GPU demand (% of the cluster's GPU capacity)")
ax.set_ylabel("unallocated GPUs (% of capacity)")
ax.set_xlim(50, max(max(x) for x, _ in lines.values()))  # below half the capacity every policy places nearly all
ax.set_ylim(0, 55)
ax.grid(alpha=0.3)
if title:
    ax.set_title(title, fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(target)
print(f"wrote {target}")
PY
