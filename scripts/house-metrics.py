#!/usr/bin/env python3
"""The codebase's shape in three numbers (docs/architecture.md, "The house, measured"):

  1. the longest functions of src/ and tools/ (lines from the signature to the closing brace);
  2. the source files over 600 lines (src/, tools/, python/tessera_ckpt/);
  3. the includes inside src/tessera/checkpoint/ that run against its folders' order (ORDER).

    python3 scripts/house-metrics.py [--top N]

A function is a brace block at namespace or class scope whose opening follows a ')' (with
const, noexcept, override, a trailing return type or a constructor's initializer list between),
so lambdas and control blocks count toward the function around them. Comments and string
literals are blanked first.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.environ.get("TESSERA_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# checkpoint/'s folders, lowest first: a file may include its own folder's headers and those
# of folders listed before it. The top level (reader, writer, save, load, resume, verify) is "".
# The build enforces the same order (src/CMakeLists.txt, TESSERA_PARTS_checkpoint).
ORDER = ["storage", "format", "interop", "", "offline"]


def tracked(prefixes, exts):
    out = subprocess.check_output(["git", "-C", ROOT, "ls-files"] + prefixes, text=True).split()
    return [f for f in out if f.endswith(exts)]


def blank(text):
    """Comments and string/char literals replaced by spaces (newlines kept)."""
    pat = re.compile(r'//[^\n]*|/\*.*?\*/|R"(\w*)\((?:.|\n)*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
    text = pat.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    # Preprocessor lines (with their continuations) too: they are not part of a signature.
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.M)


def functions(path):
    text = blank(open(os.path.join(ROOT, path), encoding="utf-8").read())
    stack = []  # kinds of the open braces: "scope" (namespace/class/enum/extern) or "fn"/"inner"
    out = []
    line = 1
    last_stmt_end = 0  # index after the last ';', '{' or '}' at the current level
    for i, ch in enumerate(text):
        if ch == "\n":
            line += 1
        elif ch == "{":
            head = text[last_stmt_end:i]
            if any(k[0] in ("fn", "inner") for k in stack):
                stack.append(("inner", 0, 0, ""))
            elif re.search(r"\b(namespace|class|struct|union|enum)\b[^()]*$", head) or re.search(r'\bextern\s*$', head) \
                    or not re.search(r"\)", head) or re.search(r"=\s*$", head):
                stack.append(("scope", 0, 0, ""))
            else:
                # The name before the signature's first '(' (not an initializer's, nor a trailing type's).
                m = re.search(r"([~\w:]+(?:<[^<>()]*>)?)\s*\(", head)
                name = m.group(1) if m else "?"
                first = last_stmt_end + len(head) - len(head.lstrip())  # the signature's first character
                start = line - text[first:i].count("\n")
                stack.append(("fn", start, i, name))
            last_stmt_end = i + 1
        elif ch == "}":
            if stack:
                kind, start, _, name = stack.pop()
                if kind == "fn":
                    out.append((line - start + 1, name, path, start))
            last_stmt_end = i + 1
        elif ch == ";":
            last_stmt_end = i + 1
    return out


def against_order(path):
    """Include lines of a checkpoint/ file that reach a folder above its own in ORDER."""
    rel = os.path.relpath(path, "src/tessera/checkpoint")
    own = os.path.dirname(rel)
    if own not in ORDER:
        return []
    bad = []
    for n, text in enumerate(open(os.path.join(ROOT, path), encoding="utf-8"), 1):
        m = re.match(r'#include "tessera/checkpoint/(.*)"', text)
        if not m:
            continue
        folder = os.path.dirname(m.group(1))
        if folder in ORDER and ORDER.index(folder) > ORDER.index(own):
            bad.append((path, n, m.group(1)))
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=10, help="how many of the longest functions to list")
    args = ap.parse_args()
    fns = []
    for f in tracked(["src", "tools"], (".cpp", ".h")):
        fns += functions(f)
    fns.sort(reverse=True)
    print("longest functions (lines):")
    for n, name, path, start in fns[:args.top]:
        print("  %4d  %s  (%s:%d)" % (n, name, path, start))
    big = []
    for f in tracked(["src", "tools", "python/tessera_ckpt"], (".cpp", ".h", ".py")):
        n = sum(1 for _ in open(os.path.join(ROOT, f), encoding="utf-8"))
        if n > 600:
            big.append((n, f))
    print("files over 600 lines: %d" % len(big))
    for n, f in sorted(big, reverse=True):
        print("  %5d  %s" % (n, f))
    bad = []
    for f in tracked(["src/tessera/checkpoint"], (".cpp", ".h")):
        bad += against_order(f)
    print("includes against checkpoint/'s folder order (%s): %d" % (" < ".join(o or "top level" for o in ORDER), len(bad)))
    for path, n, inc in bad:
        print("  %s:%d includes %s" % (path, n, inc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
