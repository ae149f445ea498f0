#!/usr/bin/env python3
"""Renders bench/results/*.json into the tables of docs/benchmarks-history.md.

Each result file has {"benchmark": NAME, "rows": [...], ...}; its table replaces
the text between <!-- BEGIN NAME --> and <!-- END NAME --> in docs/benchmarks-history.md
(appended as a new section when the markers are missing).
"""
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks-history.md"


def fmt(v):
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def flatten(prefix, v, out, sep="."):
    if isinstance(v, dict):
        for k, x in v.items():
            flatten(f"{prefix}{sep}{k}" if prefix else k, x, out, sep)
    else:
        out.append((prefix, v))


def table(doc):
    rows = doc.get("rows", [])
    if not rows:
        # A result without rows: one "measure | value" line per leaf.
        pairs = []
        flatten("", {k: v for k, v in doc.items() if k != "benchmark"}, pairs)
        return "| measure | value |\n|---|---|\n" + "".join(f"| {k} | {fmt(v)} |\n" for k, v in pairs)
    cols = list(rows[0].keys())
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
    meta = {k: v for k, v in doc.items() if k not in ("rows", "benchmark")}
    lines = "\n".join(out) + "\n"
    if meta:
        # Nested results (ratios, memory) as one "a / b: value" line each.
        pairs = []
        flatten("", meta, pairs, sep=" / ")
        lines += "\n" + "".join(f"- {k}: {fmt(v)}\n" for k, v in pairs)
    return lines


def main():
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        name = doc.get("benchmark", path.stem)
        block = f"<!-- BEGIN {name} -->\n{table(doc)}<!-- END {name} -->"
        pat = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
        if pat.search(text):
            text = pat.sub(lambda _: block, text)
        else:
            text += f"\n## {name}\n\n{block}\n"
    DOC.write_text(text)
    print(f"updated {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
