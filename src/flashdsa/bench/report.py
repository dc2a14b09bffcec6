"""Render the README performance table from the newest H200 benchmark JSON of each suite.

Usage::

    python -m flashdsa.bench.report                          # print the markdown table
    python -m flashdsa.bench.report --update-readme README.md # replace the text between the markers

The README holds the table between ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->``. Only GPU runs
count (a CPU run measures the reference at shrunk shapes) unless ``--include-cpu`` is given, and of those only the
runs on the GPU the issues' targets are set on: ``TARGET_GPU``, the H200, matched as a whole word of the JSON's
``gpu`` name (not GH200); ``--gpu`` names another. An H100 run compares builds; it is not a README row. Every
figure links its JSON file ("no figure in prose without its JSON"). Runs made with ``FLASHDSA_*`` kernel-selection
switches set (``env`` in the JSON) measure a non-default configuration and stay out of the table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from .suites import SUITES

START = "<!-- perf-table:start -->"
END = "<!-- perf-table:end -->"
DEFAULT_RESULTS = Path("benchmarks/results")
TARGET_GPU = "H200"  # the README's rows: runs whose ``gpu`` names this


def load_results(results_dir: Path | str = DEFAULT_RESULTS) -> list[tuple[Path, dict]]:
    """Every readable ``*.json`` in ``results_dir`` that looks like a bench document (has suite and cases)."""
    out = []
    d = Path(results_dir)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and "suite" in doc and isinstance(doc.get("cases"), list):
            out.append((p, doc))
    return out


def _key(p: Path, doc: dict) -> tuple[str, str]:
    return str(doc.get("date", "")), p.name


def _counts(doc: dict, include_cpu: bool, gpu: str) -> bool:
    """Whether a run may give README rows: default kernels (no ``env``), on a GPU whose name holds ``gpu`` as a
    whole word, case-insensitive (or on the CPU where ``include_cpu``)."""
    if doc.get("env"):
        return False
    if not doc.get("gpu"):
        return include_cpu
    return re.search(rf"\b{re.escape(gpu)}\b", doc["gpu"], re.IGNORECASE) is not None


def newest_per_suite(results: Sequence[tuple[Path, dict]], include_cpu: bool = False,
                     gpu: str = TARGET_GPU) -> dict[str, tuple[Path, dict]]:
    """suite -> (path, doc) of the newest whole-suite run on ``gpu`` (``_counts``) by its ``date`` field (file
    name breaks ties); runs of a subset of the cases (``flashdsa bench --case``: ``case_filter`` in the JSON) are
    left to ``newer_partial_rows``."""
    best: dict[str, tuple[Path, dict]] = {}
    for p, doc in results:
        if not _counts(doc, include_cpu, gpu) or doc.get("case_filter"):
            continue
        cur = best.get(doc["suite"])
        if cur is None or _key(p, doc) > _key(*cur):
            best[doc["suite"]] = (p, doc)
    return best


def newer_partial_rows(results: Sequence[tuple[Path, dict]], suite: str, base: tuple[Path, dict],
                       include_cpu: bool = False, gpu: str = TARGET_GPU) -> dict[str, tuple[Path, dict, dict]]:
    """case name -> (path, doc, case row) from partial runs of ``suite`` on ``gpu`` newer than its whole-suite run
    ``base`` (the newest such run per case)."""
    rows: dict[str, tuple[Path, dict, dict]] = {}
    for p, doc in results:
        if doc["suite"] != suite or not doc.get("case_filter") or not _counts(doc, include_cpu, gpu):
            continue
        if _key(p, doc) <= _key(*base):
            continue
        for c in doc["cases"]:
            cur = rows.get(c["name"])
            if cur is None or _key(p, doc) > _key(cur[0], cur[1]):
                rows[c["name"]] = (p, doc, c)
    return rows


def _source_line(label: str, path: Path, doc: dict, link_prefix: str) -> str:
    commit = (doc.get("commit") or "uncommitted")[:8] + (" (dirty)" if doc.get("dirty") else "")
    where = doc.get("gpu") or f"CPU ({doc.get('cpu', '')})"
    note = f"; {doc['note']}" if doc.get("note") else ""
    note += "".join(f"; {k}={v}" for k, v in (doc.get("env") or {}).items())
    return (f"- {label}: [`{path.name}`]({link_prefix}{path.as_posix()}) — {where}, {doc.get('date', '?')}, commit "
            f"{commit}, torch {doc.get('torch')}, tilelang {doc.get('tilelang')}; `{doc.get('command', '')}`{note}")


def _fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "—"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}g}"


def _order(suite: str) -> int:
    return SUITES.index(suite) if suite in SUITES else len(SUITES)


def render_readme_table(results_dir: Path | str = DEFAULT_RESULTS, include_cpu: bool = False,
                        link_prefix: str = "", gpu: str = TARGET_GPU) -> str:
    """Markdown: one row per case of the newest JSON per suite on ``gpu`` (``_counts``), then the source of each
    suite's numbers.

    ``link_prefix`` is prepended to the JSON paths in the links (e.g. ``""`` when the README sits at the repo root
    and ``results_dir`` is relative to it).
    """
    results = load_results(results_dir)
    newest = newest_per_suite(results, include_cpu=include_cpu, gpu=gpu)
    if not newest:
        return (f"_No {gpu} benchmark results yet: run `flashdsa bench` on an {gpu}; the JSON lands in "
                "`benchmarks/results/` and `python -m flashdsa.bench.report --update-readme README.md` fills "
                "this table._")
    # "graph ms": one CUDA-graph replay after the same flush (``bench --graph``), beside the eager median: where
    # they differ, the eager figure includes host time (small batches)
    lines = ["| suite | workload | median ms | graph ms | TFLOP/s | TB/s | target | backend |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    sources = []
    for suite in sorted(newest, key=_order):
        path, doc = newest[suite]
        partial = newer_partial_rows(results, suite, newest[suite], include_cpu, gpu)
        partial_docs: list[tuple[Path, dict]] = []
        for c in doc["cases"]:
            mark = ""
            if c["name"] in partial:
                p_path, p_doc, c = partial[c["name"]]
                if (p_path, p_doc) not in partial_docs:
                    partial_docs.append((p_path, p_doc))
                mark = " " + "*" * (1 + partial_docs.index((p_path, p_doc)))
            status = c.get("status", "ok")
            backend = c.get("backend", doc.get("backend", "")) if status == "ok" else status
            ms = c.get("ms_median") if status == "ok" else None
            graph_ms = (c.get("graph") or {}).get("ms_median") if status == "ok" else None
            lines.append(f"| {suite} | `{c['name']}`{mark} | {_fmt(ms)} | {_fmt(graph_ms)} | {_fmt(c.get('tflops'))} | "
                         f"{_fmt(c.get('tbps'))} | {c.get('target', '')} | {backend} |")
        sources.append(_source_line(suite, path, doc, link_prefix))
        for i, (p_path, p_doc) in enumerate(partial_docs):
            label = f"{suite}, rows marked {'*' * (i + 1)} (a later run of those cases only)"
            sources.append(_source_line(label, p_path, p_doc, link_prefix))
    return "\n".join(lines + ["", "Sources (newest run per suite):", ""] + sources)


def update_readme(readme: Path | str, table: str) -> bool:
    """Replace the text between the markers in ``readme`` with ``table``; True when the file changed.

    Raises ValueError when the markers are missing or out of order.
    """
    p = Path(readme)
    text = p.read_text()
    a, b = text.find(START), text.find(END)
    if a < 0 or b < 0 or b < a:
        raise ValueError(f"{p}: expected the markers {START} ... {END} in this order")
    new = text[:a + len(START)] + "\n" + table.rstrip() + "\n" + text[b:]
    if new != text:
        p.write_text(new)
        return True
    return False


def plot(docs: Sequence[dict], path: Path | str) -> Optional[str]:
    """Write a PNG bar chart (one panel per suite: TFLOP/s, else TB/s, else ms per case) to ``path``.

    Returns None on success, else why nothing was written (matplotlib missing, nothing timed).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'flashdsa[plot]'); no plot written"
    panels = []
    for doc in docs:
        ok = [c for c in doc["cases"] if c.get("status") == "ok"]
        if not ok:
            continue
        unit = "TFLOP/s" if all(c.get("tflops") for c in ok) else "TB/s" if all(c.get("tbps") for c in ok) else "ms"
        key = {"TFLOP/s": "tflops", "TB/s": "tbps", "ms": "ms_median"}[unit]
        panels.append((doc, unit, [c["name"] for c in ok], [c[key] for c in ok]))
    if not panels:
        return "no timed cases to plot"
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + sum(0.45 * len(p[2]) + 0.8 for p in panels)),
                             squeeze=False)
    for ax, (doc, unit, names, vals) in zip(axes[:, 0], panels):
        ax.barh(range(len(vals)), vals, color="#4C72B0")
        ax.set_yticks(range(len(vals)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_title(f"{doc['suite']} — {doc.get('gpu') or 'CPU'} — backend {doc.get('backend')}", fontsize=9)
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashdsa.bench.report", description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(DEFAULT_RESULTS), help="folder of bench JSON (default %(default)s)")
    ap.add_argument("--update-readme", metavar="README", help="replace the perf table between the markers")
    ap.add_argument("--include-cpu", action="store_true", help="also use CPU runs (reference, shrunk shapes)")
    ap.add_argument("--gpu", default=TARGET_GPU, help="only runs on a GPU whose name holds this (default %(default)s)")
    args = ap.parse_args(argv)
    table = render_readme_table(args.results, include_cpu=args.include_cpu, gpu=args.gpu)
    if args.update_readme:
        try:
            changed = update_readme(args.update_readme, table)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"{args.update_readme}: {'updated' if changed else 'already up to date'}")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
