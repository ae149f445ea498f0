#!/usr/bin/env python3
"""Every repository path a comment or a doc names must exist (issue 45 item 9).

Scans
  - the comments of the sources under src/, tools/, tests/, examples/, bench/, fuzz/,
    python/, scripts/, cmake/ and .ci/, and of the top-level CMakeLists.txt and Makefile
    (C/C++ `//` and `/* */`; Python `#` and triple-quoted strings that start a line, i.e.
    docstrings; shell, CMake, make and requirements files `#`);
  - the whole text of README.md, docs/*.md and every other tracked *.md;
for words that look like paths of this repository (`src/tessera/checkpoint/reader.cpp`,
`storage/file.h`, `docs/cli.md`, `_format_metadata.py`, `tests/reliability/`,
`store_gate.{h,cpp}`, `test_*.cpp`), and for links and section references between the docs:
a markdown link `[x](cli.md#restarts)` must name an existing file and, for a .md, one of its
headings (GitHub's anchor) or an `<a id=...>`; `docs/reliability.md, "The rendezvous store"`
must be the start of a heading or of a paragraph's bold lead there; `checkpoint-format.md §4`
a numbered heading. Prints `file:line: ...` for each one that names nothing and exits 1;
exits 0 when all resolve. Python 3 standard library only; about a second.

A word counts as a path when it holds a `/` and starts with a top-level folder of the
repository (`src/...`, `docs/...`) or ends with `/` (a folder: `interop/`), or when it ends
with a source file's extension (`.cpp`, `.h`, `.py`, `.md`, ...; see SOURCE_EXT). Absolute
paths (`/proc/...`, `/tmp/...`, `/usr/...`) and URLs are never this repository's. A path
resolves, in this order, against the repository root, the mentioning file's folder,
src/tessera/, src/, tests/ and python/tessera_ckpt/, and then as the tail of any file or
folder of the tree (`interop/hf_dir.h`, a bare `load.cpp`); `*`, `?` and `{a,b}` are
expanded against the tree. The tree is `git ls-files` (tracked, and untracked files that
are not ignored); outside a git checkout, the files on disk.

What is not this repository's but looks like it (another project's sources that comments
cite, files the build generates, names the programs create at run time, example paths of a
user) is listed in ALLOWED below, each with the reason: add a line there rather than
loosening the matcher.

  python3 scripts/check-doc-paths.py [--root DIR] [-v]
"""
import argparse
import fnmatch
import os
import re
import subprocess
import sys

# ---- what is not a path of this repository, although it looks like one -------------------
# (pattern, where): `pattern` is an fnmatch pattern matched against the word as written
# (after a leading `./` is dropped; a pattern ending in `/*` also matches the folder
# itself), `where` one against the mentioning file ("*": anywhere).
ALLOWED = [
    # Files the build generates: build folders, CMake's generated headers (config.h from
    # cmake/config.h.in, the tests' python_features.h), the per-layer include roots, the
    # installed package's config files.
    ("build/*", "*"), ("build-*/*", "*"), ("generated/*", "*"), ("tessera/config.h", "*"),
    ("config.h", "*"), ("tessera_tests/*", "*"), ("layers/*", "*"),
    ("TesseraConfig.cmake", "*"), ("TesseraConfigVersion.cmake", "*"),
    # The project's Python environments (scripts/setup-python.sh) and the GPU tool's
    # dependency pack (scripts/gpu-pack-deps.sh): made on the machine, ignored by git.
    (".venv/*", "*"), (".venv-torch2/*", "*"), (".venv-xla/*", "*"), (".gpu-deps/*", "*"),
    # What programs write when they run: the fuzzers' crash inputs, the GPU check's result,
    # the fixture script's probe output (scripts/xla_fixtures.py writes probe-cpu-<n>.txt
    # beside the fixtures it makes; not kept in the tree).
    ("fuzz/artifacts/*", "*"), ("bench/results/gpu.json", "*"), ("probe-cpu-*.txt", "*"),
    # Keys in the rendezvous store, not files: the launchers' round keys.
    ("tessera/launch/*", "*"),
    # A placeholder in a usage line.
    ("path/to/*", "*"),
    # Other projects' files that comments cite: libtorch and PyTorch (torch/distributed/
    # checkpoint's metadata.py, filesystem.py, default_planner.py), torch_xla
    # (state_dict_utils.py, its example test_train_mp_mnist_fsdp_with_ckpt.py) and XLA,
    # c10d, Gloo, CLI11, nlohmann json, GoogleTest, the C library and the kernel.
    ("torch/*", "*"), ("ATen/*", "*"), ("c10/*", "*"), ("c10d/*", "*"), ("caffe2/*", "*"),
    ("gloo/*", "*"), ("CLI/*", "*"), ("nlohmann/*", "*"), ("gtest/*", "*"), ("gmock/*", "*"),
    ("benchmark/*", "*"), ("sys/*", "*"), ("linux/*", "*"), ("external/xla/*", "*"),
    ("metadata.py", "*/dcp_import.cpp"),
    ("filesystem.py", "*/dcp_import.cpp"),
    ("default_planner.py", "*/dcp_import.cpp"),
    ("state_dict_utils.py", "docs/checkpoint-format.md"),
    ("test_train_mp_mnist_fsdp_with_ckpt.py", "*/xla_fixtures.py"),
    # Files that are gone, named as history by a text that says so.
    ("file_io.cpp", "docs/architecture.md"),  # "file_io.cpp held three concepts ... and is now three files"
    ("_format.py", "docs/architecture.md"),  # the measurements of the review's HEAD (16cd367), before the split
]

# Top-level folders: a word starting with one of them (and a `/`) is taken as a path.
TOP_DIRS = ("src", "tools", "tests", "examples", "bench", "fuzz", "python", "scripts",
            "cmake", "docs", ".ci")
# A word ending with one of these is taken as a file of the repository.
SOURCE_EXT = (".cpp", ".cc", ".h", ".hpp", ".cu", ".py", ".md", ".sh", ".cmake", ".supp",
              ".in", ".txt", ".toml")
# Where a path may be relative to (besides the repository root and the mentioning file).
BASES = ("src/tessera", "src", "tests", "python/tessera_ckpt")
# Which files are scanned, and how their comments are found.
SCAN_DIRS = ("src/", "tools/", "tests/", "examples/", "bench/", "fuzz/", "python/",
             "scripts/", "cmake/", ".ci/")
SCAN_TOP = ("CMakeLists.txt", "Makefile")
SELF = "scripts/check-doc-paths.py"
C_LIKE = (".cpp", ".cc", ".h", ".hpp", ".cu", ".in")
HASH_LIKE = (".sh", ".cmake", ".supp", ".txt", ".toml", ".mk")

WORD = re.compile(r"(?<![\w./*?{}+@$-])(?:[\w.*?+-]|\{[\w.,]*\}|/)+")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
# `docs/cli.md, "Restarts"` or `reliability.md, "The rendezvous store"`: a heading that
# starts with the quoted text. `checkpoint-format.md §3` (or `§2.1`): a numbered heading.
QUOTED_SECTION = re.compile(r"([\w./-]+\.md),? \"([^\"]+)\"")
NUMBERED_SECTION = re.compile(r"([\w./-]+\.md),? §\s?(\d+(?:\.\d+)*)")


def tree(root):
    """Every file of the checkout, as paths relative to root, and every folder above one."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=root, capture_output=True, check=True).stdout
        files = {f for f in out.decode().split("\0") if f and os.path.exists(os.path.join(root, f))}
    except (OSError, subprocess.CalledProcessError):
        files = set()
        for d, sub, names in os.walk(root):
            sub[:] = [s for s in sub if not s.startswith((".git", ".venv", "build"))]
            files.update(os.path.relpath(os.path.join(d, n), root) for n in names)
    dirs = set()
    for f in files:
        parts = f.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return files, dirs


C_TOKENS = re.compile(r"""
    (?P<line>//[^\n]*)
  | (?P<block>/\*.*?(?:\*/|\Z))
  | \bR"(?P<delim>[^()\\\s]{0,16})\(.*?\)(?P=delim)"
  | "(?:\\.|[^"\\\n])*"
  | (?<!\w)'(?:\\.|[^'\\\n])*'
""", re.S | re.X)

PY_TOKENS = re.compile(r"""
    (?P<comment>\#[^\n]*)
  | (?P<lead>^[ \t]*[rRuU]?)(?P<doc>\"\"\".*?\"\"\"|\'\'\'.*?\'\'\')
  | [rRbBuUfF]{0,2}(?:\"\"\".*?\"\"\"|\'\'\'.*?\'\'\'|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
""", re.S | re.X | re.M)


def _pieces(text, matches):
    """(line, text) of each line of each matched comment."""
    out, line, pos = [], 1, 0
    for start, body in matches:
        line += text.count("\n", pos, start)
        pos = start
        for k, part in enumerate(body.split("\n")):
            out.append((line + k, part))
    return out


def c_comments(text):
    """(line, text) of each // and /* */ comment, skipping string and character literals."""
    return _pieces(text, ((m.start(), m.group()[2:]) for m in C_TOKENS.finditer(text)
                          if m.group("line") or m.group("block")))


def python_comments(text):
    """(line, text) of each # comment and each triple-quoted string that starts its line
    (docstrings), skipping other string literals."""
    found = []
    for m in PY_TOKENS.finditer(text):
        if m.group("comment"):
            found.append((m.start(), m.group("comment")[1:]))
        elif m.group("doc"):
            found.append((m.start("doc"), m.group("doc")[3:-3]))
    return _pieces(text, found)


def hash_comments(text):
    """(line, text) of each # comment of a shell script, CMake file or Makefile."""
    out = []
    for no, ln in enumerate(text.split("\n"), 1):
        quote = None
        for k, c in enumerate(ln):
            if quote:
                if c == "\\":
                    continue
                if c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c == "#" and (k == 0 or ln[k - 1] in " \t;("):
                out.append((no, ln[k + 1:]))
                break
    return out


def markdown_lines(text):
    return list(enumerate(text.split("\n"), 1))


def scanned(files):
    """The files to scan and how to read their comments."""
    for f in sorted(files):
        if f == SELF:  # its own allow-list names what does not exist
            continue
        if f.endswith(".md"):
            yield f, markdown_lines
        elif f.startswith(SCAN_DIRS) or f in SCAN_TOP:
            base = os.path.basename(f)
            if f.endswith(C_LIKE):
                yield f, c_comments
            elif f.endswith(".py"):
                yield f, python_comments
            elif f.endswith(HASH_LIKE) or base in ("Makefile", "CMakeLists.txt") or f.endswith(".supp"):
                yield f, hash_comments
            elif f.startswith(("scripts/", ".ci/")) and "." not in base:
                yield f, hash_comments


def expand_braces(word):
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    out = []
    for alt in m.group(1).split(","):
        out.extend(expand_braces(word[:m.start()] + alt + word[m.end():]))
    return out


def is_candidate(word, dir_names):
    """Whether a word is meant as a path of this repository (see the module's docstring)."""
    if "/" in word:
        first = word.split("/")[0]
        if word.startswith(("/", "~")) or not first:  # absolute: /proc, /tmp, /usr/share, ...
            return False
        if first.isupper():  # a placeholder: OUT/checkpoints, DIR/text.txt
            return False
        if first in TOP_DIRS:
            return True
        if word.endswith("/") and first in dir_names:  # a folder of the tree: interop/, support/
            return True
    for w in expand_braces(word):
        last = w.rstrip("/").split("/")[-1]
        if last.endswith(SOURCE_EXT) and len(last) > len(last.rsplit(".", 1)[-1]) + 1:
            return True
    return False


def allowed(word, mentioned_in):
    for pat, where in ALLOWED:
        if not fnmatch.fnmatchcase(mentioned_in, where):
            continue
        if fnmatch.fnmatchcase(word, pat) or (pat.endswith("/*") and word.rstrip("/") == pat[:-2]):
            return True
    return False


class Tree:
    def __init__(self, files, dirs):
        self.files, self.dirs = files, dirs
        self.all = files | dirs
        self.tails = {}
        for p in self.all:
            parts = p.split("/")
            for i in range(len(parts)):
                self.tails.setdefault("/".join(parts[i:]), []).append(p)

    def exists(self, path):
        path = os.path.normpath(path)
        if any(c in path for c in "*?["):
            return any(fnmatch.fnmatchcase(p, path) for p in self.all)
        return path in self.all

    def resolve(self, word, mentioned_in):
        for w in expand_braces(word):
            w = w.rstrip("/")
            if w.startswith("./"):
                w = w[2:]
            here = os.path.dirname(mentioned_in)
            bases = ["", here] + list(BASES)
            if not any(self.exists(os.path.join(b, w)) for b in bases):
                if any(c in w for c in "*?["):
                    if not any(fnmatch.fnmatchcase(t, w) for t in self.tails):
                        return False
                elif w.startswith("../") or w not in self.tails:
                    return False
        return True


def headings(text):
    """The headings of a markdown file outside code blocks, and its explicit anchors."""
    heads, anchors, leads, fence = [], set(), [], False
    for ln in text.split("\n"):
        if ln.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if re.match(r"#{1,6} ", ln):
            heads.append(ln.lstrip("#").strip())
        anchors.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", ln))
        m = re.match(r"\s*(?:- )?\*\*([^*]+)\*\*", ln)  # a paragraph's bold lead: **Consolidation memory: ...**
        if m:
            leads.append(m.group(1))
    return heads, anchors, leads


def slug(heading):
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("-v", "--verbose", action="store_true", help="print every path checked, ok or MISSING")
    args = ap.parse_args()
    root = args.root
    files, dirs = tree(root)
    t = Tree(files, dirs)
    dir_names = {d.split("/")[-1] for d in dirs}
    doc_cache = {}

    def doc_headings(path):
        if path not in doc_cache:
            with open(os.path.join(root, path), encoding="utf-8") as fh:
                doc_cache[path] = headings(fh.read())
        return doc_cache[path]

    def find_doc(name, mentioned_in):
        for b in ("", os.path.dirname(mentioned_in), "docs"):
            p = os.path.normpath(os.path.join(b, name))
            if p in files:
                return p
        return None

    problems, checked = [], 0
    for f, reader in scanned(files):
        try:
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        is_md = f.endswith(".md")
        for line, comment in reader(text):
            if is_md:
                # markdown links: the target and its anchor
                for m in MD_LINK.finditer(comment):
                    target = m.group(1)
                    if URL.match(target) or target.startswith(("mailto:", "/")):
                        continue
                    path, _, anchor = target.partition("#")
                    doc = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
                    checked += 1
                    if doc not in t.all:
                        problems.append(f"{f}:{line}: link to {target}: {doc} does not exist")
                    elif anchor and doc.endswith(".md"):
                        heads, anchors, _ = doc_headings(doc)
                        if anchor not in anchors and anchor not in {slug(h) for h in heads}:
                            problems.append(f"{f}:{line}: link to {target}: {doc} has no heading #{anchor}")
            text_ = URL.sub(" ", MD_LINK.sub("]", comment) if is_md else comment)
            for m in QUOTED_SECTION.finditer(text_):
                doc = find_doc(m.group(1), f)
                if not doc:
                    continue
                heads, anchors, leads = doc_headings(doc)
                want = m.group(2).lower()
                if not (want in {a.lower() for a in anchors} or any(h.lower().startswith(want) for h in heads + leads)):
                    problems.append(f"{f}:{line}: {m.group(1)}, \"{m.group(2)}\": no such section in {doc}")
            for m in NUMBERED_SECTION.finditer(text_):
                doc = find_doc(m.group(1), f)
                num = m.group(2)
                if doc and not any(re.match(re.escape(num) + r"[. ]", h) for h in doc_headings(doc)[0]):
                    problems.append(f"{f}:{line}: {m.group(1)} §{num}: no heading numbered {num} in {doc}")
            for m in WORD.finditer(text_):
                word = m.group(0).rstrip(".,;:")
                while word.endswith(")") or word.endswith("'"):
                    word = word[:-1]
                if not word or not is_candidate(word, dir_names):
                    continue
                if word.startswith("./"):
                    word = word[2:]
                if allowed(word, f):
                    continue
                checked += 1
                ok = t.resolve(word, f)
                if args.verbose:
                    print(f"{f}:{line}: {word} {'ok' if ok else 'MISSING'}")
                if not ok:
                    problems.append(f"{f}:{line}: {word} does not exist")
    for p in problems:
        print(p)
    if problems:
        print(f"check-doc-paths: {len(problems)} of {checked} paths named in comments and docs do not exist "
              f"(fix the mention, or add a commented pattern to ALLOWED in {os.path.relpath(__file__, root)})",
              file=sys.stderr)
        return 1
    print(f"check-doc-paths: {checked} paths named in comments and docs exist")
    return 0


if __name__ == "__main__":
    sys.exit(main())
