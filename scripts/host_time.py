"""Host time per call of benchmark cases (run on the GPU host): is a short case launch-bound?

    python scripts/host_time.py [--profile] [--plan] [--no-eager-plans] [--flushed] SUITE CASE_SUBSTRING [...]

For each matching case of ``flashdsa bench --op SUITE``: N calls issued back to back without synchronising
(host microseconds per call: the GPU queue is deep enough that the launches do not block while the host is the
slower side), the same N calls timed to the end of the GPU work (us per call, back to back, L2 not flushed), and
``bench.harness.time_fn``'s median (L2 flushed, as the suite times it).  A host time close to or above the GPU
time per call means the suite's figure for that case includes launch gaps.  ``--profile``: then 200 more calls
under cProfile, the 30 functions with the most own time and the 40 with the most cumulative time (where the host
time goes).  ``--plan``: dense decode cases also through ``mla_decode_plan`` (the plan made once, ``plan.run``
timed).  ``--no-eager-plans``: the sparse forward's and sparse FP8 decode's calls take the plain path (no plan
looked up or stored), to compare both on one host.  ``--flushed``: the suite's own flushed loop broken down per
rep (``_flushed``): host us per call inside that loop, and from a torch.profiler trace the flush kernel's time, the
GPU's idle gap between the flush's end and the call's first kernel, the call's kernel span and busy time
(medians; where an eager figure above its kernel time comes from).
"""

import cProfile
import pstats

import sys
import time

import torch

from flashdsa.bench.harness import time_fn
from flashdsa.bench.suites import get_cases


def _times(run, inputs, dev, n):
    """(host us per call issued back to back, us per call to the end of the GPU work, time_fn median us)."""
    for _ in range(5):
        run(inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run(inputs)
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    both = (time.perf_counter() - t0) / n * 1e6
    return host, both, time_fn(run, [inputs], dev, reps=30).ms_median * 1e3


def _flushed(run, inputs, dev, reps: int = 30) -> str:
    """``time_fn``'s timed loop (``harness._timed_calls``: the L2 flush before each call, events around it; the
    garbage collector off, as ``time_fn`` has it) with the host time of each call, then the same loop under
    torch.profiler: per rep the flush kernel, the idle gap after it, the call's kernels.  The trace is split into
    reps at the flush kernels (fills over 20 us: the default write flush); where that does not give ``reps`` reps of
    equal kernel counts (a call with a large fill of its own), the profiled figures are left out."""
    import gc
    from statistics import median

    from torch.profiler import ProfilerActivity, profile

    from flashdsa.bench.harness import _timed_calls

    for _ in range(3):
        run(inputs)

    def loop():
        host = []

        def timed(i):
            t0 = time.perf_counter()
            run(i)
            host.append((time.perf_counter() - t0) * 1e6)

        gc_on = gc.isenabled()
        gc.disable()
        try:
            ms = _timed_calls(timed, [inputs], dev, reps, True)
        finally:
            if gc_on:
                gc.enable()
        return median(host), median(ms) * 1e3

    host, event = loop()
    line = f"flushed loop: event median {event:.1f} us, host per call {host:.1f} us"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        p_host, p_event = loop()
    kernels = sorted((k.time_range.start, k.time_range.end, k.name) for k in prof.events()
                     if k.device_type == torch.autograd.DeviceType.CUDA and k.time_range.end > k.time_range.start)
    rows, cur = [], None
    for st, en, name in kernels:  # time_range in us; a rep = one flush kernel (a fill over the 256 MB) and what follows
        if "fill" in name.lower() and en - st > 20:
            cur = {"flush": (st, en), "calls": []}
            rows.append(cur)
        elif cur is not None:
            cur["calls"].append((st, en))
    counts = {len(r["calls"]) for r in rows}
    line += f"; profiled loop: event median {p_event:.1f} us, host per call {p_host:.1f} us"
    if len(rows) != reps or len(counts) != 1 or 0 in counts:
        return line + f" (trace not split: {len(rows)} flush-like kernels for {reps} reps, kernels per rep {counts})"
    flush = median(r["flush"][1] - r["flush"][0] for r in rows)
    gap = median(r["calls"][0][0] - r["flush"][1] for r in rows)
    span = median(r["calls"][-1][1] - r["calls"][0][0] for r in rows)
    busy = median(sum(en - st for st, en in r["calls"]) for r in rows)
    names = sorted({n for _, _, n in kernels if "fill" not in n.lower()})
    return (line + f": flush {flush:.1f} us, gap after it {gap:.1f} us, call span {span:.1f} us, busy {busy:.1f} us, "
            f"{counts.pop()} kernels per call: {[n[:60] for n in names]}")


def main(suite: str, needles: list[str], n: int = 50, profile: bool = False, plan: bool = False,
         flushed: bool = False) -> None:
    dev = torch.device("cuda")
    cases, _ = get_cases(suite, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    for case in cases:
        if not any(s in case.name for s in needles):
            continue
        inputs = case.build(dev, gen)
        runs = {case.name: lambda i: case.run(i, "auto")}
        if plan and "block_table" in inputs:  # --plan: a dense decode case's layer through mla_decode_plan
            from flashdsa import mla_decode_plan

            q = inputs["q"]
            p = mla_decode_plan(inputs["block_table"], inputs["cache_seqlens"], inputs["kv_cache"],
                                num_heads=q.shape[2], s_q=q.shape[1])
            runs[case.name + " plan.run"] = lambda i: p.run(i["q"], i["kv_cache"])
        for label, run in runs.items():
            host, both, med = _times(run, inputs, dev, n)
            print(f"{label}: host {host:.1f} us/call, back to back {both:.1f} us/call, time_fn median {med:.1f} us",
                  flush=True)
            if flushed:
                print(f"{label}: {_flushed(run, inputs, dev)}", flush=True)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                case.run(inputs, "auto")
            prof.disable()
            torch.cuda.synchronize()
            stats = pstats.Stats(prof, stream=sys.stdout)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--no-eager-plans" in flags:
        from flashdsa.decode import api as decode_api
        from flashdsa.sparse import api as sparse_api

        sparse_api._plan_key = lambda *args: None
        decode_api._plan_key = lambda *args: None
    main(args[0], args[1:], profile="--profile" in flags, plan="--plan" in flags, flushed="--flushed" in flags)
