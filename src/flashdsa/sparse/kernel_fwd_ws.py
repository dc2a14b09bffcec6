"""Sparse MLA forward, warp-specialised TileLang kernel for Hopper (sm_90a).

Notes
-----
Same contract, host interface and numerics as ``kernel_fwd.py`` (the pipelined kernel), for H in {64, 128},
Dqk in {512, 576}, d_v = 512.  One CTA per (token, 64-head group) on a 1-D grid (head group fastest, so the
two CTAs of one token at H = 128 gather the same rows back to back: the second gather hits L2); 384 threads =
two consumer warpgroups (WG0 threads 0-127, WG1 128-255) + one producer warpgroup (256-383), ``setmaxnreg``.
Not dispatched (faster than kernel_fwd at the V32 SKV 8K shapes, about even at SKV 128K, slower at V4; docs/PERFORMANCE.md).

Measured (H200, 2026-11-30, scripts/bench_sparse_fwd.py, random per-token indices, median of 10; ms / TFLOP/s):
  | case                       | kernel_fwd   | ws1          |
  | V32 H128 SKV 8K topk 2048  | 8.74 / 267   | 8.08 / 289   |
  | V32 H64                    | 4.53 / 258   | 4.15 / 282   |
  | V32 H128 SKV 128K          | 8.78 / 266   | 8.82 / 265   |
  | V4 h64 d512 topk 640 sink  | 1.61 / 213   | 2.19 / 157   |
  The binding limit is the KV gather, not the MMA schedule: both kernels move 8192 CTAs x 2048 rows x 1152 B
  = 19.3 GB from L2 into shared memory at the headline shape; 8.1-8.7 ms is 2.2-2.4 TB/s, ~4 us per 72 KiB
  block per SM, i.e. ~7,000 cycles per block against ~2,200 tensor-core cycles of MMA.  The producer keeps ONE
  72 KiB cp.async nest in flight (the nest ends in wait_group 0).  Two other schedules of this kernel were
  GPU-verified, measured slower and removed (docs/PERFORMANCE.md, "Sparse MLA forward", sessions 2 and 3):
  both consumers computing QK of alternate blocks (FlashMLA's split), and this schedule with a sub-tiled
  gather keeping two blocks in flight (cp.async completion on mbarriers): more bytes in flight did not raise
  the gather rate.

"ws1" -- the schedule (GPU-verified at 48a0c95, 7.78 ms = 300 TFLOP/s at the headline shape): WG0 does
  QK + softmax of every block and PV on O[:, :256], WG1 only PV on O[:, 256:] (P, alpha via smem); the
  producer gathers one whole block per buffer (two buffers); setmaxnreg 240 + 176 + 88.

TileLang 0.1.15 pitfalls met here (in addition to kernel_fwd.py's):
  * ONE fragment used in two role branches made TileLang silently drop a role's element-wise loops: every
    role has its own fragments.
  * The automatic thread-storage-sync pass put the same named-barrier id into two roles: it is disabled
    (TL_DISABLE_THREAD_STORAGE_SYNC) and every intra-role sync is an explicit T.sync_threads(id, n).
  * The zero-filling cp.async comes from a T.Parallel nest annotated ``{"parallel_prefer_async": True}``
    whose body is if_then_else(ok, KV[row, c], 0); an inner serial/unroll loop in it silently disables the
    rewrite; bind ``row = ...`` once in the body (repeating the Indices expression made lowering take
    minutes).  The nest ends in cp.async wait_group 0.
  * Barrier buffers passed into T.macro must be whole Buffers (one T.alloc_barrier per barrier).
Verification: passes tests/sparse_mla/test_kernel_ws_gpu.py on the H200 (at 48a0c95); timings above.
"""

import functools

import tilelang
import tilelang.language as T

from . import _tl_common as tc
from . import kernel_fwd
from ._tl_common import BLOCK_H, BLOCK_I, D_V, LN2, LOG2E

_SUPPORTED_DQK = tc.SUPPORTED_DQK
_SUPPORTED_H = (64, 128)
THREADS = 384
# setmaxnreg budgets (WG0, WG1, producer).  The CTA's pool is what the launch allocated: a
# __launch_bounds__(384, 1) kernel gets floor(65536 / 384) rounded down to 8 = 168 registers per thread, i.e.
# 64,512 registers; setmaxnreg.inc blocks until the pool can supply the request, so the per-thread counts
# must sum to <= 3 * 168 = 504 (240 + 176 + 96 = 512 hung the H200 on 2026-11-30).
WS1_REGS = (240, 176, 88)
_REG_LAUNCH = (65536 // THREADS) // 8 * 8  # 168
assert sum(WS1_REGS) <= 3 * _REG_LAUNCH, "setmaxnreg requests exceed the CTA register pool"
assert WS1_REGS[0] >= _REG_LAUNCH and WS1_REGS[1] >= _REG_LAUNCH and WS1_REGS[2] <= _REG_LAUNCH
BAR_WG0, BAR_WG1 = 8, 9  # named barrier ids (128 threads each); 0 is __syncthreads


def _ws_macros(*, BH, BI, DH, D, D_tail, dqk, c_log2, has_sink, has_topk_length, topk_dim):
    """Per-CTA macros of the kernel (one CTA per (token ``tok``, 64-head group at ``h0``), no padded heads):

    * ``set_lim(lim, TopkLen, tok)``: lim[0] = topk_eff = clamp(topk_length[tok], 0, topk) (or topk).
    * ``load_q(Q, Q_l, Q_r, Q_t, tok, h0)``: the Q tile as two d_v halves + rope (all 384 threads), made
      visible to the async proxy, then __syncthreads.
    * ``qk_first(Qa, Ka, Vld, acc_s)``: invalid slots start at -inf, S = Qa Ka^T (first K half);
      ``qk_second(Qb, Kb, Qt, Kt, acc_s)``: S += Qb Kb^T (+ the rope product).  Async SS wgmma, not waited.
    * ``normaliser(inv, l_i, m_i, Sink, h0)``: 1 / (l + 2^(sink log2e - m c)) or 1 / l, 0 for empty rows.
    * ``store_lse(l_i, m_i, Lse, MaxLogits, tok, h0)``: natural-log lse / max_logits (+inf / -inf if empty).
    """
    f32 = "float32"
    set_lim = tc.make_set_lim(has_topk_length, topk_dim)

    @T.macro
    def load_q(Q, Q_l, Q_r, Q_t, tok, h0):
        T.copy(Q[tok, h0 : h0 + BH, 0:DH], Q_l)
        T.copy(Q[tok, h0 : h0 + BH, DH:D], Q_r)
        if D_tail > 0:
            T.copy(Q[tok, h0 : h0 + BH, D:dqk], Q_t)
        T.fence_proxy_async()
        T.sync_threads()

    @T.macro
    def qk_first(Qa, Ka, Vld, acc_s):
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.if_then_else(Vld[r], T.float32(0), -T.infinity(f32))
        T.wgmma_gemm(Qa, Ka, acc_s, transpose_B=True)

    @T.macro
    def qk_second(Qb, Kb, Qt, Kt, acc_s):
        T.wgmma_gemm(Qb, Kb, acc_s, transpose_B=True)
        if D_tail > 0:
            T.wgmma_gemm(Qt, Kt, acc_s, transpose_B=True)

    @T.macro
    def normaliser(inv, l_i, m_i, Sink, h0):
        for h in T.Parallel(BH):
            if has_sink:
                inv[h] = T.if_then_else(
                    l_i[h] > 0,
                    1.0 / (l_i[h] + T.exp2(tc.sink_exponent(Sink[h0 + h], m_i[h], c_log2))),
                    T.float32(0),
                )
            else:
                inv[h] = T.if_then_else(l_i[h] > 0, 1.0 / l_i[h], T.float32(0))

    @T.macro
    def store_lse(l_i, m_i, Lse, MaxLogits, tok, h0):
        for h in T.Parallel(BH):
            Lse[tok, h0 + h] = T.if_then_else(
                l_i[h] > 0, (T.log2(l_i[h]) + m_i[h] * c_log2) * T.float32(LN2), T.infinity(f32)
            )
            MaxLogits[tok, h0 + h] = T.if_then_else(l_i[h] > 0, m_i[h] * c_log2 * T.float32(LN2), -T.infinity(f32))

    return set_lim, load_q, qk_first, qk_second, normaliser, store_lse


def _finish_macros(*, BH, DH, D, normaliser, store_lse):
    """(wg0_finish, wg1_role): WG0's epilogue and the whole WG1 role."""

    wg1_step = tc.wg1_pv_step_macro(BH=BH, DH=DH)

    @T.macro
    def wg0_finish(inv, l_i, m_i, acc_o, Sink, Fin_s, fin, Lse, MaxLogits, Q_l, Out, tok, h0):
        # final scale (sink folded), lse, max_logits; O[:, 0:DH] staged through the dead Q_l
        normaliser(inv, l_i, m_i, Sink, h0)
        T.copy(inv, Fin_s)
        T.barrier_arrive(fin)
        store_lse(l_i, m_i, Lse, MaxLogits, tok, h0)
        for h, d in T.Parallel(BH, DH):
            acc_o[h, d] = acc_o[h, d] * inv[h]
        T.sync_threads(BAR_WG0, 128)  # all WG0 warps past their last QK (reads Q_l)
        T.copy(acc_o, Q_l)  # Q_l is dead: stage the output through it
        T.sync_threads(BAR_WG0, 128)
        T.copy(Q_l, Out[tok, h0 : h0 + BH, 0:DH])

    @T.macro
    def wg1_role(regs, n_pairs, nblk, s_ready0, s_ready1, Alpha0, Alpha1, P0, P1, KV0_r, KV1_r, kv_free0, kv_free1,
                 acc_o1, fin, Fin_s, Q_r, Out, tok, h0):
        T.set_max_nreg(regs, 1)
        T.fill(acc_o1, 0)
        for j in T.serial(n_pairs):
            if j * 2 < nblk[0]:
                wg1_step(j & 1, s_ready0, Alpha0, P0, KV0_r, kv_free0, acc_o1)
            if j * 2 + 1 < nblk[0]:
                wg1_step(j & 1, s_ready1, Alpha1, P1, KV1_r, kv_free1, acc_o1)
        T.barrier_wait(fin, 0)
        for h, d in T.Parallel(BH, DH):
            acc_o1[h, d] = acc_o1[h, d] * Fin_s[h]
        T.copy(acc_o1, Q_r)  # WG0 is past its last QK (fin), Q_r is dead
        T.sync_threads(BAR_WG1, 128)
        T.copy(Q_r, Out[tok, h0 : h0 + BH, DH:D])

    return wg0_finish, wg1_role


def build_sparse_mla_fwd(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
):
    """Return the warp-specialised TileLang prim_func (same signature as kernel_fwd).

    Signature: (Q[T,H,Dqk] bf16, KV[Tkv,Dqk] bf16, Indices[T,topk] i32, TopkLen[n_tl] i32, Sink[n_sink] f32,
    Out[T,H,d_v] bf16, Lse[T,H] f32, MaxLogits[T,H] f32).  The "ws1" schedule (GPU-verified at 48a0c95:
    300 TFLOP/s): WG0 does QK + softmax of every block and PV on O[:, :256], WG1 only PV on O[:, 256:]; see
    the module notes.
    """
    assert dqk in _SUPPORTED_DQK and d_v == D_V, (dqk, d_v)
    assert heads in _SUPPORTED_H, heads
    assert sm_scale is not None and sm_scale > 0
    D = d_v
    DH = D // 2  # d_v half owned by each consumer warpgroup
    D_tail = dqk - D
    BH = BLOCK_H
    BI = BLOCK_I
    G = heads // BH  # head groups per token
    NI = (int(topk) + BI - 1) // BI
    NP = (NI + 1) // 2  # buffer pairs
    c_log2 = float(sm_scale) * LOG2E
    neg_big = tc.NEG_BIG
    n_qk_groups = 3 if D_tail > 0 else 2  # wgmma commit groups of one QK product

    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    _row = tc.make_slot_row(topk_dim)  # KV row of a top-k slot, -1 past topk_eff
    _ok = tc.make_row_ok(n_kv)
    online_softmax = tc.online_softmax_macro(BH=BH, BI=BI, D=DH, c_log2=c_log2)
    set_lim, load_q, qk_first, qk_second, normaliser, store_lse = _ws_macros(
        BH=BH, BI=BI, DH=DH, D=D, D_tail=D_tail, dqk=dqk, c_log2=c_log2, has_sink=has_sink,
        has_topk_length=has_topk_length, topk_dim=topk_dim,
    )

    # ------------------------------------------------------------------ producer

    @T.macro
    def gather(KVl, KVr, Kt, Vld, Indices, KV, tok, lim, blk):
        # validity flags for WG0's -inf mask (threads 0-63 of the producer)
        for r in T.Parallel(BI):
            Vld[r] = _ok(_row(Indices, tok, lim, blk * BI + r))
        # One parallel nest = one cp.async group: 32 threads (one warp) per row, 16 B per
        # thread per statement, zero-filling predicated cp.async for invalid rows.  The
        # 64-column chunk index c is a nest dimension (2 statements instead of 8 written-out
        # ones: LayoutInference time scales with the statement count, this cuts the lowering
        # of one config by ~35%); the rope tile is gathered by the c == 0 quarter of each warp
        # inside the same nest (same cp.async group, no second wait).
        # (No inner serial/unroll loop here: that breaks the cp.async rewrite.)
        for r, c, d in T.Parallel(BI, 4, 64, annotations={"parallel_prefer_async": True}):
            row = _row(Indices, tok, lim, blk * BI + r)
            ok = _ok(row)
            KVl[r, c * 64 + d] = T.if_then_else(ok, KV[row, c * 64 + d], T.cast(0, bf16))
            KVr[r, c * 64 + d] = T.if_then_else(ok, KV[row, DH + c * 64 + d], T.cast(0, bf16))
            if D_tail > 0:
                if c == 0:
                    Kt[r, d] = T.if_then_else(ok, KV[row, D + d], T.cast(0, bf16))
        # TileLang closes the nest with cp.async commit + wait_group 0 (per thread); make
        # the landed tile (and the flags) visible to the wgmma async proxy, then each
        # producer thread arrives (release) on kv_ready.
        T.fence_proxy_async()

    # ------------------------------------------------------------------ WG0 pieces
    @T.macro
    def qk_issue(Ql, Qr, Qt, KVl, KVr, Kt, Vld, acc_s):
        qk_first(Ql, KVl, Vld, acc_s)
        qk_second(Qr, KVr, Qt, Kt, acc_s)

    @T.macro
    def softmax_to_p(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk, P, Alpha_s):
        online_softmax(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk)
        # every WG0 warp is past its QK wait: the K rope tile (= P for Dqk 576) is free
        T.sync_threads(BAR_WG0, 128)
        T.copy(alpha, Alpha_s)
        T.copy(acc_s, P)
        T.fence_proxy_async()
        T.sync_threads(BAR_WG0, 128)  # whole P tile written before WG0's PV wgmma

    @T.macro
    def wg0_step(
        blk, nblk, nxt_phase, P, Alpha_s, s_rdy, kv_fr, KVl,
        nkv_rdy, nKVl, nKVr, nKt, nVld,
        Ql, Qr, Qt, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
    ):
        # acc_s holds S of block blk (QK retired); buffer of blk: P/Alpha_s/KVl
        softmax_to_p(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk, P, Alpha_s)
        T.barrier_arrive(s_rdy)
        T.wgmma_gemm(P, KVl, acc_o)
        if blk + 1 < nblk:
            # queue QK(blk+1) behind PV_l(blk); retire PV first to free the buffer
            T.barrier_wait(nkv_rdy, nxt_phase)
            qk_issue(Ql, Qr, Qt, nKVl, nKVr, nKt, nVld, acc_s)
            T.wait_wgmma(n_qk_groups)
            T.barrier_arrive(kv_fr)
            T.wait_wgmma(0)
        else:
            T.wait_wgmma(0)
            T.barrier_arrive(kv_fr)

    wg0_finish, wg1_role = _finish_macros(BH=BH, DH=DH, D=D, normaliser=normaliser, store_lse=store_lse)

    @T.prim_func
    def sparse_mla_fwd_ws(
        Q: T.Tensor([n_tok, heads, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok * G, threads=THREADS) as bx:
            Q_l = T.alloc_shared([BH, DH], bf16)
            Q_r = T.alloc_shared([BH, DH], bf16)
            KV0_l = T.alloc_shared([BI, DH], bf16)
            KV0_r = T.alloc_shared([BI, DH], bf16)
            KV1_l = T.alloc_shared([BI, DH], bf16)
            KV1_r = T.alloc_shared([BI, DH], bf16)
            if D_tail > 0:
                Q_t = T.alloc_shared([BH, D_tail], bf16)
                K0_t = T.alloc_shared([BI, D_tail], bf16)
                K1_t = T.alloc_shared([BI, D_tail], bf16)
                P0 = K0_t  # P of a block reuses its K rope tile (free after QK)
                P1 = K1_t
            else:
                Q_t = Q_r  # unused placeholders
                K0_t = KV0_r
                K1_t = KV1_r
                P0 = T.alloc_shared([BH, BI], bf16)
                P1 = T.alloc_shared([BH, BI], bf16)
            Vld0 = T.alloc_shared([BI], "bool")
            Vld1 = T.alloc_shared([BI], "bool")
            Alpha0 = T.alloc_shared([BH], f32)
            Alpha1 = T.alloc_shared([BH], f32)
            Fin_s = T.alloc_shared([BH], f32)

            # one mbarrier per buffer and role (macros take whole barrier buffers)
            kv_ready0 = T.alloc_barrier(128)
            kv_ready1 = T.alloc_barrier(128)
            s_ready0 = T.alloc_barrier(128)
            s_ready1 = T.alloc_barrier(128)
            kv_free0 = T.alloc_barrier(256)
            kv_free1 = T.alloc_barrier(256)
            fin = T.alloc_barrier(128)

            acc_o = T.alloc_fragment([BH, DH], f32)  # WG0: O[:, 0:256]
            acc_o1 = T.alloc_fragment([BH, DH], f32)  # WG1: O[:, 256:512]
            acc_s = T.alloc_fragment([BH, BI], f32)
            m_i = T.alloc_fragment([BH], f32)
            m_prev = T.alloc_fragment([BH], f32)
            alpha = T.alloc_fragment([BH], f32)
            l_i = T.alloc_fragment([BH], f32)
            l_blk = T.alloc_fragment([BH], f32)
            inv = T.alloc_fragment([BH], f32)
            lim = T.alloc_local([1], i32)
            nblk = T.alloc_local([1], i32)

            tok = bx // G
            h0 = (bx % G) * BH
            tx = T.get_thread_binding()

            set_lim(lim, TopkLen, tok)
            nblk[0] = T.min((lim[0] + BI - 1) // BI, NI)
            load_q(Q, Q_l, Q_r, Q_t, tok, h0)  # Q tile (all 384 threads), visible to the async proxy

            if tx < 128:
                # ---------------------------------------------------------- WG0
                T.set_max_nreg(WS1_REGS[0], 1)
                T.fill(acc_o, 0)
                T.fill(l_i, 0)
                T.fill(m_i, neg_big)
                if nblk[0] > 0:
                    T.barrier_wait(kv_ready0, 0)
                    qk_issue(Q_l, Q_r, Q_t, KV0_l, KV0_r, K0_t, Vld0, acc_s)
                    T.wait_wgmma(0)
                for j in T.serial(NP):
                    if j * 2 < nblk[0]:
                        wg0_step(
                            j * 2, nblk[0], j & 1, P0, Alpha0, s_ready0, kv_free0, KV0_l,
                            kv_ready1, KV1_l, KV1_r, K1_t, Vld1,
                            Q_l, Q_r, Q_t, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
                        )
                    if j * 2 + 1 < nblk[0]:
                        wg0_step(
                            j * 2 + 1, nblk[0], (j + 1) & 1, P1, Alpha1, s_ready1, kv_free1, KV1_l,
                            kv_ready0, KV0_l, KV0_r, K0_t, Vld0,
                            Q_l, Q_r, Q_t, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
                        )

                wg0_finish(inv, l_i, m_i, acc_o, Sink, Fin_s, fin, Lse, MaxLogits, Q_l, Out, tok, h0)
            elif tx < 256:
                # ---------------------------------------------------------- WG1
                wg1_role(WS1_REGS[1], NP, nblk, s_ready0, s_ready1, Alpha0, Alpha1, P0, P1, KV0_r, KV1_r, kv_free0,
                         kv_free1, acc_o1, fin, Fin_s, Q_r, Out, tok, h0)
            else:
                # ---------------------------------------------------------- producer
                T.set_max_nreg(WS1_REGS[2], 0)
                for j in T.serial(NP):
                    if j * 2 < nblk[0]:
                        T.barrier_wait(kv_free0, (j & 1) ^ 1)
                        gather(KV0_l, KV0_r, K0_t, Vld0, Indices, KV, tok, lim[0], j * 2)
                        T.barrier_arrive(kv_ready0)
                    if j * 2 + 1 < nblk[0]:
                        T.barrier_wait(kv_free1, (j & 1) ^ 1)
                        gather(KV1_l, KV1_r, K1_t, Vld1, Indices, KV, tok, lim[0], j * 2 + 1)
                        T.barrier_arrive(kv_ready1)

    return sparse_mla_fwd_ws



def _pass_configs():
    # All intra-role syncs are explicit named barriers (BAR_WG0 / BAR_WG1): the automatic
    # pass gave the producer warpgroup the same named-barrier id as WG0 (deadlock risk).
    return tc.plain_pass_configs({tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, dqk: int, d_v: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool):
    func = build_sparse_mla_fwd(
        heads=heads,
        dqk=dqk,
        d_v=d_v,
        topk=n_blocks * BLOCK_I,
        sm_scale=sm_scale,
        has_sink=has_sink,
        has_topk_length=has_topk_length,
    )
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason (shapes/dtypes only): the pipelined
    kernel's rules, and full 64-head tiles."""
    reason = kernel_fwd.kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is None and q.shape[1] not in _SUPPORTED_H:
        reason = f"H={q.shape[1]} not in {_SUPPORTED_H} (warp-specialised kernel needs full 64-head tiles)"
    return reason


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None):
    """Returns (out [T,H,d_v] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32)."""
    reason = kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is not None:
        raise ValueError(f"sparse_mla fwd ws kernel: {reason}")
    return kernel_fwd.launch(_compiled, q, kv, indices, sm_scale=sm_scale, d_v=d_v, topk_length=topk_length,
                             attn_sink=attn_sink)


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test (lowering is slow)."""
    cases = []
    for heads, dqk, topk, sink, tl in [
        (64, 512, 640, True, True),  # V4 shape: Dqk 512, sink, topk_length
    ]:
        name = f"ws1_h{heads}_d{dqk}_topk{topk}" + ("_sink" if sink else "") + ("_tl" if tl else "")
        fn = build_sparse_mla_fwd(heads=heads, dqk=dqk, d_v=D_V, topk=topk, sm_scale=dqk**-0.5, has_sink=sink,
                                  has_topk_length=tl)
        cases.append((name, fn))
    return cases
