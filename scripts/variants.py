"""Time kernel variants on the H200 (tuning aid; results go to docs/, the README table comes from `flashdsa bench`).

    python scripts/variants.py [--out DIR]

* sparse MLA forward: the pipelined kernel (kernel_fwd) vs the warp-specialized one (kernel_fwd_ws)
* indexer prefill: (block_n, cols, num_stages) configurations of kernel_prefill
Median of CUDA-event timings after warm-up; random inputs; each variant checked against the default one.
"""

import argparse
import json
import os
import statistics

import torch
import tilelang

from flashdsa.indexer import kernel_prefill
from flashdsa.sparse_mla import kernel_fwd, kernel_fwd_ws


def bench(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sparse_cases(rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, H, dqk, topk, skv, sink in [("V32_H128", 128, 576, 2048, 8192, False), ("V32_H64", 64, 576, 2048, 8192, False),
                                          ("V32_H128_SKV128K", 128, 576, 2048, 131072, False),
                                          ("V4_h64_topk640_sink", 64, 512, 640, 8192, True)]:
        S = 4096
        q = (torch.randn(S, H, dqk, generator=g, device="cuda") * 0.5).bfloat16()
        kv = (torch.randn(skv, dqk, generator=g, device="cuda") * 0.5).bfloat16()
        idx = torch.stack([torch.randperm(skv, generator=g, device="cuda")[:topk] for _ in range(64)])
        idx = idx.repeat(S // 64, 1).sort(dim=-1).values.int()
        s = torch.randn(H, generator=g, device="cuda") if sink else None
        flops = 2 * S * H * topk * (dqk + 512)
        ref = None
        for mod in (kernel_fwd, kernel_fwd_ws):
            why = mod.kernel_unsupported(q, kv, idx, d_v=512, attn_sink=s)
            if why:
                rows.append({"op": "sparse_mla_fwd", "case": name, "variant": mod.__name__, "skipped": why})
                continue
            try:
                fn = lambda: mod.run_sparse_mla_fwd(q, kv, idx, sm_scale=dqk ** -0.5, d_v=512, attn_sink=s)  # noqa: E731
                out = fn()[0].float()
                err = 0.0 if ref is None else ((out - ref).abs().max() / ref.abs().max()).item()
                ref = out if ref is None else ref
                ms = bench(fn)
                rows.append({"op": "sparse_mla_fwd", "case": name, "variant": mod.__name__, "ms": ms,
                             "tflops": flops / ms / 1e9, "rel_err_vs_first": err})
            except Exception as e:  # noqa: BLE001
                rows.append({"op": "sparse_mla_fwd", "case": name, "variant": mod.__name__, "error": repr(e)[:300]})
            print(rows[-1], flush=True)


def indexer_cases(rows):
    g = torch.Generator(device="cuda").manual_seed(1)
    for H, D, N in [(64, 128, 8192), (32, 64, 8192), (64, 128, 32768)]:
        M = 4096
        q = torch.randn(M, H, D, generator=g, device="cuda").to(torch.float8_e4m3fn)
        k = torch.randn(N, D, generator=g, device="cuda").to(torch.float8_e4m3fn)
        w = torch.rand(M, H, generator=g, device="cuda")
        ks = torch.rand(N, generator=g, device="cuda")
        end = (torch.arange(M, device="cuda", dtype=torch.int32) + (N - M + 1))
        start = torch.zeros(M, dtype=torch.int32, device="cuda")
        flops = 2 * H * D * float((end - start).sum())
        configs = [(128, None, 3), (128, None, 4), (128, None, 2), (128, 128, 3), (128, 128, 4)]
        funcs = [kernel_prefill.build_indexer_prefill(heads=H, dim=D, block_n=bn, cols=c, num_stages=st)
                 for bn, c, st in configs]
        kernels = tilelang.par_compile(funcs, target="cuda", pass_configs=kernel_prefill._pass_configs(),
                                       ignore_error=True)
        ref = None
        for (bn, c, st), kern in zip(configs, kernels):
            tag = f"bn{bn}_cols{c or kernel_prefill.default_cols(H)}_st{st}"
            if kern is None:
                rows.append({"op": "indexer", "case": f"H{H}_D{D}_N{N}", "variant": tag, "error": "compile failed"})
                continue
            out = torch.empty(M, N, device="cuda")
            fn = lambda: kern(q.view(M * H, D), k, w.view(-1), ks, start, end, out)  # noqa: E731
            try:
                fn()
                fin = torch.isfinite(out)
                err = 0.0 if ref is None else ((out[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item()
                ref = out.clone() if ref is None else ref
                ms = bench(fn)
                rows.append({"op": "indexer", "case": f"H{H}_D{D}_N{N}", "variant": tag, "ms": ms,
                             "tflops": flops / ms / 1e9, "rel_err_vs_first": err})
            except Exception as e:  # noqa: BLE001
                rows.append({"op": "indexer", "case": f"H{H}_D{D}_N{N}", "variant": tag, "error": repr(e)[:300]})
            print(rows[-1], flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", choices=["sparse", "indexer"], default=None)
    a = ap.parse_args()
    rows = []
    if a.only in (None, "sparse"):
        sparse_cases(rows)
    if a.only in (None, "indexer"):
        indexer_cases(rows)
    with open(os.path.join(a.out, "variants.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
