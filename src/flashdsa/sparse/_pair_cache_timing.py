"""Timing builds of the 656-byte-cache pair kernel at the prefill shape (``python -m
flashdsa.sparse.kernel_fwd_pair_cache --variants [--skv 8192,...] [--rows ...]``): ``bench_variants``."""

import torch

from . import kernel_fwd_fp8cache as fc
from ._tl_common import D_V
from .kernel_fwd_pair_cache import run_sparse_mla_fwd


def bench_variants(tkvs=(8192, 131072), rows=None, compile_only=False, zero_latent=False, row_stride=None):
    """Kernel times at S 4096, H 128, topk 2048 (``python -m flashdsa.sparse.kernel_fwd_pair_cache --variants
    [--skv 8192,...]``): the bf16 pair kernel on the dequantized cache (the reference point), this kernel (default
    staging, and "consumer"), the whole-cache copy + bf16 pair kernel (``kernel_dequant656``), this kernel's timing
    builds (``overlap_qk=False``; ``ABLATIONS``: no conversion), the pipelined fp8-cache kernel; checks each against
    the bf16 pair kernel bitwise
    (the ablation differs by design); then the copy alone.  ``rows``: labels to run (default all);
    ``compile_only``: one call each, no timing (warms the TileLang cache: run one process per row in parallel, then
    time in one process); ``zero_latent`` (``--zero-latent``, a diagnostic, not a benchmark): latent dims 0 in
    the cache, so the ``no_convert`` ablation's tiles hold zeros where the conversion would write, and every row
    draws the power of near-zero operands; ``row_stride`` (``--row-stride B``, a diagnostic): the cache rows B bytes
    apart (e.g. 768: every row 128-byte aligned)."""
    from ..bench.flops import sparse_fwd_flops
    from ..bench.harness import time_fn
    from ..quant import dequantize_kv_fp8, quantize_kv_fp8
    from . import kernel_dequant656, kernel_fwd, kernel_fwd_pair

    gen = torch.Generator(device="cuda").manual_seed(0)
    n_tok, heads, topk, dqk = 4096, 128, 2048, fc.DQK
    for tkv in tkvs:
        q = (torch.randn(n_tok, heads, dqk, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
        kv = torch.randn(tkv, dqk, generator=gen, device="cuda") * 0.1
        if zero_latent:
            kv[:, :D_V] = 0
        kv8 = quantize_kv_fp8(kv.to(torch.bfloat16))
        if row_stride:
            kv8 = torch.zeros(tkv, row_stride, dtype=torch.uint8, device="cuda").copy_(
                torch.nn.functional.pad(kv8, (0, row_stride - fc.ROW_BYTES)))[:, : fc.ROW_BYTES]
        kv_deq = dequantize_kv_fp8(kv8)
        idx = torch.argsort(torch.rand(n_tok, tkv, generator=gen, device="cuda"), dim=1)[:, :topk].to(torch.int32)
        sm = dqk**-0.5
        flops = sparse_fwd_flops(heads, idx.numel(), dqk, D_V)  # every index is valid here
        runs = {"bf16_pair": lambda: kernel_fwd_pair.run_sparse_mla_fwd(q, kv_deq, idx, sm_scale=sm, d_v=D_V),
                "bf16_pair_hop": lambda: kernel_fwd.launch(
                    lambda *a: kernel_fwd_pair._compiled(*a, (("hop", True), ("row_gather", True))), q, kv_deq, idx,
                    sm_scale=sm, d_v=D_V),
                "bf16_pair_no_overlap_qk": lambda: kernel_fwd.launch(
                    lambda *a: kernel_fwd_pair._compiled(*a, (("overlap_qk", False),)), q, kv_deq, idx, sm_scale=sm,
                    d_v=D_V),
                "cache_pair": lambda: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V),
                "cache_dequant_once": lambda: fc.run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V,
                                                                    dequant_once=True),
                "cache_pair_no_overlap_qk": lambda: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V,
                                                                       overlap_qk=False),
                "cache_pair_no_convert": lambda: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V,
                                                                    ablate="no_convert"),
                "cache_pair_contig_no_convert": lambda: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V,
                                                                           ablate="contig_no_convert"),
                "cache_converter_contig": lambda: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V,
                                                                     staging="converter_contig"),
                "cache_consumer": lambda: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V, staging="consumer"),
                "cache_consumer_no_convert": lambda: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V,
                                                                        staging="consumer", ablate="no_convert"),
                "cache_pipelined": lambda: fc.run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V, pair=False)}
        if compile_only:
            for label in rows or runs:
                runs[label]()
            torch.cuda.synchronize()
            continue
        ref = runs["bf16_pair"]()
        base = None
        for label, fn in runs.items():
            if rows and label not in rows and label != "bf16_pair":
                continue
            same = all(torch.equal(a, b) for a, b in zip(fn(), ref))
            ms = time_fn(lambda _, f=fn: f(), [None], q.device, reps=10).ms_median
            base = base or ms
            print(f"variant SKV {tkv} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, {base / ms:.3f}x bf16 pair,"
                  f" bitwise equal to bf16 pair: {same}", flush=True)
        ms = time_fn(lambda _: kernel_dequant656.dequantize_cache(kv8), [None], q.device, reps=10).ms_median
        tbps = tkv * (fc.ROW_BYTES + 2 * fc.DQK) / ms / 1e9
        print(f"variant SKV {tkv} dequantize_cache alone: {ms * 1e3:.1f} us, {tbps:.2f} TB/s", flush=True)
