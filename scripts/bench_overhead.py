"""Where the time of a small public-API call goes: host submission vs GPU work (run on the GPU host).

    python scripts/bench_overhead.py [--json out.json]

Cases: the V4 ``sparse_attn`` decode-shaped call of issue #8 (b 128, m 1, n 8192, h 64, d 512, topk 640, sink) and
the memory-bound dense decode of issue #6 (B 64, H 16, s_q 1, cache 8192, block 64), each also on the ``flashdsa
bench`` case's own inputs (``--suite-cases``).  Per case, medians of:
  * ``eager``: CUDA events around one eager call, L2 flushed before it (what ``flashdsa bench`` reports),
  * ``host``: wall time to submit one call without synchronising (mean over 50 back-to-back calls),
  * ``graph``: the call captured in a CUDA graph and replayed (events around the replay, L2 flushed),
  * ``kernels``: the GPU time of each kernel the call launches (torch.profiler, mean over 10 calls).
"""

import argparse
import json
import statistics
import sys
import time

import torch

try:
    import flashdsa
except ImportError:  # run from a checkout without an install: use its src/
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
    import flashdsa


def _events(fn, reps, flush):
    ts = []
    for i in range(reps):
        flush.fill_(i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def graph_ms(fn, reps, flush):
    """Median ms of ``fn`` captured in a CUDA graph and replayed (events around each replay, L2 flushed), after
    two warm-up calls on a side stream (what capture needs)."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _events(g.replay, reps, flush)


def _measure(fn, reps, flush):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    res = {"eager_ms": _events(fn, reps, flush)}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    res["host_ms"] = (time.perf_counter() - t0) / 50 * 1e3
    res["graph_ms"] = graph_ms(fn, reps, flush)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    res["kernels"] = {e.key[:60]: round(e.device_time_total / e.count / 1e3, 4) for e in prof.key_averages()
                      if e.device_time_total > 0}
    return res


def v4_decode_inputs(gen):
    """q [128, 1, 64, 512], kv [128, 8192, 512], sink [64], sorted topk_idxs [128, 1, 640] (also scripts/host_stages.py)."""
    b, n, h, d, topk = 128, 8192, 64, 512, 640
    q = (torch.randn(b, 1, h, d, generator=gen, device="cuda") * 0.1).bfloat16()
    kv = (torch.randn(b, n, d, generator=gen, device="cuda") * 0.1).bfloat16()
    idx = torch.argsort(torch.rand(b, n, generator=gen, device="cuda"), dim=1)[:, :topk].sort(dim=1).values
    idx = idx.int().view(b, 1, topk).contiguous()
    sink = torch.randn(h, generator=gen, device="cuda")
    return q, kv, sink, idx


def dense_mem_inputs(gen):
    """q [64, 1, 16, 576], cache [8192, 64, 576] (block 64), block table, lengths 8192 (also host_stages.py)."""
    B, H, cache, bs = 64, 16, 8192, 64
    nb = B * cache // bs
    kv = (torch.randn(nb, bs, 576, generator=gen, device="cuda") * 0.1).bfloat16()
    table = torch.randperm(nb, generator=gen, device="cuda").int().view(B, cache // bs)
    lens = torch.full((B,), cache, dtype=torch.int32, device="cuda")
    q = (torch.randn(B, 1, H, 576, generator=gen, device="cuda") * 0.1).bfloat16()
    return q, kv, table, lens


def v4_decode(gen):
    q, kv, sink, idx = v4_decode_inputs(gen)
    return lambda: flashdsa.sparse_attn(q, kv, sink, idx)


def dense_mem(gen):
    q, kv, table, lens = dense_mem_inputs(gen)
    return lambda: flashdsa.mla_decode(q, kv, table, lens, causal=True)


def suite_case(suite, name):
    """The timed call of one ``flashdsa bench`` case, on that case's own inputs."""
    from flashdsa.bench.suites import get_cases

    def make(gen):
        case = {c.name: c for c in get_cases(suite, torch.device("cuda"))[0]}[name]
        inputs = case.build(torch.device("cuda"), gen)
        return lambda: case.run(inputs, "auto")

    return make


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--suite-cases", default="decode:dense_bf16_B64_H16_sq1_cache8192,"
                    "sparse_mla_fwd:V4_sparse_attn_decode_b128_m1_n8192_h64_d512_topk640_sink",
                    help="SUITE:CASE,... also measured on the suite's own inputs ('' for none)")
    ap.add_argument("--only-suite-cases", action="store_true", help="skip the two built-in cases")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device="cuda")
    rows = []
    cases = [] if args.only_suite_cases else [("v4_sparse_attn_decode_b128_h64_topk640", v4_decode),
                                              ("dense_decode_B64_H16_cache8192", dense_mem)]
    for item in filter(None, args.suite_cases.split(",")):
        suite, name = item.split(":")
        cases.append((f"suite:{name}", suite_case(suite, name)))
    for name, make in cases:
        row = {"case": name, **_measure(make(gen), args.reps, flush)}
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    if args.json:
        from flashdsa.bench.harness import environment

        with open(args.json, "w") as f:  # environment(): GPU, versions, commit, date, FLASHDSA_* switches
            json.dump(dict(environment(torch.device("cuda")), results=rows), f, indent=1)


if __name__ == "__main__":
    main()
