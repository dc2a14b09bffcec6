"""Sparse MLA forward for few heads (H <= 32): the gathered KV rows on the wgmma M side, the heads on N.

Notes
-----
Same contract, host interface (``kernel_fwd.launch``) and numerics as ``kernel_fwd.py``, which dispatches here for
``H <= MAX_HEADS``.  Why: ``kernel_fwd`` pads the heads of a token to a 64-row wgmma tile, so H = 16 (DeepSeek's 128
heads sharded over 8 GPUs) pays 4x the tensor work and the full per-block chain of H = 64 (measured 72 TFLOP/s at
S 4096, topk 2048 against 270 for H = 64 in the same time).  Here, per token (one CTA), each block of 64 top-k rows
is the M side and the zero-padded heads are N (``BR`` = 16 or 32), as in ``decode/kernel_dense_narrow.py``:

  * ``S^T [64, BR] = K Q^T`` (A = the gathered tile, K-major; B = the Q tile), staged in shared memory as fp32 and
    read back transposed as ``S [BR, 64]`` for the online softmax's row max / sum;
  * ``O^T [512, BR] += V^T P^T`` (A = the latent columns of the same tile read MN-major; B = P bf16 ``[BR, 64]``),
    fp32 accumulators, rescaled by ``alpha`` broadcast through shared memory.

Schedule: 128 threads (one warpgroup), grid ``(T,)``, blocks ``ceil(topk_eff / 64)`` (topk_length honoured, a
dynamic trip count: the pipeline is written by hand).  Two tile buffers: at the top of iteration ``it`` block
``it + 1`` is gathered into the buffer block ``it - 1`` released (predicated zero-filling cp.async of the 16-byte
chunks of each selected row, one commit group per block), then ``wait_group 1`` leaves only that block in flight.
Invalid slots (``-1``, out of range, past ``topk_eff``) are never read: the cp.async reads nothing and the rows are
zeros, and their scores are -inf.  Running max from the finite -1e30, exp2 with ``sm_scale * log2(e)`` folded, sink
``1 / (l + 2^(sink log2e - m c))``, empty rows -> out 0, lse +inf, max_logits -inf (``_tl_common`` macros).

Shared memory (Dqk 576, BR 16): 2 x 72 KB tiles + Q 18 KB + S^T 4 KB + P 2 KB = 171 KB (BR 32: 198 KB).

The same tile shape over the 656-byte FP8 cache is ``kernel_fwd_narrow656`` (its own gather and conversion).

Measured (H200, session 6, S 4096, SKV 8192, topk 2048, Dqk 576; docs/PERFORMANCE.md): H 16 4.18 ms (64-head tile)
-> 3.27 ms (89 TFLOP/s; suite 3.15 ms, 92.8), H 32 131.9 -> 143.8 TFLOP/s.  Gather-bound: 9.7 GB through the
gather at ~3.1 TB/s.  GPU tests: tests/sparse_mla/test_kernel_gpu.py (H 16 / 1 cases, peaky H 16),
test_autograd_gpu.py (H 16 / 3), memcheck ``sparse_bf16``.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import tilelang
import tilelang.language as T

from .._tilelang import plain_pass_configs
from . import _tl_common as tc
from ._tl_common import BLOCK_I, D_V, LOG2E

MAX_HEADS = 32
THREADS = 128
# The row gather of a block: 64 rows into the tile buffer at ``tile`` (the slot's first row of chunk 0; the buffer
# is TileLang's 128B-swizzled [NCH * R, 64] bf16 layout: 128-byte rows, chunk c of every row R rows = ``chunk``
# bytes after chunk c - 1) and its rope rows at ``rope`` (chunk 8).  Thread t: rows t / 8 + 16 k (k < 4; -1
# invalid: zero fill, nothing read), piece t % 8 of each chunk and of the rope row.
_ROWS_SRC = r"""
__device__ __forceinline__ void fdsa_gather_rows(void *tile, void *rope, int has_rope, const void *kv, int ld,
                                                 int chunk, int r0, int r1, int r2, int r3, int t) {
  const int g = t >> 3, q = t & 7, rows[4] = {r0, r1, r2, r3};
  const unsigned tile_s = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  const unsigned rope_s = static_cast<unsigned>(__cvta_generic_to_shared(rope));
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int r = g + 16 * k, sz = rows[k] >= 0 ? 16 : 0;
    const char *src = fdsa_row_ptr(kv, rows[k], ld * 2) + q * 16;
    const unsigned dst = tile_s + fdsa_swz128(r, q);
#pragma unroll
    for (int c = 0; c < 8; ++c) fdsa_cp16(dst + c * chunk, src + c * 128, sz);
    if (has_rope) fdsa_cp16(rope_s + fdsa_swz128(r, q), src + 1024, sz);
  }
}
"""


def rows_tile(heads: int) -> int:
    """The wgmma N (heads per CTA, zero-padded)."""
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"narrow sparse forward: H={heads} not in 1..{MAX_HEADS}")
    return 16 if heads <= 16 else 32


def _prologue_macro(*, BI, topk_dim, has_topk_length, load_q):
    """``start(TopkLen, Q, Q_s, Qt_s, lim, nblk, acc_ot, l_i, m_i, tok)``: topk_eff (``lim``) and its block count,
    the Q tile (heads past H -> 0), the accumulator and softmax state."""

    @T.macro
    def start(TopkLen, Q, Q_s, Qt_s, lim, nblk, acc_ot, l_i, m_i, tok):
        if has_topk_length:
            lim[0] = T.max(T.min(TopkLen[tok], topk_dim), 0)
        else:
            lim[0] = topk_dim
        nblk[0] = T.ceildiv(lim[0], BI)
        load_q(Q, Q_s, Qt_s, tok, 0)
        T.fill(acc_ot, 0)
        T.fill(l_i, 0)
        T.fill(m_i, tc.NEG_BIG)

    return start


def _epilogue_macro(*, BR, D, heads, normaliser, store_lse, bar=None):
    """``epilogue(acc_ot, inv, l_i, m_i, Sink, Alpha_s, Q_s, Out, Lse, MaxLogits, tok)``: the normaliser (sink
    folded) broadcast through ``Alpha_s`` (``acc_ot``'s layout differs from the rows'), the output staged transposed
    through the dead Q tile and written for the real heads, then lse / max_logits.  ``bar``: a named barrier id
    when only one warpgroup (128 threads) runs the epilogue; None: ``__syncthreads``."""

    @T.macro
    def sync():
        if bar is None:
            T.sync_threads()
        else:
            T.sync_threads(bar, 128)

    @T.macro
    def epilogue(acc_ot, inv, l_i, m_i, Sink, Alpha_s, Q_s, Out, Lse, MaxLogits, tok):
        normaliser(inv, l_i, m_i, Sink, 0)
        T.copy(inv, Alpha_s)
        sync()
        for d, n in T.Parallel(D, BR):
            Q_s[n, d] = T.cast(acc_ot[d, n] * Alpha_s[n], "bfloat16")
        sync()
        for n, d in T.Parallel(BR, D):
            if n < heads:
                Out[tok, n, d] = Q_s[n, d]
        store_lse(l_i, m_i, Lse, MaxLogits, tok, 0)

    return epilogue


def build_sparse_mla_fwd_narrow(*, heads: int, dqk: int, d_v: int = D_V, sm_scale: float, has_sink: bool = False,
                                has_topk_length: bool = False, row_gather: bool = False):
    """prim_func with ``kernel_fwd.build_sparse_mla_fwd``'s signature (Q[T,H,Dqk], KV[Tkv,Dqk], Indices[T,topk],
    TopkLen[n_tl], Sink[n_sink], Out[T,H,d_v], Lse[T,H], MaxLogits[T,H]); any topk (dynamic trip count).
    ``row_gather`` (dispatched since session 19: S 4096 / SKV 8192 / topk 2048 H 16 3.143 -> 2.327 ms, H 32 3.950 ->
    3.019): each thread looks up 4 rows and copies 8 (+1 rope) 16-byte pieces of each (``fdsa_gather_rows``,
    this module) instead of one Indices load and check per copy; same bytes and swizzled layout, so the same
    outputs bitwise.  Since session 36 the row gather fills ``_build_rows``'s chunked tile buffer (per-chunk
    products issued together, one wait; S 4096 / SKV 8192 / topk 2048 H 16 2.325 -> 2.247 ms, H 32 3.016 ->
    2.883, bitwise the same outputs)."""
    assert dqk in tc.SUPPORTED_DQK and d_v == D_V, (dqk, d_v)
    BR = rows_tile(heads)
    BI, D, DT = BLOCK_I, d_v, dqk - d_v
    assert sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    _row = tc.make_slot_row(topk_dim)
    _ok = tc.make_row_ok(n_kv)
    load_q, normaliser, _, store_lse = tc.padded_head_macros(
        BH=BR, D=D, D_tail=DT, dqk=dqk, heads=heads, c_log2=c_log2, has_sink=has_sink, dtype=bf16)
    qk_t, softmax_pv, _ = tc.narrow_macros(BR=BR, BI=BI, D=D, has_tail=DT > 0, c_log2=c_log2)
    epilogue = _epilogue_macro(BR=BR, D=D, heads=heads, normaliser=normaliser, store_lse=store_lse)
    start = _prologue_macro(BI=BI, topk_dim=topk_dim, has_topk_length=has_topk_length, load_q=load_q)
    if row_gather:
        return _build_rows(heads=heads, dqk=dqk, D=D, DT=DT, BR=BR, c_log2=c_log2, normaliser=normaliser,
                           store_lse=store_lse, row=_row, ok=_ok, topk_dim=topk_dim,
                           dims=(n_tok, n_kv, n_tl, n_sink), has_topk_length=has_topk_length)

    @T.macro
    def gather_parallel(KV, Indices, tok, lim, blk, KV_b, Kt_b):
        # row / ok / src bound once per element: repeating the Indices expression makes lowering take minutes
        for r, d in T.Parallel(BI, D, annotations=tc.ASYNC_GATHER):
            row = _row(Indices, tok, lim, blk * BI + r)
            ok = _ok(row)
            src = T.if_then_else(ok, row, 0)
            KV_b[r, d] = T.if_then_else(ok, KV[src, d], T.cast(0, bf16))
        if DT > 0:
            for r, d in T.Parallel(BI, DT, annotations=tc.ASYNC_GATHER):
                row = _row(Indices, tok, lim, blk * BI + r)
                ok = _ok(row)
                src = T.if_then_else(ok, row, 0)
                Kt_b[r, d] = T.if_then_else(ok, KV[src, D + d], T.cast(0, bf16))

    @T.macro
    def attend(Indices, tok, lim, blk, KV_b, Kt_b, Q_s, Qt_s, ST_s, P_s, Alpha_s, acc_t, acc_ot, s_f, m_i, m_prev,
               alpha, l_i, l_blk):
        qk_t(KV_b, Kt_b, Q_s, Qt_s, acc_t, ST_s)
        for n, r in T.Parallel(BR, BI):
            row = _row(Indices, tok, lim, blk * BI + r)
            s_f[n, r] = T.if_then_else(_ok(row), ST_s[r, n], -T.infinity(f32))
        softmax_pv(KV_b, s_f, P_s, Alpha_s, acc_ot, m_i, m_prev, alpha, l_i, l_blk)

    @T.prim_func
    def sparse_mla_fwd_narrow(
        Q: T.Tensor([n_tok, heads, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, threads=THREADS) as bx:
            Q_s = T.alloc_shared([BR, D], bf16)
            KV_0 = T.alloc_shared([BI, D], bf16)
            KV_1 = T.alloc_shared([BI, D], bf16)
            if DT > 0:
                Qt_s = T.alloc_shared([BR, DT], bf16)
                Kt_0 = T.alloc_shared([BI, DT], bf16)
                Kt_1 = T.alloc_shared([BI, DT], bf16)
            else:
                Qt_s = Kt_0 = Kt_1 = None
            ST_s = T.alloc_shared([BI, BR], f32)
            P_s = T.alloc_shared([BR, BI], bf16)
            Alpha_s = T.alloc_shared([BR], f32)

            acc_t = T.alloc_fragment([BI, BR], f32)
            acc_ot = T.alloc_fragment([D, BR], f32)
            s_f = T.alloc_fragment([BR, BI], f32)
            m_i = T.alloc_fragment([BR], f32)
            m_prev = T.alloc_fragment([BR], f32)
            alpha = T.alloc_fragment([BR], f32)
            l_i = T.alloc_fragment([BR], f32)
            l_blk = T.alloc_fragment([BR], f32)
            inv = T.alloc_fragment([BR], f32)
            lim = T.alloc_local([1], i32)
            nblk = T.alloc_local([1], i32)

            start(TopkLen, Q, Q_s, Qt_s, lim, nblk, acc_ot, l_i, m_i, bx)
            if nblk[0] > 0:
                gather_parallel(KV, Indices, bx, lim[0], 0, KV_0, Kt_0)
                T.ptx_commit_group()
            for it in T.serial(nblk[0]):
                # gather block it + 1 into the buffer block it - 1 released, then wait for block it only
                if it + 1 < nblk[0]:
                    if it % 2 == 0:
                        gather_parallel(KV, Indices, bx, lim[0], it + 1, KV_1, Kt_1)
                    else:
                        gather_parallel(KV, Indices, bx, lim[0], it + 1, KV_0, Kt_0)
                    T.ptx_commit_group()
                    T.ptx_wait_group(1)
                else:
                    T.ptx_wait_group(0)
                T.sync_threads()
                if it % 2 == 0:
                    attend(Indices, bx, lim[0], it, KV_0, Kt_0, Q_s, Qt_s, ST_s, P_s, Alpha_s, acc_t, acc_ot, s_f,
                           m_i, m_prev, alpha, l_i, l_blk)
                else:
                    attend(Indices, bx, lim[0], it, KV_1, Kt_1, Q_s, Qt_s, ST_s, P_s, Alpha_s, acc_t, acc_ot, s_f,
                           m_i, m_prev, alpha, l_i, l_blk)
                T.sync_threads()  # the buffer just read is refilled in the next iteration

            epilogue(acc_ot, inv, l_i, m_i, Sink, Alpha_s, Q_s, Out, Lse, MaxLogits, bx)

    return sparse_mla_fwd_narrow


def _build_rows(*, heads, dqk, D, DT, BR, c_log2, normaliser, store_lse, row, ok, topk_dim, dims, has_topk_length):
    """The row-gather build (``build_sparse_mla_fwd_narrow``): the same schedule as the T.Parallel build (two tile
    slots, block it + 1 gathered while block it is computed), with the tiles in one shared buffer
    ``KV_r [NCH * R, 64]`` (TileLang's 128B swizzle: 128-byte rows; R = 128 rows (two slots of 64) per 64-column
    chunk of the row; NCH = 8 latent chunks + the rope chunk) and Q likewise ``[NCH * BR, 64]``.  Every product is
    per chunk (a K-major or MN-major operand of one 64-column atom), issued together and waited once, and the
    output accumulator is one ``[64, BR]`` fragment per latent chunk (O^T by chunk), stored straight to global.
    (Measured slower in session 36, docs/PERFORMANCE.md: deeper rings of 48 / 32 / 16-row slots, two warpgroups
    with their own slots, row numbers loaded a block ahead, QK over three accumulators, PV interleaved by keys.)"""
    BI, n_buf = BLOCK_I, 2
    R = n_buf * BI  # rows per chunk
    NC, NCH = D // 64, dqk // 64
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink = dims
    _, _, softmax_stage = tc.narrow_macros(BR=BR, BI=BI, D=D, has_tail=DT > 0, c_log2=c_log2)
    set_lim = tc.make_set_lim(has_topk_length, topk_dim)

    @T.macro
    def gather(KV, Indices, tok, lim, blk, slot, KV_r, rows_l):
        # cp.async (no commit, no wait) of block blk's rows into slot ``slot``; invalid slots: zero fill
        tx = T.get_thread_binding()
        for k in T.unroll(4):
            r = row(Indices, tok, lim, blk * BI + tx // 8 + 16 * k)
            rows_l[k] = T.if_then_else(ok(r), r, -1)
        T.call_extern("handle", "fdsa_gather_rows", T.address_of(KV_r[slot * BI, 0]),
                      T.address_of(KV_r[NC * R + slot * BI, 0]), 1 if DT > 0 else 0, T.address_of(KV[0, 0]), dqk,
                      R * 128, rows_l[0], rows_l[1], rows_l[2], rows_l[3], tx)

    @T.macro
    def attend(Indices, tok, lim, blk, slot, KV_r, Q_s, ST_s, P_s, Alpha_s, acc_t, acc_o, s_f, m_i, m_prev, alpha,
               l_i, l_blk):
        r0 = slot * BI
        T.clear(acc_t)
        for c in tuple(range(NCH)):  # a Python iterable: unrolled while tracing
            T.wgmma_gemm(KV_r[c * R + r0 : c * R + r0 + BI, :], Q_s[c * BR : c * BR + BR, :], acc_t,
                         transpose_B=True)
        T.wait_wgmma(0)
        T.copy(acc_t, ST_s)
        for n, r in T.Parallel(BR, BI):
            rw = row(Indices, tok, lim, blk * BI + r)
            s_f[n, r] = T.if_then_else(ok(rw), ST_s[r, n], -T.infinity(f32))
        softmax_stage(s_f, P_s, Alpha_s, m_i, m_prev, alpha, l_i, l_blk)
        for c in tuple(range(NC)):
            for d, n in T.Parallel(64, BR):
                acc_o[c][d, n] = acc_o[c][d, n] * Alpha_s[n]
        for c in tuple(range(NC)):
            T.wgmma_gemm(KV_r[c * R + r0 : c * R + r0 + BI, :], P_s, acc_o[c], transpose_A=True, transpose_B=True)
        T.wait_wgmma(0)

    @T.prim_func
    def sparse_mla_fwd_narrow_rows(
        Q: T.Tensor([n_tok, heads, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, threads=THREADS, prelude=tc.ROW_GATHER_PRELUDE + _ROWS_SRC) as bx:
            Q_s = T.alloc_shared([NCH * BR, 64], bf16)
            KV_r = T.alloc_shared([NCH * R, 64], bf16)
            ST_s = T.alloc_shared([BI, BR], f32)
            P_s = T.alloc_shared([BR, BI], bf16)
            Alpha_s = T.alloc_shared([BR], f32)

            acc_t = T.alloc_fragment([BI, BR], f32)
            acc_o = [T.alloc_fragment([64, BR], f32) for _ in range(NC)]
            s_f = T.alloc_fragment([BR, BI], f32)
            m_i = T.alloc_fragment([BR], f32)
            m_prev = T.alloc_fragment([BR], f32)
            alpha = T.alloc_fragment([BR], f32)
            l_i = T.alloc_fragment([BR], f32)
            l_blk = T.alloc_fragment([BR], f32)
            inv = T.alloc_fragment([BR], f32)
            lim = T.alloc_local([1], i32)
            nblk = T.alloc_local([1], i32)
            rows_l = T.alloc_local([4], i32)

            set_lim(lim, TopkLen, bx)
            nblk[0] = T.ceildiv(lim[0], BI)
            for h, d in T.Parallel(BR, dqk):  # chunk d // 64 of head h (heads past H -> 0)
                Q_s[(d // 64) * BR + h, d % 64] = T.if_then_else(h < heads, Q[bx, T.min(h, heads - 1), d],
                                                                  T.cast(0, bf16))
            for c in tuple(range(NC)):
                T.fill(acc_o[c], 0)
            T.fill(l_i, 0)
            T.fill(m_i, tc.NEG_BIG)
            for b in T.unroll(n_buf - 1):
                if b < nblk[0]:
                    gather(KV, Indices, bx, lim[0], b, b, KV_r, rows_l)
                T.ptx_commit_group()  # one group per block, empty past the last: wait_group's count stays fixed
            for it in T.serial(nblk[0]):
                # block it + 1 into the slot block it - 1 released, then wait for block it only
                if it + n_buf - 1 < nblk[0]:
                    gather(KV, Indices, bx, lim[0], it + n_buf - 1, (it + n_buf - 1) % n_buf, KV_r, rows_l)
                T.ptx_commit_group()
                T.ptx_wait_group(n_buf - 1)
                T.sync_threads()
                attend(Indices, bx, lim[0], it, it % n_buf, KV_r, Q_s, ST_s, P_s, Alpha_s, acc_t, acc_o, s_f, m_i,
                       m_prev, alpha, l_i, l_blk)
                T.sync_threads()  # the slot just read is refilled in the next iteration

            normaliser(inv, l_i, m_i, Sink, 0)
            T.copy(inv, Alpha_s)
            T.sync_threads()
            for c in tuple(range(NC)):
                for d, n in T.Parallel(64, BR):
                    if n < heads:
                        Out[bx, n, c * 64 + d] = T.cast(acc_o[c][d, n] * Alpha_s[n], bf16)
            store_lse(l_i, m_i, Lse, MaxLogits, bx, 0)

    return sparse_mla_fwd_narrow_rows


def _pass_configs():
    return plain_pass_configs()


def _compiled(heads: int, dqk: int, d_v: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool,
              row_gather: bool = True):
    # n_blocks is not a build parameter (the trip count is dynamic): one kernel per (H, Dqk, sink, topk_length)
    return _build(heads, dqk, d_v, sm_scale, has_sink, has_topk_length, row_gather)


@functools.lru_cache(maxsize=64)
def _build(heads, dqk, d_v, sm_scale, has_sink, has_topk_length, row_gather=False):
    func = build_sparse_mla_fwd_narrow(heads=heads, dqk=dqk, d_v=d_v, sm_scale=sm_scale, has_sink=has_sink,
                                       has_topk_length=has_topk_length, row_gather=row_gather)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("h16_d576_sink_tl", build_sparse_mla_fwd_narrow(heads=16, dqk=576, sm_scale=576 ** -0.5, has_sink=True,
                                                         has_topk_length=True)),
        ("h9_d512", build_sparse_mla_fwd_narrow(heads=9, dqk=512, sm_scale=512 ** -0.5)),  # the T.Parallel gather
        ("h16_d576_sink_tl_row_gather", build_sparse_mla_fwd_narrow(heads=16, dqk=576, sm_scale=576 ** -0.5,
                                                                    has_sink=True, has_topk_length=True,
                                                                    row_gather=True)),  # dispatched
        ("h3_d512_sink_row_gather", build_sparse_mla_fwd_narrow(heads=3, dqk=512, sm_scale=512 ** -0.5,
                                                                 has_sink=True, row_gather=True)),  # no rope chunk
    ]


def _bench_variants():
    """Kernel times at S 4096 / SKV 8192 / topk 2048 for H 16 and 32, Dqk 576 (``python -m
    flashdsa.sparse.kernel_fwd_narrow --variants``): the default build and ``row_gather``, outputs compared."""
    import torch

    from ..bench.flops import sparse_fwd_flops
    from ..bench.harness import time_fn
    from . import kernel_fwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    for heads in (16, 32):
        q, kv, idx = kernel_fwd._prefill_inputs(gen, H=heads, topk=2048)
        flops = sparse_fwd_flops(heads, idx.numel(), 576, D_V)  # every index is valid here
        ref = None
        for label, rows in (("narrow", False), ("narrow_row_gather", True)):  # narrow: the T.Parallel gather
            def fn(rg=rows):
                return kernel_fwd.launch(lambda *a: _compiled(*a, rg), q, kv, idx, sm_scale=576**-0.5, d_v=D_V)

            out = fn()
            ref = out if ref is None else ref
            same = all(map(torch.equal, out, ref))
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out[:2], ref[:2]))
            ms = time_fn(lambda _: fn(), [None], q.device, reps=10).ms_median
            print(f"variant H {heads} {label}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s (bitwise equal to narrow:"
                  f" {same}, max |out / lse difference| {err:.2e})", flush=True)


if __name__ == "__main__":
    import sys

    if "--variants" in sys.argv[1:]:
        _bench_variants()
