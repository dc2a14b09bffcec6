"""Paged pair kernel (dense decode, H 64 / 128): DRAM-resident pages (each request its own) vs L2-resident pages
(every request's block table points at the same pages), one-wave and two-wave H 64 grids.  Timing as ``flashdsa
bench`` (``time_fn``: L2 flushed before each call, median of 30).  Run on the GPU host after ``source
.gpu/env.sh``; writes ``$OUT/l2res.json`` (PERFORMANCE.md, session 29)."""

import json
import os

import torch

from flashdsa.bench.flops import causal_decode_keys, decode_flops
from flashdsa.bench.harness import time_fn
from flashdsa.decode import kernel_dense

BLOCK_SIZE = 64


def run(B: int, H: int, s_q: int, L: int, shared: bool, causal: bool = False) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    n_per_req = L // BLOCK_SIZE
    n_pages = n_per_req if shared else B * n_per_req
    kv = (torch.randn(n_pages, BLOCK_SIZE, 576, generator=g, device="cuda") * 0.1).bfloat16()
    if shared:
        table = torch.randperm(n_per_req, generator=g, device="cuda").int().repeat(B, 1).contiguous()
    else:
        table = torch.randperm(n_pages, generator=g, device="cuda").int().view(B, n_per_req).contiguous()
    q = (torch.randn(B, s_q, H, 576, generator=g, device="cuda") * 0.1).bfloat16()
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")

    def call(_):
        return kernel_dense.run_mla_decode_dense(q, kv, table, lens, sm_scale=0.04, d_v=512, causal=causal,
                                                 variant="pair")

    t = time_fn(call, [None], q.device, reps=30)
    flops = decode_flops(H, causal_decode_keys(lens, s_q, causal))
    return dict(B=B, H=H, s_q=s_q, L=L, shared=shared, ms=t.ms_median, p10=t.ms_p10,
                tflops=flops / t.ms_median / 1e9)


def main() -> None:
    rows = []
    for args in [(128, 128, 1, 8192, False), (128, 128, 1, 8192, True), (128, 64, 1, 8192, False),
                 (128, 64, 1, 8192, True), (132, 64, 1, 8192, False), (264, 64, 1, 8192, False)]:
        rows.append(run(*args))
        print(rows[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "l2res.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
