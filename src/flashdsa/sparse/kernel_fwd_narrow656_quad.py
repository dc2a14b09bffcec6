"""Four-warpgroup ("pair split") form of the few-head forward over the 656-byte FP8 cache (H <= 16), with the f16
products of ``kernel_fwd_narrow656_dual``'s "ring_er_f16" form.  Not yet run on the GPU (lowered and compiled on
the CPU only; GPU tests in tests/sparse_mla/test_kernel_narrow656_gpu.py, form "quad").

Notes
-----
Why: ncu of the dual form (docs/PERFORMANCE.md "Session 13") shows each warpgroup's serial chain per 64-row
block (convert, QK, softmax, PV: ~6 us) bounding it with two warps per scheduler, not the row copies.  Here two
*pairs* of warpgroups alternate blocks as the dual form's two warpgroups do, and inside a pair warpgroup h
converts and multiplies latent dims [256 h, 256 h + 256) of the pair's tile (half 0 also the rope and the row
mask): QK gives each half a partial S^T, both halves read the sum from shared memory and run the same softmax
(bitwise equal results; both write the same P and alpha), then each accumulates its half of O^T.  Per block a
warpgroup does half the conversion, half the QK and half the PV of the dual form, on 16 warps instead of 8.

Same ring protocol as the dual form's "ring_er" (one shared ring of two 32-row stages; the pair converting stage s
of block b refills it with stage s of block b + 1 after its pair barrier; per-pair mbarriers, parity = the pair's
block count mod 2), the same token-scale pass, Q / K / P formats and row marks as "ring_er_f16".  At the end pair 1
publishes O^T (through the ring's bytes), m and l; pair 0 merges and each of its halves writes its 256 columns.
Shared memory: Q 18 KB + 2 x (tile 64 KB + rope 8 KB + 2 partial S^T 8 KB + P 2 KB) + ring 41 KB = 223 KB.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import tilelang
import tilelang.language as T

from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from . import kernel_fwd_narrow as _kn
from ._tl_common import BLOCK_I, D_V, LOG2E
from .kernel_fwd_narrow656 import _SRC, ROPE_BYTE, ROW, SCALE_BYTE, _pass_configs
from .kernel_fwd_narrow656_dual import _DUAL_SRC, f16_prologue_macros

THREADS = 512
QR = 32  # rows per ring stage
HALF = D_V // 2  # latent dims per warpgroup of a pair
# named barriers (TileLang numbers its own partial barriers from 3 up): pair p, warpgroup w, all 512 threads
BAR_PAIR = (13, 14)
BAR_WG = (9, 10, 11, 12)
BAR_ALL = 15


def build_sparse_mla_fwd_narrow656_quad(*, heads: int, sm_scale: float, has_sink: bool = False,
                                        has_topk_length: bool = False):
    """prim_func with ``kernel_fwd_narrow656.build_sparse_mla_fwd_narrow656``'s signature; H <= 16, any topk."""
    BR = _kn.rows_tile(heads)
    assert BR == 16, "the quad form is for H <= 16"
    BI, D, DT, CH = BLOCK_I, D_V, fc.D_TAIL, fc.CHUNK
    NQ = BI // QR  # ring stages per block
    ISSUE = 128 // QR  # one issuing thread per ISSUE threads of the issuing warpgroup
    assert sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E
    f16, bf16, f32, i32, u8 = "float16", "bfloat16", "float32", "int32", "uint8"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    _row = tc.make_slot_row(topk_dim)
    set_lim = tc.make_set_lim(has_topk_length, topk_dim)
    _, normaliser, _, store_lse = tc.padded_head_macros(
        BH=BR, D=D, D_tail=DT, dqk=fc.DQK, heads=heads, c_log2=c_log2, has_sink=has_sink, dtype=bf16)
    _, _, softmax_stage = tc.narrow_macros(BR=BR, BI=BI, D=D, has_tail=True, c_log2=c_log2)
    token_scales, load_q_f16 = f16_prologue_macros(BR=BR, heads=heads, threads=THREADS)

    def wg_fragments():
        # acc_t (this half's S^T), acc_r (the rope's, half 0), acc_ot (this half's O^T), s_f, m_i, m_prev, alpha,
        # l_i, l_blk, inv
        return (T.alloc_fragment([BI, BR], f32), T.alloc_fragment([BI, BR], f32), T.alloc_fragment([HALF, BR], f32),
                T.alloc_fragment([BR, BI], f32), *[T.alloc_fragment([BR], f32) for _ in range(6)])

    @T.macro
    def issue_stage(KV8, rs16, n_rows, blk, s, Raw, bars, t, rows):
        # stage s of block blk: thread ISSUE * r of the issuing warpgroup copies row r (rows[s]) or zeroes and marks it
        if t % ISSUE == 0:
            ok = (rows[s] >= 0) & (rows[s] < n_rows)
            T.call_extern("handle", "fdsa_bulk_row_mark", T.address_of(Raw[s, t // ISSUE, 0]),
                          T.address_of(KV8[T.if_then_else(ok, rows[s], 0) * rs16, 0]),
                          T.address_of(bars[(blk % 2) * NQ + s]), T.if_then_else(ok, 1, 0))

    @T.macro
    def load_rows(Indices, tok, lim, blk, raw, t):
        # the issuing threads' row numbers of block blk
        if t % ISSUE == 0:
            for s in T.unroll(NQ):
                raw[s] = _row(Indices, tok, lim, blk * BI + s * QR + t // ISSUE)

    def make_chain(p, h):
        w = 2 * p + h

        @T.macro
        def convert_half(Raw, s, KV, Kt, Vld, sc, t):
            # thread t: stage row t % QR, latent dims [256 h + 64 part, +64) (scale tile 2 h + part / 2); half 0
            # also rope chunks [2 part, +2) and (part 0) the row's validity (-inf / 0) from the issuer's mark
            r = t % QR
            part = t // QR
            col0 = HALF * h + 64 * part
            sc[0] = T.call_extern(f32, "fdsa_ld_f32", T.address_of(Raw[s, r, SCALE_BYTE]), col0 // 128)
            T.call_extern("handle", "fdsa_dequant64_f16", T.address_of(Raw[s, r, col0]),
                          *[T.address_of(KV[s * QR + r, col0 + i * 16 + hh * 8]) for i in range(4) for hh in range(2)],
                          T.max(sc[0], T.float32(0)) * sc[1])
            if h == 0:
                for c in T.unroll(2):
                    T.call_extern("handle", "fdsa_copy16", T.address_of(Raw[s, r, ROPE_BYTE + (part * 2 + c) * 16]),
                                  T.address_of(Kt[s * QR + r, (part * 2 + c) * 8]))
                if part == 0:
                    Vld[s * QR + r] = T.if_then_else(sc[0] < 0, -T.infinity(f32), T.float32(0))

        @T.macro
        def chain(Q_s, Qt_s, Qsc_s, Sg_s, KV8, rs16, n_rows, Indices, tok, lim, nblk, KV, Kt, STs, P_s, Al_s, Vld,
                  frags, raw, Raw, bars, sc, nb, tx):
            acc_t, acc_r, acc_ot, s_f, m_i, m_prev, alpha, l_i, l_blk, _ = frags
            t = tx - 128 * w
            sc[1] = 1.0 / Sg_s[2 * h + (t // QR) // 2]
            nb[0] = (nblk - p + 1) // 2
            T.fill(acc_ot, 0)
            T.fill(l_i, 0)
            T.fill(m_i, tc.NEG_BIG)
            for j in T.serial(nb[0]):
                b = 2 * j + p
                if h == 0:  # the next block's row numbers before converting (off the refill's path)
                    if b + 1 < nblk:
                        load_rows(Indices, tok, lim, b + 1, raw, t)
                for s in T.unroll(NQ):
                    T.barrier_wait(bars[p * NQ + s], j % 2)
                    convert_half(Raw, s, KV, Kt, Vld, sc, t)
                    T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
                    T.sync_threads(BAR_PAIR[p], 256)  # both halves are past stage s: refill it
                    if h == 0:
                        if b + 1 < nblk:
                            issue_stage(KV8, rs16, n_rows, b + 1, s, Raw, bars, t, raw)
                T.wgmma_gemm(KV[:, HALF * h:HALF * h + HALF], Q_s[:, HALF * h:HALF * h + HALF], acc_t,
                             transpose_B=True, clear_accum=True)
                if h == 0:
                    T.wgmma_gemm(Kt, Qt_s, acc_r, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                for r, n in T.Parallel(BI, BR):
                    if h == 0:
                        STs[0][r, n] = acc_t[r, n] * Qsc_s[n] + acc_r[r, n] + Vld[r]
                    else:
                        STs[1][r, n] = acc_t[r, n] * Qsc_s[n]
                T.sync_threads(BAR_PAIR[p], 256)  # both partial S^T written
                for n, r in T.Parallel(BR, BI):
                    s_f[n, r] = STs[0][r, n] + STs[1][r, n]
                softmax_stage(s_f, P_s, Al_s, m_i, m_prev, alpha, l_i, l_blk)  # both halves: the same values
                T.fence_proxy_async()
                T.sync_threads(BAR_WG[w], 128)
                for d, n in T.Parallel(HALF, BR):
                    acc_ot[d, n] = acc_ot[d, n] * Al_s[n]
                T.wgmma_gemm(KV[:, HALF * h:HALF * h + HALF], P_s, acc_ot, transpose_A=True, transpose_B=True)
                T.wait_wgmma(0)
                T.sync_threads(BAR_WG[w], 128)

        return chain

    chains = [[make_chain(p, h) for h in range(2)] for p in range(2)]

    @T.macro
    def finish(h, frags, Mrg_s, Ml_s, Ma_s, Sg_s, Qv, Sink, Out, Lse, MaxLogits, tok, tx):
        # pair 0, half h: merge pair 1's state, normalise, write columns [256 h, +256) (+ lse / max_logits: h 0)
        _, _, acc_ot, _, m_i, m_prev, alpha, l_i, l_blk, inv = frags
        for n in T.Parallel(BR):
            m_prev[n] = T.max(m_i[n], Ml_s[0, n])
            alpha[n] = T.exp2((m_i[n] - m_prev[n]) * c_log2)
            l_blk[n] = T.exp2((Ml_s[0, n] - m_prev[n]) * c_log2)
            l_i[n] = l_i[n] * alpha[n] + Ml_s[1, n] * l_blk[n]
            m_i[n] = m_prev[n]
        normaliser(inv, l_i, m_i, Sink, 0)
        for n in T.Parallel(BR):
            Ma_s[h, 0, n] = alpha[n] * inv[n]
            Ma_s[h, 1, n] = l_blk[n] * inv[n]
        T.sync_threads(BAR_WG[h], 128)
        for d, n in T.Parallel(HALF, BR):  # O^T of tile t carries 1 / its token scale
            Qv[n, HALF * h + d] = T.cast((acc_ot[d, n] * Ma_s[h, 0, n] + Mrg_s[HALF * h + d, n] * Ma_s[h, 1, n]) *
                                         Sg_s[(HALF * h + d) // 128], bf16)
        T.sync_threads(BAR_WG[h], 128)
        for n, d in T.Parallel(BR, HALF):
            if n < heads:
                Out[tok, n, HALF * h + d] = Qv[n, HALF * h + d]
        if h == 0:
            store_lse(l_i, m_i, Lse, MaxLogits, tok, 0)

    @T.prim_func
    def sparse_mla_fwd_narrow656_quad(
        Q: T.Tensor([n_tok, heads, fc.DQK], bf16),
        KV8: T.Tensor([n_ch, CH], fc.FP8),
        KVf: T.Tensor([n_ch, CH // 4], f32),
        KVb: T.Tensor([n_ch, CH // 2], bf16),
        rs16: T.int32,
        n_rows: T.int32,
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, threads=THREADS, prelude=_SRC + _DUAL_SRC) as bx:
            tx = T.get_thread_binding()
            Q_s = T.alloc_shared([BR, D], f16)
            Qt_s = T.alloc_shared([BR, DT], bf16)
            KVs = [T.alloc_shared([BI, D], f16) for _ in range(2)]
            Kts = [T.alloc_shared([BI, DT], bf16) for _ in range(2)]
            STs = [[T.alloc_shared([BI, BR], f32) for _ in range(2)] for _ in range(2)]
            Ps = [T.alloc_shared([BR, BI], f16) for _ in range(2)]
            Als = [T.alloc_shared([BR], f32) for _ in range(2)]
            Vlds = [T.alloc_shared([BI], f32) for _ in range(2)]
            frags = [wg_fragments() for _ in range(4)]
            Raw = T.alloc_shared([NQ, QR, ROW], u8)
            Mrg_s = T.view(Raw, [NQ * QR * ROW // (4 * BR), BR], f32)  # 656 rows of 16 fp32: O^T of pair 1
            bars = T.alloc_barrier([QR] * (2 * NQ))  # stage s of pair p's blocks: p * NQ + s
            raw = T.alloc_local([NQ], i32)
            Ml_s = T.alloc_shared([2, BR], f32)
            Ma_s = T.alloc_shared([2, 2, BR], f32)
            Pmx_s = T.alloc_shared([8, 4], f32)
            Sg_s = T.alloc_shared([4], f32)
            Qsc_s = T.alloc_shared([BR], f32)
            Qf = T.alloc_fragment([BR, D], f32)
            qmax = T.alloc_fragment([BR], f32)
            lim = T.alloc_local([1], i32)
            nb = T.alloc_local([1], i32)
            sc = T.alloc_local([2], f32)

            set_lim(lim, TopkLen, bx)
            nblk = T.ceildiv(lim[0], BI)
            if tx < 128:  # block 0's rows in flight during the token-scale pass
                if nblk > 0:
                    load_rows(Indices, bx, lim[0], 0, raw, tx)
                    for s in T.unroll(NQ):
                        issue_stage(KV8, rs16, n_rows, 0, s, Raw, bars, tx, raw)
            token_scales(Indices, KVf, rs16, n_rows, lim[0], Pmx_s, Sg_s, sc, bx, tx)
            load_q_f16(Q, Q_s, Qt_s, Qf, qmax, Sg_s, Qsc_s, bx)
            T.fence_proxy_async()
            T.sync_threads()

            args = (Q_s, Qt_s, Qsc_s, Sg_s, KV8, rs16, n_rows, Indices, bx, lim[0], nblk)
            if tx < 256:
                if tx < 128:
                    chains[0][0](*args, KVs[0], Kts[0], STs[0], Ps[0], Als[0], Vlds[0], frags[0], raw, Raw, bars,
                                 sc, nb, tx)
                else:
                    chains[0][1](*args, KVs[0], Kts[0], STs[0], Ps[0], Als[0], Vlds[0], frags[1], raw, Raw, bars,
                                 sc, nb, tx)
                T.sync_threads(BAR_ALL, THREADS)  # pair 1 may overwrite the ring only after our last block
            else:
                if tx < 384:
                    chains[1][0](*args, KVs[1], Kts[1], STs[1], Ps[1], Als[1], Vlds[1], frags[2], raw, Raw, bars,
                                 sc, nb, tx)
                    T.sync_threads(BAR_ALL, THREADS)
                    T.copy(frags[2][2], Mrg_s[0:HALF, :])
                    for n in T.Parallel(BR):
                        Ml_s[0, n] = frags[2][4][n]
                        Ml_s[1, n] = frags[2][7][n]
                else:
                    chains[1][1](*args, KVs[1], Kts[1], STs[1], Ps[1], Als[1], Vlds[1], frags[3], raw, Raw, bars,
                                 sc, nb, tx)
                    T.sync_threads(BAR_ALL, THREADS)
                    T.copy(frags[3][2], Mrg_s[HALF:D, :])
            T.sync_threads()  # pair 1's state published; every wgmma done (Q_s is dead)
            Qv = T.view(Q_s, dtype=bf16)
            if tx < 128:
                finish(0, frags[0], Mrg_s, Ml_s, Ma_s, Sg_s, Qv, Sink, Out, Lse, MaxLogits, bx, tx)
            elif tx < 256:
                finish(1, frags[1], Mrg_s, Ml_s, Ma_s, Sg_s, Qv, Sink, Out, Lse, MaxLogits, bx, tx)

    return sparse_mla_fwd_narrow656_quad


@functools.lru_cache(maxsize=64)
def compiled(heads: int, sm_scale: float, has_sink: bool, has_topk_length: bool):
    func = build_sparse_mla_fwd_narrow656_quad(heads=heads, sm_scale=sm_scale, has_sink=has_sink,
                                               has_topk_length=has_topk_length)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [("narrow656_quad_h16_sink_tl", build_sparse_mla_fwd_narrow656_quad(
        heads=16, sm_scale=576 ** -0.5, has_sink=True, has_topk_length=True))]
