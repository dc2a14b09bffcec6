"""Sparse MLA forward reading the DeepSeek-V3.2 FP8 KV cache (656-byte rows) directly (TileLang, Hopper sm_90a).

Notes
-----
Same contract, host interface and numerics as ``kernel_fwd.py`` (the pipelined bf16 forward), with ``kv`` the
uint8 `[Tkv, 656]` cache of :func:`flashdsa.quant.quantize_kv_fp8`::

    bytes [  0, 512)  e4m3 of dims 0..511 (four 128-dim tiles)
    bytes [512, 528)  four float32 scales (powers of two), one per tile
    bytes [528, 656)  dims 512..575 (rope) as bfloat16

The kernel gathers the raw rows, dequantizes ``bf16(float(e4m3) * scale)`` (exact) into a bf16 tile in shared
memory and then computes exactly like the bf16 forward on ``dequantize_kv_fp8(kv)``: bf16 wgmma for QK^T and PV,
fp32 online softmax in the exp2 domain.  q is bf16 `[T, H, 576]`, d_v = 512.

Design
  * Grid ``(T, ceil(H / 64))``, 256 threads = 2 warpgroups, ``GemmWarpPolicy.FullRow`` (as kernel_fwd): QK^T is
    64 x 32 per warpgroup over 576 dims, PV 64 x 256 per warpgroup.  Heads padded to 64 rows (H = 1..128).
  * The cache is passed as 16-byte chunks: a `[n_chunks, 16]` array (three dtype views of the same bytes: e4m3
    `[n_chunks, 16]`, float32 `[n_chunks, 4]`, bf16 `[n_chunks, 8]`), row ``r`` starting at chunk ``r * rs16``
    (``rs16`` = row stride / 16, a scalar argument), so padded row strides need no copy and every address is
    provably 16-byte aligned.  Chunks 0..31 of a row are the e4m3 latent, 32 the scales, 33..40 the rope.
  * Hand-written pipeline, one top-k block of ``BI = 64`` slots per iteration (cp.async, ``wait_group 0``):
        wait(raw i, rope i) -> barrier -> dequant Raw -> KV (bf16) -> fence.proxy.async + barrier
        -> issue cp.async of raw i+1 (Raw, Scl) and rope i+1 (Kt[(i+1)%2]) -> QK(i) -> softmax -> PV(i)
    The gather of block i+1 (41 x 16 B per row, 57% of the bf16 kernel's 72 x 16 B) is in flight during
    QK/softmax/PV of block i (one whole block of latency cover).  The rope goes straight from the cache into a
    double-buffered bf16 tile (no conversion); the e4m3 latent and the scales are staged raw (one stage).
  * Gathers are ``T.Parallel`` nests annotated ``parallel_prefer_async`` + ``parallel_async_without_async_
    commit_wait``: predicated zero-filling cp.async (src-size 0 for invalid slots: nothing is read, the staging
    rows are zeros, scale 0) with one explicit commit per block.  The address of an invalid slot is clamped to
    row 0 anyway.  Invalid score columns start at -inf before the QK wgmma accumulates (as kernel_fwd).
  * Blocks past ceil(topk_eff / 64) are skipped (uniform per CTA): short ``topk_length`` rows cost less.
  * Masking / numerics exactly as kernel_fwd: slot j valid iff j < topk_eff and 0 <= idx < Tkv; running max
    starts at -1e30; empty row -> out 0, lse +inf, max_logits -inf; sink folded as
    1 / (l + exp2(sink*log2e - m*c)).
  * Dequantization: the vectorized fp8 -> f32 cast (cvt.rn.f16x2.e4m3x2 + f16 -> f32), fp32 multiply by the
    power-of-two tile scale (exact), f32x2 -> bf16x2 (exact: 4 significant bits).
Shared memory: Q 64x512 + 64x64 bf16 (73,728) + KV latent 64x512 bf16 (65,536) + 2 rope tiles 64x64 bf16
  (16,384) + raw e4m3 64x512 (32,768) + scales 64x4 f32 (1,024) + P 64x64 bf16 (8,192) = 197,632 B + reduction
  scratch (~2 KB), under the 232,448 B cap.  A second raw stage would not fit next to a double bf16 tile.
Cost model per block vs kernel_fwd: the gather moves 41 instead of 72 16-byte chunks per row (fewer cp.async
  and shared stores); the dequant adds 64x512 conversions (~6 ALU instructions per pair of values, ~400 per
  thread), 32 KB of shared reads and 64 KB of shared writes, serialized between the gather wait and QK.
  Expected 0.85-0.95x of kernel_fwd's time per block; see Risks.
Verified on the H200 (tests/sparse_mla/test_kernel_fp8cache_gpu.py).  Since session 9 ``run_sparse_mla_fwd`` sends H 64
and 128 to ``kernel_fwd_pair_cache`` (the pair schedule; this kernel stays for other head counts); since session 14,
where the cache rows are reused enough (prefill), H 64 / 128 run ``kernel_fwd_pair`` on a bf16 copy of the whole cache
instead (``kernel_dequant656``; same bits, S 4096 / H 128: 1.02x / 1.03x of the bf16 forward at SKV 8192 / 131072).
Risks
  * Speed: the dequant is not overlapped with the tensor cores (one bf16 tile only).  If below 0.9x, next step:
    register-staged raw prefetch (ld.global of block i+1 into 36 registers/thread) + two bf16 tiles (like
    kernel_fwd's smem) + async PV(i) overlapping the dequant of block i+1 into the other tile.
  * Exactness assumes the format's scales (powers of two in [2^-126, 2^127] such that e4m3 * scale is a normal
    bf16, true for the quantizer's scales >= 2^-13).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools
import os

import torch

import tilelang
import tilelang.language as T

from .._tilelang import aligned, direct_launcher, plain_pass_configs
from . import _tl_common as tc
from ._tl_common import BLOCK_H, BLOCK_I, D_V, LN2, LOG2E  # noqa: F401  (re-exported: LN2)

DQK = 576
D_TAIL = DQK - D_V  # 64 rope dims
ROW_BYTES = 656
CHUNK = 16  # bytes per cp.async
N_CHUNKS_ROW = ROW_BYTES // CHUNK  # 41
LAT_CHUNKS = D_V // CHUNK  # 32 e4m3 chunks (dims 0..511)
SCALE_CHUNK = 32  # 4 float32 scales
ROPE_CHUNK0 = 33  # 8 chunks of 8 bf16
TILE = 128  # dims per scale
FP8 = "float8_e4m3fn"



def cache_macros(*, BI: int, topk_dim):
    """(issue, dequant) over the 656-byte cache (``topk_dim``: the indices width symbol):

    * ``issue(Indices, KV8, KVf, KVb, rs16, n_rows, tok, lim, blk, Raw_s, Scl_s, Kt_b)``: cp.async (no commit, no
      wait) of top-k block ``blk`` of token ``tok``: e4m3 latent -> ``Raw_s [BI, 512]``, scales -> ``Scl_s [BI, 4]``,
      rope -> ``Kt_b [BI, 64]`` bf16.  Invalid slots: src-size 0 (zero fill, nothing read), address clamped to row 0.
    * ``dequant(Raw_s, Scl_s, KV_s)``: ``KV_s = bf16(float(e4m3) * scale)`` (exact for the format's scales).
    """
    _row = tc.make_slot_row(topk_dim)
    bf16, f32 = "bfloat16", "float32"

    @T.macro
    def issue(Indices, KV8, KVf, KVb, rs16, n_rows, tok, lim, blk, Raw_s, Scl_s, Kt_b):
        for r, c, v in T.Parallel(BI, LAT_CHUNKS, CHUNK, annotations=tc.ASYNC_GATHER):
            row = _row(Indices, tok, lim, blk * BI + r)
            ok = (row >= 0) & (row < n_rows)
            base = T.if_then_else(ok, row, 0) * rs16
            Raw_s[r, c * CHUNK + v] = T.if_then_else(ok, KV8[base + c, v], T.cast(0, FP8))
        for r, v in T.Parallel(BI, 4, annotations=tc.ASYNC_GATHER):
            row = _row(Indices, tok, lim, blk * BI + r)
            ok = (row >= 0) & (row < n_rows)
            base = T.if_then_else(ok, row, 0) * rs16
            Scl_s[r, v] = T.if_then_else(ok, KVf[base + SCALE_CHUNK, v], T.float32(0))
        for r, c, v in T.Parallel(BI, D_TAIL // 8, 8, annotations=tc.ASYNC_GATHER):
            row = _row(Indices, tok, lim, blk * BI + r)
            ok = (row >= 0) & (row < n_rows)
            base = T.if_then_else(ok, row, 0) * rs16
            Kt_b[r, c * 8 + v] = T.if_then_else(ok, KVb[base + ROPE_CHUNK0 + c, v], T.cast(0, bf16))

    @T.macro
    def dequant(Raw_s, Scl_s, KV_s):
        for r, d in T.Parallel(BI, D_V):
            KV_s[r, d] = T.cast(T.cast(Raw_s[r, d], f32) * Scl_s[r, d // TILE], bf16)

    return issue, dequant


def build_sparse_mla_fwd_fp8cache(
    *,
    heads: int,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
    threads: int = 256,
    softmax_batch: int | tuple = 1,
):
    """Return the TileLang prim_func.

    ``softmax_batch``: see ``_tl_common.online_softmax_macro``.  2 fits here (~202 KB of shared memory + 2 KB of
    scratch) and passed this kernel's GPU correctness tests in session 7 (`74f7a0f`), but is not timed yet: 1
    stays the default until the decode / FP8 suites have measured it.

    Specialised on ceil(topk / 64) (static trip count); T, the number of cache chunks and the indices width are
    dynamic.  Signature: (Q[T,H,576] bf16, KV8[n_ch,16] e4m3, KVf[n_ch,4] f32, KVb[n_ch,8] bf16 (three views of
    the same cache bytes), rs16 int32 (row stride in chunks), n_rows int32 (Tkv), Indices[T,topk] i32,
    TopkLen[n_tl] i32, Sink[n_sink] f32, Out[T,H,512] bf16, Lse[T,H] f32, MaxLogits[T,H] f32).
    """
    assert 1 <= heads <= 2 * BLOCK_H
    assert sm_scale is not None and sm_scale > 0
    D = D_V
    DT = D_TAIL
    BH = BLOCK_H
    BI = BLOCK_I
    n_hblk = (heads + BH - 1) // BH
    NI = (int(topk) + BI - 1) // BI
    c_log2 = float(sm_scale) * LOG2E  # raw score -> log2 units
    neg_big = tc.NEG_BIG

    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    _row = tc.make_slot_row(topk_dim)  # cache row of a top-k slot, -1 past topk_eff
    online_softmax = tc.online_softmax_macro(BH=BH, BI=BI, D=D, c_log2=c_log2, batch=softmax_batch)
    load_q, normaliser, store_out, store_lse = tc.padded_head_macros(
        BH=BH, D=D, D_tail=DT, dqk=DQK, heads=heads, c_log2=c_log2, has_sink=has_sink, dtype=bf16,
        sync_before_stage=True,  # every warpgroup must be past its last QK (reads Q_s) before Q_s is overwritten
    )
    issue, dequant = cache_macros(BI=BI, topk_dim=topk_dim)

    @T.macro
    def attend(Indices, n_rows, tok, lim, blk, Q_s, Qt_s, KV_s, Kt_b, S_s, acc_s, acc_o, m_i, m_prev, alpha, l_i,
               l_blk):
        # ---- S = Q K^T, invalid columns start at -inf ----
        for h, r in T.Parallel(BH, BI):
            row = _row(Indices, tok, lim, blk * BI + r)
            acc_s[h, r] = T.if_then_else((row >= 0) & (row < n_rows), T.float32(0), -T.infinity(f32))
        T.gemm(Q_s, KV_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.gemm(Qt_s, Kt_b, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        # ---- online softmax (raw-score max, exp2 with folded scale) ----
        online_softmax(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk)
        T.copy(acc_s, S_s)
        T.gemm(S_s, KV_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.prim_func
    def sparse_mla_fwd_fp8cache(
        Q: T.Tensor([n_tok, heads, DQK], bf16),
        KV8: T.Tensor([n_ch, CHUNK], FP8),
        KVf: T.Tensor([n_ch, CHUNK // 4], f32),
        KVb: T.Tensor([n_ch, CHUNK // 2], bf16),
        rs16: T.int32,
        n_rows: T.int32,
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, n_hblk, threads=threads) as (bx, by):
            Q_s = T.alloc_shared([BH, D], bf16)
            Qt_s = T.alloc_shared([BH, DT], bf16)
            KV_s = T.alloc_shared([BI, D], bf16)
            Kt0 = T.alloc_shared([BI, DT], bf16)
            Kt1 = T.alloc_shared([BI, DT], bf16)
            Raw_s = T.alloc_shared([BI, D], FP8)
            Scl_s = T.alloc_shared([BI, 4], f32)
            S_s = T.alloc_shared([BH, BI], bf16)

            acc_o = T.alloc_fragment([BH, D], f32)
            acc_s = T.alloc_fragment([BH, BI], f32)
            m_i = T.alloc_fragment([BH], f32)
            m_prev = T.alloc_fragment([BH], f32)
            alpha = T.alloc_fragment([BH], f32)
            l_i = T.alloc_fragment([BH], f32)
            l_blk = T.alloc_fragment([BH], f32)
            inv = T.alloc_fragment([BH], f32)
            lim = T.alloc_local([1], i32)
            nblk = T.alloc_local([1], i32)

            h0 = by * BH
            if has_topk_length:
                lim[0] = T.max(T.min(TopkLen[bx], topk_dim), 0)
            else:
                lim[0] = topk_dim
            nblk[0] = T.min((lim[0] + BI - 1) // BI, NI)

            load_q(Q, Q_s, Qt_s, bx, h0)  # Q tile, padded heads -> 0

            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, neg_big)

            if nblk[0] > 0:
                issue(Indices, KV8, KVf, KVb, rs16, n_rows, bx, lim[0], 0, Raw_s, Scl_s, Kt0)
                T.ptx_commit_group()

            for it in T.serial(NI):
                if it < nblk[0]:
                    # raw(it) and rope(it) landed (each thread its own copies, then the barrier for all);
                    # every thread is past PV(it-1), so KV_s and S_s are free
                    T.ptx_wait_group(0)
                    T.fence_proxy_async()
                    T.sync_threads()
                    dequant(Raw_s, Scl_s, KV_s)
                    T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
                    T.sync_threads()  # KV_s complete; Raw_s / Scl_s consumed
                    if it % 2 == 0:
                        if it + 1 < nblk[0]:
                            issue(Indices, KV8, KVf, KVb, rs16, n_rows, bx, lim[0], it + 1, Raw_s, Scl_s, Kt1)
                            T.ptx_commit_group()
                        attend(Indices, n_rows, bx, lim[0], it, Q_s, Qt_s, KV_s, Kt0, S_s, acc_s, acc_o, m_i,
                               m_prev, alpha, l_i, l_blk)
                    else:
                        if it + 1 < nblk[0]:
                            issue(Indices, KV8, KVf, KVb, rs16, n_rows, bx, lim[0], it + 1, Raw_s, Scl_s, Kt0)
                            T.ptx_commit_group()
                        attend(Indices, n_rows, bx, lim[0], it, Q_s, Qt_s, KV_s, Kt1, S_s, acc_s, acc_o, m_i,
                               m_prev, alpha, l_i, l_blk)

            # ---- epilogue (the Q tile is the output staging buffer) ----
            normaliser(inv, l_i, m_i, Sink, h0)
            store_out(acc_o, inv, Q_s, Out, bx, h0)
            store_lse(l_i, m_i, Lse, MaxLogits, bx, h0)

    return sparse_mla_fwd_fp8cache


def _pass_configs():
    return plain_pass_configs()


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool):
    func = build_sparse_mla_fwd_fp8cache(
        heads=heads, topk=n_blocks * BLOCK_I, sm_scale=sm_scale, has_sink=has_sink, has_topk_length=has_topk_length
    )
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason (shapes/dtypes/layout only)."""
    if not (q.is_cuda and kv.is_cuda and indices.is_cuda):
        return "tensors must be on CUDA"
    if q.dtype != torch.bfloat16:
        return "q must be bfloat16"
    if kv.dtype != torch.uint8:
        return "kv must be the uint8 656-byte FP8 cache"
    if indices.dtype != torch.int32:
        return "indices must be int32"
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        return "expected q [T,H,576], kv [Tkv,656], indices [T,topk]"
    n_tok, heads, dqk = q.shape
    if dqk != DQK:
        return f"Dqk={dqk} != {DQK}"
    if d_v != D_V:
        return f"d_v={d_v} != {D_V}"
    if kv.shape[1] != ROW_BYTES:
        return f"kv last dim {kv.shape[1]} != {ROW_BYTES}"
    reason = tc.check_heads_indices(n_tok, heads, indices)
    if reason is not None:
        return reason
    if q.stride(-1) != 1 or indices.stride(-1) != 1:
        return "last dim must be contiguous"
    reason = cache_layout_unsupported(kv)
    if reason is not None:
        return reason
    if n_tok >= 2**31 or indices.shape[1] >= 2**30:
        return "sizes exceed int32 indexing"
    return tc.check_optional(n_tok, heads, topk_length, attn_sink)


def cache_layout_unsupported(kv) -> str | None:
    """The cache's part of ``kernel_unsupported`` (kv [Tkv, 656] uint8, its shape and dtype checked already): None
    where the kernels address its rows, else why not; what ``mla_decode_plan`` checks per layer."""
    if kv.stride(-1) != 1:
        return "last dim must be contiguous"
    if kv.shape[0] > 1 and (kv.stride(0) % CHUNK != 0 or kv.stride(0) < ROW_BYTES):
        return "kv row stride must be a multiple of 16 bytes and >= 656"
    if kv.data_ptr() % CHUNK != 0:
        return "kv must be 16-byte aligned"
    if _n_chunks(kv) >= 2**31:
        return "sizes exceed int32 indexing"
    return None


def _rs16(kv) -> int:
    return (kv.stride(0) if kv.shape[0] > 1 else ROW_BYTES) // CHUNK


def _n_chunks(kv) -> int:
    return (kv.shape[0] - 1) * _rs16(kv) + N_CHUNKS_ROW if kv.shape[0] > 0 else 0


def cache_chunks(kv):
    """The cache as 16-byte chunks ``[n_chunks, 16]`` uint8 (no copy; any row stride that is a multiple of 16 B);
    row r starts at chunk ``r * _rs16(kv)``."""
    return kv.as_strided((_n_chunks(kv), CHUNK), (CHUNK, 1))


# "0": H <= 32 runs this module's 64-head kernel; "1" / "narrow656": kernel_fwd_narrow656 up to H 32; a name in
# kernel_fwd_narrow656_dual.PREFETCH or "mma" (kernel_fwd_mma656): that form at H <= 16; unset: FEW_HEAD_FORM at
# H <= 16, narrow656 at 17..32
NARROW_ENV = "FLASHDSA_NARROW_CACHE656"
# The form run at H <= 16 without an explicit choice: kernel_fwd_mma656's per-warp mma.sync chains with the row
# copies issued by 4 producer warps ("mma_ws"), the fastest build on every shape measured (session 43, H 16, topk
# 2048, de6276c, "mma" -> "mma_ws": decode B 128 73.6 -> 71.3 us, B 512 269.8 -> 246.8 us, prefill S 4096 over
# SKV 8192 1.999 -> 1.674 ms, S 256 130.9 -> 110.8 us; "mma" beat the two-warpgroup form everywhere in session 33)
FEW_HEAD_FORM = "mma_ws"


def _use_pair(q, pair, narrow) -> bool:
    """``pair`` as given, or by default: the pair cache kernel for H 64 / 128 unless a narrow form was asked."""
    from . import kernel_fwd_pair_cache

    return pair if pair is not None else (q.dim() == 3 and q.shape[1] in kernel_fwd_pair_cache.SUPPORTED_H
                                          and not narrow)


def _default_narrow(heads: int) -> bool | str:
    """The ``narrow`` choice at this H when none is given: ``$FLASHDSA_NARROW_CACHE656`` (``NARROW_ENV``), else
    ``FEW_HEAD_FORM`` at H <= 16 and narrow656 at 17..32, False above."""
    from . import kernel_fwd_narrow656, kernel_fwd_narrow656_dual

    env = os.environ.get(NARROW_ENV, "")
    narrow = env != "0" and heads <= kernel_fwd_narrow656.MAX_HEADS
    if narrow and heads <= kernel_fwd_narrow656_dual.MAX_HEADS and env not in ("1", "narrow656"):
        known = env in kernel_fwd_narrow656_dual.PREFETCH or env.startswith("mma")  # "mma_a<N>": timing builds
        narrow = env if known else FEW_HEAD_FORM
    return narrow


def writes_f32(heads: int) -> bool:
    """Whether the kernel ``run_sparse_mla_fwd`` picks at this H (no explicit form) writes float32 outputs with
    ``out_f32`` (split-KV partials): the pair form (H 64 / 128) and the "mma" forms (H <= 16, not a timing build)."""
    from . import kernel_fwd_mma656, kernel_fwd_pair_cache

    if heads in kernel_fwd_pair_cache.SUPPORTED_H:
        return True
    narrow = _default_narrow(heads)
    return (isinstance(narrow, str) and narrow.startswith("mma") and heads <= kernel_fwd_mma656.MAX_HEADS
            and kernel_fwd_mma656.form(narrow)[0] == 0)


def launcher(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
             narrow: bool | str | None = None, pair: bool | None = None, narrow_stages: int | None = None,
             dequant_once: bool | None = None, out_f32: bool = False):
    """The one kernel launch ``run_sparse_mla_fwd`` makes for these accepted arguments (T > 0, Tkv > 0), as a
    callable ``(q, kv, indices, topk_length or dummy, attn_sink or dummy, out, lse, max_logits)`` (q and indices
    contiguous and 16-byte aligned: ``_tilelang.aligned``; the "mma" forms' Q loads are 16-byte vectors); None
    where the call takes the whole-cache bf16 copy (``dequant_once``: two launches).  What ``mla_decode``'s eager
    plans store per call signature.  Arguments: as ``run_sparse_mla_fwd``."""
    from . import (kernel_dequant656, kernel_fwd_mma656, kernel_fwd_narrow656, kernel_fwd_narrow656_dual,
                   kernel_fwd_pair_cache)

    heads = q.shape[1]
    has_sink, has_tl = attn_sink is not None, topk_length is not None
    n_blocks = (indices.shape[1] + BLOCK_I - 1) // BLOCK_I
    if _use_pair(q, pair, narrow):
        if kernel_dequant656.use_dequant_once(q.shape[0], indices.shape[-1], heads, kv.shape[0], dequant_once):
            return None
        return kernel_fwd_pair_cache.launcher(heads, n_blocks, float(sm_scale), has_sink, has_tl, out_f32=out_f32,
                                              n_tok=indices.shape[0], device_index=q.device.index)
    if narrow is None:
        narrow = _default_narrow(heads)
    if isinstance(narrow, str) and narrow.startswith("mma"):  # per-warp mma.sync chains (H <= 16)
        if heads > kernel_fwd_mma656.MAX_HEADS:
            raise ValueError(f"narrow: the 'mma' form takes H <= {kernel_fwd_mma656.MAX_HEADS}, got H={heads}")
        kernel = kernel_fwd_mma656.compiled(heads, float(sm_scale), has_sink, has_tl, narrow, out_f32)
    elif out_f32:
        raise ValueError(f"out_f32: only the pair and 'mma' forms write float32 outputs, got narrow={narrow!r}")
    elif narrow in kernel_fwd_narrow656_dual.PREFETCH:  # the two-warpgroup forms (H <= 16)
        if heads > kernel_fwd_narrow656_dual.MAX_HEADS:
            raise ValueError(f"narrow: the {narrow!r} form takes H <= {kernel_fwd_narrow656_dual.MAX_HEADS}, "
                             f"got H={heads}")
        kernel = kernel_fwd_narrow656_dual.compiled(heads, float(sm_scale), has_sink, has_tl, narrow)
    elif narrow:
        kernel = kernel_fwd_narrow656.compiled(heads, float(sm_scale), has_sink, has_tl, narrow_stages)
    else:
        kernel = _compiled(heads, n_blocks, float(sm_scale), has_sink, has_tl)
    run = direct_launcher(kernel)

    def launch(q, kv, indices, tl_arg, sink_arg, out, lse, max_logits):
        chunks = cache_chunks(kv)
        run(q, chunks.view(torch.float8_e4m3fn), chunks.view(torch.float32), chunks.view(torch.bfloat16), _rs16(kv),
            kv.shape[0], indices, tl_arg, sink_arg, out, lse, max_logits)

    return launch


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
                       narrow: bool | str | None = None, pair: bool | None = None, narrow_stages: int | None = None,
                       dequant_once: bool | None = None, checked: bool = False, out_f32: bool = False):
    """Returns (out [T,H,512] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32).  ``out_f32`` (split-KV
    partials; the pair and "mma" forms only, no whole-cache copy): out float32, and q may hold one row per token
    for T = indices' rows = a multiple of q's (row t reads q row t / (T / q rows)); such a q passes only with
    ``checked=True`` (``kernel_unsupported`` asks q rows = indices rows).

    ``pair``: run ``kernel_fwd_pair_cache`` (the warp-specialised pair schedule, H 64 / 128); None: whenever H
    is 64 or 128.  With ``pair``, ``dequant_once`` (None: ``kernel_dequant656.use_dequant_once``'s rule, which
    picks it where every cache row is gathered many times, as in prefill) runs ``kernel_fwd_pair`` on a bf16 copy
    of the whole cache instead (``kernel_dequant656.dequantize_cache``; bitwise the same outputs).  ``narrow``: run
    ``kernel_fwd_narrow656`` (bulk row copies, keys on the wgmma M side, H <= 32;
    ``narrow_stages``: its raw stage count, None = its default; ``narrow`` = a name in
    ``kernel_fwd_narrow656_dual.PREFETCH``: that two-warpgroup form, H <= 16; "mma": ``kernel_fwd_mma656``'s
    per-warp ``mma.sync`` chains, H <= 16); None: ``FEW_HEAD_FORM`` at H <= 16 and narrow656 at H 17..32, unless
    ``$FLASHDSA_NARROW_CACHE656`` says otherwise (``NARROW_ENV``).
    Otherwise this module's pipelined kernel (heads padded to 64).
    ``checked``: ``kernel_unsupported`` has already accepted these arguments (the dispatcher ran it)."""
    from . import kernel_dequant656, kernel_fwd_pair, kernel_fwd_pair_cache

    pair = _use_pair(q, pair, narrow)
    if not checked:
        check = kernel_fwd_pair_cache.kernel_unsupported if pair else kernel_unsupported
        reason = check(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
        if reason is not None:
            raise ValueError(f"sparse_mla fwd {'pair ' if pair else ''}fp8-cache kernel: {reason}")
    if out_f32:
        dequant_once = False
    if pair and kernel_dequant656.use_dequant_once(q.shape[0], indices.shape[-1], q.shape[1], kv.shape[0],
                                                   dequant_once):
        return kernel_fwd_pair.run_sparse_mla_fwd(q, kernel_dequant656.dequantize_cache(kv), indices,
                                                  sm_scale=sm_scale, d_v=d_v, topk_length=topk_length,
                                                  attn_sink=attn_sink, checked=True)
    (out, lse, max_logits), done = tc.fwd_outputs(q, kv, sm_scale=sm_scale, d_v=d_v,
                                                  out_dtype=torch.float32 if out_f32 else torch.bfloat16,
                                                  n_tok=indices.shape[0])
    if done:
        return out, lse, max_logits
    q, indices = aligned(q), aligned(indices)
    launch = launcher(q, kv, indices, sm_scale=sm_scale, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink,
                      narrow=narrow, pair=pair, narrow_stages=narrow_stages, dequant_once=False, out_f32=out_f32)
    _, _, tl_arg, sink_arg, _ = tc.optional_args(indices, topk_length, attn_sink, q.device)
    launch(q, kv, indices, tl_arg, sink_arg, out, lse, max_logits)
    return out, lse, max_logits


def lowering_cases():
    """One representative (name, prim_func) for the CPU lowering test (lowering is slow on CPU)."""
    heads, topk = 128, 2048
    fn = build_sparse_mla_fwd_fp8cache(heads=heads, topk=topk, sm_scale=DQK**-0.5, has_sink=True, has_topk_length=True)
    return [(f"fp8cache_h{heads}_topk{topk}_sink_tl", fn)]
