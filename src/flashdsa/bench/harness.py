"""Benchmark harness: timing (CUDA events or perf_counter), environment record, running one suite to JSON.

Timing rule: warm up, then N timed runs; each run is preceded by an L2 flush
(a 256 MB buffer written) outside the timed region; inputs rotate over several independent sets when one set fits
in L2; the result is the median with p10/p90. On CPU the same loop runs with ``time.perf_counter``.
Inputs are random (never zeros) and built once per case, outside timing.
"""

from __future__ import annotations

import datetime as _dt
import functools
import gc
import importlib.metadata
import json
import math
import platform
import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from . import flops as F

FLUSH_BYTES = 256 * 1024 * 1024
MAX_ROTATE = 8  # most input sets kept alive for rotation


@dataclass
class Timing:
    """Times of one case in milliseconds: median, p10, p90 over ``reps`` timed runs."""

    ms_median: float
    ms_p10: float
    ms_p90: float
    reps: int


# ------------------------------------------------------------------------------------------------ timing
@functools.lru_cache(maxsize=4)
def _flush_buffer(device_str: str) -> torch.Tensor:
    return torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device_str)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def l2_bytes(device: torch.device) -> int:
    """L2 size of ``device`` (0 on CPU)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 50 * 1024 * 1024))


def rotation_count(set_bytes: int, device: torch.device) -> int:
    """Input sets to rotate over: enough that rotating touches >= 4x L2 when one set fits in L2, else 1."""
    l2 = l2_bytes(device)
    if l2 == 0 or set_bytes <= 0 or set_bytes >= l2:
        return 1
    return max(1, min(MAX_ROTATE, math.ceil(4 * l2 / set_bytes)))


def time_fn(fn: Callable[[Any], Any], arg_sets: Sequence[Any], device: torch.device, *, warmup: int = 3,
            reps: int = 20, min_reps: int = 3, max_seconds: float = 10.0, flush_l2: bool = True,
            warm_seconds: float = 0.1) -> Timing:
    """Median/p10/p90 milliseconds of ``fn(arg_sets[i % len(arg_sets)])``.

    Two warm-up calls always run (the first may compile); the second, timed with a host clock, estimates the cost:
    when ``reps`` runs would exceed ``max_seconds`` the count shrinks (never below ``min_reps``) and further
    warm-up is skipped; otherwise the calls repeat for ``warm_seconds`` more (GPU clocks ramp up from idle). CUDA:
    events around each call, a 256 MB buffer written before each (outside the events) to flush L2 (as
    ``triton.testing.do_bench`` and nvbench do; ``$FLASHDSA_L2_FLUSH=read`` reads it instead, which leaves L2 clean:
    after a write, up to the L2's size of dirty lines are written back while the timed kernel runs, which a
    memory-bound kernel pays for; a diagnostic, such runs stay out of the README table). CPU:
    ``time.perf_counter``.  Python's garbage collector is off while the timed calls are issued (as in ``timeit``):
    a collection pass over the many objects of compiled kernels stalls the host, and a short call launched late
    shows that stall as GPU time.
    """
    n = len(arg_sets)
    fn(arg_sets[0])  # first call: JIT compile / module load, never used for the estimate
    _sync(device)
    t0 = time.perf_counter()
    fn(arg_sets[1 % n])
    _sync(device)
    est = time.perf_counter() - t0
    if est * (reps + warmup) > max_seconds:
        reps = max(min_reps, min(reps, int(max_seconds / max(est, 1e-9))))
        warmup = 0
    for i in range(2, warmup):
        fn(arg_sets[i % n])
    _sync(device)
    if device.type == "cuda" and warmup > 0 and warm_seconds > 0:
        # keep the GPU busy for warm_seconds before timing: an idle H200 sits at a few hundred MHz and takes tens of
        # ms to reach its boost clock, which otherwise inflates the first timed runs of short kernels
        t_end = time.perf_counter() + warm_seconds
        batch = max(1, min(64, int(0.005 / max(est, 1e-6))))
        i = 0
        while time.perf_counter() < t_end:
            for _ in range(batch):
                fn(arg_sets[i % n])
                i += 1
            _sync(device)
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        times = _timed_calls(fn, arg_sets, device, reps, flush_l2)
    finally:
        if gc_was_on:
            gc.enable()
    return _timing(times)


def _timing(times: Sequence[float]) -> Timing:
    """Median / p10 / p90 of per-call milliseconds."""
    t = torch.tensor(times, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64)).tolist()
    return Timing(ms_median=q[0], ms_p10=q[1], ms_p90=q[2], reps=len(times))


def time_graph(fn: Callable[[], Any], device: torch.device, *, reps: int = 20, flush_l2: bool = True) -> Timing:
    """Median/p10/p90 milliseconds of ``fn()`` captured once in a CUDA graph and replayed ``reps`` times in
    :func:`time_fn`'s timed loop (each replay between two events, after the same L2 flush).  One replay is one host
    call, so the host work of an eager call (validation, dispatch, launches) leaves the timed interval: the GPU
    time of the op as a serving runtime replays it.  A diagnostic beside the eager figure (``bench --graph``)."""
    graph, _outs = capture_graph(fn)  # the outputs live in the graph's pool while it replays
    for _ in range(3):
        graph.replay()
    return _timing(_timed_calls(lambda _: graph.replay(), [None], device, reps, flush_l2))


def _timed_calls(fn, arg_sets, device, reps: int, flush_l2: bool) -> list[float]:
    """Milliseconds of each of ``reps`` calls (``time_fn``'s and ``time_graph``'s timed loop)."""
    n = len(arg_sets)
    times: list[float] = []
    if device.type == "cuda":
        buf = _flush_buffer(str(device)) if flush_l2 else None
        read_flush = os.environ.get("FLASHDSA_L2_FLUSH", "write") == "read"
        if buf is not None and read_flush:
            buf.fill_(0)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if buf is not None:
                if read_flush:
                    buf.sum()
                else:
                    buf.fill_(i)
            starts[i].record()
            fn(arg_sets[i % n])
            ends[i].record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fn(arg_sets[i % n])
            times.append((time.perf_counter() - t0) * 1e3)
    return times


# ------------------------------------------------------------------------------------------------ environment
def capture_graph(fn: Callable[[], Any], warmup: int = 2):
    """(graph, ``fn``'s outputs inside it): ``fn`` run ``warmup`` times on a side stream first (compiles and lazy
    allocations stay out of the capture, as the CUDA-graph notes ask), then captured once on the current device."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def _pkg_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_info() -> dict:
    """Commit (``None`` outside a git checkout or before the first commit) and dirty flag: whether the package
    source (``src/flashdsa``, untracked files included) differs from that commit."""
    if os.environ.get("FLASHDSA_COMMIT"):  # a copy of the tree without .git (the GPU host): the caller says
        return {"commit": os.environ["FLASHDSA_COMMIT"], "dirty": os.environ.get("FLASHDSA_DIRTY", "0") == "1"}
    src = Path(__file__).resolve().parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=src)
    status = _run(["git", "status", "--porcelain", "--", "."], cwd=src.parent)  # the package, untracked files too
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def gpu_slug(name: Optional[str]) -> str:
    """'NVIDIA H200' -> 'h200'; None -> 'cpu'."""
    if not name:
        return "cpu"
    s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


def environment(device: torch.device) -> dict:
    """GPU name/capability/clocks, driver, CUDA/torch/tilelang/python versions, CPU, git commit, date, and the
    ``FLASHDSA_*`` environment switches set (``env``)."""
    env: dict[str, Any] = {
        "gpu": None, "capability": None, "sm_count": None, "driver": None, "clocks": None,
        "cuda": torch.version.cuda, "torch": torch.__version__, "tilelang": _pkg_version("tilelang"),
        "flashdsa": _pkg_version("flashdsa"), "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "device": str(device),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                   gpu_memory_gib=round(p.total_memory / 2**30, 1), l2_mib=round(l2_bytes(device) / 2**20, 1))
        smi = _run(["nvidia-smi", f"--id={device.index or 0}", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,"
                    "clocks.mem,power.limit", "--format=csv,noheader"])
        if smi:
            parts = [x.strip() for x in smi.split(",")]
            env["driver"] = parts[0]
            env["clocks"] = dict(zip(("sm", "sm_max", "mem", "power_limit"), parts[1:]))
    env.update(git_info())
    # kernel-selection switches in force (e.g. FLASHDSA_NARROW_CACHE656): part of what was measured
    switches = {k: v for k, v in sorted(os.environ.items())
                if k.startswith("FLASHDSA_") and k not in ("FLASHDSA_COMMIT", "FLASHDSA_DIRTY")}
    if switches:
        env["env"] = switches
    return env


def default_json_path(results_dir: Path, env: dict, suite: str) -> Path:
    """``<results_dir>/<date>_<gpu-slug>_<shortsha>_<suite>.json``."""
    sha = (env.get("commit") or "nocommit")[:8] + ("-dirty" if env.get("dirty") else "")
    return results_dir / f"{env['date'][:10]}_{gpu_slug(env.get('gpu'))}_{sha}_{suite}.json"


# ------------------------------------------------------------------------------------------------ compare
def max_error(out: Any, ref: Any) -> float:
    """Normalised max error between two outputs (tensor or tuple of tensors), the worst over the tuple.

    Float tensors: ``max|a - b| / max|ref|`` over the positions where ``ref`` is finite; inf if the non-finite
    positions (the -inf masks, +inf lse of empty rows) differ or ``out`` has NaN. Integer tensors (top-k
    indices): fraction of positions that differ.
    """
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    worst = 0.0
    for a, b in zip(outs, refs):
        if a is None or b is None:
            continue
        a, b = a.detach(), b.detach().to(a.device)
        if a.shape != b.shape:
            return math.inf
        if not a.is_floating_point():
            worst = max(worst, float((a != b).float().mean()) if a.numel() else 0.0)
            continue
        a, b = a.double(), b.double()
        fin = torch.isfinite(b)
        if torch.isnan(a).any() or not torch.equal(torch.where(fin, 0.0, b), torch.where(fin, 0.0, a)):
            return math.inf
        if fin.any():
            scale = max(float(b[fin].abs().max()), 1e-12)
            worst = max(worst, float((a[fin] - b[fin]).abs().max()) / scale)
    return worst


# ------------------------------------------------------------------------------------------------ suites
def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(v) for v in x)
    return 0


def _short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:300]


def run_case(case, device: torch.device, *, backend: str, check: bool, quick: bool, graph: bool = False,
             log: Callable[[str], None] = lambda s: None) -> dict:
    """Build inputs, optionally run the reference first (``check``), time the chosen backend; one JSON row.
    ``graph`` (CUDA only): also :func:`time_graph` on the first input set, as the row's ``graph`` entry (or its
    error: an op path that syncs with the host cannot be captured)."""
    from .. import _dispatch

    row: dict[str, Any] = {"name": case.name, "params": dict(case.params), "target": case.target,
                           "backend": None, "status": None, "ms_median": None, "ms_p10": None, "ms_p90": None,
                           "reps": 0, "flops": None, "bytes": None, "tflops": None, "tbps": None}
    missing = [n for n in case.requires if not _has_public(n)]
    if missing:
        row["status"] = f"skipped: op missing ({', '.join(missing)})"
        return row
    try:
        row["backend"] = _dispatch.resolve_backend(case.dispatch_op, backend, device)
    except NotImplementedError as e:
        row["status"] = f"skipped: {_short_error(e)}"
        return row
    except Exception:  # noqa: BLE001 - dispatch does not know this op yet
        row["backend"] = backend
    gen = torch.Generator(device=device).manual_seed(case.seed)
    first = sets = None
    try:
        first = case.build(device, gen)
        n = rotation_count(_tensor_bytes(first), device) if device.type == "cuda" else 1
        sets = [first] + [case.build(device, gen) for _ in range(n - 1)]
        row["input_sets"] = n
        counts = case.counts(first)
        if check:
            ref = case.reference(first)
            out = case.run(first, backend)
            err = max_error(out, ref)
            row["check"] = {"max_err": err, "tol": case.tol, "ok": bool(err <= case.tol),
                            "metric": "max|out-ref|/max|ref| (finite), masks equal; ints: mismatch fraction"}
            del ref, out
        if case.measure_memory and device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            case.run(first, backend)
            torch.cuda.synchronize(device)
            row["peak_temp_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        reps = case.reps_quick if quick else case.reps
        t = time_fn(lambda s: case.run(s, backend), sets, device, warmup=2 if quick else 5, reps=reps,
                    min_reps=min(case.min_reps, reps), max_seconds=case.max_seconds * (0.5 if quick else 1.0))
        row["backend"] = _dispatch.last_choice(case.dispatch_op) or row["backend"]  # the path actually taken
        if case.baseline is not None:
            tb = time_fn(case.baseline, sets, device, warmup=2 if quick else 5, reps=reps,
                         max_seconds=case.max_seconds * (0.5 if quick else 1.0))
            row["baseline"] = {"name": case.baseline_name, "ms_median": tb.ms_median,
                               "speedup": tb.ms_median / t.ms_median if t.ms_median > 0 else None}
        if graph and device.type == "cuda":
            row["graph"] = _graph_entry(lambda: case.run(first, backend), device, reps, log)
    except NotImplementedError as e:
        row["status"] = f"skipped: {_short_error(e)}"
        return row
    except (TypeError, ValueError) as e:
        row["status"] = f"skipped: unsupported inputs ({_short_error(e)})"
        return row
    except Exception as e:  # noqa: BLE001 - a broken case must not stop the suite
        row["status"] = f"error: {_short_error(e)}"
        log(traceback.format_exc())
        return row
    finally:
        first = sets = None  # free this case's inputs before the next case builds its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flops, nbytes = counts.get("flops"), counts.get("bytes")
    row.update(status="ok", ms_median=t.ms_median, ms_p10=t.ms_p10, ms_p90=t.ms_p90, reps=t.reps,
               flops=flops, bytes=nbytes, tflops=F.rate(flops, t.ms_median), tbps=F.rate(nbytes, t.ms_median))
    return row


def _graph_entry(fn, device: torch.device, reps: int, log: Callable[[str], None]) -> dict:
    """``run_case``'s ``graph`` entry: the :func:`time_graph` figures, or why the call was not captured.

    A call that synchronises with the host cannot be captured, and a capture that fails part-way can leave
    PyTorch's current stream and graph memory pool in capture state for the rest of the process.  So the call
    first runs once with PyTorch's sync debug mode set to "error" and is captured only if nothing synchronised."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - e.g. .item() / .tolist() on a device tensor
        log(traceback.format_exc())
        return {"error": "not captured, the call synchronises with the host: " + _short_error(e)}
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    stream = torch.cuda.current_stream(device)
    try:
        tg = time_graph(fn, device, reps=max(reps, 10))
    except Exception as e:  # noqa: BLE001 - the row keeps its eager figures
        log(traceback.format_exc())
        torch.cuda.set_stream(stream)  # torch.cuda.graph leaves its side stream current when capture_end raises
        return {"error": _short_error(e.__context__ or e)}
    return {"ms_median": tg.ms_median, "ms_p10": tg.ms_p10, "ms_p90": tg.ms_p90, "reps": tg.reps}


def _has_public(name: str) -> bool:
    import flashdsa

    return callable(getattr(flashdsa, name, None))


def run_suite(suite: str, cases: list, device: torch.device, *, backend: str = "auto", check: bool = False,
              quick: bool = False, note: str = "", command: Optional[str] = None, graph: bool = False,
              log: Callable[[str], None] = lambda s: None, on_case: Callable[[dict], None] = lambda r: None) -> dict:
    """Run every case of one suite; returns the JSON document (environment + cases).  ``graph``: each row also
    gets ``run_case``'s CUDA-graph timing."""
    env = environment(device)
    doc = {**env, "suite": suite, "backend": backend, "quick": quick, "check": check, "note": note,
           "command": command or " ".join(shlex.quote(a) for a in ["flashdsa", *sys.argv[1:]]), "cases": []}
    for case in cases:
        row = run_case(case, device, backend=backend, check=check, quick=quick, graph=graph, log=log)
        doc["cases"].append(row)
        on_case(row)
    return doc


def write_json(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path
