"""Time the sparse MLA forward kernels on the GPU: kernel_fwd as dispatched vs its forced forms and the pair kernel.

    python scripts/bench_sparse_fwd.py [--out FILE.json] [--reps 20] [--variants fwd,pair] [--cases ...]

Variants: "fwd" = kernel_fwd.run_sparse_mla_fwd as dispatched, "padded" / "narrow" = its 64-head-tile kernel /
kernel_fwd_narrow.py forced, "pair" = kernel_fwd_pair.py.

Four shapes (issue targets in TFLOP/s, FLOPs = 2 S H topk (Dqk + 512)):
  V32_H128          S 4096, SKV 8192,   H 128, Dqk 576, topk 2048        -> 700
  V32_H64           S 4096, SKV 8192,   H 64,  Dqk 576, topk 2048        -> 690
  V32_H128_SKV128K  S 4096, SKV 131072, H 128, Dqk 576, topk 2048        -> 620
  V4_h64_k640_sink  S 4096, SKV 8192,   H 64,  Dqk 512 (K = V), topk 640, attn_sink -> 600
Indices: independent uniform random rows per token (duplicates allowed; they count, as in the reference).
Timing: median of CUDA-event times of single launches after warm-up. Each variant's output is compared with the
first variant's (max |diff| / max |ref|). A launch that does not finish within HANG_S seconds aborts the script
(a hung kernel cannot be interrupted) after printing which one hung.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from flashdsa.sparse import kernel_fwd, kernel_fwd_pair

HANG_S = 30.0
VARIANTS = ("fwd", "padded", "narrow", "pair")
CASES = {
    "V32_H128": dict(H=128, dqk=576, topk=2048, skv=8192, sink=False, target=700),
    "V32_H64": dict(H=64, dqk=576, topk=2048, skv=8192, sink=False, target=690),
    "V32_H128_SKV128K": dict(H=128, dqk=576, topk=2048, skv=131072, sink=False, target=620),
    "V4_h64_k640_sink": dict(H=64, dqk=512, topk=640, skv=8192, sink=True, target=600),
    "V32_H16": dict(H=16, dqk=576, topk=2048, skv=8192, sink=False, target=250),
    "V32_H32": dict(H=32, dqk=576, topk=2048, skv=8192, sink=False, target=0),
    # DeepSeek-V4 decode-shaped: 128 tokens (one per sequence), each over its own 8192-row KV slice
    "V4_decode_b128": dict(H=64, dqk=512, topk=640, skv=128 * 8192, sink=True, target=0, S=128),
}


def _sync_or_die(what):
    stream = torch.cuda.current_stream()
    deadline = time.monotonic() + HANG_S
    while not stream.query():
        if time.monotonic() > deadline:
            print(f"HANG: {what} did not finish within {HANG_S:.0f} s; aborting", flush=True)
            os._exit(3)
        time.sleep(0.002)
    torch.cuda.synchronize()


def _runner(variant, q, kv, idx, sm_scale, sink):
    if variant in ("fwd", "padded", "narrow"):
        narrow = {"fwd": None, "padded": False, "narrow": True}[variant]
        pair = False if variant == "padded" else None
        return lambda: kernel_fwd.run_sparse_mla_fwd(q, kv, idx, sm_scale=sm_scale, d_v=512, attn_sink=sink,
                                                     narrow=narrow, pair=pair)
    return lambda: kernel_fwd_pair.run_sparse_mla_fwd(q, kv, idx, sm_scale=sm_scale, d_v=512, attn_sink=sink)


def bench(fn, what, reps, warmup=3):
    for _ in range(warmup):
        fn()
    _sync_or_die(what)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        _sync_or_die(what)
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="fwd,pair")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    variants = a.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}: one of {VARIANTS}")
    rows = []
    for name in a.cases.split(","):
        c = CASES[name]
        S = c.get("S", 4096)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(S, c["H"], c["dqk"], generator=g, device="cuda").bfloat16()
        kv = torch.randn(c["skv"], c["dqk"], generator=g, device="cuda").bfloat16()
        idx = torch.randint(0, c["skv"], (S, c["topk"]), generator=g, device="cuda", dtype=torch.int32)
        sink = torch.randn(c["H"], generator=g, device="cuda") if c["sink"] else None
        sm_scale = c["dqk"] ** -0.5
        flops = 2 * S * c["H"] * c["topk"] * (c["dqk"] + 512)
        ref = None
        for v in variants:
            row = {"case": name, "variant": v, "target_tflops": c["target"]}
            try:
                fn = _runner(v, q, kv, idx, sm_scale, sink)
                t0 = time.perf_counter()
                out = fn()[0]
                _sync_or_die(f"{name}/{v} first launch")
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                out = out.float()
                if ref is None:
                    ref = out
                    row["rel_err_vs_first"] = 0.0
                else:
                    row["rel_err_vs_first"] = ((out - ref).abs().max() / ref.abs().max()).item()
                ms = bench(fn, f"{name}/{v}", a.reps)
                row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, kv, idx
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
