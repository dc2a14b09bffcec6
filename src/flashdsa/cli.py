"""``flashdsa`` command line: ``info`` | ``demo`` | ``bench`` (also ``python -m flashdsa``).

* ``flashdsa info``: versions, GPU and compute capability, which backend each op uses on this machine.
* ``flashdsa demo [--device cpu|cuda] [--size small|full]``: one DeepSeek-V3.2 DSA attention layer on random
  inputs (indexer -> top-k -> sparse MLA forward -> one decode step over paged bf16 and FP8 caches), each stage on
  the auto backend checked against ``backend="reference"``; exit code 1 if a check fails.
* ``flashdsa bench [--op NAME] [--quick] [--json PATH] [--plot PATH] [--backend B] [--check]``: the benchmark
  suites (:mod:`flashdsa.bench`), one JSON per suite in ``benchmarks/results/``.

``main(argv)`` returns the exit code (the console script passes it to ``sys.exit``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table

import flashdsa

from . import _dispatch
from .bench import flops as F
from .bench.harness import max_error, time_fn

console = Console()
if not console.is_terminal:  # pipes and logs: wide enough for the tables
    console = Console(width=160)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(name: Optional[str]) -> torch.device:
    name = name or _default_device()
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda requested but no CUDA GPU is available")
    return torch.device(name)


# ------------------------------------------------------------------------------------------------ info
def _version(pkg: str) -> Optional[str]:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_info(args) -> int:
    """Versions, GPU, and the backend ``auto`` picks for each op on this machine (tilelang is not imported)."""
    tl = _version("tilelang") if importlib.util.find_spec("tilelang") is not None else None
    vt = Table(title="FlashDSA environment", show_header=False)
    vt.add_column("item", style="bold")
    vt.add_column("value")
    vt.add_row("flashdsa", flashdsa.__version__)
    vt.add_row("python", platform.python_version())
    vt.add_row("torch", torch.__version__)
    vt.add_row("tilelang", tl or "not installed (kernels unavailable; references run everywhere)")
    vt.add_row("CUDA (torch build)", torch.version.cuda or "none (CPU build)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            vt.add_row(f"GPU {i}", f"{p.name}, compute capability {p.major}.{p.minor} (sm_{p.major}{p.minor}), "
                       f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
    else:
        vt.add_row("GPU", "no CUDA GPU")
    env = _dispatch.ENV_VAR
    vt.add_row(env, os.environ.get(env, "") or "(unset: auto)")
    console.print(vt)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    bt = Table(title=f"Backend per op on {dev} (backend='auto')")
    bt.add_column("op", style="bold")
    bt.add_column("backend")
    bt.add_column("why")
    for op in _dispatch.OPS:
        try:
            backend, reason = _dispatch.describe(op, dev)
        except Exception as e:  # noqa: BLE001 - e.g. a bad FLASHDSA_BACKEND value
            backend, reason = "error", f"{type(e).__name__}: {e}"
        style = {"kernel": "green", "reference": "yellow"}.get(backend, "red")
        bt.add_row(op, f"[{style}]{backend}[/{style}]", reason)
    console.print(bt)
    return 0


# ------------------------------------------------------------------------------------------------ demo
class _Demo:
    """Runs stages, times the auto backend, checks it against the reference, collects table rows."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rows: list[tuple] = []
        self.failed = False

    def stage(self, name: str, shapes: str, public: str, dispatch_op: str, call: Callable[[str], Any],
              tol: float, flops: Optional[float] = None, nbytes: Optional[float] = None):
        """Run ``call("auto")`` (timed) and ``call("reference")``; returns the auto output (None if skipped)."""
        if not callable(getattr(flashdsa, public, None)):
            self.rows.append((name, shapes, "—", "—", "—", "—", "[yellow]skipped: op missing[/yellow]"))
            return None
        try:
            backend = _dispatch.resolve_backend(dispatch_op, "auto", self.device)
        except Exception:  # noqa: BLE001
            backend = "auto"
        try:
            out = call("auto")  # first call (compiles a kernel if needed), not timed
            backend = _dispatch.last_choice(dispatch_op) or backend
            if self.device.type == "cuda":
                ms = time_fn(lambda _: call("auto"), [None], self.device, warmup=3, reps=10, max_seconds=5).ms_median
            else:  # the CPU reference: one more call, host clock
                t0 = time.perf_counter()
                out = call("auto")
                ms = (time.perf_counter() - t0) * 1e3
            ref = call("reference")
            err = max_error(out, ref)
        except Exception as e:  # noqa: BLE001 - report the stage, keep going
            self.failed = True
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:120]
            self.rows.append((name, shapes, backend, "—", "—", "—", f"[red]error: {msg}[/red]"))
            return None
        ok = err <= tol
        self.failed |= not ok
        if flops is not None:
            rate = f"{F.rate(flops, ms):.3g} TFLOP/s"
        elif nbytes is not None:
            rate = f"{nbytes / (ms * 1e6):.3g} GB/s"
        else:
            rate = "—"
        self.rows.append((name, shapes, backend, f"{ms:.3g}", rate, f"{err:.2e} (tol {tol:g})",
                          "[green]ok[/green]" if ok else "[red]FAIL[/red]"))
        return out

    def table(self, title: str) -> Table:
        t = Table(title=title)
        for c in ("stage", "shapes", "backend", "time ms", "rate", "max error", "ok"):
            t.add_column(c, overflow="fold")
        for r in self.rows:
            t.add_row(*r)
        return t


def cmd_demo(args) -> int:
    """One DeepSeek-V3.2 DSA attention layer on random inputs; every stage checked against the reference."""
    device = _device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "small")
    S, SKV, K = (4096, 8192, 2048) if size == "full" else (128, 512, 64)
    HI, DI, H, DQK, DV, P = 64, 128, 128, 576, 512, 64
    g = torch.Generator(device=device).manual_seed(0)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    d = _Demo(device)
    # 1. indexer (fp8): scores of every query against its causal key range [0, m + SKV - S + 1)
    q8, qs = flashdsa.quantize_fp8(rn(S, HI, DI), block=DI)
    k8, ks = flashdsa.quantize_fp8(rn(SKV, DI), block=DI)
    ks = ks[:, 0].contiguous()
    w = rn(S, HI, dtype=torch.float32) * qs[..., 0] * (HI * DI) ** -0.5
    k_end = (torch.arange(S, device=device) + SKV - S + 1).int()
    k_start = torch.zeros_like(k_end)
    logits = d.stage("indexer (fp8)", f"q [{S},{HI},{DI}] e4m3, k [{SKV},{DI}] e4m3 -> [{S},{SKV}] fp32",
                     "indexer_logits", "indexer_logits",
                     lambda b: flashdsa.indexer_logits(q8, k8, w, k_scale=ks, k_start=k_start, k_end=k_end,
                                                       backend=b),
                     tol=1e-3, flops=F.indexer_flops(HI, DI, k_start, k_end, S, SKV))
    if logits is None:  # stand-in scores so the later stages still run
        pos = torch.arange(SKV, device=device)
        logits = torch.where(pos < k_end.unsqueeze(1), rn(S, SKV, dtype=torch.float32), float("-inf"))
    # 2. top-k over each row's range
    idx = d.stage("top-k", f"[{S},{SKV}] fp32 -> [{S},{K}] int32", "topk_indices", "topk_indices",
                  lambda b: flashdsa.topk_indices(logits, K, starts=k_start, ends=k_end, backend=b),
                  tol=1e-3, nbytes=F.topk_bytes(S, SKV))
    if idx is None:
        idx = logits.topk(K, dim=-1).indices.sort(dim=-1).values.int()
    # 3. sparse MLA forward
    q = rn(S, H, DQK)
    kv = rn(SKV, DQK)
    n_valid = F.valid_count(idx, SKV)
    d.stage("sparse MLA fwd", f"q [{S},{H},{DQK}], kv [{SKV},{DQK}], idx [{S},{K}] -> out [{S},{H},{DV}] + lse",
            "sparse_mla_fwd", "sparse_mla_fwd", lambda b: flashdsa.sparse_mla_fwd(q, kv, idx, backend=b),
            tol=1e-2, flops=F.sparse_fwd_flops(H, n_valid))
    # 4. one decode step (B=1, s_q=1) over a paged cache holding the same kv behind a shuffled block table
    nblk = -(-SKV // P)
    table = torch.randperm(nblk, generator=g, device=device).int().unsqueeze(0)  # [1, nblk]
    pos = torch.arange(SKV, device=device)
    slots = table[0, pos // P].long() * P + pos % P
    cache = torch.zeros(nblk, P, DQK, dtype=torch.bfloat16, device=device)
    cache8 = torch.zeros(nblk, P, 656, dtype=torch.uint8, device=device)  # the FP8 656-byte format
    if callable(getattr(flashdsa, "write_kv_cache", None)):
        flashdsa.write_kv_cache(kv, cache, slots)
        flashdsa.write_kv_cache(kv, cache8, slots)  # quantizes on write
    else:
        cache.view(-1, DQK)[slots] = kv
        cache8.view(-1, 656)[slots] = flashdsa.quantize_kv_fp8(kv)
    seqlens = torch.tensor([SKV], dtype=torch.int32, device=device)
    qd = rn(1, 1, H, DQK)
    last = idx[-1]
    sidx = torch.where(last >= 0, slots[last.clamp_min(0).long()], -1).int().view(1, 1, K)
    ks_ = int((last >= 0).sum())
    for kind, c, rb in (("bf16", cache, F.KV_BF16_ROW_BYTES), ("fp8", cache8, F.KV_FP8_ROW_BYTES)):
        d.stage(f"decode dense {kind}", f"q [1,1,{H},{DQK}], cache [{nblk},{P},{c.shape[-1]}] {kind}, len {SKV}",
                "mla_decode", "mla_decode",
                lambda b, c=c: flashdsa.mla_decode(qd, c, table, seqlens, backend=b),
                tol=1e-2, nbytes=F.decode_bytes(SKV, rb, 1, 1, H))
        d.stage(f"decode sparse {kind}", f"q [1,1,{H},{DQK}], cache {kind}, indices [1,1,{K}] (slots)",
                "mla_decode", "mla_decode",
                lambda b, c=c: flashdsa.mla_decode(qd, c, None, None, indices=sidx, backend=b),
                tol=1e-2, nbytes=F.decode_bytes(ks_, rb, 1, 1, H))
    console.print(d.table(f"DeepSeek-V3.2 DSA layer on {device} ({size}: S={S}, S_kv={SKV}, K={K}, "
                          f"indexer H={HI} D={DI}, MLA H={H} {DQK}/{DV})"))
    console.print("errors: max|auto - reference| / max|reference| on finite entries (masks must match); "
                  "top-k: fraction of differing indices")
    if d.failed:
        console.print("[red]demo: a stage failed its check[/red]")
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ bench
def _json_path(args, suite: str, n_suites: int, env: dict) -> Path:
    from .bench.harness import default_json_path

    if args.json:
        p = Path(args.json)
        return p if n_suites == 1 else p.with_name(f"{p.stem}_{suite}{p.suffix or '.json'}")
    return default_json_path(Path(args.results_dir), env, suite)


def _fmt(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.4g}"


def _suite_table(doc: dict) -> Table:
    t = Table(title=f"{doc['suite']} on {doc.get('gpu') or 'CPU'} (backend {doc['backend']})")
    for c in ("case", "backend", "median ms", "p10", "p90", "TFLOP/s", "TB/s", "target", "check"):
        t.add_column(c, overflow="fold")
    for c in doc["cases"]:
        st = c.get("status", "")
        if st != "ok":
            t.add_row(c["name"], f"[yellow]{st}[/yellow]" if st.startswith("skipped") else f"[red]{st}[/red]",
                      *[""] * 5, c.get("target", ""), "")
            continue
        chk = c.get("check")
        chk_s = "" if not chk else (f"[green]{chk['max_err']:.1e}[/green]" if chk["ok"] else
                                    f"[red]{chk['max_err']:.1e} > {chk['tol']:g}[/red]")
        extra = f" (torch.topk {c['baseline']['ms_median']:.3g} ms)" if c.get("baseline") else ""
        g = c.get("graph") or {}
        extra += f" (graph {g['ms_median']:.3g} ms)" if "ms_median" in g else (" (graph: error)" if g else "")
        t.add_row(c["name"], c.get("backend", ""), _fmt(c["ms_median"]) + extra, _fmt(c["ms_p10"]),
                  _fmt(c["ms_p90"]), _fmt(c.get("tflops")), _fmt(c.get("tbps")), c.get("target", ""), chk_s)
    return t


def cmd_bench(args, argv: Sequence[str]) -> int:
    """Run the suites; one JSON per suite; exit 1 if a check fails or a case errors."""
    from .bench import get_cases
    from .bench.harness import run_suite, write_json
    from .bench.suites import SUITES

    device = _device(args.device)
    suites = [args.op] if args.op else list(SUITES)
    command = "flashdsa " + " ".join(shlex.quote(a) for a in argv)
    if args.list:
        for s in suites:
            cases, note = get_cases(s, device, args.quick)
            console.print(f"[bold]{s}[/bold]" + (f"  ({note})" if note else ""))
            for c in cases:
                console.print(f"  {c.name}  {c.params}  target {c.target}")
        return 0
    docs, bad = [], False
    for s in suites:
        cases, note = get_cases(s, device, args.quick)
        if args.case:
            cases = [c for c in cases if any(sub in c.name for sub in args.case)]
            if not cases:
                continue
        console.print(f"[bold]{s}[/bold]: {len(cases)} cases on {device}" + (f" — {note}" if note else ""))

        def on_case(r):
            ms = f"{r['ms_median']:.4g} ms" if r.get("status") == "ok" else r.get("status")
            console.print(f"  {r['name']}: {ms}")

        doc = run_suite(s, cases, device, backend=args.backend, check=args.check, quick=args.quick, note=note,
                        command=command, graph=args.graph, on_case=on_case,
                        log=(lambda m: console.print(m, markup=False)) if args.verbose else (lambda m: None))
        if args.case:
            doc["case_filter"] = list(args.case)  # a partial run: the report takes only these rows from it
        path = write_json(doc, _json_path(args, s, len(suites), doc))
        console.print(_suite_table(doc))
        console.print(f"wrote {path}")
        docs.append(doc)
        for c in doc["cases"]:
            bad |= c.get("status", "").startswith("error") or (c.get("check") is not None and not c["check"]["ok"])
    if args.plot:
        from .bench.report import plot

        why = plot(docs, args.plot)
        console.print(f"wrote {args.plot}" if why is None else f"[yellow]--plot: {why}[/yellow]")
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    from .bench.suites import SUITES

    ap = argparse.ArgumentParser(prog="flashdsa", description="FlashDSA: DeepSeek Sparse Attention kernels "
                                 "(TileLang, Hopper) with PyTorch references.")
    ap.add_argument("--version", action="version", version=f"flashdsa {flashdsa.__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="{info,demo,bench}")
    sub.add_parser("info", help="versions, GPU, and which backend each op uses here")
    p = sub.add_parser("demo", help="one DSA attention layer on random inputs, every stage checked")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--size", choices=("small", "full"), default=None,
                   help="full: S=4096, S_kv=8192, K=2048 (default on GPU); small: S=128, S_kv=512, K=64 (CPU)")
    p = sub.add_parser("bench", help="benchmark suites -> JSON in benchmarks/results/")
    p.add_argument("--op", choices=SUITES, default=None, help="one suite (default: all)")
    p.add_argument("--quick", action="store_true", help="reduced case list (GPU) and fewer reps")
    p.add_argument("--json", metavar="PATH", help="output file (several suites: PATH with _<suite> appended)")
    p.add_argument("--results-dir", default="benchmarks/results", help="default output folder (%(default)s)")
    p.add_argument("--plot", metavar="PATH", help="also write a PNG bar chart (needs matplotlib)")
    p.add_argument("--backend", choices=_dispatch.BACKENDS, default="auto")
    p.add_argument("--check", action="store_true", help="run the reference on the same inputs first, report error")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--case", action="append", metavar="SUBSTR",
                   help="only the cases whose name contains SUBSTR (repeatable); the JSON records the filter")
    p.add_argument("--graph", action="store_true",
                   help="CUDA: also time each case as one CUDA-graph replay (the host's part of an eager call out of "
                        "the timed interval; a diagnostic in the JSON's 'graph' entries, not a README figure)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing cases")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "info":
        return cmd_info(args)
    if args.cmd == "demo":
        return cmd_demo(args)
    if args.cmd == "bench":
        return cmd_bench(args, argv)
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
