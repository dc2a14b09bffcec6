"""GPU timing tools of the sparse MLA backward's main kernel (``python -m flashdsa.sparse.kernel_bwd ...``):
``--ablate`` (without the atomics / the dK/dV stage), ``--red`` (the dKV reduction patterns), ``--det`` (the
deterministic path's chunking), ``--topk`` (the V4 shape over topk), ``--reducer`` (the reducer warpgroup and its
hand-over), ``--rows`` (the dispatched gather by rows against the T.Parallel gather), and the headline shapes through
``run_sparse_mla_bwd``."""

import torch

from . import kernel_fwd
from ._tl_common import BLOCK_I, D_V
from .kernel_bwd import _compiled, run_sparse_mla_bwd


def _time_ms(fn, reps):
    """Median ms of ``fn()`` (bench.harness.time_fn without the L2 flush: the main kernel back to back, as the
    session 5-17 rows in docs/PERFORMANCE.md were timed)."""
    from ..bench.harness import time_fn

    return time_fn(lambda _: fn(), [None], torch.device("cuda"), reps=reps, flush_l2=False).ms_median


def _inputs(S, SKV, H, dqk, topk, sink=False):
    """(q, kv, idx, dout, attn_sink or None, sm_scale, out, lse): N(0, 0.1^2) bf16 inputs, unique random indices
    (every one valid) and the forward's out / lse, from seed 0."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn(S, H, dqk, generator=gen, device="cuda") * 0.1).bfloat16()
    kv = (torch.randn(SKV, dqk, generator=gen, device="cuda") * 0.1).bfloat16()
    idx = torch.argsort(torch.rand(S, SKV, generator=gen, device="cuda"), dim=1)[:, :topk].int().contiguous()
    dout = (torch.randn(S, H, D_V, generator=gen, device="cuda") * 0.1).bfloat16()
    attn_sink = torch.randn(H, generator=gen, device="cuda") if sink else None
    scale = dqk**-0.5
    out, lse, _ = kernel_fwd.run_sparse_mla_fwd(q, kv, idx, sm_scale=scale, d_v=D_V, attn_sink=attn_sink)
    return q, kv, idx, dout, attn_sink, scale, out, lse


def _bench_ablate(S=4096, SKV=8192, H=64, dqk=576, topk=2048, ablates=None, builds=()):
    """Main-kernel-only times of the fast path and of the ``ablate`` variants (wrong results, timing only);
    ``builds``: also these ``_compiled`` keyword sets, with their dq / dkv difference from the default build."""
    from ..bench.flops import sparse_bwd_flops

    q, kv, idx, dout, _, scale, out, lse = _inputs(S, SKV, H, dqk, topk)
    dq = torch.empty_like(q)
    acc = torch.zeros((SKV, dqk), dtype=torch.float32, device="cuda")
    tl_arg, sink, dl, ds = idx.new_empty((1,)), lse.new_empty((1,)), lse.new_empty((1, H)), lse.new_empty((1, H))
    n_blocks = (topk + BLOCK_I - 1) // BLOCK_I
    flops = sparse_bwd_flops(H, S * topk, dqk, D_V)  # every index is valid here
    if ablates is None:
        ablates = ("", "no_atomics", "no_dkv") + (("half_atomics",) if H > 64 else ())
    ref = None
    for kw in [dict(ablate=a) for a in ablates] + list(builds):
        kernel = _compiled(H, dqk, D_V, n_blocks, float(scale), False, False, **kw)
        diff = ""
        if not kw.get("ablate"):
            acc.zero_()
            kernel(q, kv, dout, out, idx, tl_arg, lse, sink, dl, dq, acc, ds)
            if ref is None:
                ref = (dq.float().clone(), acc.clone())
            else:
                diff = (f" max|ddq| {(dq.float() - ref[0]).abs().max().item():.3g}"
                        f" max|ddkv| {(acc - ref[1]).abs().max().item():.3g} (|dkv| {ref[1].abs().max().item():.3g})")
        ms = _time_ms(lambda: kernel(q, kv, dout, out, idx, tl_arg, lse, sink, dl, dq, acc, ds), 10)
        name = ",".join(f"{k}={v}" for k, v in kw.items() if v) or "none"
        print(f"{name}{diff} S={S} H={H} Dqk={dqk} topk={topk}: "
              f"main kernel {ms:.3f} ms, "
              f"{flops / ms / 1e9:.1f} TFLOP/s (full-work FLOPs)", flush=True)


def _bench_det(S=4096, SKV=8192, H=128, dqk=576, topk=2048):
    """The deterministic path at the suite's H 128 shape: whole-wave chunks (``_det_chunk``) against a plain 1 GiB
    cap, and whole-wave chunks under 1 / 1.5 / 2 GiB caps (chunkings differ in the order chunks add up: not
    bitwise equal to each other)."""
    from ..bench.flops import sparse_bwd_flops
    from . import kernel_bwd as kb

    q, kv, idx, dout, _, scale, out, lse = _inputs(S, SKV, H, dqk, topk)
    flops = sparse_bwd_flops(H, S * topk, dqk, D_V)
    whole_waves, cap0 = kb._det_chunk, kb._PARTIAL_ELEMS
    ref = None
    try:
        for name, chunking, cap in (("cap 1 GiB", None, 1 << 28), ("whole waves, 1 GiB", whole_waves, 1 << 28),
                                    ("whole waves, 1.5 GiB", whole_waves, 3 << 27),
                                    ("whole waves, 2 GiB", whole_waves, 1 << 29)):
            kb._PARTIAL_ELEMS = cap
            kb._det_chunk = chunking or (lambda n, g, k, d, _sm: max(1, min(n, kb._PARTIAL_ELEMS // (g * k * d))))
            chunk = kb._det_chunk(S, H // 64, topk, dqk, torch.cuda.get_device_properties(0).multi_processor_count)

            def fn():
                return run_sparse_mla_bwd(q, kv, idx, out, lse, dout, sm_scale=scale, d_v=D_V, deterministic=True)

            res = fn()
            same = "" if ref is None else f" bitwise equal: {all(torch.equal(a, b) for a, b in zip(res[:2], ref))}"
            ref = ref or res[:2]
            ms = _time_ms(fn, 5)
            print(f"deterministic H={H} {name} ({chunk} tokens per chunk): {ms:.3f} ms, "
                  f"{flops / ms / 1e9:.1f} TFLOP/s{same}", flush=True)
    finally:
        kb._det_chunk, kb._PARTIAL_ELEMS = whole_waves, cap0


def _bench(argv=None):
    """GPU timing of the headline shapes: ``python -m flashdsa.sparse.kernel_bwd [--quick] [--ablate]``."""
    import sys

    from ..bench.flops import sparse_bwd_flops

    argv = argv if argv is not None else sys.argv[1:]
    if "--topk" in argv:  # "--topk 320,640,1280": the V4 shape's main kernel at these topk (a fit of time per CTA
        # = fixed + blocks x per-block separates the prologue / epilogue from the per-block cost), with and
        # without the atomics
        for k in argv[argv.index("--topk") + 1].split(","):
            _bench_ablate(dqk=512, topk=int(k), ablates=("", "no_atomics"))
        return
    if "--reducer" in argv:  # the reducer warpgroup against the default build (V4 shape, and H 64 at Dqk 512)
        for kw in (dict(topk=640), dict(topk=2048)):
            _bench_ablate(dqk=512, ablates=("", "no_atomics"),
                          builds=(dict(reducer=True), dict(reducer=True, ablate="red_skip")), **kw)
        return
    if "--rows" in argv:  # the dispatched row gather vs the T.Parallel one (H 64 / 128 at Dqk 576; V4 reducer)
        _bench_ablate(ablates=("", "no_atomics"), builds=(dict(row_gather=True),))
        _bench_ablate(H=128, ablates=("",), builds=(dict(row_gather=True),))
        _bench_ablate(dqk=512, topk=640, ablates=(), builds=(dict(reducer=True), dict(reducer=True, row_gather=True)))
        return
    if "--det" in argv:  # deterministic H 128: the chunking and the partial buffer's cap
        _bench_det()
        return
    if "--red" in argv:  # the dKV reduction patterns (row gather builds; H 64 and H 128 at Dqk 576)
        builds = tuple(dict(row_gather=True, red=r) for r in ("frag2", "oct4"))
        _bench_ablate(ablates=("no_atomics",), builds=builds)
        _bench_ablate(H=128, ablates=(), builds=builds)
        return
    if "--ablate" in argv:  # "--v4": the V4 shape too; "--h128": H 128 too (with "half_atomics")
        _bench_ablate()
        if "--h128" in argv:
            _bench_ablate(H=128)
        if "--v4" in argv:
            _bench_ablate(dqk=512, topk=640)
        return
    quick = "--quick" in argv
    shapes = [  # (S, SKV, H, Dqk, topk, sink)
        (4096, 8192, 64, 576, 2048, False),
        (4096, 8192, 128, 576, 2048, False),
        (4096, 8192, 64, 512, 640, True),
    ]
    if quick:
        shapes = shapes[:1]
    for S, SKV, H, dqk, topk, sink in shapes:
        q, kv, idx, dout, attn_sink, scale, out, lse = _inputs(S, SKV, H, dqk, topk, sink)
        flops = sparse_bwd_flops(H, S * topk, dqk, D_V)  # every index is valid here
        for det in (False, True):
            def fn():
                return run_sparse_mla_bwd(q, kv, idx, out, lse, dout, sm_scale=scale, d_v=D_V, attn_sink=attn_sink,
                                          deterministic=det)

            ms = _time_ms(fn, 3 if quick else 10)
            print(f"S={S} SKV={SKV} H={H} Dqk={dqk} topk={topk} sink={sink} deterministic={det}: "
                  f"{ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)


def main():
    _bench()


if __name__ == "__main__":
    main()
