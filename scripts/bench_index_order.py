"""A/B: does the order of the selected indices change the sparse MLA forward's speed? (issue #5 asks.)

Same index sets, three orders, one run: "sorted" (ascending, what ``topk_indices(order="index")`` returns),
"shuffled" (each row randomly permuted), "clustered" (sorted, then a random rotation per row: two ascending runs).
The op is ``flashdsa.sparse_mla_fwd`` (the dispatched kernel), timed with ``flashdsa.bench.harness.time_fn`` (CUDA
events, L2 flush before each run, median). Outputs must agree across orders up to summation order.

    source .gpu/env.sh && python scripts/bench_index_order.py [--json out.json] [--cases V32_H128,V32_H128_SKV128K]
"""

import argparse
import json
import sys

import torch

CASES = {
    "V32_H128": dict(S=4096, SKV=8192, H=128, topk=2048),
    "V32_H128_SKV128K": dict(S=4096, SKV=131072, H=128, topk=2048),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import flashdsa
    from flashdsa.bench.harness import time_fn
    from flashdsa.bench.suites import unique_indices

    dev = torch.device("cuda")
    rows, ok = [], True
    for name in args.cases.split(","):
        c = CASES[name]
        gen = torch.Generator(device=dev).manual_seed(7)
        S, SKV, H, K = c["S"], c["SKV"], c["H"], c["topk"]
        q = (torch.randn(S, H, 576, device=dev, generator=gen) * 0.1).bfloat16()
        kv = (torch.randn(SKV, 576, device=dev, generator=gen) * 0.1).bfloat16()
        srt = unique_indices(S, SKV, K, dev, gen, sort=True)
        perm = torch.rand(S, K, device=dev, generator=gen).argsort(dim=-1)
        shuf = torch.gather(srt, 1, perm)
        rot = torch.randint(0, K, (S, 1), device=dev, generator=gen)
        clus = torch.gather(srt, 1, (torch.arange(K, device=dev)[None, :] + rot) % K)
        flops = 2 * S * H * K * (576 + 512)
        outs, rec = {}, dict(case=name, **c)
        for order, idx in (("sorted", srt), ("shuffled", shuf), ("clustered", clus)):
            fn = lambda a: flashdsa.sparse_mla_fwd(q, kv, a, sm_scale=576**-0.5, d_v=512)  # noqa: E731
            t = time_fn(fn, [idx], dev, reps=args.reps)
            outs[order] = fn(idx)[0].float()
            rec[f"{order}_ms"] = round(t.ms_median, 4)
            rec[f"{order}_tflops"] = round(flops / t.ms_median / 1e9, 1)
        for order in ("shuffled", "clustered"):
            d = float((outs[order] - outs["sorted"]).abs().max())
            rec[f"{order}_max_diff"] = d
            ok &= d < 1e-2
        rec["shuffled_over_sorted"] = round(rec["shuffled_ms"] / rec["sorted_ms"], 3)
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("OUTPUTS AGREE" if ok else "OUTPUT MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
