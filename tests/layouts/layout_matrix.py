#!/usr/bin/env python3
"""The layout matrix: train_gpt, the front door users run, in combinations of data (dp), tensor
(tp) and pipeline (pp: 1F1B, GPipe, interleaved) parallelism, ZeRO 0-3, fp32/bf16/fp16,
recomputation and sequence parallelism on host devices, each row's per-step training losses
against the one-device run of the same precision (fp32: 1e-4 relative per step and in the final
validation loss; bf16 and fp16: 2% against the one-device 16-bit run).

The full product (1,440 runs, --part product: each trains to the curve or meets a refusal of the
tables below) is reduced to rows covering every pair of factor values (CHECKED and REFUSED_TODAY
together; the runner verifies that cover). Combinations the library
refuses today are in REFUSED_TODAY with the refusal expected, before any work; when a layout
learns them, its rows move to CHECKED. Combinations that cannot work are in IMPOSSIBLE, refused
likewise. DIST rows run under mpirun -np 2 against the same one-device curves.

  layout_matrix.py TRAIN_GPT TEXT_FILE DIR [--part one|refused|reasons|dist|product]... [--mpirun MPIRUN... -np]

A row is words: dpN, tpN, pp:SCHEDULE (2 stages, 2 micro-batches), zeroN (--zero N; without it
no --zero is given), fp32|bf16|fp16, none|selective|full (--recompute), sp (--sequence-parallel)
and raw --flag=value words. Exit status 1 names every failed row.
"""
import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time

# Each row covers the factor values it names: every pair of values (but the impossible ones below)
# is in some row of CHECKED or REFUSED_TODAY.
FACTORS = {
    "dp": ["1", "2"],
    "tp": ["1", "2"],
    "pp": ["1", "1f1b", "gpipe", "interleaved"],
    "zero": ["0", "1", "2", "3"],
    "precision": ["fp32", "bf16", "fp16"],
    "recompute": ["none", "selective", "full"],
    "sp": ["off", "on"],
}
IMPOSSIBLE_PAIRS = {(("tp", "1"), ("sp", "on"))}  # sequence parallelism splits the tensor-parallel ranks' tokens

# Rows checked against the one-device curve, in one process.
CHECKED = [
    # data parallel: every ZeRO stage in every precision it takes, every recomputation
    "dp2",
    "dp2 zero0", "dp2 zero0 bf16 selective", "dp2 zero0 fp16 full",
    "dp2 zero1 bf16 full", "dp2 zero1 fp16 selective", "dp2 zero1 selective",
    "dp2 zero2", "dp2 zero2 full", "dp2 zero3", "dp2 zero3 selective",
    # tensor parallel, its replicas, sequence parallel
    "tp2", "tp2 bf16", "tp2 fp16 selective", "tp2 sp", "tp2 sp bf16 full", "tp2 sp fp16",
    "dp2 tp2", "dp2 tp2 sp selective", "dp2 tp2 bf16 full", "dp2 tp2 sp fp16",
    # ZeRO over tensor-parallel replicas (one device's curve: with dp 1 there is nothing to shard)
    "tp2 zero0", "tp2 zero1 bf16", "tp2 zero2 sp full", "tp2 zero3 sp selective",
    "dp2 tp2 zero1 sp", "dp2 tp2 zero3", "dp2 tp2 zero0 fp16", "dp2 tp2 zero2 sp",
    # pipelines, their replicas, tensor-parallel stages
    "pp:1f1b", "pp:1f1b bf16 selective", "pp:1f1b fp16 full",
    "pp:gpipe", "pp:gpipe bf16 full", "pp:gpipe fp16 selective",
    "pp:interleaved", "pp:interleaved bf16", "pp:interleaved fp16 full", "pp:interleaved selective",
    "dp2 pp:1f1b", "dp2 pp:gpipe bf16", "dp2 pp:interleaved fp16 selective", "dp2 pp:1f1b full",
    "tp2 pp:1f1b sp", "tp2 pp:gpipe bf16 sp", "tp2 pp:interleaved fp16", "tp2 pp:1f1b selective",
    "dp2 tp2 pp:gpipe", "dp2 tp2 pp:1f1b sp bf16 full", "dp2 tp2 pp:interleaved sp fp16 selective",
    # ZeRO 0 to 2 over a pipeline's replicas, of tensor-parallel stages too (1 by default in one
    # process; with dp 1 there is nothing to shard)
    "pp:1f1b zero1", "dp2 pp:gpipe zero1 bf16", "dp2 pp:interleaved zero0", "dp2 pp:gpipe zero0 full",
    "pp:interleaved zero1 full", "dp2 pp:interleaved zero1 fp16 selective", "tp2 pp:interleaved zero0",
    "tp2 pp:1f1b zero0 sp", "tp2 pp:1f1b zero1 sp", "dp2 tp2 pp:1f1b zero1",
    "pp:interleaved zero2", "dp2 pp:interleaved zero2", "dp2 pp:1f1b zero2", "dp2 tp2 pp:1f1b zero2 sp",
    "pp:gpipe zero2 selective", "dp2 pp:gpipe zero2 bf16", "dp2 tp2 pp:1f1b zero2 fp16 sp",
    # ZeRO-3 over a pipeline's replicas, in every precision
    "pp:gpipe zero3 full", "dp2 pp:1f1b zero3 selective", "dp2 tp2 pp:gpipe zero3 sp",
    "pp:interleaved zero3 fp16", "dp2 pp:interleaved zero3 fp16", "dp2 pp:gpipe zero3 bf16 selective",
    # ZeRO-2 and 3 in 16 bits, of data parallelism and tensor-parallel replicas
    "dp2 zero2 bf16", "dp2 zero3 fp16", "dp2 zero2 fp16 selective", "dp2 zero3 bf16 full", "dp1 zero3 bf16",
    "dp2 tp2 zero2 bf16", "dp2 tp2 zero3 fp16 sp",
]

# Refused today: each row's refusal, asserted. When the library learns a combination, move its
# rows to CHECKED.
REFUSED_TODAY = []

# Cannot work: refused, naming why.
IMPOSSIBLE = [
    ("sp", r"--sequence-parallel with --tp 1 \(expected --tp 2 or more"),
    ("dp2 sp", r"--sequence-parallel with --tp 1 \(expected --tp 2 or more"),
    ("pp:1f1b sp", r"--sequence-parallel with --tp 1 \(expected --tp 2 or more"),
    ("tp2 sp --block-size=15", r"--sequence-parallel with --block-size 15 over --tp 2 \(expected a block size divisible by --tp\)"),
    ("tp2 --n-head=3 --n-embd=33", r"--tp 2 with --n-head 3 \(expected --tp dividing --n-head: each device holds whole heads\)"),
    ("dp2 pp:interleaved --micro-batches=3", r"interleaved 1F1B with 3 micro-batches on 2 devices \(expected a multiple of the device count\)"),
    ("dp2 tp2 --batch-size=1", r"--batch-size 1 with --dp 2 \(expected at least 2: one row per replica\)"),
    ("dp2 --batch-size=1", r"--batch-size 1 with --dp 2 \(expected at least 2: one row per replica\)"),
    ("pp:1f1b --batch-size=1", r"--batch-size 1 with --dp 1 and --micro-batches 2 \(expected at least 2: one row per replica and micro-batch\)"),
    ("dp2 tp2 --devices=host:3", r"--devices host:3 has 3 devices \(expected --dp x --tp = 4\)"),
    ("pp:1f1b --devices=host:3", r"--devices host:3 has 3 devices \(expected --stages x --dp = 2\)"),
    ("--zero=4", r"--zero 4 \(expected 0, the replicated update, 1"),
    ("--micro-batches=2", r"--micro-batches 2 without a pipeline \(expected --schedule or --stages > 1"),
]

# Fail today (findings): each still fails as described, or the part fails asking to move it to
# IMPOSSIBLE (the refusal it expects, before any work) or CHECKED once train_gpt is fixed.
FAILING_TODAY = []

# Across processes (mpirun -np 2, each process half the devices), against the same curves.
DIST = ["dp2", "dp2 zero2 fp16 full", "dp2 zero3", "tp2 fp16 full", "dp2 tp2 sp bf16", "pp:1f1b fp16 selective", "tp2 pp:gpipe",
        "dp2 tp2 pp:interleaved sp", "dp2 tp2 zero1", "dp2 tp2 zero3 sp bf16", "dp2 pp:1f1b", "dp2 pp:gpipe zero0 bf16",
        "dp2 pp:gpipe zero2 fp16",
        "dp2 pp:1f1b zero3"]
DIST_REFUSED = []

COMMON = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
          "--iters", "12", "--lr", "3e-3", "--warmup", "2", "--dropout", "0", "--seed", "7", "--log-every", "1",
          "--eval-every", "0", "--eval-iters", "2", "--json", "--no-progress"]
TOLERANCE = {"fp32": 1e-4, "bf16": 0.02, "fp16": 0.02}  # relative, per step (fp32: and the val loss)
STEP = re.compile(r"^step (\d+)/\d+  loss (\S+)", re.M)
SANITIZER = re.compile(r"ERROR: [A-Za-z]+Sanitizer|WARNING: ThreadSanitizer|runtime error:")
STARTED = re.compile(r"^mgpu \S+: GPT of", re.M)  # printed once the model is built: work began


def parse(row, processes=1):
    """The row's factor values and train_gpt flags (--devices: each process's share)."""
    values = {"dp": "1", "tp": "1", "pp": "1", "zero": None, "precision": "fp32", "recompute": "none", "sp": "off"}
    raw = {}
    for word in row.split():
        if word.startswith("--"):
            flag, _, value = word.partition("=")
            raw[flag] = value
        elif word.startswith("pp:"):
            values["pp"] = word[3:]
        elif word == "sp":
            values["sp"] = "on"
        elif word in FACTORS["precision"]:
            values["precision"] = word
        elif word in FACTORS["recompute"]:
            values["recompute"] = word
        else:
            m = re.fullmatch(r"(dp|tp|zero)(\d+)", word)
            if not m:
                raise ValueError(f"row '{row}': unknown word '{word}'")
            values[m.group(1)] = m.group(2)
    dp, tp, stages = int(values["dp"]), int(values["tp"]), 1 if values["pp"] == "1" else 2
    flags = ["--devices", f"host:{max(1, dp * tp * stages // processes)}", "--precision", values["precision"], "--recompute", values["recompute"]]
    if dp > 1:
        flags += ["--dp", str(dp)]
    if tp > 1:
        flags += ["--tp", str(tp)]
    if stages > 1:
        flags += ["--stages", "2", "--schedule", values["pp"], "--micro-batches", "2"]
    if values["zero"] is not None:
        flags += ["--zero", values["zero"]]
    if values["sp"] == "on":
        flags += ["--sequence-parallel"]
    for flag, value in raw.items():
        if flag in flags:
            flags[flags.index(flag) + 1] = value
        else:
            flags += [flag, value]
    return values, flags


def expected_fields(values, processes):
    """The --json fields that say the row ran in its layout (no flag silently dropped)."""
    dp, tp, stages = int(values["dp"]), int(values["tp"]), 1 if values["pp"] == "1" else 2
    data_parallel = tp == 1 and stages == 1 and dp > 1
    schedule = values["pp"] if stages > 1 else "data-parallel" if data_parallel else "tensor-parallel" if tp > 1 else "none"
    return {"dp": dp, "tp": tp, "stages": stages, "schedule": schedule, "precision": values["precision"],
            "recompute": values["recompute"], "sequence_parallel": values["sp"] == "on", "processes": processes,
            "zero": int(values["zero"] or 1) if dp > 1 else 0,  # the replicas' stage: 1 by default
            "devices": dp * tp * stages}


def covered_pairs(rows):
    pairs = set()
    for row in rows:
        values, _ = parse(row)
        named = [(f, v) for f, v in values.items() if v is not None]
        pairs.update(itertools.combinations(named, 2))
    return pairs


def check_cover():
    """Every pair of factor values but the impossible ones is in a row of CHECKED or REFUSED_TODAY."""
    have = covered_pairs(CHECKED + [row for row, _ in REFUSED_TODAY])
    names = list(FACTORS)
    missing = []
    for a, b in itertools.combinations(names, 2):
        for pair in itertools.product([(a, v) for v in FACTORS[a]], [(b, v) for v in FACTORS[b]]):
            if pair not in have and pair not in IMPOSSIBLE_PAIRS:
                missing.append(f"{pair[0][0]}={pair[0][1]} with {pair[1][0]}={pair[1][1]}")
    return missing


class Runner:
    def __init__(self, exe, text, folder, launcher):
        self.exe, self.text, self.folder, self.launcher = exe, text, folder, launcher
        self.failures, self.lines, self.baselines = [], [], {}

    def run(self, name, flags, processes=1):
        """train_gpt's exit status (None: no end within the deadline), stdout, stderr and seconds."""
        command = [self.exe, "--data", self.text] + COMMON + flags
        if processes > 1:
            command = self.launcher + [str(processes)] + command
        start = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            status, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as e:
            status, out, err = None, "", f"no end within {e.timeout} s"
        with open(os.path.join(self.folder, re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".log"), "w") as f:
            f.write(" ".join(command) + "\n" + out + err)
        return status, out, err, time.monotonic() - start

    def curve(self, status, out, err):
        """The run's per-step losses and --json fields, or why there are none."""
        if SANITIZER.search(err):
            return None, f"a sanitizer's report: {SANITIZER.search(err).group(0)}"
        if status != 0:
            return None, f"exit status {status}: {((err or out).strip().splitlines() or ['(no output)'])[-1]}"
        steps = [float(loss) for _, loss in STEP.findall(err)]
        iters = int(COMMON[COMMON.index("--iters") + 1])
        if len(steps) != iters:
            return None, f"{len(steps)} step lines (expected {iters})"
        try:
            return (steps, json.loads(out.strip().splitlines()[-1])), None
        except (ValueError, IndexError):
            return None, "no JSON line on stdout"

    def baseline(self, precision):
        """The one-device curve of that precision."""
        if precision not in self.baselines:
            got, error = self.curve(*self.run(f"one-device {precision}", ["--devices", "host:1", "--precision", precision])[:3])
            if error:
                raise SystemExit(f"FAIL: the one-device {precision} run: {error}")
            self.baselines[precision] = got
        return self.baselines[precision]

    def record(self, row, how, deviation, seconds, failure=None):
        self.lines.append((row, how, deviation, seconds))
        if failure:
            self.failures.append(f"{row} ({how}): {failure}")

    def compare(self, values, processes, got):
        """The largest relative deviation from the one-device curve and, past the tolerance, why."""
        steps, result = got
        precision = values["precision"]
        expected = expected_fields(values, processes)
        ran = dict(result, devices=len(result["devices"]))
        wrong = [f"{key} {json.dumps(ran.get(key))} (expected {json.dumps(value)})"
                 for key, value in expected.items() if ran.get(key) != value]
        if wrong:
            return None, "ran another layout: " + ", ".join(wrong)
        reference, tolerance = self.baseline(precision), TOLERANCE[precision]
        deviations = [abs(a - b) / abs(b) for a, b in zip(steps, reference[0])]
        worst = max(range(len(deviations)), key=deviations.__getitem__)
        if deviations[worst] > tolerance:
            return deviations[worst], (f"step {worst + 1} loss {steps[worst]:.4f} (expected {reference[0][worst]:.4f} as on "
                                       f"one device in {precision}, within {tolerance:g} relative)")
        val, val_reference = result["val_loss"], reference[1]["val_loss"]
        deviation = max(deviations[worst], abs(val - val_reference) / abs(val_reference))
        if precision == "fp32" and deviation > tolerance:
            return deviation, f"val loss {val} (expected {val_reference} as on one device, within {tolerance:g} relative)"
        return deviation, None

    def check(self, row, processes=1):
        values, flags = parse(row, processes)
        how = "checked" + (f", {processes} processes" if processes > 1 else "")
        status, out, err, seconds = self.run(f"{row} np{processes}", flags, processes)
        got, error = self.curve(status, out, err)
        deviation, failure = (None, error) if error else self.compare(values, processes, got)
        self.record(row, how, deviation, seconds, failure)

    def control(self):
        """The comparison tells another curve apart: one device with seed 8 is not seed 7's curve."""
        status, out, err, seconds = self.run("control seed 8", ["--devices", "host:1", "--seed", "8"])
        got, error = self.curve(status, out, err)
        deviation, failure = (None, error) if error else self.compare(parse("")[0], 1, got)
        if not error and failure is None:
            error = f"seed 8's curve within {TOLERANCE['fp32']:g} of seed 7's (expected apart: the check could not fail)"
        self.record("--seed=8", "control: must deviate", deviation, seconds, error)

    def refusal(self, pattern, processes, status, out, err):
        """Why the run is not a refusal matching pattern in every process before any work, or None."""
        if status is None:
            return err
        if SANITIZER.search(err):
            return f"a sanitizer's report: {SANITIZER.search(err).group(0)}"
        if status == 0:
            return "trained (expected a refusal)"
        if len(re.findall(pattern, err)) < processes:
            return (f"exit status {status}, {len(re.findall(pattern, err))} of {processes} process(es) printing "
                    f"'{pattern}': {(err.strip().splitlines() or ['(no output)'])[-1]}")
        if processes == 1 and status != 2:
            return f"exit status {status} (expected 2, train_gpt's refusal)"
        if STARTED.search(out + err) or STEP.search(err):
            return "refused after the model was built (expected before any work)"
        return None

    def refused(self, row, pattern, how, processes=1):
        status, out, err, seconds = self.run(f"{how} {row}", parse(row, processes)[1], processes)
        failure = self.refusal(pattern, processes, status, out, err)
        if how.startswith("fails today"):  # a finding: it must still fail, or move to its table
            failure = ("refused as expected now: move it to IMPOSSIBLE" if failure is None else
                       "trains now: move it to CHECKED, or IMPOSSIBLE with the refusal" if status == 0 else None)
        self.record(row, how, None, seconds, failure)

    def product(self):
        """Every combination of factor values trains to the one-device curve or meets a refusal of the tables."""
        patterns = [pattern for _, pattern in REFUSED_TODAY + IMPOSSIBLE]
        names = list(FACTORS)
        for combination in itertools.product(*([None] + FACTORS[n] if n == "zero" else FACTORS[n] for n in names)):
            v = dict(zip(names, combination))
            row = " ".join([f"dp{v['dp']}", f"tp{v['tp']}"] + ([f"pp:{v['pp']}"] if v["pp"] != "1" else []) +
                           ([f"zero{v['zero']}"] if v["zero"] else []) + [v["precision"], v["recompute"]] +
                           (["sp"] if v["sp"] == "on" else []))
            values, flags = parse(row)
            status, out, err, seconds = self.run(row, flags)
            if status == 2:
                why = [self.refusal(pattern, 1, status, out, err) for pattern in patterns]
                self.record(row, "refused", None, seconds, None if None in why else min(why, key=len))
                continue
            got, error = self.curve(status, out, err)
            deviation, failure = (None, error) if error else self.compare(values, 1, got)
            self.record(row, "checked", deviation, seconds, failure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train_gpt")
    parser.add_argument("text")
    parser.add_argument("dir")
    parser.add_argument("--part", choices=["one", "refused", "reasons", "dist", "product"], action="append",
                        help="one (default with refused): CHECKED in one process; refused: REFUSED_TODAY, IMPOSSIBLE and "
                             "FAILING_TODAY; reasons: their first row per refusal message; dist: DIST and DIST_REFUSED "
                             "under --mpirun; product: the full product of factor values (minutes)")
    parser.add_argument("--mpirun", nargs=argparse.REMAINDER, default=[],
                        help="the launcher and, last, its process count flag (e.g. mpirun --oversubscribe -n)")
    args = parser.parse_args()
    parts = args.part or ["one", "refused"]
    if "dist" in parts and not args.mpirun:
        print("FAIL: --part dist without --mpirun", file=sys.stderr)
        return 1
    missing = check_cover()
    if missing:
        print("FAIL: no row of CHECKED or REFUSED_TODAY has " + "; ".join(missing), file=sys.stderr)
        return 1
    os.makedirs(args.dir, exist_ok=True)
    runner = Runner(args.train_gpt, args.text, args.dir, args.mpirun)
    start = time.monotonic()
    if "one" in parts:
        runner.control()
        for row in CHECKED:
            runner.check(row)
    if "refused" in parts:
        for table, how in ((REFUSED_TODAY, "refused today"), (IMPOSSIBLE, "impossible"), (FAILING_TODAY, "fails today (finding)")):
            for row, pattern in table:
                runner.refused(row, pattern, how)
    if "reasons" in parts:
        seen = set()
        for table, how in ((REFUSED_TODAY, "refused today"), (IMPOSSIBLE, "impossible")):
            for row, pattern in table:
                if pattern not in seen:
                    seen.add(pattern)
                    runner.refused(row, pattern, how)
    if "dist" in parts:
        for row in DIST:
            runner.check(row, processes=2)
        for row, pattern in DIST_REFUSED:
            runner.refused(row, pattern, "refused today, 2 processes", processes=2)
    if "product" in parts:
        runner.product()
    width = max(len(row) for row, *_ in runner.lines)
    print(f"{'layout':<{width}}  {'how':<26} {'max rel dev':>11}  {'s':>5}")
    for row, how, deviation, seconds in runner.lines:
        shown = "-" if deviation is None else f"{deviation:.2e}"
        print(f"{row:<{width}}  {how:<26} {shown:>11}  {seconds:5.2f}")
    print(f"{len(runner.lines)} rows in {time.monotonic() - start:.1f} s (parts: {', '.join(parts)}); CHECKED and "
          f"REFUSED_TODAY cover every pair of factor values but {len(IMPOSSIBLE_PAIRS)} impossible")
    for failure in runner.failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
