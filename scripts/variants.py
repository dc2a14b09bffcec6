"""Time kernel variants on the H200 (tuning aid; results go to docs/, the README table comes from `flashdsa bench`).

    python scripts/variants.py [--out DIR]

* sparse MLA forward: the dispatched kernel (kernel_fwd) vs the pair kernel forced (kernel_fwd_pair)
* indexer prefill: (block_n, cols, num_stages, schedule, head_major, chains, relu_add) configurations of kernel_prefill
Median of CUDA-event timings after warm-up; random inputs; each variant checked against the default one.
"""

import argparse
import json
import os
import time

import torch
import tilelang

from flashdsa.bench.harness import time_fn
from flashdsa.indexer import kernel_prefill
from flashdsa.sparse import kernel_fwd, kernel_fwd_pair


def bench(fn, reps=20, warmup=3):
    """Median ms of ``fn()`` (CUDA events, L2 flushed before each run: ``flashdsa.bench.harness.time_fn``)."""
    return time_fn(lambda _: fn(), [None], torch.device("cuda"), warmup=warmup, reps=reps).ms_median


def sparse_cases(rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, H, dqk, topk, skv, sink in [("V32_H128", 128, 576, 2048, 8192, False),
                                          ("V32_H64", 64, 576, 2048, 8192, False),
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
        for mod in (kernel_fwd, kernel_fwd_pair):
            why = mod.kernel_unsupported(q, kv, idx, d_v=512, attn_sink=s)
            if why:
                rows.append({"op": "sparse_mla_fwd", "case": name, "variant": mod.__name__, "skipped": why})
                continue
            try:
                def fn(mod=mod, q=q, kv=kv, idx=idx, s=s, dqk=dqk):
                    return mod.run_sparse_mla_fwd(q, kv, idx, sm_scale=dqk ** -0.5, d_v=512, attn_sink=s)
                out = fn()[0].float()
                err = 0.0 if ref is None else ((out - ref).abs().max() / ref.abs().max()).item()
                ref = out if ref is None else ref
                ms = bench(fn)
                rows.append({"op": "sparse_mla_fwd", "case": name, "variant": mod.__name__, "ms": ms,
                             "tflops": flops / ms / 1e9, "rel_err_vs_first": err})
            except Exception as e:  # noqa: BLE001
                rows.append({"op": "sparse_mla_fwd", "case": name, "variant": mod.__name__, "error": repr(e)[:300]})
            print(rows[-1], flush=True)


# (block_n, cols, num_stages, schedule, head_major, chains, relu_add): the first is the reference of the error check
# (the 98d26d6 schedule: ping-pong, head-major, one serial head sum per logit); then the epilogue with `chains`
# independent partial head sums and a branch-free mask (kernel_prefill notes, "Epilogue"; default for H <= 32), its
# relu as FADD(x, |x|) on the FMA pipe, and pipeline depth 3 with it. Only the epilogue differs from the first
# config (same barriers: no new hang risk). chains changes the head-summation order: expect rel_err ~1e-7, not
# bitwise equality; relu_add with chains=4 should be bitwise equal to chains=4.
INDEXER_CONFIGS = [(128, None, 2, "pingpong", True, 1, False), (128, None, 2, "pingpong", True, 2, False),
                   (128, None, 2, "pingpong", True, 4, False), (128, None, 2, "pingpong", True, 4, True),
                   (128, None, 3, "pingpong", True, 4, False)]
INDEXER_WORKLOADS = [(64, 128, 8192), (32, 64, 8192)]  # (H, D, N), M = 4096 causal
HANG_S = 20.0  # a launch not finished after this long is a deadlock: dump what we have and exit


def _wait_or_exit(rows, out_dir, what):
    """Synchronize with a timeout (a deadlocked kernel would otherwise eat the whole GPU session)."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > HANG_S:
            rows.append({"op": "indexer", "variant": what, "error": f"no completion after {HANG_S} s (hang): exiting"})
            print(rows[-1], flush=True)
            _dump(rows, out_dir)
            os._exit(3)
        time.sleep(0.001)


def _dump(rows, out_dir):
    if out_dir is not None:
        with open(os.path.join(out_dir, "variants_indexer.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def _edge_check(kern, H, D, wait):
    """Correctness on awkward sizes vs the PyTorch reference (M % rows-per-CTA != 0, N % 128 != 0, empty, inverted,
    out-of-range and extreme ranges; same metric and tolerance as tests/indexer/test_kernel_gpu.py)."""
    from flashdsa.indexer.reference import indexer_logits_reference

    g = torch.Generator(device="cuda").manual_seed(7)
    M, N = 1003, 1900
    q = (torch.randn(M, H, D, generator=g, device="cuda") * 8).to(torch.float8_e4m3fn)
    kf = torch.randn(N, D, generator=g, device="cuda")
    ks = (kf.abs().amax(-1).clamp_min(1e-4) / 448.0).float()
    k = (kf / ks[:, None]).to(torch.float8_e4m3fn)
    w = torch.randn(M, H, generator=g, device="cuda") * H ** -0.5
    st = torch.randint(-N, 2 * N, (M,), generator=g, device="cuda").to(torch.int32)
    en = torch.randint(-N, 2 * N, (M,), generator=g, device="cuda").to(torch.int32)
    st[::3] = en[::3]
    st[1::7] = -(2 ** 31)
    en[2::7] = 2 ** 31 - 1
    causal = torch.arange(M, device="cuda") >= M // 2  # second half: causal rows (the common shape)
    st[causal] = 0
    en[causal] = (torch.arange(M, device="cuda")[causal] + 1 + (N - M)).to(torch.int32)
    out = torch.full((M, N), float("nan"), device="cuda")
    kern(q.view(M * H, D), k, w.view(-1), ks, st, en, out)
    wait()
    ref = indexer_logits_reference(q, k, w, ks, st, en)
    torch.cuda.synchronize()
    ref_inf = torch.isinf(ref)
    x, y = out[~ref_inf].double(), ref[~ref_inf].double()
    den = (x * x).sum() + (y * y).sum()
    err = 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)
    ok = (not torch.isnan(out).any().item()) and torch.equal(torch.isinf(out), ref_inf) \
        and bool((out[ref_inf] == -float("inf")).all()) and err < 5e-6
    return {"edge_ok": bool(ok), "edge_err": err}


def indexer_cases(rows, out_dir=None, configs=None):
    """Variant-major: every workload of a config before the next config (a hang loses only later configs).
    Checks per variant: bit-identical to the first config, every element written (output pre-filled with NaN),
    rel error on the finite part, and (N = 8192 cases) an awkward-size / awkward-range check against the PyTorch
    reference (edge_ok, edge_err); rows are also written to variants_indexer.json after each one."""
    configs = configs or INDEXER_CONFIGS
    g = torch.Generator(device="cuda").manual_seed(1)
    data = []
    for H, D, N in INDEXER_WORKLOADS:
        M = 4096
        q = torch.randn(M, H, D, generator=g, device="cuda").to(torch.float8_e4m3fn)
        k = torch.randn(N, D, generator=g, device="cuda").to(torch.float8_e4m3fn)
        w = torch.rand(M, H, generator=g, device="cuda")
        ks = torch.rand(N, generator=g, device="cuda")
        end = (torch.arange(M, device="cuda", dtype=torch.int32) + (N - M + 1))
        start = torch.zeros(M, dtype=torch.int32, device="cuda")
        flops = 2 * H * D * float((end - start).sum())
        data.append(dict(H=H, D=D, N=N, M=M, q=q, k=k, w=w, ks=ks, start=start, end=end, flops=flops, ref=None))
    funcs, keys = [], []
    for d in data:
        for bn, c, st, sch, hm, ch, ra in configs:
            funcs.append(kernel_prefill.build_indexer_prefill(heads=d["H"], dim=d["D"], block_n=bn, cols=c,
                                                              num_stages=st, schedule=sch, head_major=hm,
                                                              chains=ch, relu_add=ra))
            keys.append((d["H"], d["D"], bn, c, st, sch, hm, ch, ra))
    kernels = dict(zip(keys, tilelang.par_compile(funcs, target="cuda", pass_configs=kernel_prefill._pass_configs(),
                                                  ignore_error=True)))
    for bn, c, st, sch, hm, ch, ra in configs:
        for d in data:
            H, D, N, M = d["H"], d["D"], d["N"], d["M"]
            case = f"H{H}_D{D}_N{N}"
            tag = (f"bn{bn}_cols{c or kernel_prefill.default_cols(H)}_st{st}_{sch}" + ("_hm" if hm else "")
                   + f"_ch{ch}" + ("_radd" if ra else ""))
            kern = kernels.get((H, D, bn, c, st, sch, hm, ch, ra))
            if kern is None:
                rows.append({"op": "indexer", "case": case, "variant": tag, "error": "compile failed"})
                print(rows[-1], flush=True)
                continue
            out = torch.full((M, N), float("nan"), device="cuda")
            q2, w2 = d["q"].view(M * H, D), d["w"].view(-1)
            fn = lambda: kern(q2, d["k"], w2, d["ks"], d["start"], d["end"], out)  # noqa: E731
            try:
                fn()
                _wait_or_exit(rows, out_dir, f"{case} {tag}")
                unwritten = int(torch.isnan(out).sum())
                ref = d["ref"]
                if ref is None:
                    d["ref"] = ref = out.clone()
                fin = torch.isfinite(ref)
                err = ((out[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item()
                same_inf = bool(torch.equal(torch.isneginf(out), torch.isneginf(ref)))
                ms = bench(fn)
                row = {"op": "indexer", "case": case, "variant": tag, "ms": ms,
                       "tflops": d["flops"] / ms / 1e9, "rel_err_vs_first": err,
                       "bitwise_equal_first": bool(torch.equal(out, ref)), "neg_inf_mask_equal_first": same_inf,
                       "unwritten": unwritten}
                if N == 8192:  # once per (H, D, config): awkward sizes / ranges vs the reference
                    row.update(_edge_check(kern, H, D, lambda: _wait_or_exit(rows, out_dir, f"edge {case} {tag}")))
                rows.append(row)
            except Exception as e:  # noqa: BLE001
                rows.append({"op": "indexer", "case": case, "variant": tag, "error": repr(e)[:300]})
            print(rows[-1], flush=True)
            _dump(rows, out_dir)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", choices=["sparse", "indexer"], default=None)
    a = ap.parse_args()
    rows = []
    if a.only in (None, "sparse"):
        sparse_cases(rows)
    if a.only in (None, "indexer"):
        indexer_cases(rows, out_dir=a.out)
    with open(os.path.join(a.out, "variants.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
