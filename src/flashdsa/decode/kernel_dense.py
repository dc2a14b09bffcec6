"""Dense MLA decode over a paged bf16 cache (TileLang, Hopper sm_90a): split-KV partial kernel + combine kernel.

Notes
-----
Variants (``run_mla_decode_dense(..., variant=)``, else ``$FLASHDSA_DECODE_VARIANT``, else ``DEFAULT_VARIANT``):
  * "auto" (default): "narrow_fused" for ``s_q * H <= AUTO_NARROW_ROWS``; "pair" where H is 64 / 128 and its
    CTAs fill the SM waves well (``_pair_path.pair_efficiency`` >= ``PAIR_MIN_EFFICIENCY``); else "ws".
  * "pair": one sparse MLA forward on the pair schedule over the flat cache, each query token's slot list its
    cache positions, its causal length as ``topk_length`` (``_pair_path.py``); H 64 / 128 only, and for block
    sizes that are not multiples of 64 slot lists within ``_pair_path.MAX_SLOT_BYTES`` (else "ws"); block sizes
    that are multiples of 64 read the pages through the block table instead (``kernel_pair_paged.py``).
  * "narrow": ``kernel_dense_narrow.py`` (cache positions on the wgmma M side, the few query rows as N) where
    ``s_q * H <= 32``, else "ws"; see its notes.  Three launches (plan, partial, combine); explicit only.
  * "ws": the warp-specialised partial kernel of ``kernel_dense_ws.py`` (producer warpgroup + two
    consumer warpgroups, 64-key tiles, the n_mt row tiles of a split in adjacent CTAs); see its notes.
  * "pipelined": this module's partial kernel, described below (the one measured on the H200 first).
  * "narrow_fused": the narrow kernel in ONE launch (``kernel_dense_fused.py``: each CTA derives its split from
    cache_seqlens, the last split of a sequence merges), where ``s_q * H <= 32``, else "ws".
  The three-launch ones use this module's split plan (``_plan``, tile size per variant), partial buffers and
  combine kernel.

Design
  * Query rows: the ``s_q * H`` query rows of one sequence (row ``m = i * H + h``) form the M side of the wgmma
    tile, ``BLOCK_M = 64`` rows per tile (padded rows read q = 0 and are never written); ``s_q * H > 64`` gives
    ``ceil(s_q * H / 64)`` row tiles (``n_mt``).  So H = 16, s_q = 1 wastes 3/4 of the tensor-core work but reads
    each cache byte once per sequence, which is what the memory-bound case needs.
  * Split-KV (flash-decoding) with a plan computed on the GPU (``_plan``: torch ops on device tensors, no
    ``.item()``, no host sync, CUDA-graph capturable).  Work is counted in 64-token tiles plus a fixed per-split
    overhead (``_OVERHEAD_TILES``; computed by one launch of ``_plan_kernel``, bit-identical to ``_plan``'s torch
    ops, which stay as its specification); one chunk length ``C`` (tiles) is chosen so that the full chunks of all
    sequences fit in one wave over the SMs: ``C = max(ceil(n_mt * (sum tiles_b + B * ovh) / num_sms), MIN)``.
    Sequence b is cut into ``nsplit_b = max(1, ceil(tiles_b / C))`` chunks (all full except the last, which
    fills in the gaps of the first wave).  ``sum_b nsplit_b <= B + num_sms / n_mt``, so the work-item buffer and
    the grid have the static size ``max_items = B + num_sms // n_mt + 1`` derived from shapes only; CTAs whose
    item is idle exit at once.  Chunk starts are multiples of 64 tokens, so for block_size >= 64 a 64-token tile
    lies inside one page.
  * Partial kernel: grid ``(max_items, n_mt)``, 256 threads = 2 warpgroups.  ``GemmWarpPolicy.FullRow`` on the
    64-row tile gives each warpgroup all 64 rows and half of N: S = Q K^T is 64 x 32 per warpgroup (576-deep,
    split into the 512 latent dims + the 64 rope dims), O += P V is 64 x 256 per warpgroup, so the fp32 output
    accumulator (64 x 512) is split across the two consumer warpgroups (128 fp32 registers per thread).
    The KV loop is a two-stage software pipeline written by hand (TileLang 0.1.15's ``T.Pipelined`` cannot
    take the data-dependent trip count: its epilogue emits ``cp.async.wait_group`` with a non-constant count):
    two KV buffers, ``T.async_copy`` (cp.async, no wait) of the tile's page segments (``min(block_size, 64)``
    rows each, contiguous within a page), ``wait_group 0`` + barrier at the top of iteration ``it``, then the
    prefetch of tile ``it + 1`` into the other buffer, then the wgmma / softmax of tile ``it``.
    Scores stay raw; the softmax runs in the exp2 domain with ``sm_scale * log2(e)`` folded into one multiplier.
  * Masking: position p of a chunk is valid iff ``p < end`` and its page id is in ``[0, num_blocks)``.  Page
    segments past ``end`` or with an out-of-range id are never copied (their smem rows keep earlier finite data or
    the zeros written at kernel start); rows past ``end`` inside a copied page (unused slots, may be NaN) are
    zeroed in shared memory on the last tile, so NaN cannot leak through P V.  Causal: row m (query
    i = m // H) also needs ``p < cache_seqlens[b] - s_q + 1 + i``.  Masked scores start at -inf (the S
    accumulator is initialised to 0 / -inf before the QK wgmma accumulates); the running max starts at the finite
    -1e30 so an all-masked tile gives exp2(-inf) = 0, never inf - inf.
  * Output: a sequence with ``nsplit_b == 1`` is written directly (bf16 out, natural-log lse, sink applied).
    Otherwise each split writes fp32 partial out (normalised) and its partial ``lse2`` (base 2, -inf when the row
    saw no key) to ``[max_items, s_q * H, ...]``; the combine kernel (grid ``(s_q * H, B)``, 128 threads x 4 dims)
    merges them for sequences with ``nsplit_b > 1`` and exits for the others.
  * attn_sink: ``out *= 1 / (1 + exp(sink - lse))`` written as ``1 / (1 + exp2(sink * log2e - lse2))`` guarded so
    that +inf sinks give 0, -inf sinks no change, empty rows stay 0.

Shared memory (partial kernel): Q 64 x 512 + 64 x 64 bf16 (72 KiB) + 2 stages x KV 64 x 576 bf16 (144 KiB) +
  P 64 x 64 bf16 (8 KiB) = 224 KiB of the 227 KiB limit (+ reduction scratch).  One CTA per SM.

Targets (H200, 132 SMs, ~4.8 TB/s HBM):
  * B=64, H=16, s_q=1, cache 8192: bytes = 64*8192*1152 (cache) + q + out ~= 604 MB -> 3.8 TB/s is 159 us.
    n_mt = 1, C = ceil((64 * 128 + 64 * 5) / 132) = 65 tiles, so each sequence is cut into 65 + 63 tiles:
    128 CTAs in one wave on 132 SMs.  Partial traffic: 16 rows x 2 KiB written + read per split (~4 MB, <1%).
  * B=128, H=128, s_q=1, cache 8192: FLOPs = 2*128*1088*8192*128 = 292 GFLOP -> 690 TFLOP/s is 423 us.
    n_mt = 2; C = ceil(2*128*133/132) = 258 tiles > 128, so no split: 256 CTAs of 128 tiles in ~1.94 waves.
  (Derived figures, not measured.)

Verified (CPU only, never run on a GPU by the author): both kernels lower to CUDA for sm_90a (partial: ~18-40 s
  per configuration on the 2-core dev box; combine: 0.3 s); the partial source has wgmma (64x32x16 for QK,
  64x256x16 for PV) and cp.async (cp.async.cg with zero-fill predicate, commit/wait_group 0).  The split plan was
  checked on CPU (every sequence covered exactly once, item count <= the static bound over 3000 random shapes),
  and a float32 torch emulation of plan + partial + combine matched ``mla_decode_reference`` (1e-7) with NaN
  in unused slots, out-of-range table entries, causal s_q > cache length, and sinks.

Risks for the GPU run
  * Only one tile load is in flight while a tile is computed (issue after wait); if HBM is not saturated the
    next step is a 3-buffer ring or a producer warpgroup (FlashMLA-style warp specialisation).
  * 224 KiB shared memory is near the cap (no room for a third KV stage at BLOCK_N = 64).
  * No warp specialisation: softmax does not overlap the next tile's wgmma, so the 690 TFLOP/s target likely
    needs a producer/consumer variant; the masks re-read block_table per score element (L1 hits).
  * The split plan's ``num_sms`` comes from the device properties (host-side, cached); the plan is int64 torch
    math, so sequences up to 2**31 tokens are fine but the kernel's int32 slot arithmetic caps
    ``num_blocks * block_size`` below 2**31 (checked in ``kernel_unsupported``).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools
import os

import torch

from ._tl_common import D_ROPE, D_V, DQK, LN2, LOG2E, combine_row_macro, partial_prim_func, partial_sizes
from .._tilelang import direct_launcher, plain_pass_configs
from .. import _dispatch

BLOCK_M = 64  # query rows (s_q * H) per tile: the wgmma M
BLOCK_N = 32  # cache positions per tile (64 needs 233472 B of smem, over the 232448 B cap)
MAX_ROWS = 4 * 128  # s_q * H <= 512 (s_q <= 4 at H = 128)
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128, 256)
_OVERHEAD_TILES = 5  # fixed cost of one split (Q load, epilogue, combine) in units of 64-token tiles
_MIN_CHUNK_TILES = 2  # never split below 128 tokens
_COMBINE_THREADS = 128
VARIANTS = ("auto", "ws", "narrow", "pipelined", "narrow_fused", "pair")
DEFAULT_VARIANT = "auto"  # "pipelined": the two-stage cp.async kernel of this module (measured on the H200)
AUTO_NARROW_ROWS = 32  # "auto" runs the fused narrow kernel for s_q * H <= this, else "ws"
VARIANT_ENV = "FLASHDSA_DECODE_VARIANT"


def _tl():
    import tilelang
    import tilelang.language as T

    return tilelang, T


# --------------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------------
def build_partial_kernel(*, heads: int, s_q: int, block_size: int, causal: bool, sm_scale: float,
                         has_sink: bool, threads: int = 256):
    """Split-KV attention kernel.

    Signature: (Q [B, M, 576] bf16, KV [num_blocks, block_size, 576] bf16, BlockTable [B, max_blocks] i32,
    SeqLens [B] i32, Plan [4, max_items] i32 (b or -1, start, end, nsplit_b), Sink [n_sink] f32,
    Out [B, M, 512] bf16, Lse [B, M] f32, OPart [max_items, M, 512] f32, LsePart [max_items, M] f32),
    with M = s_q * heads.
    """
    tilelang, T = _tl()
    M = s_q * heads
    n_mt = (M + BLOCK_M - 1) // BLOCK_M
    BM, BN, D, DT = BLOCK_M, BLOCK_N, D_V, D_ROPE
    bs = int(block_size)
    SEG = min(bs, BN)  # rows of one tile that are contiguous in one page
    NSEG = BN // SEG
    c_log2 = float(sm_scale) * LOG2E
    neg_big = -1.0e30
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    sizes = partial_sizes()
    _, nblk, maxb, nitem, _ = sizes  # (batch, num_blocks, max_blocks, max_items, n_sink)

    @T.macro
    def issue_tile(KV, BlockTable, b, p0, end, KV_b, Kt_b):
        # cp.async (no wait) of the tile's pages; pages past `end` or with an out-of-range id are not read at all
        for sg in T.unroll(NSEG):
            pg = BlockTable[b, T.min((p0 + sg * SEG) // bs, maxb - 1)]
            if (p0 + sg * SEG < end) and (pg >= 0) and (pg < nblk):
                T.async_copy(KV[pg, (p0 + sg * SEG) % bs:(p0 + sg * SEG) % bs + SEG, 0:D],
                             KV_b[sg * SEG:(sg + 1) * SEG, :])
                T.async_copy(KV[pg, (p0 + sg * SEG) % bs:(p0 + sg * SEG) % bs + SEG, D:DQK],
                             Kt_b[sg * SEG:(sg + 1) * SEG, :])

    @T.macro
    def attend_tile(KV, BlockTable, b, p0, end, lim0, m0, KV_b, Kt_b, Q_s, Qt_s, P_s, acc_s, acc_o, m_i, m_prev,
                    alpha, l_i, l_blk):
        # Rows whose page was skipped keep stale finite data (or the initial zeros); rows past `end` inside a
        # valid page were loaded (they may hold NaN) and are zeroed here.  Both get a -inf score below.
        if p0 + BN > end:
            for r, d in T.Parallel(BN, D):
                if p0 + r >= end:
                    KV_b[r, d] = T.cast(0, bf16)
            for r, d in T.Parallel(BN, DT):
                if p0 + r >= end:
                    Kt_b[r, d] = T.cast(0, bf16)
            T.sync_threads()
        for r, c in T.Parallel(BM, BN):
            pg = BlockTable[b, T.min((p0 + c) // bs, maxb - 1)]
            ok = (p0 + c < end) & (pg >= 0) & (pg < nblk)
            if causal:
                ok = ok & (p0 + c < lim0 + (m0 + r) // heads)
            acc_s[r, c] = T.if_then_else(ok, T.float32(0), -T.infinity(f32))
        T.gemm(Q_s, KV_b, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.gemm(Qt_s, Kt_b, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        for r in T.Parallel(BM):
            alpha[r] = T.exp2((m_prev[r] - m_i[r]) * c_log2)
        for r, c in T.Parallel(BM, BN):
            acc_s[r, c] = T.exp2(acc_s[r, c] * c_log2 - m_i[r] * c_log2)
        T.reduce_sum(acc_s, l_blk, dim=1)
        for r in T.Parallel(BM):
            l_i[r] = l_i[r] * alpha[r] + l_blk[r]
        for r, d in T.Parallel(BM, D):
            acc_o[r, d] = acc_o[r, d] * alpha[r]
        T.copy(acc_s, P_s)
        T.gemm(P_s, KV_b, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def body(Q, KV, BlockTable, SeqLens, Plan, Sink, Out, Lse, OPart, LsePart):
        with T.Kernel(nitem, n_mt, threads=threads) as (bx, by):
            Q_s = T.alloc_shared([BM, D], bf16)
            Qt_s = T.alloc_shared([BM, DT], bf16)
            KV_0 = T.alloc_shared([BN, D], bf16)
            Kt_0 = T.alloc_shared([BN, DT], bf16)
            KV_1 = T.alloc_shared([BN, D], bf16)
            Kt_1 = T.alloc_shared([BN, DT], bf16)
            P_s = T.alloc_shared([BM, BN], bf16)

            acc_o = T.alloc_fragment([BM, D], f32)
            acc_s = T.alloc_fragment([BM, BN], f32)
            m_i = T.alloc_fragment([BM], f32)
            m_prev = T.alloc_fragment([BM], f32)
            alpha = T.alloc_fragment([BM], f32)
            l_i = T.alloc_fragment([BM], f32)
            l_blk = T.alloc_fragment([BM], f32)
            inv = T.alloc_fragment([BM], f32)
            lse2 = T.alloc_fragment([BM], f32)
            info = T.alloc_local([6], i32)

            info[0] = Plan[0, bx]  # b (-1: idle item)
            info[1] = Plan[1, bx]  # start position (multiple of BLOCK_N)
            info[2] = Plan[2, bx]  # end position
            info[3] = Plan[3, bx]  # nsplit of this sequence
            m0 = by * BM

            if info[0] >= 0:
                b = info[0]
                # causal: row m (query i = m // heads) sees p < seqlen - s_q + 1 + i
                info[4] = SeqLens[b] - s_q + 1 if causal else 0
                info[5] = T.ceildiv(info[2] - info[1], BN)
                T.clear(KV_0)
                T.clear(Kt_0)
                T.clear(KV_1)
                T.clear(Kt_1)
                for r, d in T.Parallel(BM, D):
                    Q_s[r, d] = T.if_then_else(m0 + r < M, Q[b, T.min(m0 + r, M - 1), d], T.cast(0, bf16))
                for r, d in T.Parallel(BM, DT):
                    Qt_s[r, d] = T.if_then_else(m0 + r < M, Q[b, T.min(m0 + r, M - 1), D + d], T.cast(0, bf16))
                T.fill(acc_o, 0)
                T.fill(l_i, 0)
                T.fill(m_i, neg_big)
                T.sync_threads()
                if info[5] > 0:
                    issue_tile(KV, BlockTable, b, info[1], info[2], KV_0, Kt_0)
                    T.ptx_commit_group()

                # two-stage software pipeline by hand: wait for tile it, prefetch tile it + 1 into the other
                # buffer, attend tile it (the loads of it + 1 overlap the wgmma / softmax of it)
                for it in T.serial(info[5]):
                    T.ptx_wait_group(0)
                    T.sync_threads()
                    if it + 1 < info[5]:
                        if it % 2 == 0:
                            issue_tile(KV, BlockTable, b, info[1] + (it + 1) * BN, info[2], KV_1, Kt_1)
                        else:
                            issue_tile(KV, BlockTable, b, info[1] + (it + 1) * BN, info[2], KV_0, Kt_0)
                        T.ptx_commit_group()
                    if it % 2 == 0:
                        attend_tile(KV, BlockTable, b, info[1] + it * BN, info[2], info[4], m0, KV_0, Kt_0, Q_s, Qt_s,
                                    P_s, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk)
                    else:
                        attend_tile(KV, BlockTable, b, info[1] + it * BN, info[2], info[4], m0, KV_1, Kt_1, Q_s, Qt_s,
                                    P_s, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk)
                    T.sync_threads()  # the buffer just read is refilled in the next iteration

                # ---- epilogue ----
                for r in T.Parallel(BM):
                    lse2[r] = T.if_then_else(l_i[r] > 0, T.log2(l_i[r]) + m_i[r] * c_log2, -T.infinity(f32))
                if info[3] == 1:
                    # whole sequence in this CTA: final output (sink folded into the normaliser)
                    for r in T.Parallel(BM):
                        if has_sink:
                            inv[r] = T.if_then_else(
                                l_i[r] > 0,
                                1.0 / (l_i[r] + T.exp2(Sink[(m0 + r) % heads] * T.float32(LOG2E) - m_i[r] * c_log2)),
                                T.float32(0))
                        else:
                            inv[r] = T.if_then_else(l_i[r] > 0, 1.0 / l_i[r], T.float32(0))
                    for r, d in T.Parallel(BM, D):
                        acc_o[r, d] = acc_o[r, d] * inv[r]
                    T.copy(acc_o, Q_s)
                    for r, d in T.Parallel(BM, D):
                        if m0 + r < M:
                            Out[b, m0 + r, d] = Q_s[r, d]
                    for r in T.Parallel(BM):
                        if m0 + r < M:
                            Lse[b, m0 + r] = T.if_then_else(l_i[r] > 0, lse2[r] * T.float32(LN2), T.infinity(f32))
                else:
                    for r in T.Parallel(BM):
                        inv[r] = T.if_then_else(l_i[r] > 0, 1.0 / l_i[r], T.float32(0))
                    for r, d in T.Parallel(BM, D):
                        if m0 + r < M:
                            OPart[bx, m0 + r, d] = acc_o[r, d] * inv[r]
                    for r in T.Parallel(BM):
                        if m0 + r < M:
                            LsePart[bx, m0 + r] = lse2[r]

    return partial_prim_func("mla_decode_dense_partial", body, M=M, block_size=bs, sizes=sizes)


def build_combine_kernel(*, heads: int, s_q: int, has_sink: bool, threads: int = _COMBINE_THREADS):
    """Merge the partial (out, lse2) of sequences with nsplit_b > 1.

    Signature: (SeqPlan [2, B] i32 (first item, nsplit), Sink [n_sink] f32, OPart [max_items, M, 512] f32,
    LsePart [max_items, M] f32, Out [B, M, 512] bf16, Lse [B, M] f32).
    """
    tilelang, T = _tl()
    M = s_q * heads
    D = D_V
    VPT = D // threads
    f32, i32, bf16 = "float32", "int32", "bfloat16"
    nbat = T.dynamic("batch")
    nitem = T.dynamic("max_items")
    n_sink = T.dynamic("n_sink")
    combine_row = combine_row_macro(heads=heads, has_sink=has_sink, vpt=VPT, col=lambda t, v: t * VPT + v)

    @T.prim_func
    def mla_decode_dense_combine(
        SeqPlan: T.Tensor([2, nbat], i32),
        Sink: T.Tensor([n_sink], f32),
        OPart: T.Tensor([nitem, M, D], f32),
        LsePart: T.Tensor([nitem, M], f32),
        Out: T.Tensor([nbat, M, D], bf16),
        Lse: T.Tensor([nbat, M], f32),
    ):
        with T.Kernel(M, nbat, threads=threads) as (m, b):
            tx = T.get_thread_binding()
            first = T.alloc_local([1], i32)
            nsp = T.alloc_local([1], i32)
            mx = T.alloc_local([1], f32)
            tot = T.alloc_local([1], f32)
            w = T.alloc_local([1], f32)
            scl = T.alloc_local([1], f32)
            acc = T.alloc_local([VPT], f32)
            first[0] = SeqPlan[0, b]
            nsp[0] = SeqPlan[1, b]
            if nsp[0] > 1:
                combine_row(Sink, OPart, LsePart, Out, Lse, b, m, first[0], nsp[0], tx == 0, tx, (mx, tot, w, scl, acc))

    return mla_decode_dense_combine


# --------------------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------------------
def _pass_configs():
    return plain_pass_configs()


@functools.lru_cache(maxsize=64)
def _compiled_partial(heads, s_q, block_size, causal, sm_scale, has_sink):
    tilelang, _ = _tl()
    func = build_partial_kernel(heads=heads, s_q=s_q, block_size=block_size, causal=causal, sm_scale=sm_scale,
                                has_sink=has_sink)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


@functools.lru_cache(maxsize=64)
def _compiled_combine(heads, s_q, has_sink):
    tilelang, _ = _tl()
    func = build_combine_kernel(heads=heads, s_q=s_q, has_sink=has_sink)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


_num_sms = _dispatch.sm_count


def max_items(batch: int, n_mt: int, num_sms: int) -> int:
    """Static upper bound of the number of splits (work items) of one call: shapes only."""
    return batch + num_sms // n_mt + 1


def _plan(cache_seqlens, *, max_blocks: int, block_size: int, n_mt: int, num_sms: int, tile: int = BLOCK_N,
          overhead: int = _OVERHEAD_TILES, min_chunk: int = _MIN_CHUNK_TILES):
    """Work items from cache_seqlens, on the device (no host sync).

    Returns ``plan [4, max_items]`` int32 rows (b or -1, start, end, nsplit_b) and ``seq_plan [2, B]`` int32 rows
    (first item of b, nsplit_b).  Chunk boundaries are multiples of ``tile`` positions (the kernel's tile).
    """
    B = cache_seqlens.shape[0]
    dev = cache_seqlens.device
    n_items = max_items(B, n_mt, num_sms)
    cap = max_blocks * block_size  # positions past the table are skipped
    lens = cache_seqlens.to(torch.int64).clamp(0, cap)
    tiles = (lens + tile - 1) // tile
    work = (tiles.sum() + B * overhead) * n_mt
    chunk = torch.clamp((work + num_sms - 1) // num_sms, min=min_chunk)  # tiles per split (0-dim tensor)
    nsplit = torch.clamp((tiles + chunk - 1) // chunk, min=1)
    ends = torch.cumsum(nsplit, 0)
    first = ends - nsplit
    ids = torch.arange(n_items, device=dev, dtype=torch.int64)
    b_of = torch.searchsorted(ends, ids, right=True)  # == B past the last item
    live = b_of < B
    bc = b_of.clamp(max=B - 1)
    k = ids - first[bc]
    start = k * chunk * tile
    end = torch.minimum(start + chunk * tile, lens[bc])
    plan = torch.stack([torch.where(live, bc, -1), torch.where(live, start, 0), torch.where(live, end, 0),
                        torch.where(live, nsplit[bc], 0)]).to(torch.int32)
    seq_plan = torch.stack([first, nsplit]).to(torch.int32)
    return plan, seq_plan


def _plan_device(cache_seqlens, *, max_blocks: int, block_size: int, n_mt: int, num_sms: int, tile: int = BLOCK_N,
                 overhead: int = _OVERHEAD_TILES, min_chunk: int = _MIN_CHUNK_TILES, out=None):
    """``_plan`` as one kernel launch (``_plan_kernel``; bit-identical results, ~20 fewer launches per call).

    ``out``: optional preallocated ``(plan [4, max_items] int32, seq_plan [2, B] int32)``."""
    from ._plan_kernel import compiled_plan

    B = cache_seqlens.shape[0]
    dev = cache_seqlens.device
    if out is None:
        out = (torch.empty((4, max_items(B, n_mt, num_sms)), dtype=torch.int32, device=dev),
               torch.empty((2, B), dtype=torch.int32, device=dev))
    plan, seq_plan = out
    direct_launcher(compiled_plan(tile, n_mt, num_sms, overhead, min_chunk))(cache_seqlens.contiguous(), plan,
                                                                             seq_plan, max_blocks * block_size)
    return plan, seq_plan


def _workspace(B: int, M: int, n_items: int, dev):
    """One allocation for a call's split plan and partial results (each ``torch.empty`` costs microseconds of host
    time, as much as a decode kernel's share): plan [4, n_items] i32, seq_plan [2, B] i32, o_part [n_items, M, 512]
    f32, lse_part [n_items, M] f32; every piece starts on a 256-byte boundary."""
    def pad(n):
        return -(-n // 64) * 64

    sizes = [pad(4 * n_items), pad(2 * B), pad(n_items * M * D_V), n_items * M]
    plan, seq_plan, o_part, lse_part = torch.empty(sum(sizes), dtype=torch.float32, device=dev).split(sizes)
    return (plan[:4 * n_items].view(torch.int32).view(4, n_items), seq_plan[:2 * B].view(torch.int32).view(2, B),
            o_part[:n_items * M * D_V].view(n_items, M, D_V), lse_part.view(n_items, M))


def kernel_unsupported(q, kv_cache, block_table, cache_seqlens, *, d_v, causal, indices=None,
                       attn_sink=None) -> str | None:
    """None when this kernel handles the arguments, else a short reason (shapes, dtypes, devices only)."""
    if indices is not None:
        return "sparse decode (indices given) is not handled by the dense kernel"
    if block_table is None or cache_seqlens is None:
        return "dense decode needs block_table and cache_seqlens"
    if not all(t.is_cuda for t in (q, kv_cache, block_table, cache_seqlens)):
        return "tensors must be on CUDA"
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        return "q and kv_cache must be bfloat16 (FP8 cache: another kernel)"
    if q.dim() != 4 or q.shape[-1] != DQK:
        return f"q must be [B, s_q, H, {DQK}]"
    if d_v != D_V:
        return f"d_v={d_v} != {D_V}"
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache.squeeze(2)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != DQK:
        return f"kv_cache must be [num_blocks, block_size, {DQK}]"
    if kv_cache.shape[1] not in SUPPORTED_BLOCK_SIZES:
        return f"block_size={kv_cache.shape[1]} not in {SUPPORTED_BLOCK_SIZES}"
    B, s_q, H, _ = q.shape
    if not 1 <= H <= 128:
        return f"H={H} not in 1..128"
    if not 1 <= s_q * H <= MAX_ROWS:
        return f"s_q*H={s_q * H} not in 1..{MAX_ROWS}"
    if kv_cache.shape[0] * kv_cache.shape[1] >= 2**31 or block_table.shape[1] * kv_cache.shape[1] >= 2**31:
        return "cache too large for int32 slot arithmetic"
    if block_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32:
        return "block_table and cache_seqlens must be int32"
    if block_table.dim() != 2 or block_table.shape[0] != B or cache_seqlens.shape != (B,):
        return "block_table must be [B, max_blocks], cache_seqlens [B]"
    if attn_sink is not None and (attn_sink.dtype != torch.float32 or attn_sink.shape != (H,) or not attn_sink.is_cuda):
        return "attn_sink must be float32 [H] on CUDA"
    if not isinstance(causal, bool):
        return "causal must be a bool"
    return None


def _variant(variant):
    v = variant if variant is not None else (os.environ.get(VARIANT_ENV, "").strip().lower() or DEFAULT_VARIANT)
    if v not in VARIANTS:
        raise ValueError(f"mla_decode dense kernel: variant {v!r} not in {VARIANTS} (argument or ${VARIANT_ENV})")
    return v


def _ws_module(variant: str, rows: int):
    """The partial-kernel module a variant other than "pipelined" runs for ``s_q * H = rows``: "ws" ->
    ``kernel_dense_ws`` (every ``rows``); "narrow" and "narrow_fused" -> ``kernel_dense_narrow`` where ``rows`` fits
    it (``MAX_ROWS``), else ``kernel_dense_ws``; "auto" -> the narrow kernel for ``rows <= AUTO_NARROW_ROWS``.
    Where "auto" and "narrow_fused" get the narrow kernel, its single-launch form runs instead (``_runs_fused``).
    The module has ``BLOCK_N``, ``_OVERHEAD_TILES``, ``_MIN_CHUNK_TILES`` (the split plan's tile), ``ctas_per_sm`` (the
    plan's work items per SM) and ``compiled_partial``."""
    from . import kernel_dense_narrow as narrow
    from . import kernel_dense_ws as ws

    limit = {"narrow": narrow.MAX_ROWS, "narrow_fused": narrow.MAX_ROWS,
             "auto": min(AUTO_NARROW_ROWS, narrow.MAX_ROWS)}.get(variant, 0)
    return narrow if rows <= limit else ws


def _runs_fused(variant: str, rows: int) -> bool:
    """True where ``variant`` runs the single-launch ``kernel_dense_fused`` for ``s_q * H = rows``: "auto" and
    "narrow_fused" wherever ``_ws_module`` gives them the narrow kernel ("narrow" keeps its three launches)."""
    from . import kernel_dense_narrow as narrow

    return variant in ("auto", "narrow_fused") and _ws_module(variant, rows) is narrow


def run_mla_decode_dense(q, kv_cache, block_table, cache_seqlens, *, sm_scale, d_v, causal, attn_sink=None,
                         variant=None, checked=False):
    """Returns (out [B, s_q, H, 512] bf16, lse [B, s_q, H] f32 natural log, +inf / 0 for empty rows).

    ``variant``: "auto" (default: "narrow_fused" for s_q * H <= ``AUTO_NARROW_ROWS``, else "ws"), "ws"
    (warp-specialised partial kernel), "narrow" (keys-as-M kernel where s_q * H <= 32, else "ws"), "pipelined"
    (this module's two-stage cp.async kernel), "narrow_fused" (the narrow kernel as one launch, plan and combine
    inside, where s_q * H <= 32, else "ws") or "pair" (one sparse forward on the pair schedule, H 64 / 128, else
    "ws"); None takes ``$FLASHDSA_DECODE_VARIANT`` or ``DEFAULT_VARIANT``.
    The three-launch paths share the split plan, the partial buffers and the combine kernel.  ``checked``: the
    caller has already had ``kernel_unsupported`` accept these arguments (the dispatcher does), so it is not run
    twice.  One call is ``prepare_dense`` (the decisions and the per-step work that depends on block_table /
    cache_seqlens only) then one launch of what it returns (``mla_decode_plan`` keeps that for many layers).
    """
    if not checked:
        reason = kernel_unsupported(q, kv_cache, block_table, cache_seqlens, d_v=d_v, causal=causal,
                                    attn_sink=attn_sink)
        if reason is not None:
            raise ValueError(f"mla_decode dense kernel: {reason}")
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    from ._dense_step import prepare_dense

    B, s_q, H, _ = q.shape
    step = prepare_dense(B, s_q, H, kv_cache.shape, block_table, cache_seqlens, sm_scale=sm_scale, causal=causal,
                         has_sink=attn_sink is not None, variant=variant, device=q.device)
    return step(q, kv_cache, attn_sink)


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    cases = []
    for heads, s_q, bs, causal, sink in [
        (128, 2, 16, True, True),  # lowering is slow on CPU: one case
    ]:
        name = f"partial_h{heads}_sq{s_q}_bs{bs}" + ("_causal" if causal else "") + ("_sink" if sink else "")
        cases.append((name, build_partial_kernel(heads=heads, s_q=s_q, block_size=bs, causal=causal,
                                                 sm_scale=DQK ** -0.5, has_sink=sink)))
    return cases


def combine_lowering_cases():
    """The combine kernel (no wgmma, so kept out of ``lowering_cases``, whose test asserts wgmma)."""
    cases = []
    for heads, s_q, sink in [(128, 2, True)]:
        cases.append((f"combine_h{heads}_sq{s_q}" + ("_sink" if sink else ""),
                      build_combine_kernel(heads=heads, s_q=s_q, has_sink=sink)))
    from ._plan_kernel import build_plan_kernel

    cases.append(("plan", build_plan_kernel(tile=BLOCK_N, n_mt=1, num_sms=132, overhead=_OVERHEAD_TILES,
                                            min_chunk=_MIN_CHUNK_TILES)))
    return cases
