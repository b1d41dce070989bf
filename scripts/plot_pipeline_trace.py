#!/usr/bin/python3
"""Renders pipeline timelines (the Chrome trace JSON that train_pipeline --trace writes) as one
Gantt chart per trace, stacked: a row per rank, forwards light, backwards dark, weight-gradient
halves hatched, transfers thin grey. Needs python3-matplotlib (Debian).

  scripts/plot_pipeline_trace.py out.png 1f1b.json:1F1B zb.json:ZB-H1
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"forward": "#9ecae1", "backward": "#3182bd", "backward_input": "#3182bd", "backward_weight": "#fd8d3c"}


def load(path):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "pipeline"]
    start = min(e["ts"] for e in events)
    return events, start


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, traces = sys.argv[1], [a.rsplit(":", 1) for a in sys.argv[2:]]
    loaded = [(load(path), title) for path, title in traces]
    span = max(max(e["ts"] + e["dur"] for e in ev) - start for (ev, start), _ in loaded) / 1000.0
    fig, axes = plt.subplots(len(loaded), 1, figsize=(11, 1.9 * len(loaded)), squeeze=False)
    for ax, ((events, start), title) in zip(axes[:, 0], loaded):
        ranks = sorted({e["pid"] for e in events})
        for e in events:
            x, w = (e["ts"] - start) / 1000.0, e["dur"] / 1000.0
            kind, _, rest = e["name"].partition("(")
            y = ranks.index(e["pid"])
            if e["tid"] != 0:  # transfers
                ax.broken_barh([(x, w)], (y - 0.08, 0.16), color="#bbbbbb")
                continue
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolor=COLORS.get(kind, "#cccccc"), edgecolor="white", linewidth=0.5)
            mb = rest.split(",")[0].replace("mb ", "")
            if w > span / 120:
                ax.text(x + w / 2, y, mb, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(ranks)), [f"device {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlim(0, span)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms (one training step; numbers are micro-batches)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#9ecae1", "#3182bd", "#fd8d3c", "#bbbbbb")]
    fig.legend(handles, ["forward", "backward (input)", "backward weight", "transfer"], loc="upper right", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
