"""Timing builds of the FP8-compute pair forward (``python -m flashdsa.sparse.kernel_fwd_pair_fp8 --variants
[--skv 8192,...] [--rows ...]``), on the GPU."""

import torch

from ..bench.flops import sparse_fwd_flops
from ..bench.harness import time_fn
from ..quant import quantize_fp8
from . import kernel_fwd_fp8 as f8
from . import kernel_fwd_pair, kernel_fwd_pair_fp8 as pf8
from ._tl_common import D_V


def bench_variants(tkvs=(8192, 131072), rows=None):
    """Kernel times at S 4096, H 128, Dqk 576, topk 2048: the bf16 pair kernel on the dequantized inputs (the
    reference point), the FP8 pair kernel, its ablation "no_lo" (timing only: its outputs are less accurate), a
    register split, the pipelined FP8 kernel (``pair=False``); max |out - bf16 pair| of each; ``rows``: only these
    labels (and the reference point)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_tok, heads, topk, dqk = 4096, 128, 2048, 576
    for tkv in tkvs:
        q8, q_scale = quantize_fp8((torch.randn(n_tok, heads, dqk, generator=gen, device="cuda") * 0.1), block=dqk)
        kv8, kv_scale = quantize_fp8((torch.randn(tkv, dqk, generator=gen, device="cuda") * 0.1), block=dqk)
        q_scale, kv_scale = q_scale[..., 0].contiguous(), kv_scale[..., 0].contiguous()
        qd = (q8.float() * q_scale.unsqueeze(-1)).bfloat16()
        kvd = (kv8.float() * kv_scale.unsqueeze(-1)).bfloat16()
        idx = torch.argsort(torch.rand(n_tok, tkv, generator=gen, device="cuda"), dim=1)[:, :topk].to(torch.int32)
        sm = dqk**-0.5
        flops = sparse_fwd_flops(heads, idx.numel(), dqk, D_V)  # every index is valid here
        kw = dict(q_scale=q_scale, kv_scale=kv_scale, sm_scale=sm, d_v=D_V)
        runs = {"bf16_pair": lambda: kernel_fwd_pair.run_sparse_mla_fwd(qd, kvd, idx, sm_scale=sm, d_v=D_V),
                "fp8_pair": lambda: pf8.run_sparse_mla_fwd_fp8(q8, kv8, idx, **kw),
                "fp8_pair_no_lo": lambda: pf8.run_sparse_mla_fwd_fp8(q8, kv8, idx, ablate="no_lo", **kw),
                "fp8_pair_r224": lambda: pf8.run_sparse_mla_fwd_fp8(q8, kv8, idx, regs=(224, 224, 56), **kw),
                "fp8_pipelined": lambda: f8.run_sparse_mla_fwd_fp8(q8, kv8, idx, pair=False, **kw)}
        ref = runs["bf16_pair"]()[0].float()
        base = None
        for label, fn in runs.items():
            if rows and label not in rows and label != "bf16_pair":
                continue
            err = (fn()[0].float() - ref).abs().max().item()
            ms = time_fn(lambda _, f=fn: f(), [None], q8.device, reps=10).ms_median
            base = base or ms
            print(f"variant SKV {tkv} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, {base / ms:.3f}x bf16 pair,"
                  f" max |out - bf16 pair| {err:.2e}", flush=True)
