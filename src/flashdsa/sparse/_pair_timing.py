"""Timing builds of the pair forward (``python -m flashdsa.sparse.kernel_fwd_pair --variants [--rows ...]
[--compile-only] [--topk 256,512,...]``): kernel times of ``kernel_fwd_pair``'s builds at the prefill shapes."""

import sys

import torch

from .. import _dispatch


def bench_variants(rows=None, compile_only=False, topks=()):
    """Kernel times of timing builds at the prefill H 64 / H 128 shapes and the V4 prefill shape (``python -m
    flashdsa.sparse.kernel_fwd_pair --variants [--rows padded,pair,no_overlap_qk,...] [--compile-only]
    [--topk 256,512,1024]``): the pipelined kernel ("padded"), this kernel ("pair"), and its ``overlap_qk=False`` /
    ``prefetch_rows=False`` / ``ablate`` builds; us per 64-row block and SM.  ``compile_only``: one call each, no
    timing (warms the TileLang cache).  ``topks``: the H 64 / Dqk 576 shape at these topk instead (a fit of time per
    CTA = fixed + blocks x per-block separates the per-CTA prologue / epilogue from the per-block cost)."""
    from ..bench.flops import sparse_fwd_flops
    from ..bench.harness import time_fn
    from . import kernel_fwd
    from ._tl_common import BLOCK_H, BLOCK_I, D_V
    from .kernel_fwd_pair import _compiled

    gen = torch.Generator(device="cuda").manual_seed(0)
    n_sm = _dispatch.sm_count(0)
    shapes = (("prefill_S4096_H64_d576_topk2048", 64, 576, 2048), ("v4_S4096_H64_d512_topk640", 64, 512, 640),
              ("prefill_S4096_H128_d576_topk2048", 128, 576, 2048))
    if topks:
        shapes = tuple((f"prefill_S4096_H64_d576_topk{k}", 64, 576, k) for k in topks)
    for name, heads, dqk, topk in shapes:
        q, kv, idx = kernel_fwd._prefill_inputs(gen, H=heads, dqk=dqk, topk=topk)
        blocks_per_sm = q.shape[0] * (heads // BLOCK_H) * (topk // BLOCK_I) / n_sm
        flops = sparse_fwd_flops(heads, idx.numel(), dqk, D_V)  # every index is valid here
        runs = [("padded", lambda: kernel_fwd.run_sparse_mla_fwd(q, kv, idx, sm_scale=dqk**-0.5, d_v=D_V, pair=False))]
        for label, kw in (("pair", dict()), ("no_overlap_qk", dict(overlap_qk=False)),
                          ("no_prefetch_rows", dict(prefetch_rows=False)), ("no_gather", dict(ablate="no_gather")),
                          ("half_gather", dict(ablate="half_gather")), ("l2_prefetch", dict(l2_prefetch=True)),
                          ("persistent", dict(persistent=n_sm)),
                          ("row_gather", dict(row_gather=True)),
                          ("row_gather_persistent", dict(row_gather=True, persistent=n_sm)),
                          ("row_gather_q_tma", dict(row_gather=True, q_gate="tma"))):
            key = tuple(sorted(kw.items()))
            runs.append((label, lambda k=key: kernel_fwd.launch(lambda *a: _compiled(*a, k), q, kv, idx,
                                                                 sm_scale=dqk**-0.5, d_v=D_V)))
        ref = None
        for label, fn in runs:
            if rows and label not in rows:
                continue
            if compile_only:
                fn()
                continue
            out = fn()
            ref = out if label == "pair" else ref
            same = "-" if ref is None or label in ("padded", "pair") else all(map(torch.equal, out, ref))
            ms = time_fn(lambda _, f=fn: f(), [None], q.device, reps=10).ms_median
            ctas_per_sm = q.shape[0] * (heads // BLOCK_H) / n_sm
            print(f"variant {name} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s,"
                  f" {ms * 1e3 / blocks_per_sm:.2f} us per block and SM, {ms * 1e3 / ctas_per_sm:.1f} us per CTA"
                  f" (bitwise equal to pair: {same})", flush=True)


def main(args=None):
    args = sys.argv[1:] if args is None else args
    if "--variants" in args:
        bench_variants(args[args.index("--rows") + 1].split(",") if "--rows" in args else None,
                       "--compile-only" in args,
                       tuple(int(k) for k in args[args.index("--topk") + 1].split(",")) if "--topk" in args else ())
