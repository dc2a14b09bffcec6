"""Time and check the paged (decode) lightning-indexer kernel variants (``flashdsa.indexer.kernel_paged``).

For each shape: random fp8 inputs built like the bench suite's ``_indexer_paged`` (bf16 randn quantized with
``quantize_fp8``, shuffled block table), then

  * check: every variant against ``indexer_logits_paged_reference`` (-inf mask identical, no NaN, relative error
    ``1 - 2<x,y>/(<x,x>+<y,y>)`` on the finite part < 5e-6) and the variants against each other (bitwise equal
    count, max |diff|);
  * time: the compiled kernel called directly (no Python launcher in the timed region), CUDA events, an L2 flush
    (256 MB write) before every run outside the events, median / p10 / p90 over ``--reps`` runs
    (``flashdsa.bench.harness.time_fn``); TB/s with bytes = keys x (D + 4) (the suite's count; the output,
    B*next_n*L*4 bytes, is printed separately).

Shapes: ``nn1`` / ``nn2`` = the suite's cases (B 128, ctx 32768, H 64, D 128, block 64, next_n 1 / 2); ``ragged``
(optional) = B 64, random contexts in [1, 32768], block 16, next_n 2, some invalid block ids.

``--sweep 3x1024,4x2048,a6x1024,a6x1024m3,4x1024:no_epilogue,...`` additionally times "pipelined" builds (``a``
prefix: "pipelined_async" builds, optional ``mN`` suffix: the ``__launch_bounds__`` minimum CTAs per SM, optional
``:ABLATE``: a timing build of ``kernel_paged._tile_macros``, wrong results, expected to differ) with other
(stages x chunk) settings (one compile each, ~10-20 s) and checks them bitwise against the "pipelined" output
(else that of the first of ``--variants``).

Variants: ``flashdsa.indexer.kernel_paged.VARIANTS`` ("pipelined" = default, "sync", "pipelined_async" = opt-in
overlap of the next tile's wgmma with the epilogue, next_n*H <= 128).

Usage (repo root, GPU host):
    source .gpu/env.sh && python scripts/bench_paged_indexer.py [--shapes nn1,nn2]
        [--variants pipelined,sync,pipelined_async] [--reps 50] [--sweep 3x1024,6x1024,4x2048,a4x1024,a8x1024]
        [--json out.json]
Exit status 1 when a check fails.
"""

import argparse
import json
import math
import re
import sys
import time

import torch

SHAPES = {
    "nn1": dict(B=128, next_n=1, ctx=32768, H=64, D=128, bs=64, ragged=False),
    "nn2": dict(B=128, next_n=2, ctx=32768, H=64, D=128, bs=64, ragged=False),
    "ragged": dict(B=64, next_n=2, ctx=32768, H=64, D=128, bs=16, ragged=True),
}
TOL = 5e-6


def build_inputs(B, next_n, ctx, H, D, bs, ragged, seed=0, dev="cuda"):
    from flashdsa import quantize_fp8
    from flashdsa.bench.suites import paged_layout

    g = torch.Generator(device=dev).manual_seed(seed)
    if ragged:
        lens = torch.randint(1, ctx + 1, (B,), device=dev, generator=g).to(torch.int32)
        lens[0] = ctx
        lens[1] = 1
    else:
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    table, nblocks = paged_layout(lens, bs, dev, g)
    if ragged:  # a few out-of-range ids: those positions must come out -inf
        table[2, 0] = -1
        table[3, -1] = nblocks + 5
    k = torch.randn(nblocks * bs, D, device=dev, generator=g, dtype=torch.bfloat16)
    k8, ks = quantize_fp8(k, block=D)
    del k
    q = torch.randn(B, next_n, H, D, device=dev, generator=g, dtype=torch.bfloat16)
    q8, qs = quantize_fp8(q, block=D)
    w = torch.randn(B * next_n, H, device=dev, generator=g) * qs[..., 0].reshape(B * next_n, H) * (H * D) ** -0.5
    return dict(q=q8, k_cache=k8.view(nblocks, bs, D).contiguous(), k_scale_cache=ks.view(nblocks, bs).contiguous(),
                weights=w.contiguous(), context_lens=lens, block_table=table.contiguous(), max_context=int(ctx))


def rel_err(out, ref):
    """(ok, message) with the GPU tests' criteria."""
    if out.shape != ref.shape:
        return False, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if torch.isnan(out).any():
        return False, "NaN in the output"
    ref_inf = torch.isinf(ref)
    if not torch.equal(torch.isinf(out), ref_inf) or not (out[ref_inf] == -math.inf).all():
        return False, f"-inf mask differs ({int((torch.isinf(out) != ref_inf).sum())} elements)"
    x, y = out[~ref_inf].double(), ref[~ref_inf].double()
    den = (x * x).sum() + (y * y).sum()
    err = 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)
    return err < TOL, f"rel err {err:.2e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="nn1,nn2")
    ap.add_argument("--variants", default="pipelined,sync")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--sweep", default="", help="extra builds, [a]STAGESxCHUNK[mMINCTAS] comma list "
                    "(a: pipelined_async), e.g. 3x1024,4x2048,a4x1024,a6x1024m3")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from flashdsa.bench.harness import time_fn
    from flashdsa.indexer import kernel_paged as kp
    from flashdsa.indexer.reference import indexer_logits_paged_reference

    dev = torch.device("cuda")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        assert v in kp.VARIANTS, f"unknown variant {v}; known {kp.VARIANTS}"
    print(f"device {torch.cuda.get_device_name()}, variants {variants}, default {kp.VARIANT}", flush=True)
    results, ok_all = [], True
    for name in [s for s in args.shapes.split(",") if s]:
        p = SHAPES[name]
        inp = build_inputs(**p)
        B, NN, H, D = inp["q"].shape
        L = inp["max_context"]
        keys = int(inp["context_lens"].long().clamp(0, L).sum())
        nbytes = keys * (D + 4)
        out_bytes = B * NN * L * 4
        print(f"\n[{name}] {p}  keys {keys}  read {nbytes / 1e6:.0f} MB  output {out_bytes / 1e6:.1f} MB", flush=True)
        ref = None
        if not args.no_check:
            ref = indexer_logits_paged_reference(inp["q"], inp["k_cache"], inp["weights"], inp["context_lens"],
                                                 inp["block_table"], inp["k_scale_cache"], L).float()
        outs = {}
        for v in variants:
            t0 = time.time()
            out = kp.run_indexer_logits_paged(inp["q"], inp["k_cache"], inp["weights"], inp["context_lens"],
                                              inp["block_table"], inp["k_scale_cache"], L, variant=v)
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            rec = dict(shape=name, variant=v, params=p, keys=keys, bytes=nbytes, compile_s=round(compile_s, 1))
            if ref is not None:
                ok, msg = rel_err(out, ref)
                rec.update(check_ok=ok, check=msg)
                ok_all &= ok
                outs[v] = out
            # time the compiled kernel itself (arguments prepared once, as run_indexer_logits_paged passes them)
            kernel = kp._compiled(H, D, NN, inp["k_cache"].shape[1], kp._TL_DTYPES[inp["q"].dtype],
                                 kp.resolve_variant(v, H, NN))
            o = torch.empty((B * NN, L), dtype=torch.float32, device=dev)
            kargs = (inp["q"].view(B * NN * H, D), inp["k_cache"], inp["k_scale_cache"], inp["weights"].view(-1),
                     inp["context_lens"], inp["block_table"], o)
            tm = time_fn(lambda a: kernel(*a), [kargs], dev, warmup=5, reps=args.reps, max_seconds=30.0)
            tbs = nbytes / (tm.ms_median * 1e-3) / 1e12
            rec.update(ms_median=tm.ms_median, ms_p10=tm.ms_p10, ms_p90=tm.ms_p90, reps=tm.reps, tb_s=tbs,
                       tb_s_with_output=(nbytes + out_bytes) / (tm.ms_median * 1e-3) / 1e12)
            if ref is not None and not torch.equal(o.view(torch.int32), out.view(torch.int32)):
                rec.update(check_ok=False, check=rec["check"] + "; timed output differs from the checked one")
                ok_all = False
            print(f"  {v:10s} {tm.ms_median * 1e3:8.1f} us (p10 {tm.ms_p10 * 1e3:.1f}, p90 {tm.ms_p90 * 1e3:.1f}) "
                  f"{tbs:5.2f} TB/s (+output {rec['tb_s_with_output']:.2f})  check: {rec.get('check', 'skipped')}"
                  f"{'' if rec.get('check_ok', True) else '  <-- FAIL'}  (first call {compile_s:.1f} s)", flush=True)
            results.append(rec)
        for cfg in [c for c in args.sweep.split(",") if c]:
            import tilelang

            m = re.fullmatch(r"(a?)(\d+)x(\d+)(?:m(\d+))?(?::(\w+))?", cfg.lower())
            assert m, f"bad --sweep entry {cfg!r} (expected [a]STAGESxCHUNK[mMINCTAS][:ABLATE])"
            sv = "pipelined_async" if m[1] else "pipelined"
            st, ch = int(m[2]), int(m[3])
            extra = dict(min_ctas=int(m[4])) if m[4] else {}
            if m[5]:
                extra["ablate"] = m[5]
            t0 = time.time()
            func = kp.build(sv, heads=H, dim=D, next_n=NN, block_size=inp["k_cache"].shape[1],
                            dtype=kp._TL_DTYPES[inp["q"].dtype], num_stages=st, chunk=ch, **extra)
            kernel = tilelang.compile(func, target="cuda", pass_configs=kp._pass_configs(sv))
            compile_s = time.time() - t0
            o = torch.full((B * NN, L), math.nan, dtype=torch.float32, device=dev)
            kargs = (inp["q"].view(B * NN * H, D), inp["k_cache"], inp["k_scale_cache"], inp["weights"].view(-1),
                     inp["context_lens"], inp["block_table"], o)
            kernel(*kargs)
            torch.cuda.synchronize()
            base_v = "pipelined" if "pipelined" in outs else variants[0]
            base = outs.get(base_v) if outs else None
            same = None if base is None else torch.equal(o.view(torch.int32), base.view(torch.int32))
            tm = time_fn(lambda a: kernel(*a), [kargs], dev, warmup=5, reps=args.reps, max_seconds=30.0)
            tbs = nbytes / (tm.ms_median * 1e-3) / 1e12
            if same is False and not m[5]:
                ok_all = False
            results.append(dict(shape=name, variant=f"{sv}_{cfg}", params=p, keys=keys, bytes=nbytes,
                                ms_median=tm.ms_median, ms_p10=tm.ms_p10, ms_p90=tm.ms_p90, reps=tm.reps, tb_s=tbs,
                                bitwise_equal_default=same, compile_s=round(compile_s, 1)))
            print(f"  sweep {cfg:<10s} {tm.ms_median * 1e3:8.1f} us (p10 "
                  f"{tm.ms_p10 * 1e3:.1f}, p90 {tm.ms_p90 * 1e3:.1f}) {tbs:5.2f} TB/s  bitwise equal to "
                  f"{base_v}: {same}"
                  f"{'  <-- FAIL' if same is False else ''}", flush=True)
        for v in variants[1:] if len(outs) > 1 else []:
            a, b = outs[variants[0]], outs[v]
            same = torch.equal(a.view(torch.int32), b.view(torch.int32))
            fin = torch.isfinite(a) & torch.isfinite(b)
            diff = float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0
            print(f"  {variants[0]} vs {v}: bitwise equal {same}, max |diff| on finite {diff:.3e}", flush=True)
        del inp, ref, outs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), results=results), f, indent=1)
    print("\nALL CHECKS PASSED" if ok_all else "\nCHECK FAILED", flush=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
