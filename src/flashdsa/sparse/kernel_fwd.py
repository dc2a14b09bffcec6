"""Sparse MLA forward (DeepSeek-V3.2 / V4 sparse attention prefill) in TileLang for Hopper.

Notes
-----
Dispatch (``run_sparse_mla_fwd``): H <= ``FEW_HEAD_MMA`` -> ``kernel_fwd_mma`` (per-warp ``mma.sync`` chains),
other H <= 32 -> ``kernel_fwd_narrow``; H in {64, 128} -> ``kernel_fwd_pair`` (the
warp-specialised pair schedule, 1.3-1.55x faster, session 8); every other H -> this module's kernel.

Design (this file, "pipelined" variant):
  * Grid ``(T, ceil(H / 64))``: block (t, g) handles query token t and heads
    [64*g, 64*g + 64).  Heads are always padded to a 64-row tile so every GEMM is a
    Hopper wgmma (m64); padded heads read zeros and are never written (H = 1..128).
  * 256 threads = 2 warpgroups.  ``GemmWarpPolicy.FullRow`` on a 64-row tile gives
    each warpgroup the full 64 rows and half of N (QK^T: 64x32, PV: 64x256).
  * Loop over the top-k list in blocks of ``BI = 64`` indices with ``T.Pipelined``
    (num_stages=2): the KV gather lowers to predicated, zero-filling cp.async
    (``cp_async_gs_conditional``), two KV buffers, loads for block i+2 issued while
    block i is consumed.  S = Q K^T (512 dims + the 64-dim rope tail for Dqk = 576,
    two wgmma 64x32 per warpgroup), online softmax in fp32 with exp2 and
    ``sm_scale * log2(e)`` folded into one constant, P -> bf16 (shared) @ V
    (wgmma 64x256 per warpgroup).  Automatic warp specialisation is off (pass configs)
    and the Q / Out copies pass ``disable_tma``, so the schedule is the plain cp.async pipeline.
  * Masking: slot j of token t is valid iff ``j < topk_eff`` and
    ``0 <= indices[t, j] < Tkv``.  The gather uses row ``j < topk_eff ?
    indices[t, min(j, topk-1)] : -1``; TileLang's safe-access legalisation turns the
    KV bounds into the cp.async predicate (src-size 0 => zero fill, no read), so
    invalid rows are never dereferenced and land as zeros (NaN in unreferenced rows
    cannot leak).  Invalid score columns are initialised to -inf before the QK^T
    wgmma accumulates into them.  The CPU lowering test asserts the guarded cp.async.
  * Running max starts at the finite -1e30 (raw score units; requires sm_scale > 0),
    so all-invalid blocks give exp2(-inf) = 0, never inf - inf.  Empty rows
    (sum == 0) write out = 0, lse = +inf, max_logits = -inf.
  * attn_sink: out *= 1 / (1 + exp(sink - lse)) is folded into the normaliser,
    1 / (l + exp2(sink*log2e - m*c)) (exact: l * 2^-lse2 = 2^-m*c); sink = +inf
    gives 0, -inf gives the plain softmax, never NaN.
  * T, Tkv and the indices width are dynamic symbols.  The loop trip count
    ceil(topk / 64) is static (a symbolic trip count crashed TileLang 0.1.15's
    codegen for the pipelined loop), so kernels are cached per
    (H, Dqk, ceil(topk/64), sm_scale, has_sink, has_topk_length); the tail block is
    masked, e.g. topk = 100 and 128 share one kernel.
Shared memory (Dqk = 576): Q 64x576 bf16 (72 KiB) + 2 x KV 64x576 (144 KiB) + P 64x64
  (8 KiB) + reduction scratch (~2 KiB) = 231,424 B of the 232,448 B (227 KiB) limit.
  Dqk = 512: ~202 KiB.  The output is staged through the Q buffer (stmatrix).
  Registers: acc_o 64x512 fp32 over 256 threads = 128 floats/thread.
Verified: lowering only (CPU, sm_90a, TileLang 0.1.15): all lowering_cases() lower,
  contain wgmma and the guarded cp.async gather; the generated CUDA was read by hand
  (pipeline prologue/epilogue, head-padding guards on Out/Lse/MaxLogits, sink read
  clamped).  Never compiled by nvcc nor run on a GPU by the author.
Known risks for the GPU run:
  * Performance: this is the simple pipelined design (gather not warp-specialised,
    both warpgroups gather, __syncthreads between phases, every KV row fetched once
    per 64-head block).  Expect well below the 700 TFLOP/s target; the
    producer/consumer warp-specialised variant is not written yet.
  * Shared memory is within 1 KiB of the cap for Dqk = 576; if the launch fails
    with "too many resources"/smem, use num_stages=1 (build arg) for Dqk = 576.
  * H < 64 pads to 64 rows (up to 64x wasted MMA for H = 1); since session 6 ``run_sparse_mla_fwd`` sends
    H <= 32 to ``kernel_fwd_narrow`` (rows on the wgmma M side) instead.
  * q is made contiguous on the host (a strided q costs one extra copy).
  * Compile time on the GPU host: one nvcc compile per cached config (the CPU
    lowering alone takes 6-16 s per config).
"""



import functools

import torch

import tilelang
import tilelang.language as T

from .. import _dispatch
from .._tilelang import aligned, direct_launcher, plain_pass_configs
from . import _tl_common as tc
from ._tl_common import BLOCK_H, BLOCK_I, D_V, LN2, LOG2E  # noqa: F401  (re-exported: LN2, LOG2E)

_SUPPORTED_DQK = tc.SUPPORTED_DQK
FEW_HEAD_MMA = 32  # H <= this runs kernel_fwd_mma, the rest of H <= 32 kernel_fwd_narrow


def default_softmax_batch(dqk: int) -> int:
    """Rows per cross-warpgroup reduction round in this forward (each thread holds 2 of the 64 rows):
    2 = one barrier pair for both rows' max and one for both sums instead of one per row (session 7: V4 prefill,
    Dqk 512, 1.49 -> 1.30 ms).  Its larger reduction scratch does not fit beside Dqk 576's tiles (233,472 B of
    shared memory asked for, 232,448 allowed), so Dqk 576 keeps 1."""
    return 2 if dqk <= 512 else 1


def build_sparse_mla_fwd(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
    block_i: int = BLOCK_I,
    num_stages: int = 2,
    threads: int = 256,
    ablate: str = "",
    softmax_batch: int | tuple | None = None,  # see _tl_common.online_softmax_macro; None: default_softmax_batch(dqk)
):
    """Return the TileLang prim_func.

    ``ablate`` (timing only, wrong results; ``python -m flashdsa.sparse.kernel_fwd --ablate``): "no_gather" drops
    the KV gather (the tiles keep whatever shared memory holds), "no_softmax" replaces the online softmax by a cast
    of S, "no_pv" drops the PV product.

    The kernel is specialised on ceil(topk / block_i) (the loop trip count); the
    indices width itself is dynamic, so any topk with the same block count works.
    Signature: (Q[T,H,Dqk], KV[Tkv,Dqk], Indices[T,topk], TopkLen[n_tl], Sink[n_sink],
    Out[T,H,d_v], Lse[T,H], MaxLogits[T,H]); TopkLen / Sink are only read when
    has_topk_length / has_sink (pass 1-element dummies otherwise).
    """
    assert dqk in _SUPPORTED_DQK and d_v == D_V, (dqk, d_v)
    assert ablate in ("", "no_gather", "no_softmax", "no_pv"), ablate
    assert 1 <= heads <= 2 * BLOCK_H
    D = d_v
    D_tail = dqk - d_v
    BH = BLOCK_H
    BI = block_i
    n_hblk = (heads + BH - 1) // BH

    bf16, f32, i32 = "bfloat16", "float32", "int32"
    # The indices width is always a dynamic symbol; the loop trip count is static
    # (a symbolic trip count breaks TileLang 0.1.15's pipelined codegen), so one
    # kernel serves every topk with the same ceil(topk / BI).
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    NI = (int(topk) + BI - 1) // BI
    assert sm_scale is not None and sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E  # raw score -> log2 units
    neg_big = tc.NEG_BIG
    _row = tc.make_slot_row(topk_dim)
    batch = default_softmax_batch(dqk) if softmax_batch is None else softmax_batch
    lazy_sum = not isinstance(batch, int) and batch[1] == 0  # row sums accumulated per thread, reduced once
    online_softmax = tc.online_softmax_macro(BH=BH, BI=BI, D=D, c_log2=c_log2, batch=batch)
    load_q, normaliser, store_out, store_lse = tc.padded_head_macros(
        BH=BH, D=D, D_tail=D_tail, dqk=dqk, heads=heads, c_log2=c_log2, has_sink=has_sink, dtype=bf16
    )

    @T.prim_func
    def sparse_mla_fwd(
        Q: T.Tensor([n_tok, heads, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, n_hblk, threads=threads) as (bx, by):
            Q_s = T.alloc_shared([BH, D], bf16)
            KV_s = T.alloc_shared([BI, D], bf16)
            S_s = T.alloc_shared([BH, BI], bf16)
            if D_tail > 0:
                Qt_s = T.alloc_shared([BH, D_tail], bf16)
                Kt_s = T.alloc_shared([BI, D_tail], bf16)
            else:
                Qt_s = None

            acc_o = T.alloc_fragment([BH, D], f32)
            acc_s = T.alloc_fragment([BH, BI], f32)
            m_i = T.alloc_fragment([BH], f32)
            m_prev = T.alloc_fragment([BH], f32)
            alpha = T.alloc_fragment([BH], f32)
            l_i = T.alloc_fragment([BH], f32)
            l_blk = T.alloc_fragment([BH, BI] if lazy_sum else [BH], f32)
            inv = T.alloc_fragment([BH], f32)
            lim = T.alloc_local([1], i32)

            h0 = by * BH
            if has_topk_length:
                lim[0] = T.min(TopkLen[bx], topk_dim)
            else:
                lim[0] = topk_dim

            load_q(Q, Q_s, Qt_s, bx, h0)  # Q tile, padded heads -> 0

            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            if lazy_sum:
                T.fill(l_blk, 0)
            T.fill(m_i, neg_big)

            if ablate == "no_gather":  # timing only: the tiles stay zero
                T.clear(KV_s)
                if D_tail > 0:
                    T.clear(Kt_s)
            for it in T.Pipelined(NI, num_stages=num_stages):
                # ---- gather KV rows ----
                # The row index is forced to -1 past topk_eff; TileLang's safe-access
                # legalisation predicates the (cp.async, zero-fill) load on
                # 0 <= row < Tkv, so invalid rows are never read and land as zeros.
                # (the row is bound once per element: written inline, the Indices load is repeated per use)
                if ablate != "no_gather":
                    for r, d in T.Parallel(BI, D):
                        row = _row(Indices, bx, lim[0], it * BI + r)
                        KV_s[r, d] = KV[row, d]
                    if D_tail > 0:
                        for r, d in T.Parallel(BI, D_tail):
                            row = _row(Indices, bx, lim[0], it * BI + r)
                            Kt_s[r, d] = KV[row, D + d]

                # ---- S = Q K^T, invalid columns start at -inf ----
                for h, r in T.Parallel(BH, BI):
                    row = _row(Indices, bx, lim[0], it * BI + r)
                    acc_s[h, r] = T.if_then_else((row >= 0) & (row < n_kv), T.float32(0), -T.infinity(f32))
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if D_tail > 0:
                    T.gemm(Qt_s, Kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

                # ---- online softmax (raw-score max, exp2 with folded scale) ----
                if ablate != "no_softmax":
                    online_softmax(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk)
                T.copy(acc_s, S_s)
                if ablate != "no_pv":
                    T.gemm(S_s, KV_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            # ---- epilogue (the Q tile is the output staging buffer) ----
            if lazy_sum:
                T.reduce_sum(l_blk, l_i, dim=1)
            normaliser(inv, l_i, m_i, Sink, h0)
            store_out(acc_o, inv, Q_s, Out, bx, h0)
            store_lse(l_i, m_i, Lse, MaxLogits, bx, h0)

    return sparse_mla_fwd




def _pass_configs():
    return plain_pass_configs()


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, dqk: int, d_v: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool,
              build_kw: tuple = ()):
    """The compiled forward; ``build_kw``: extra ``build_sparse_mla_fwd`` keywords as sorted (name, value) pairs
    (the timing tools' ``ablate`` / ``softmax_batch`` builds; the dispatched kernel passes none)."""
    func = build_sparse_mla_fwd(
        heads=heads, dqk=dqk, d_v=d_v, topk=n_blocks * BLOCK_I, sm_scale=sm_scale, has_sink=has_sink,
        has_topk_length=has_topk_length, **dict(build_kw)
    )
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def _launch_build(q, kv, idx, **build_kw):
    """``launch`` of the forward built with extra keywords (timing tools; the default scale, no sink)."""
    key = tuple(sorted(build_kw.items()))
    return launch(lambda *a: _compiled(*a, key), q, kv, idx, sm_scale=q.shape[-1] ** -0.5, d_v=D_V)


def kernel_unsupported(q, kv, indices, *, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason (shapes/dtypes only)."""
    if not (q.is_cuda and kv.is_cuda and indices.is_cuda):
        return "tensors must be on CUDA"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return "q and kv must be bfloat16"
    if indices.dtype != torch.int32:
        return "indices must be int32"
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        return "expected q [T,H,Dqk], kv [Tkv,Dqk], indices [T,topk]"
    return tc.check_fwd_shapes(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
                       narrow: bool | None = None, pair: bool | None = None, checked: bool = False):
    """Returns (out [T,H,d_v] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32).

    Kernel choice: ``narrow`` None runs ``kernel_fwd_mma`` (per-warp ``mma.sync`` chains) for H <= ``FEW_HEAD_MMA``
    and ``kernel_fwd_narrow`` for the other H it takes; True runs ``kernel_fwd_narrow`` (rows on the wgmma M side,
    H <= its MAX_HEADS).  Otherwise ``pair`` runs ``kernel_fwd_pair`` (warp-specialised, H in
    {64, 128}); None picks it for every H it takes.  Else this module's padded 64-head-tile kernel.
    The pair grid's last partial round runs as split-KV chunks where ``_tail_split.tail_plan`` says so.
    ``checked``: ``kernel_unsupported`` has already accepted these arguments (the dispatcher ran it), so it is
    not run twice."""
    if not checked:
        reason = kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
        if reason is not None:
            raise ValueError(f"sparse_mla fwd kernel: {reason}")
    compiled, is_pair = _select(q, kv, narrow, pair)
    wrap = _tail_wrap(q, indices, sm_scale=sm_scale, d_v=d_v, has_sink=attn_sink is not None,
                      has_topk_length=topk_length is not None) if is_pair else None
    return launch(compiled, q, kv, indices, sm_scale=sm_scale, d_v=d_v, topk_length=topk_length,
                  attn_sink=attn_sink, wrap=wrap)


def _select(q, kv, narrow=None, pair=None):
    """(``compiled(heads, dqk, d_v, n_blocks, sm_scale, has_sink, has_topk_length)`` of the kernel
    ``run_sparse_mla_fwd`` picks for ``q``'s head count (its docstring) and ``kv``'s row count, whether it is the
    pair grid)."""
    from . import kernel_fwd_mma, kernel_fwd_narrow, kernel_fwd_pair

    heads = q.shape[1]
    if narrow is None:
        if heads <= FEW_HEAD_MMA:
            return kernel_fwd_mma.dispatched(q.shape[0], q.device.index or 0, heads), False
        narrow = heads <= kernel_fwd_narrow.MAX_HEADS
    if pair is None:
        pair = heads in kernel_fwd_pair.SUPPORTED_H
    if narrow:
        return kernel_fwd_narrow._compiled, False
    if pair:
        return kernel_fwd_pair.dispatched(q, kv.shape[0]), True
    return _compiled, False


def _tail_wrap(q, indices, *, sm_scale: float, d_v: int, has_sink: bool, has_topk_length: bool):
    """None, or where ``_tail_split.tail_plan`` splits this pair-grid call's last round, a function taking the
    grid's launch to the launch with its last tokens as split-KV chunks (``_tail_split.tail_launcher``)."""
    from . import _tail_split

    n_sm = _dispatch.sm_count(q.device.index or 0) if q.is_cuda else 0
    plan = _tail_split.tail_plan(q.shape[0], q.shape[1], indices.shape[1], n_sm)
    if plan is None:
        return None
    return lambda main: _tail_split.tail_launcher(main, plan, heads=q.shape[1], dqk=q.shape[2], d_v=d_v,
                                                  sm_scale=sm_scale, has_sink=has_sink,
                                                  has_topk_length=has_topk_length)


def launcher(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None, batched=False):
    """The launch ``run_sparse_mla_fwd`` makes for these accepted arguments (contiguous, T > 0, Tkv > 0), as one
    callable ``(q, kv, indices, topk_length or dummy, attn_sink or dummy, out, lse, max_logits)``: what the
    public API's eager fast path stores per call signature (``_dispatch.PlanCache``).  Returns (launch, fused):
    with ``batched`` and the pair kernel selected, the launch is its ``batched`` build, which takes the batched
    forms' per-batch positions as indices and two more arguments (S, S_kv) (``fused`` True); else fused is
    False and indices are flat kv rows.  Either pair launch runs its last partial round as split-KV chunks where
    ``_tail_split.tail_plan`` says so (``_tail_wrap``)."""
    from . import kernel_fwd_pair

    n_blocks = (indices.shape[1] + BLOCK_I - 1) // BLOCK_I
    has_sink, has_tl = attn_sink is not None, topk_length is not None
    compiled, is_pair = _select(q, kv)
    fused = batched and is_pair
    if fused:
        run = kernel_fwd_pair.batched_launcher(q, kv.shape[0], n_blocks, sm_scale=sm_scale, d_v=d_v,
                                               has_sink=has_sink, has_topk_length=has_tl)
    else:
        run = direct_launcher(compiled(q.shape[1], q.shape[2], d_v, n_blocks, float(sm_scale), has_sink, has_tl))
    wrap = _tail_wrap(q, indices, sm_scale=sm_scale, d_v=d_v, has_sink=has_sink,
                      has_topk_length=has_tl) if is_pair else None
    return (run if wrap is None else wrap(run)), fused


def launch(compiled, q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None, extra=(),
           out_f32: bool = False, wrap=None):
    """Host side shared by the forward variants: outputs, empty inputs, layouts, dummy optional args, then
    ``compiled(heads, dqk, d_v, n_blocks, sm_scale, has_sink, has_topk_length)(...)``; ``extra``: more kernel
    inputs, passed after Sink (e.g. the pair kernel's Order). Arguments already checked.  ``out_f32``: a build
    writing float32 out over indices' rows (split-KV partials; q one row per token).  ``wrap``: None, or a
    function of the kernel's launch giving the launch to make instead (``_tail_wrap``; no ``extra``)."""
    assert wrap is None or not extra, "wrap: a launch without extra inputs before out"
    (out, lse, max_logits), done = tc.fwd_outputs(q, kv, sm_scale=sm_scale, d_v=d_v, n_tok=indices.shape[0],
                                                  out_dtype=torch.float32 if out_f32 else torch.bfloat16)
    if done:
        return out, lse, max_logits
    n_tok, heads, dqk = q.shape
    q, kv, indices = aligned(q), aligned(kv), aligned(indices)
    has_sink, has_tl, tl_arg, sink_arg, n_blocks = tc.optional_args(indices, topk_length, attn_sink, q.device)
    run = direct_launcher(compiled(heads, dqk, d_v, n_blocks, float(sm_scale), has_sink, has_tl))
    (run if wrap is None else wrap(run))(q, kv, indices, tl_arg, sink_arg, *extra, out, lse, max_logits)
    return out, lse, max_logits


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    cases = []
    # lowering is slow on CPU (10-40 s a case): three cases cover both Dqk, sink/topk_length and padded heads
    for heads, dqk, topk, sink, tl in [
        (128, 576, 2048, True, True),
        (16, 512, 100, False, True),
    ]:
        name = f"h{heads}_d{dqk}_topk{topk}" + ("_sink" if sink else "") + ("_tl" if tl else "")
        fn = build_sparse_mla_fwd(
            heads=heads, dqk=dqk, d_v=D_V, topk=topk, sm_scale=dqk**-0.5, has_sink=sink, has_topk_length=tl
        )
        cases.append((name, fn))
    # the opt-in reduction schedules of _bench_variants (not dispatched): batched max, per-thread row sums
    cases.append(("h64_d576_topk2048_lazy_sum", build_sparse_mla_fwd(
        heads=64, dqk=576, d_v=D_V, topk=2048, sm_scale=576**-0.5, softmax_batch=(2, 0))))
    return cases


def _prefill_inputs(gen, S=4096, SKV=8192, H=64, dqk=576, topk=2048):
    """Random q [S, H, dqk], kv [SKV, dqk] and distinct in-range indices [S, topk] (the suite's prefill shape)."""
    q = (torch.randn(S, H, dqk, generator=gen, device="cuda") * 0.1).bfloat16()
    kv = (torch.randn(SKV, dqk, generator=gen, device="cuda") * 0.1).bfloat16()
    idx = torch.argsort(torch.rand(S, SKV, generator=gen, device="cuda"), dim=1)[:, :topk].int().contiguous()
    return q, kv, idx


def _bench_ablate(S=4096, SKV=8192, H=64, dqk=576, topk=2048):
    """Kernel times of the forward and its ``ablate`` variants at one shape (wrong results, timing only)."""
    from ..bench.harness import time_fn

    q, kv, idx = _prefill_inputs(torch.Generator(device="cuda").manual_seed(0), S, SKV, H, dqk, topk)
    n_blocks = (topk + BLOCK_I - 1) // BLOCK_I
    n_sm = _dispatch.sm_count(0)
    blocks_per_sm = S * ((H + BLOCK_H - 1) // BLOCK_H) * n_blocks / n_sm
    for ablate in ("", "no_gather", "no_softmax", "no_pv"):
        ms = time_fn(lambda _, a=ablate: _launch_build(q, kv, idx, ablate=a), [None], q.device, reps=10).ms_median
        print(f"ablate={ablate or 'none'} S={S} H={H} Dqk={dqk} topk={topk}: {ms:.3f} ms, "
              f"{ms * 1e3 / blocks_per_sm:.2f} us per 64-row block and SM", flush=True)


_VARIANTS = (dict(softmax_batch=1), dict(), dict(softmax_batch=(2, 1)), dict(softmax_batch=(2, 0)))


def _bench_variants(configs=_VARIANTS, only: str = ""):
    """Kernel times of builds of this forward (``build_sparse_mla_fwd`` keyword sets) at the prefill H 64 shape
    and the V4 decode shape, each checked against the first build's output
    (``python -m flashdsa.sparse.kernel_fwd --variants``).  Session 7 also ran block_i 32 x 4 stages this way
    (more, smaller tiles in flight): 5.71 vs 4.32 ms and 74.7 vs 62.2 us, slower.  Not yet run on a GPU:
    ``softmax_batch=(2, 1)`` (batched max only: its scratch fits Dqk 576 exactly, 232,448 B) and ``(2, 0)`` (no
    per-block row sum: P accumulated per thread, reduced once after the loop; 24 B of register spill at Dqk 576
    in ptxas -v, against none for the others)."""
    from ..bench.flops import sparse_fwd_flops
    from ..bench.harness import time_fn

    gen = torch.Generator(device="cuda").manual_seed(0)
    H = 64
    q, kv, idx = _prefill_inputs(gen, H=H)
    shapes = [("prefill_S4096_H64_topk2048", q, kv, idx)]
    b, n, d, topk = 128, 8192, 512, 640
    q = (torch.randn(b, H, d, generator=gen, device="cuda") * 0.1).bfloat16()
    kv = (torch.randn(b * n, d, generator=gen, device="cuda") * 0.1).bfloat16()
    idx = torch.argsort(torch.rand(b, n, generator=gen, device="cuda"), dim=1)[:, :topk].sort(dim=1).values
    idx = (idx + torch.arange(b, device="cuda").view(b, 1) * n).int().contiguous()
    shapes.append(("v4_decode_b128_H64_d512_topk640", q, kv, idx))
    for name, q, kv, idx in shapes:
        if only not in name:
            continue
        flops = sparse_fwd_flops(H, idx.numel(), q.shape[-1], D_V)  # every index is valid here
        base = None
        for kw in configs:
            run = lambda _, k=kw: _launch_build(q, kv, idx, **k)  # noqa: E731
            out = run(None)[0].float()
            base = out if base is None else base
            err = (out - base).abs().max().item()
            ms = time_fn(run, [None], q.device, reps=20).ms_median
            print(f"variant {name} {kw}: {ms:.4f} ms, {flops / ms / 1e9:.1f} TFLOP/s, max |diff| vs first {err:.2e}",
                  flush=True)


if __name__ == "__main__":
    import sys

    if "--variants" in sys.argv[1:]:  # optional shape filter after it: --variants decode
        rest = sys.argv[sys.argv.index("--variants") + 1:]
        _bench_variants(only=rest[0] if rest and not rest[0].startswith("-") else "")

    if "--ablate" in sys.argv[1:]:  # the headline shape at H 64 (and H 128 with --h128): 4 compiles per H
        _bench_ablate(H=64)
        if "--h128" in sys.argv[1:]:
            _bench_ablate(H=128)
