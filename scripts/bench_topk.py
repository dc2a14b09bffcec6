"""Time the radix top-k paths on the issue shapes (k = 2048, random float32) and check them exactly.

Run on the GPU host from the repo root:  source .gpu/env.sh && python scripts/bench_topk.py [--json out.json]

Per shape it prints microseconds (median of ``--reps`` calls, CUDA events, a 256 MiB L2-flush fill before each call,
outside the events, as ``flashdsa.bench.harness``) for:
  * old:     the path the router picked before ``kernel_radix_persist`` existed (single / multi4);
  * new:     ``kernel_radix.run_topk_indices`` with today's routing (``impl`` in the output);
  * each forced path that applies: single (one CTA per row), orig (the same before this change: pass-0 unroll 4,
    512 threads for N <= 8192),
    cand (single with candidate compaction), multi4 (4 launches), persist (one launch, row barriers);
  * api:     ``flashdsa.topk_indices`` (what ``flashdsa bench --op topk`` times: dispatch + validation + kernel);
    host time exceeding the 256 MiB flush fill (~75 us) shows up here; api_host_us / new_host_us are host times;
  * graph:   the new path replayed from a CUDA graph (GPU time without host launch overhead);
  * torch:   ``torch.topk(x, k, dim=-1)``.
Exactness: every path equals ``topk_indices_reference`` (randn input, a tie-heavy input, random ranges) and, on
randn, ``torch.topk``'s index set sorted ascending.
"""

import argparse
import json
import sys

import torch

SHAPES = [(64, 32768), (4096, 8192), (16, 131072), (1, 1048576)]
TARGET_US = {(64, 32768): 40, (4096, 8192): 150, (16, 131072): 50, (1, 1048576): 60}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--shapes", default=None, help="e.g. 64x32768,1x1048576")
    ap.add_argument("--threads-sweep", action="store_true", help="also time the one-CTA kernel at 256/512/1024 threads")
    ap.add_argument("--paths", default=None, help="only these forced paths, e.g. single,untuned,lean8m5")
    args = ap.parse_args()

    import flashdsa
    from flashdsa.topk import kernel_radix as kr
    from flashdsa.topk import kernel_radix_multi as km
    from flashdsa.topk.reference import topk_indices_reference

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device=dev)
    k = args.k
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        a = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps)]
        b = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps)]
        for i in range(args.reps):
            flush.fill_(i)
            a[i].record()
            fn()
            b[i].record()
        torch.cuda.synchronize()
        ts = sorted(x.elapsed_time(y) * 1e3 for x, y in zip(a, b))
        return round(ts[len(ts) // 2], 1)

    def host_us(fn, reps=30):
        """Host time of one call (launches are asynchronous; synchronised between calls)."""
        import time

        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return round(sorted(ts)[len(ts) // 2], 1)

    rows = []
    ok_all = True
    for M, N in shapes:
        gen = torch.Generator(device=dev).manual_seed(M * 7 + N)
        x = torch.randn(M, N, generator=gen, device=dev)
        old_impl = "multi4" if km.use_multi(M, N, "index", sms) else "single"
        new_impl = kr.pick_impl(M, N, "index", sms)
        # single: today's one-CTA kernel; orig: its schedule before this change (pass-0 unroll 4); cand: compaction
        paths = {"single": dict(impl="single"), "orig": dict(impl="single", u0=4, threads=512 if N <= 8192 else None), "cand": dict(impl="single", cand=True)}
        if km.pick_groups(M, N, sms) >= 2:
            paths["multi4"] = dict(impl="multi4")
        from flashdsa.topk import kernel_radix_persist as kp

        if kp.pick_groups(M, N, sms) >= 2:
            paths["persist"] = dict(impl="persist")
        # one-CTA kernel tunings (u0, min_ctas, lean): untuned = the schedule before kernel_radix.TUNED
        paths["untuned"] = dict(impl="single", tune=(kr.pick_u0(*kr.pick_config(N)), 0, False))
        if N <= 8192:
            paths["lean8m5"] = dict(impl="single", tune=(8, 5, True))
            paths["m5"] = dict(impl="single", tune=(16, 5, False))
            # keys in registers (kernel_radix_regs): threads x keys per thread, __launch_bounds__ minimum CTAs
            for t, kpt, mc in ((256, 32, 4), (256, 32, 3), (512, 16, 2), (1024, 8, 1)):
                paths[f"regs{t}m{mc}"] = dict(impl="regs", regs=(t, kpt, mc))
            paths["regs_safe"] = dict(impl="regs", regs=(256, 32, 4, False))  # TileLang's load bounds checks kept
        if args.paths:
            keep = set(args.paths.split(","))
            paths = {nm: kw for nm, kw in paths.items() if nm in keep}
        if args.threads_sweep and N <= 32768:
            for t in (256, 512, 1024):
                paths[f"single_t{t}"] = dict(impl="single", threads=t)
        row = {"M": M, "N": N, "k": k, "old_impl": old_impl, "new_impl": new_impl, "target_us": TARGET_US.get((M, N))}
        # ---- exactness ----
        if not args.no_check:
            xt = torch.round(torch.randn(M, N, generator=gen, device=dev) * 2) / 2  # heavy ties at the threshold
            st = torch.randint(0, N // 2 + 1, (M,), generator=gen, device=dev, dtype=torch.int32)
            en = torch.clamp(st + torch.randint(0, N + 1, (M,), generator=gen, device=dev, dtype=torch.int32), max=N)
            tk = torch.topk(x, min(k, N), dim=-1).indices.sort(dim=-1).values.int()
            refs = [(x, None, None, topk_indices_reference(x, k)), (xt, None, None, topk_indices_reference(xt, k)),
                    (x, st, en, topk_indices_reference(x, k, st, en))]
            check = {}
            for name, kw in paths.items():
                good = True
                for inp, s_, e_, ref in refs:
                    got = kr.run_topk_indices(inp, k, s_, e_, "index", **kw)
                    good &= bool(torch.equal(got, ref))
                got = kr.run_topk_indices(x, k, **kw)
                good &= bool(torch.equal(got[:, :min(k, N)], tk))
                again = kr.run_topk_indices(xt, k, **kw)
                good &= bool(torch.equal(again, kr.run_topk_indices(xt, k, **kw)))
                check[name] = good
                ok_all &= good
            row["exact"] = check
        # ---- timing ----
        for name, kw in paths.items():
            row[f"{name}_us"] = timed(lambda kw=kw: kr.run_topk_indices(x, k, **kw))
        row["old_us"] = row.get("multi4_us") if old_impl == "multi4" else row.get("orig_us")
        row["new_us"] = timed(lambda: kr.run_topk_indices(x, k))
        row["api_us"] = timed(lambda: flashdsa.topk_indices(x, k, backend="kernel"))
        row["api_host_us"] = host_us(lambda: flashdsa.topk_indices(x, k, backend="kernel"))
        row["new_host_us"] = host_us(lambda: kr.run_topk_indices(x, k))
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = kr.run_topk_indices(x, k)
            g.replay()
            torch.cuda.synchronize()
            row["graph_equal"] = bool(torch.equal(out, kr.run_topk_indices(x, k)))
            row["graph_us"] = timed(g.replay)
        except Exception as e:  # noqa: BLE001 - report and go on
            row["graph_us"] = f"capture failed: {type(e).__name__}: {e}"[:200]
        row["torch_topk_us"] = timed(lambda: torch.topk(x, k, dim=-1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("ALL EXACT" if ok_all else "MISMATCH FOUND")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
