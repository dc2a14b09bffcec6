"""Pieces shared by the sparse MLA kernel modules (kernel_fwd*, kernel_bwd): constants, the top-k slot -> KV row
expression, TileLang macro factories for the online softmax and the forward epilogue, and host-side checks and
launch helpers.

The macros are built by factories (closures over the per-kernel constants, like the macros each build function
defines); TileLang inlines them at trace time, so a kernel that uses them lowers to the same CUDA as one that
writes the statements out (checked byte for byte when they were factored out).  TileLang 0.1.15 details that
matter for that: a macro binds each scalar argument to its parameter name (a Var passed in is RENAMED to the
parameter, an expression becomes a let-bound var), buffers pass through unchanged, and ``x = buf`` inside a
prim_func renames ``buf``; so the macros take the names the kernels already use (``bx``, ``h0``, ``tok``) and a
missing optional tile is passed as ``None`` rather than as a placeholder alias.
"""

# no `from __future__ import annotations`: TileLang reads annotations at definition time

import math

import tilelang.language as T
import torch

from .._tilelang import aligned, dummy

LOG2E = 1.4426950408889634
# f16 products over the 656-byte cache: each head's largest |q * token tile scale| is scaled into [2^13, 2^14)
# (f16 max 65504; kernel_fwd_narrow656_dual's "ring_er_f16")
Q_F16_TOP = 8192.0
LN2 = 0.6931471805599453

BLOCK_H = 64  # heads per block (wgmma M)
BLOCK_I = 64  # top-k slots per iteration
D_V = 512
SUPPORTED_DQK = (512, 576)
NEG_BIG = -1.0e30  # initial running max (raw score units): all-invalid blocks give exp2(-inf) = 0, never inf - inf


# ---------------------------------------------------------------------------------------------- kernel side
# T.Parallel annotations of a gather nest: cp.async without the implicit commit/wait (the caller commits once)
ASYNC_GATHER = {"parallel_prefer_async": True, "parallel_async_without_async_commit_wait": True}


def dynamic_dims(*names):
    """One TileLang dynamic symbol per name (T, Tkv, the indices width, ...)."""
    return tuple(T.dynamic(n) for n in names)


def make_slot_row(topk_dim):
    """``row(Indices, tok, lim, slot)``: KV row of top-k slot ``slot`` of token ``tok``, or -1 when
    ``slot >= lim`` (topk_eff); the Indices read stays in bounds.  Loads through row -1 / rows >= Tkv are
    predicated off by TileLang's safe-access legalisation (zero fill, nothing read)."""

    def row(Indices, tok, lim, slot):
        return T.if_then_else(slot < lim, Indices[tok, T.min(slot, topk_dim - 1)], -1)

    return row


def make_set_lim(has_topk_length, topk_dim):
    """Macro ``set_lim(lim, TopkLen, tok)``: lim[0] = topk_eff = clamp(topk_length[tok], 0, topk), or topk."""

    @T.macro
    def set_lim(lim, TopkLen, tok):
        if has_topk_length:
            lim[0] = T.max(T.min(TopkLen[tok], topk_dim), 0)
        else:
            lim[0] = topk_dim

    return set_lim


def make_row_ok(n_rows):
    """``ok(row)``: 0 <= row < n_rows."""

    def ok(row):
        return (row >= 0) & (row < n_rows)

    return ok


def online_softmax_macro(*, BH, BI, D, c_log2, batch=1):
    """Macro ``online_softmax(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk)``: one block of the exp2 online
    softmax on raw scores acc_s [BH, BI] (c_log2 = sm_scale * log2(e) folded): m_i = max(m_i, rowmax S),
    alpha = 2^((m_prev - m_i) c), acc_s = 2^(S c - m_i c) (P, in place), l_i = l_i alpha + rowsum(P),
    acc_o [BH, D] *= alpha.  ``batch``: rows per cross-thread reduction round (TileLang's ``reduce(batch=)``: one
    pair of barriers per round instead of per row; must divide the rows each thread holds), one int for both
    reductions or ``(max_batch, sum_batch)`` (each batched reduction needs its own, larger scratch).
    ``sum_batch == 0``: no row sum per block; ``l_blk`` is then a [BH, BI] fragment that accumulates P
    element-wise (``l_blk = l_blk * alpha + P``, thread-local, no barrier) and the caller reduces it into l_i once
    after the loop (``T.reduce_sum(l_blk, l_i, dim=1)``); ``l_i`` is not touched here."""
    max_batch, sum_batch = (batch, batch) if isinstance(batch, int) else batch

    @T.macro
    def online_softmax(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk):
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False, batch=max_batch)
        for h in T.Parallel(BH):
            alpha[h] = T.exp2((m_prev[h] - m_i[h]) * c_log2)
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.exp2(acc_s[h, r] * c_log2 - m_i[h] * c_log2)
        if sum_batch == 0:
            for h, r in T.Parallel(BH, BI):
                l_blk[h, r] = l_blk[h, r] * alpha[h] + acc_s[h, r]
        else:
            T.reduce_sum(acc_s, l_blk, dim=1, batch=sum_batch)
            for h in T.Parallel(BH):
                l_i[h] = l_i[h] * alpha[h] + l_blk[h]
        for h, d in T.Parallel(BH, D):
            acc_o[h, d] = acc_o[h, d] * alpha[h]

    return online_softmax


def wg1_pv_step_macro(*, BH, DH):
    """Macro ``wg1_step(phase, s_rdy, Alpha_s, P, KVr, kv_fr, acc_o)`` of the warp-specialised kernels' second
    consumer warpgroup (dense decode "ws"): wait for P and alpha of a block (``s_rdy``), rescale
    its O half, O += P V_half (wgmma), retire it and release the KV buffer (``kv_fr``)."""

    @T.macro
    def wg1_step(phase, s_rdy, Alpha_s, P, KVr, kv_fr, acc_o):
        T.barrier_wait(s_rdy, phase)
        for h, d in T.Parallel(BH, DH):
            acc_o[h, d] = acc_o[h, d] * Alpha_s[h]
        T.wgmma_gemm(P, KVr, acc_o)
        T.wait_wgmma(0)
        T.barrier_arrive(kv_fr)

    return wg1_step


def narrow_macros(*, BR, BI, D, has_tail, c_log2):
    """Macros of the narrow kernels (``kernel_fwd_narrow``, ``decode/kernel_dense_narrow``): the ``BI`` keys of a
    tile on the wgmma M side, ``BR`` zero-padded query rows on N.

    * ``qk_t(KV_b, Kt_b, Q_s, Qt_s, acc_t, ST_s)``: ``S^T [BI, BR] = K Q^T`` (+ the rope tail when ``has_tail``) into
      the fragment ``acc_t``, then staged as fp32 in ``ST_s`` (the caller reads it back transposed and masked).
    * ``softmax_pv(KV_b, s_f, P_s, Alpha_s, acc_ot, m_i, m_prev, alpha, l_i, l_blk)``: one online-softmax step on
      the masked raw scores ``s_f [BR, BI]`` (-inf where invalid; exp2 with ``c_log2`` folded), P (bf16) and alpha
      to shared memory, ``acc_ot [D, BR]`` rescaled by alpha and ``+= V^T P^T`` (V = the first ``D`` columns of
      ``KV_b``, read MN-major).
    * ``softmax_stage(s_f, P_s, Alpha_s, m_i, m_prev, alpha, l_i, l_blk)``: the softmax part of ``softmax_pv``
      alone (P and alpha in shared memory; no rescale, no product), for kernels that issue their own PV.
    """

    @T.macro
    def qk_t(KV_b, Kt_b, Q_s, Qt_s, acc_t, ST_s):
        T.clear(acc_t)
        T.gemm(KV_b, Q_s, acc_t, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        if has_tail:
            T.gemm(Kt_b, Qt_s, acc_t, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.copy(acc_t, ST_s)

    @T.macro
    def softmax_stage(s_f, P_s, Alpha_s, m_i, m_prev, alpha, l_i, l_blk):
        T.copy(m_i, m_prev)
        T.reduce_max(s_f, m_i, dim=1, clear=False)
        for n in T.Parallel(BR):
            alpha[n] = T.exp2((m_prev[n] - m_i[n]) * c_log2)
        for n, r in T.Parallel(BR, BI):
            s_f[n, r] = T.exp2(s_f[n, r] * c_log2 - m_i[n] * c_log2)
        T.reduce_sum(s_f, l_blk, dim=1)
        for n in T.Parallel(BR):
            l_i[n] = l_i[n] * alpha[n] + l_blk[n]
        T.copy(alpha, Alpha_s)
        T.copy(s_f, P_s)

    @T.macro
    def softmax_pv(KV_b, s_f, P_s, Alpha_s, acc_ot, m_i, m_prev, alpha, l_i, l_blk):
        softmax_stage(s_f, P_s, Alpha_s, m_i, m_prev, alpha, l_i, l_blk)
        for d, n in T.Parallel(D, BR):
            acc_ot[d, n] = acc_ot[d, n] * Alpha_s[n]
        T.gemm(KV_b, P_s, acc_ot, transpose_A=True, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

    return qk_t, softmax_pv, softmax_stage


def sink_exponent(sink, m, c_log2):
    """``sink * log2(e) - m * c_log2`` with both products and the difference rounded separately
    (``__fmul_rn`` / ``__fsub_rn`` are never contracted into an FMA): nvcc otherwise fuses them one way in one
    loop nest and another way in the next (session 16: the persistent pair grid's ``fma.rn.f32`` vs the one-item
    kernel's ``mul.f32``), and the sink outputs of two kernels with the same products would differ in the last bit."""
    f32 = "float32"
    return T.call_extern(f32, "__fsub_rn", T.call_extern(f32, "__fmul_rn", sink, T.float32(LOG2E)),
                         T.call_extern(f32, "__fmul_rn", m, T.float32(c_log2)))


def padded_head_macros(*, BH, D, D_tail, dqk, heads, c_log2, has_sink, dtype, sync_before_stage=False):
    """Macros of the pipelined forwards (grid (T, ceil(H / 64)), heads padded to 64 rows):

    * ``load_q(Q, Q_s, Qt_s, bx, h0)``: Q[bx, h0:h0+64, :D] -> Q_s and the rope dims -> Qt_s (``dtype``);
      padded heads read as 0.
    * ``normaliser(inv, l_i, m_i, Sink, h0)``: inv = 1 / (l + 2^(sink log2e - m c)) (sink folded, exact:
      l 2^-lse2 = 2^-m c) or 1 / l; 0 for empty rows (l = 0).
    * ``store_out(acc_o, inv, Stage, Out, bx, h0)``: acc_o *= inv, staged through the bf16 tile Stage, written
      to the real heads of Out (``sync_before_stage``: a __syncthreads before the staging copy, for a Stage
      that other warps may still read).
    * ``store_lse(l_i, m_i, Lse, MaxLogits, bx, h0)``: natural-log lse and max_logits of the real heads
      (+inf / -inf for empty rows).
    """
    heads_exact = heads % BH == 0
    f32 = "float32"

    @T.macro
    def load_q(Q, Q_s, Qt_s, bx, h0):
        if heads_exact:
            T.copy(Q[bx, h0 : h0 + BH, 0:D], Q_s, disable_tma=True)
            if D_tail > 0:
                T.copy(Q[bx, h0 : h0 + BH, D:dqk], Qt_s, disable_tma=True)
        else:
            for h, d in T.Parallel(BH, D):
                Q_s[h, d] = T.if_then_else(h0 + h < heads, Q[bx, T.min(h0 + h, heads - 1), d], T.cast(0, dtype))
            if D_tail > 0:
                for h, d in T.Parallel(BH, D_tail):
                    Qt_s[h, d] = T.if_then_else(
                        h0 + h < heads, Q[bx, T.min(h0 + h, heads - 1), D + d], T.cast(0, dtype)
                    )

    @T.macro
    def normaliser(inv, l_i, m_i, Sink, h0):
        for h in T.Parallel(BH):
            if has_sink:
                inv[h] = T.if_then_else(
                    l_i[h] > 0,
                    1.0 / (l_i[h] + T.exp2(sink_exponent(Sink[T.min(h0 + h, heads - 1)], m_i[h], c_log2))),
                    T.float32(0),
                )
            else:
                inv[h] = T.if_then_else(l_i[h] > 0, 1.0 / l_i[h], T.float32(0))

    @T.macro
    def store_out(acc_o, inv, Stage, Out, bx, h0):
        for h, d in T.Parallel(BH, D):
            acc_o[h, d] = acc_o[h, d] * inv[h]
        if sync_before_stage:
            T.sync_threads()
        T.copy(acc_o, Stage)
        if heads_exact:
            T.copy(Stage, Out[bx, h0 : h0 + BH, :], disable_tma=True)
        else:
            for h, d in T.Parallel(BH, D):
                if h0 + h < heads:
                    Out[bx, h0 + h, d] = Stage[h, d]

    @T.macro
    def store_lse(l_i, m_i, Lse, MaxLogits, bx, h0):
        for h in T.Parallel(BH):
            if h0 + h < heads:
                Lse[bx, h0 + h] = T.if_then_else(
                    l_i[h] > 0, (T.log2(l_i[h]) + m_i[h] * c_log2) * T.float32(LN2), T.infinity(f32)
                )
                MaxLogits[bx, h0 + h] = T.if_then_else(
                    l_i[h] > 0, m_i[h] * c_log2 * T.float32(LN2), -T.infinity(f32)
                )

    return load_q, normaliser, store_out, store_lse


# A kernel prelude (``T.Kernel(..., prelude=...)``, emitted before TileLang's headers): its cp.async helpers then
# carry the ``.L2::128B`` prefetch hint
L2_PREFETCH_PRELUDE = "#define TL_ENABLE_L2_PREFETCH 1\n"


# ---------------------------------------------------------------------------------------------- host side
def check_heads_indices(n_tok, heads, indices) -> str | None:
    if not 1 <= heads <= 2 * BLOCK_H:
        return f"H={heads} not in 1..{2 * BLOCK_H}"
    if indices.shape[0] != n_tok or indices.shape[1] < 1:
        return "indices must be [T, topk] with topk >= 1"
    return None


def check_optional(n_tok, heads, topk_length, attn_sink) -> str | None:
    """topk_length int32 [T] and attn_sink float32 [H], both on CUDA, when given."""
    if topk_length is not None:
        if topk_length.dtype != torch.int32 or topk_length.shape != (n_tok,) or not topk_length.is_cuda:
            return "topk_length must be int32 [T] on CUDA"
    if attn_sink is not None:
        if attn_sink.dtype != torch.float32 or attn_sink.shape != (heads,) or not attn_sink.is_cuda:
            return "attn_sink must be float32 [H] on CUDA"
    return None


def check_fwd_shapes(q, kv, indices, *, d_v, topk_length, attn_sink) -> str | None:
    """The shape/layout checks of the bf16 and FP8 forwards after their dtype checks (q [T,H,Dqk],
    kv [Tkv,Dqk], indices [T,topk], optional topk_length / attn_sink)."""
    n_tok, heads, dqk = q.shape
    if dqk not in SUPPORTED_DQK:
        return f"Dqk={dqk} not in {SUPPORTED_DQK}"
    if d_v != D_V:
        return f"d_v={d_v} != {D_V}"
    if kv.shape[1] != dqk:
        return "kv last dim != q last dim"
    reason = check_heads_indices(n_tok, heads, indices)
    if reason is not None:
        return reason
    if n_tok >= 2**31 or kv.shape[0] >= 2**31 or indices.shape[1] >= 2**30:
        return "sizes exceed int32 indexing"
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or indices.stride(-1) != 1:
        return "last dim must be contiguous"
    return check_optional(n_tok, heads, topk_length, attn_sink)


def fwd_outputs(q, kv, *, sm_scale: float, d_v: int, out_dtype=torch.bfloat16, n_tok=None):
    """Forward outputs (out [T,H,d_v] ``out_dtype``, lse [T,H] f32, max_logits [T,H] f32; T = ``n_tok``, default
    q's rows) and whether they are already final (T = 0, or Tkv = 0: every index invalid -> out 0, lse +inf,
    max_logits -inf)."""
    if not (sm_scale > 0 and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale: expected a finite float > 0, got {sm_scale}")
    heads = q.shape[1]
    n_tok = q.shape[0] if n_tok is None else n_tok
    dev = q.device
    out = torch.empty((n_tok, heads, d_v), dtype=out_dtype, device=dev)
    lse = torch.empty((n_tok, heads), dtype=torch.float32, device=dev)
    max_logits = torch.empty((n_tok, heads), dtype=torch.float32, device=dev)
    if n_tok == 0:
        return (out, lse, max_logits), True
    if kv.shape[0] == 0:  # every index is invalid
        out.zero_()
        lse.fill_(math.inf)
        max_logits.fill_(-math.inf)
        return (out, lse, max_logits), True
    return (out, lse, max_logits), False


def optional_args(indices, topk_length, attn_sink, dev):
    """(has_sink, has_topk_length, topk_length arg, attn_sink arg, n_blocks): 1-element dummies for the optional
    inputs the kernel does not read; n_blocks = ceil(topk / BLOCK_I), the kernels' static trip count."""
    has_sink = attn_sink is not None
    has_tl = topk_length is not None
    tl_arg = aligned(topk_length) if has_tl else dummy(torch.int32, dev)
    sink_arg = aligned(attn_sink) if has_sink else dummy(torch.float32, dev)
    n_blocks = (indices.shape[1] + BLOCK_I - 1) // BLOCK_I
    return has_sink, has_tl, tl_arg, sink_arg, n_blocks


# 2^x as one MUFU.EX2 (ex2.approx.ftz): exp2f without fast math adds a range test and two scalings per element for
# subnormal results, which softmax probabilities below 2^-126 do not need (they flush to +0; 2^-inf = +0).
FAST_EXP2_PRELUDE = r"""
__device__ __forceinline__ float fdsa_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


def ex2(x):
    """2^x through ``FAST_EXP2_PRELUDE`` (the kernel's prelude must include it)."""
    return T.call_extern("float32", "fdsa_ex2", x)


# A named barrier that threads of different roles meet at, each role from its own code (e.g. both consumer
# warpgroups of a pair kernel): ``barrier.sync`` without ``.aligned``.  ``T.sync_threads(id, n)`` emits ``bar.sync``,
# i.e. ``barrier.sync.aligned``, which promises that every thread of a barrier generation executes the same static
# instruction; two warpgroups arriving from their own branches break that promise (undefined in PTX, reported by
# compute-sanitizer synccheck as "Divergent thread(s) in block": scripts/sanitize.sh).  TileLang does not see this
# extern as a sync: kernels built with TL_DISABLE_THREAD_STORAGE_SYNC, or whose lowering was compared
# (kernel_fwd_narrow656_dual: its sync pass then only swaps two warpgroups' private buffers; docs/PERFORMANCE.md
# "Session 56").
ROLE_BARRIER_PRELUDE = r"""
__device__ __forceinline__ void fdsa_role_barrier(int id, int n) {
  asm volatile("barrier.sync %0, %1;" :: "r"(id), "r"(n) : "memory");
}
"""


def role_barrier(bar_id, n_threads):
    """``barrier.sync bar_id, n_threads`` (unaligned) through ``ROLE_BARRIER_PRELUDE``: for a named barrier whose
    participants reach it from different code (the kernel's prelude must include the helper)."""
    return T.call_extern("handle", "fdsa_role_barrier", bar_id, n_threads)


# ``row_gather``: the producer's gather of one half tile by an extern with a row-major thread mapping.  TileLang's
# mapping of the T.Parallel gather gives each thread 16 different rows per half tile (a warp copies one 512-byte
# row segment per instruction), so every 16-byte cp.async needs its own Rows[] load, validity check and address
# (ncu, session 18: the producer's samples are 35% short-scoreboard waits on those loads and 47% ISETP / LEA; the
# consumers wait on ready barriers 45% of the time).  Here 8 threads share a 128-byte row segment: thread t takes
# rows g, g + 16, g + 32, g + 48 (g = t / 8) and 16-byte piece q = t % 8 of each 64-column chunk: one Rows[] load
# and one address per row, 4 (+1 rope) cp.async per row; same bytes, same 128B-swizzled layout (chunk c at c * 8 KiB,
# row r at r * 128 B, piece q at (q ^ (r & 7)) * 16 B), invalid rows (-1) zero-filled without a read.
ROW_GATHER_PRELUDE = r"""
#ifdef FDSA_GATHER_EVICT_FIRST
// rows read once per call: each copy carries an L2 evict_first policy, so the streamed rows replace each other in
// L2 rather than lines other work left there (EVICT_FIRST_PRELUDE; the policy register comes from createpolicy)
__device__ __forceinline__ void fdsa_cp16(unsigned dst, const char *src, int sz) {  // sz 0: zero fill, no read
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src), "r"(sz),
               "l"(pol) : "memory");
}
#else
__device__ __forceinline__ void fdsa_cp16(unsigned dst, const char *src, int sz) {  // sz 0: zero fill, no read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(sz) : "memory");
}
#endif
// byte offset of 16-byte piece q of row r: 128-byte rows with the 128B swizzle / 64-byte rows with the 64B swizzle
__device__ __forceinline__ unsigned fdsa_swz128(int r, int q) { return r * 128 + ((q ^ (r & 7)) << 4); }
__device__ __forceinline__ unsigned fdsa_swz64(int r, int q) { return r * 64 + ((q ^ ((r >> 1) & 3)) << 4); }
// the global row (-1: the tensor base, never read: the copies get size 0)
__device__ __forceinline__ const char *fdsa_row_ptr(const void *kv, int row, int row_bytes) {
  return static_cast<const char *>(kv) + static_cast<long long>(row >= 0 ? row : 0) * row_bytes;
}
// piece src .. src + 15 of each of NC consecutive 128-byte global chunks into chunks 8 KiB apart in shared memory
template <int NC>
__device__ __forceinline__ void fdsa_cp_chunks(unsigned dst, const char *src, int sz) {
#pragma unroll
  for (int c = 0; c < NC; ++c) fdsa_cp16(dst + c * 8192, src + c * 128, sz);
}
// row r of a 128B-swizzled tile: piece q of NC chunks of the global row from byte col_b, and (has_rope) of the bf16
// rope (bytes 1024 .. 1151 of the row) into the rope tile
template <int NC>
__device__ __forceinline__ void fdsa_row_swz128(unsigned tile_s, unsigned rope_s, int has_rope, const char *row,
                                                int col_b, int r, int q, int sz) {
  fdsa_cp_chunks<NC>(tile_s + fdsa_swz128(r, q), row + col_b + q * 16, sz);
  if (has_rope) fdsa_cp16(rope_s + fdsa_swz128(r, q), row + 1024 + q * 16, sz);
}

// The forward's half tiles (kernel_fwd_pair, kernel_fwd_pair_fp8), 128 producer threads.
// EB: bytes per element (2: bf16, kernel_fwd_pair; 1: e4m3, kernel_fwd_pair_fp8); a half row is 256 EB bytes = 2 EB
// 128-byte chunks.  The rope tile [64, 64]: bf16 rows are 128 bytes (one piece per thread and row, as the half
// tile); e4m3 rows are 64 bytes with the 64B swizzle: thread t copies piece t % 4 of rows t / 4 and t / 4 + 32.
template <int EB>
__device__ __forceinline__ void fdsa_gather_half(void *tile, void *rope, int has_rope, const void *kv, int ld,
                                                 int col0, const int *rows, int t) {
  const int g = t >> 3, q = t & 7;
  const unsigned tile_s = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  const unsigned rope_s = static_cast<unsigned>(__cvta_generic_to_shared(rope));
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int r = g + 16 * k, row = rows[r], sz = row >= 0 ? 16 : 0;
    fdsa_row_swz128<2 * EB>(tile_s, rope_s, EB == 2 && has_rope, fdsa_row_ptr(kv, row, ld * EB), col0 * EB, r, q, sz);
  }
  if (EB == 1 && has_rope) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = (t >> 2) + 32 * j, q4 = t & 3, row = rows[r];
      fdsa_cp16(rope_s + fdsa_swz64(r, q4), fdsa_row_ptr(kv, row, ld) + 512 + q4 * 16, row >= 0 ? 16 : 0);
    }
  }
}

// The backward's block tile (kernel_bwd ``row_gather``, 256 compute threads): KV_s [64, 512] bf16 = 8 chunks of 64
// columns (8 KiB, 128-byte rows, 128B swizzle); Kt_s [64, 64] = 2 halves of 32 columns (4 KiB, 64-byte rows, 64B
// swizzle).  Thread t: rows t / 8 and t / 8 + 32 (KV rows row0 / row1, -1 invalid: zero fill, nothing read), piece
// t % 8 of each chunk and of the rope row.
__device__ __forceinline__ void fdsa_gather_bwd(void *kv_s, void *kt_s, int has_rope, const void *kv, int ld,
                                                int row0, int row1, int t) {
  const int g = t >> 3, q = t & 7;
  const unsigned kv_sa = static_cast<unsigned>(__cvta_generic_to_shared(kv_s));
  const unsigned kt_sa = static_cast<unsigned>(__cvta_generic_to_shared(kt_s));
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int r = g + 32 * k, row = k ? row1 : row0, sz = row >= 0 ? 16 : 0;
    const char *src = fdsa_row_ptr(kv, row, ld * 2) + q * 16;
    fdsa_cp_chunks<8>(kv_sa + fdsa_swz128(r, q), src, sz);
    if (has_rope) fdsa_cp16(kt_sa + (q >> 2) * 4096 + fdsa_swz64(r, q & 3), src + 1024, sz);
  }
}
"""

# ``ROW_GATHER_PRELUDE`` with the evict_first gather (kernel_fwd_pair's ``evict_first`` build: decode-shaped calls,
# where every KV row is read about once; session 31: V4 decode shape 40.7 -> 37.5 us after the suite's write flush)
EVICT_FIRST_PRELUDE = "#define FDSA_GATHER_EVICT_FIRST 1\n" + ROW_GATHER_PRELUDE
