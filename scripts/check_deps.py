#!/usr/bin/env python3
"""Fails when the build reads a file from a Debian package that scripts/setup.sh does not install.

setup.sh installs its packages without their Recommends, so on a fresh machine exactly these are
there: the packages it names, everything they Depend or Pre-Depend on (transitively), and the
Essential ones. A machine that has more (CI's, a developer's) builds fine either way; this check
finds the difference by mapping every file the build reads under /usr to the package that owns it:

  - each CMake list file the configure ran (its --trace-format=json-v1 trace),
  - each FILEPATH entry of its CMakeCache.txt (libraries, programs, headers found),
  - each absolute path in the build's commands (ninja -t commands: include dirs, libraries),
  - each header a compile read (ninja -t deps of a build that ran).

Files outside Debian's packages (the CUDA toolkit in /usr/local, the source tree) are not counted.
Usage: check_deps.py --packages FILE --trace FILE --build DIR [--built DIR ...]
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys


def read_status():
    """Installed packages from dpkg's status file: name -> its fields."""
    packages, fields = {}, {}
    key = None
    with open("/var/lib/dpkg/status", encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                if "install ok installed" in fields.get("Status", ""):
                    packages[fields["Package"]] = fields
                fields, key = {}, None
            elif line[0] in " \t":
                fields[key] += " " + line.strip()
            else:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    if "install ok installed" in fields.get("Status", ""):
        packages[fields["Package"]] = fields
    return packages


def names(relation):
    """Package names in a Depends-style field (every alternative, versions and arches dropped)."""
    return [re.split(r"[\s(:]", alternative.strip())[0]
            for group in relation.split(",") if group.strip()
            for alternative in group.split("|")]


def closure(roots, installed):
    """The installed packages that roots Depend or Pre-Depend on, transitively, roots included."""
    providers = {}
    for name, fields in installed.items():
        for virtual in names(fields.get("Provides", "")):
            providers.setdefault(virtual, []).append(name)
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        for real in ([name] if name in installed else providers.get(name, [])):
            if real in seen:
                continue
            seen.add(real)
            fields = installed[real]
            todo += names(fields.get("Depends", "") + "," + fields.get("Pre-Depends", ""))
    return seen


def owners():
    """path -> the packages whose file lists name it (files only, not directories)."""
    table = {}
    for listing in glob.glob("/var/lib/dpkg/info/*.list"):
        package = os.path.basename(listing)[:-len(".list")].split(":")[0]
        with open(listing, encoding="utf-8", errors="replace") as f:
            for path in f.read().splitlines():
                table.setdefault(path, set()).add(package)
    return table


def merged_usr(path):
    """The same file as dpkg may name it on a merged-/usr system (/lib -> /usr/lib, /bin -> /usr/bin)."""
    for short in ("/lib", "/lib64", "/bin", "/sbin"):
        if path.startswith("/usr" + short + "/"):
            return [path, path[len("/usr"):]]
        if path.startswith(short + "/"):
            return [path, "/usr" + path]
    return [path]


def files_read(args):
    paths = set()
    with open(args.trace, encoding="utf-8") as f:
        for line in f:
            event = json.loads(line)
            if "file" in event:
                paths.add(event["file"])
    with open(os.path.join(args.build, "CMakeCache.txt"), encoding="utf-8") as f:
        for line in f:
            match = re.match(r"^[^#/][^:]*:FILEPATH=(/.+)$", line.strip())
            if match:
                paths.add(match.group(1))
    commands = subprocess.run(["ninja", "-C", args.build, "-t", "commands"], check=True,
                              capture_output=True, text=True).stdout
    paths.update(re.findall(r"(?:^|[\s=,:]|-I|-isystem\s|-L|-Wl,-rpath,)(/usr/[^\s:;,\"']+)", commands))
    for built in args.built:
        deps = subprocess.run(["ninja", "-C", built, "-t", "deps"], check=True,
                              capture_output=True, text=True).stdout
        paths.update(line.strip() for line in deps.splitlines() if line.startswith("    /"))
    return {os.path.normpath(p) for p in paths if p.startswith("/usr/") and not p.startswith("/usr/local/")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", required=True, help="the packages setup.sh installs, one a line")
    parser.add_argument("--trace", required=True, help="the configure's --trace-format=json-v1 output")
    parser.add_argument("--build", required=True, help="the traced build directory (configured)")
    parser.add_argument("--built", action="append", default=[], help="a build directory that was built")
    args = parser.parse_args()

    installed = read_status()
    with open(args.packages, encoding="utf-8") as f:
        listed = [line.strip() for line in f if line.strip()]
    missing = [p for p in listed if p not in installed]
    if missing:
        sys.exit(f"check-deps: setup.sh's packages are not installed: {' '.join(missing)} (run scripts/setup.sh)")
    essential = [name for name, fields in installed.items() if fields.get("Essential") == "yes"]
    allowed = closure(listed + essential, installed)

    table = owners()
    unlisted = {}  # package -> the files read from it
    unowned = []
    files = files_read(args)
    for path in sorted(files):
        if os.path.isdir(path):
            continue
        # The file as named (a library's development symlink, say) and the file it resolves to
        # may come from different packages: each must be there.
        named, resolved = ({p for c in merged_usr(f) for p in table.get(c, ())}
                           for f in (path, os.path.realpath(path)))
        if not named and not resolved:
            unowned.append(path)
        for found in (named, resolved):
            if found and not found & allowed:
                for package in found:
                    unlisted.setdefault(package, set()).add(path)
    print(f"check-deps: the build reads {len(files)} files under /usr; setup.sh names {len(listed)} packages, "
          f"{len(allowed)} with their Depends and the Essential ones")
    for path in unowned:
        print(f"check-deps: {path} is read but belongs to no package (installed by hand?)")
    for package, paths in sorted(unlisted.items()):
        paths = sorted(paths)
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        print(f"check-deps: {package} is not installed by scripts/setup.sh (nor a Depends of a package it "
              f"names), yet the build reads {shown}")
    if unlisted or unowned:
        sys.exit(1)
    print("check-deps: ok")


if __name__ == "__main__":
    main()
