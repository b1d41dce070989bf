#!/usr/bin/env python3
"""Prints each public header's prose fraction: its comment lines over all its lines.

A line is prose when, stripped, it starts with // (///, //!, //) or lies inside a /* */ block;
every line counts in the whole, blank ones too (as issue 38 measured: 196 /// lines of 332).
The rule (CONTRIBUTING: docs/contributing.md) is that no public header is over a third prose;
the rationale belongs in docs/.

  scripts/header-prose.py [--max F] [PATH...]   headers or folders (default include/mgpu);
                                                with --max, exit 1 when one is over F
  scripts/header-prose.py --check               every public header at most a third, but those
                                                KNOWN lists (printed as notes); docs-check.sh runs it
Python standard library only.
"""

import argparse
import pathlib
import sys


# Headers allowed over a third, each with why (as check-layers.py's KNOWN).
KNOWN = {}
THIRD = 1 / 3


def prose_fraction(text):
    prose = code = 0
    in_block = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            code += 1
        elif in_block:
            prose += 1
            in_block = "*/" not in line
        elif line.startswith("//"):
            prose += 1
        elif line.startswith("/*"):
            prose += 1
            in_block = "*/" not in line
        else:
            code += 1
    return prose, prose + code


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=float)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args()
    paths = [pathlib.Path(p) for p in args.paths] or [root / "include" / "mgpu"]
    headers = []
    for path in paths:
        headers += sorted(path.rglob("*.hpp")) if path.is_dir() else [path]
    if args.check:
        args.max = THIRD
    over = 0
    for header in headers:
        prose, lines = prose_fraction(header.read_text())
        fraction = prose / lines if lines else 0.0
        try:
            name = header.resolve().relative_to(root).as_posix()
        except ValueError:
            name = str(header)
        bad = args.max is not None and fraction > args.max
        if args.check:
            if bad and name in KNOWN:
                print(f"header-prose: note: {name} is {fraction:.2f} comment lines ({prose}/{lines}): {KNOWN[name]}")
            elif bad:
                print(f"header-prose: {name} is {fraction:.2f} comment lines ({prose}/{lines}), over a third: "
                      "keep the contract there and move the rest to docs/", file=sys.stderr)
                over += 1
            continue
        over += bad
        print(f"{fraction:5.2f}  {prose:4d}/{lines:<4d} {name}{'  over ' + str(args.max) if bad else ''}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
