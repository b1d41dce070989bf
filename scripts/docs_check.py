#!/usr/bin/env python3
"""Checks that the documentation cannot rot: every C++ block of README.md and docs/ compiles
against the installed package, every shell block marked runnable runs, and every relative link
and anchor resolves. Each failure names the Markdown file and line. scripts/docs-check.sh runs it.

Markers, each on the line right before a block's opening fence (HTML comments: hidden on GitHub):
  <!-- fragment -->     a ```cpp block of statements, compiled inside a function body
  <!-- fragment         the same, with the C++ lines up to --> compiled before the block:
  mgpu::Tensor x;        the declarations the fragment uses, which the reader does not need
  -->
  <!-- run -->          a ```cpp program (it has `int main`) that is also run
  <!-- runnable -->     a ```sh block whose lines are run, one at a time, in a scratch folder
A ```cpp block without a marker must be a whole program (`int main`). Every block is compiled in
one translation unit, with #line directives, by one CMake project over find_package(mgpu): one
compiler invocation and one link for all of them.

  scripts/docs_check.py --build build/release [--prefix DIR] [--work DIR] [--no-compile]
                        [--no-run] [--no-links] [FILE.md ...]
--prefix names an installed mgpu (default: --build installed into WORK/prefix); the runnable
blocks find the examples and benchmarks in --build. Python standard library only.
"""

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(fragment|runnable|run)\b(.*)$")
LINK = re.compile(r"!?\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
MAIN = re.compile(r"\bint\s+main\s*\(")
PRELUDE = """#include <mgpu/mgpu.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>
"""


class Block:
    def __init__(self, path, line, lang, marker, setup, setup_line, text):
        self.path, self.line, self.lang, self.marker = path, line, lang, marker
        self.setup, self.setup_line, self.text = setup, setup_line, text

    def where(self, offset=0):
        return f"{self.path}:{self.line + offset}"


def rel(path):
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def parse(path):
    """The fenced blocks of a Markdown file, with the marker before each; and its lines outside
    blocks (for links), as (line number, text)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, prose = [], []
    i = 0
    pending = None  # (marker, setup lines, setup's first line number, the line after the comment)
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line)
        if m:
            kind, rest = m.group(1), m.group(2)
            setup, start = [], i + 2
            if "-->" not in rest:
                j = i + 1
                while j < len(lines) and "-->" not in lines[j]:
                    setup.append(lines[j])
                    j += 1
                i = j
            pending = (kind, setup, start, i + 1)
            i += 1
            continue
        f = FENCE.match(line)
        if f:
            indent, fence, lang = f.group(1), f.group(2), f.group(3).lower()
            body, j = [], i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
                j += 1
            marker, setup, setup_line = None, [], 0
            if pending and pending[3] == i:
                marker, setup, setup_line = pending[0], pending[1], pending[2]
            blocks.append(Block(rel(path), i + 2, lang, marker, setup, setup_line, body))
            pending = None
            i = j + 1
            continue
        prose.append((i + 1, line))
        i += 1
    return blocks, prose


def slug(heading, seen):
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    text = text.replace(" ", "-")
    n = seen.get(text, 0)
    seen[text] = n + 1
    return text if n == 0 else f"{text}-{n}"


def anchors(path, cache={}):
    if path not in cache:
        _, prose = parse(path)
        seen = {}
        cache[path] = {slug(m.group(2), seen) for _, l in prose if (m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", l))}
    return cache[path]


def check_links(files):
    errors = []
    for path in files:
        _, prose = parse(path)
        for number, line in prose:
            spans = [m.span() for m in CODE_SPAN.finditer(line)]
            for m in LINK.finditer(line):
                if any(a <= m.start() < b for a, b in spans):
                    continue
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path.resolve()
                where = f"{rel(path)}:{number}"
                if not dest.exists():
                    errors.append(f"{where}: link to {target}: {rel(dest)} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    errors.append(f"{where}: link to {target}: no heading of {rel(dest)} has the anchor #{anchor}")
    return errors


def translation_unit(blocks):
    """One C++ file holding every block: programs in namespaces of their own with main renamed,
    fragments inside functions; the blocks' #includes first. Returns (source, programs to run)."""
    head, body, runs = [PRELUDE], [], []
    for n, b in enumerate(blocks):
        include_lines = [(k, l) for k, l in enumerate(b.text) if l.lstrip().startswith("#include")]
        for k, l in include_lines:
            head.append(f'#line {b.line + k} "{b.path}"\n{l}\n')
        text = ["" if l.lstrip().startswith("#include") else l for l in b.text]
        code = "\n".join(text)
        body.append(f"namespace docs_block_{n} {{")
        if MAIN.search(code):
            # main may end without a return; a renamed function returning int may not.
            returns = re.search(r"\breturn\b", code)
            code = MAIN.sub(f"int main_{n}(" if returns else f"void main_{n}(", code, count=1)
            body.append(f'#line {b.line} "{b.path}"\n{code}')
            if b.marker == "run":
                runs.append((n, b, bool(returns)))
        else:
            body.append("[[maybe_unused]] void fragment() {")
            if b.setup:
                body.append(f'#line {b.setup_line} "{b.path}"\n' + "\n".join(b.setup))
            body.append(f'#line {b.line} "{b.path}"\n{code}\n}}')
        body.append(f"}}  // namespace docs_block_{n}")
    calls = "\n".join(f'  if (which == "{n}") return docs_block_{n}::main_{n}();' if returns else
                      f'  if (which == "{n}") return docs_block_{n}::main_{n}(), 0;' for n, _, returns in runs)
    main = f"""#line 1 "docs_check_main"
int main(int argc, char** argv) {{
  std::string const which = argc > 1 ? argv[1] : "";
{calls}
  return 0;
}}
"""
    return "\n".join(head) + "\n" + "\n".join(body) + "\n" + main, runs


def compile_blocks(blocks, prefix, work):
    errors = []
    for b in blocks:
        if not MAIN.search("\n".join(b.text)) and b.marker != "fragment":
            errors.append(f"{b.where()}: a C++ block that is neither a program (int main) nor marked <!-- fragment -->")
    if errors:
        return errors, None, []
    source, runs = translation_unit(blocks)
    project = work / "snippets"
    project.mkdir(parents=True, exist_ok=True)
    (project / "snippets.cpp").write_text(source)
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.25)\nproject(mgpu_docs_snippets LANGUAGES CXX)\n"
        "find_package(mgpu CONFIG REQUIRED)\nadd_executable(snippets snippets.cpp)\n"
        "target_link_libraries(snippets PRIVATE mgpu::mgpu)\n"
        "target_compile_options(snippets PRIVATE -Wall -Wextra -Werror -Wno-unused-variable "
        "-Wno-unused-but-set-variable -Wno-unused-parameter)\n")
    build = work / "snippets-build"
    configure = subprocess.run(["cmake", "-S", project, "-B", build, "-G", "Ninja", f"-DCMAKE_PREFIX_PATH={prefix}"],
                               capture_output=True, text=True)
    if configure.returncode != 0:
        return [f"docs-check: configuring the snippets against {prefix} failed:\n{configure.stdout}{configure.stderr}"], None, []
    result = subprocess.run(["cmake", "--build", build], capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        output = result.stdout + result.stderr
        located = sorted({m.group(0) for m in re.finditer(r"(?:README|CHANGELOG|docs/[\w.-]+)\.md:\d+", output)})
        summary = "".join(f"{where}: this block does not compile (the compiler's message above)\n" for where in located)
        return [output.rstrip() + "\n" + summary.rstrip()], None, []
    return [], build / "snippets", runs


def shell_lines(block):
    """The commands of a shell block: its lines, continued lines joined, blank lines left out."""
    commands, current, start = [], "", None
    for k, line in enumerate(block.text):
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if start is None:
            start = k
        current += line.rstrip("\\") + (" " if line.endswith("\\") else "")
        if not line.endswith("\\"):
            commands.append((block.line + start, current))
            current, start = "", None
    return commands


def scratch(work, name):
    folder = work / "run" / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for entry in ROOT.iterdir():  # the repository's files, read where they are; what a block writes stays here
        if not entry.name.startswith(".") and entry.name != "build":
            (folder / entry.name).symlink_to(entry)
    return folder


def run_blocks(blocks, programs, executable, build, work, timeout):
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(build / "examples"), str(build / "bench"), env.get("PATH", "")])
    # mpirun in the blocks, as root on a small machine (the tests' mpirun passes the same flags).
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    env.setdefault("MGPU_COMM_TIMEOUT", "60")
    errors = []
    for n, b, _ in programs:
        start = time.monotonic()
        r = subprocess.run([executable, str(n)], cwd=scratch(work, f"program-{n}"), env=env, capture_output=True,
                           text=True, timeout=timeout)
        print(f"docs-check: ran the program at {b.where()} ({time.monotonic() - start:.1f} s)")
        if r.returncode != 0:
            errors.append(f"{b.where()}: the program exited with {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    folders = {}
    for b in blocks:
        if b.marker != "runnable":
            continue
        if b.lang not in ("sh", "bash", "shell", "console"):
            errors.append(f"{b.where()}: <!-- runnable --> marks a {b.lang or 'plain'} block, not a shell block")
            continue
        folder = folders.get(b.path) or scratch(work, re.sub(r"\W", "_", b.path))
        folders[b.path] = folder
        start = time.monotonic()
        for line, command in shell_lines(b):
            try:
                r = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=folder, env=env, capture_output=True,
                                   text=True, timeout=timeout)
                status, output = r.returncode, r.stdout + r.stderr
            except subprocess.TimeoutExpired as e:
                status, output = f"a timeout ({timeout} s)", str(e.stdout or "") + str(e.stderr or "")
            if status != 0:
                errors.append(f"{b.path}:{line}: `{command.strip()}` failed ({status}):\n{output[-3000:]}")
                break
        print(f"docs-check: ran the block at {b.where()} ({time.monotonic() - start:.1f} s)")
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.environ.get("MGPU_BUILD_DIR", "build/release"))
    parser.add_argument("--prefix", default=os.environ.get("MGPU_PREFIX"))
    parser.add_argument("--work", default="build/docs-check")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a command of a block may take")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-run", action="store_true")
    parser.add_argument("--no-links", action="store_true")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    os.chdir(ROOT)
    files = [pathlib.Path(f) for f in args.files] or [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted(
        (ROOT / "docs").glob("*.md"))
    work = pathlib.Path(args.work).resolve()
    build = pathlib.Path(args.build).resolve()
    errors = []
    blocks = [b for f in files for b in parse(f)[0]]
    cpp = [b for b in blocks if b.lang in ("cpp", "c++", "cxx")]
    start = time.monotonic()
    if not args.no_links:
        errors += check_links(files)
        print(f"docs-check: links of {len(files)} files ({time.monotonic() - start:.1f} s)")
    executable, programs = None, []
    if not args.no_compile:
        start = time.monotonic()
        prefix = args.prefix
        if not prefix:
            prefix = work / "prefix"
            shutil.rmtree(prefix, ignore_errors=True)
            subprocess.run(["cmake", "--install", build, "--prefix", prefix], check=True, capture_output=True)
        compile_errors, executable, programs = compile_blocks(cpp, pathlib.Path(prefix).resolve(), work)
        errors += compile_errors
        print(f"docs-check: {len(cpp)} C++ blocks compiled in one translation unit ({time.monotonic() - start:.1f} s)")
    if not args.no_run:
        start = time.monotonic()
        errors += run_blocks(blocks, [] if executable is None else programs, executable, build, work, args.timeout)
        print(f"docs-check: runnable blocks ({time.monotonic() - start:.1f} s)")
    for e in errors:
        print(e if e.startswith("docs-check") else f"docs-check: {e}", file=sys.stderr)
    if errors:
        print(f"docs-check: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print("docs-check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
