"""The "ws2" schedule of the warp-specialised sparse MLA forward (``kernel_fwd_ws.build_sparse_mla_fwd(...,
schedule="ws2")``): "ws1"'s roles and math with a gather that keeps two blocks in flight and lets QK start on
the first 64 dims of a block while the rest is still landing.  Same contract, constants and host side as
``kernel_fwd_ws.py``.  Opt-in only (not the default schedule, not dispatched).

Why.  Every sparse forward we have moves 8192 CTAs x 2048 rows x 1152 B = 19.3 GB from L2 into shared memory at
the headline shape (S 4096, H 128, Dqk 576, topk 2048) in 8.1-8.7 ms: ~7,000 cycles per 64-row block per SM
against ~2,200 tensor cycles.  ws1's producer issues a block (72 KiB of cp.async) and then waits for ALL of it
(``cp.async.wait_all``) before it signals and before it may issue anything else, so at most one block is in
flight, the in-flight volume drains to zero at the end of every block, and QK cannot start before the last
row landed.

Roles (384 threads, setmaxnreg 240 + 176 + 88 = 504 = 3 x 168, as ws1):
  * WG0 (threads 0-127): QK + online softmax of every block, PV on O[:, 0:256].
  * WG1 (128-255): PV on O[:, 256:512] (P and the rescale alpha through shared memory).
  * producer (256-383): the gather.
Data per KV buffer b in {0, 1} (two buffers; block blk lives in buffer blk % 2, its use u = blk // 2):
  KVl_b [64, 256], KVr_b [64, 256], Kt_b [64, 64] (rope, Dqk 576; after QK it holds P, as in ws1) or
  P_b [64, 64] (Dqk 512), Rows_b [64] int32 (KV row of each slot, -1 if invalid), Alpha_b [64] f32.
Sub-tiles: the Dqk columns of a block are NC = Dqk / 64 column tiles (9 for Dqk 576, 8 for 512) of
  64 rows x 64 dims = 8 KiB each; tile k is dims [64k, 64k + 64) (k < 4: KVl, 4 <= k < 8: KVr, k = 8: Kt).

Protocol (mbarriers; every barrier completes exactly once per use u of its buffer, waiters use parity u & 1):
  ready[b*NC + k]  tile k of buffer b landed.  Count 128 (producer threads, deferred arrivals
                   ``cp.async.mbarrier.arrive.noinc``: the arrive fires when ALL earlier cp.async of that thread
                   completed, so tile k's barrier also implies tiles < k landed); k = 0 has count 256: the 128
                   deferred arrivals + 128 ordinary (release) arrivals issued after Rows_b was written, which
                   publish Rows_b to WG0.
  s_ready[b]  (128, WG0)      P_b and Alpha_b of the block in buffer b are written (as ws1).
  kv_free[b]  (256, WG0+WG1)  each consumer warpgroup retired its PV reading buffer b (as ws1).
  fin         (128, WG0)      final normaliser in Fin_s (as ws1).
  Producer, block blk in buffer b, use u:
      wait kv_free[b] parity (u & 1) ^ 1     (fresh barrier: passes for u = 0)
      Rows_b[r] = row or -1 (threads 0-63); named barrier 11 (128 producer threads); arrive ready[b*NC]
      for k in 0..NC-1: cp.async tile k (zero-filling predicated copies, src-size 0 for invalid rows: nothing
          is read), then cp.async.mbarrier.arrive.noinc ready[b*NC + k]   -- no wait, no commit
  and after the last block ``commit; wait_group 0`` (nothing is left in flight when the thread exits).
  WG0, per block: softmax(blk) -> P_b, arrive s_ready[b]; issue PV_l(blk); then, if blk + 1 exists (buffer
      nb, parity of its use): wait ready[nb*NC], fence.proxy.async, -inf mask from Rows_nb, issue QK tile 0;
      wait_wgmma(1) (= PV_l(blk) retired) and arrive kv_free[b]; for k = 1..NC-1: wait ready[nb*NC + k],
      fence.proxy.async, issue QK tile k; wait_wgmma(0).  (Else: wait_wgmma(0), arrive kv_free[b].)
  WG1, per block: wait s_ready[b], fence.proxy.async, O_r *= alpha, PV_r, wait_wgmma(0), arrive kv_free[b].
  Visibility: cp.async writes are generic-proxy writes; the wgmma reads are async-proxy reads, so each
  consumer executes fence.proxy.async after the mbarrier wait that made the tile visible to it (WG1 sees
  KVr through WG0's chain ready -> s_ready) and before its wgmma.  (FlashMLA's sm90 sparse kernels go from
  the cp.async mbarrier wait straight to the wgmma; env FLASHDSA_WS2_PROXY_FENCE=0 at build time drops our
  fences for a timing comparison.)
  Deadlock-freedom: the producer's only wait is kv_free[b] of use u - 1 (blocks blk - 2), which needs WG0's
  arrival (after tile 0 of blk - 1 landed: issued before, no wait in between) and WG1's (after s_ready of
  blk - 2); neither depends on anything the producer does after blk - 1.  No barrier runs two phases ahead
  of a waiter: ready[b*NC + k] of use u + 1 needs kv_free[b] of use u, which WG0 arrives only after it passed
  its ready waits of use u; s_ready[b] of use u + 1 comes after WG0 waited ready of use u + 1, i.e. after
  WG1's kv_free[b] arrival of use u, which follows WG1's s_ready[b] wait of use u.  Checked by a randomised
  simulation of the protocol (nblk 0..8, NC 8 and 9, random landing order/interleavings; mutations of the
  parities / counts deadlock in it).
  Named barriers: 8 (WG0), 9 (WG1), 11 (producer); the automatic storage sync pass is off (as ws1).

In flight.  While the consumers work on block blk (buffer b), the producer has issued block blk + 1 into nb
  and waits only for buffer b; once the consumers lag (gather-bound regime) both buffers are in flight at
  once: up to 144 KiB per SM instead of <= 72 KiB, with no drain-to-zero between blocks.  A buffer is
  released right after its PVs retire (WG0: as soon as the next block's tile 0 has landed).  A third
  stage does not fit: Q 72 KiB + 2 x 72 KiB = 221,184 B of the 232,448 B cap.

Shared memory (lowered, TileLang's offsets): Dqk 576: Q 73,728 + KV 2 x 73,728 + Alpha 2 x 256 + Fin 256 +
  Rows 2 x 256 = 222,464 B dynamic + 1,024 B static (23 mbarriers, reduction scratch) of the 232,448 B cap;
  Dqk 512: Q 65,536 + KV 131,072 + P 2 x 8,192 + 1,280 = 214,272 B dynamic.  ptxas (nvcc 13.0, sm_90a):
  168 registers at launch, 0 spills, no C7515/C7512 wgmma-serialisation warning, 12 named barriers.
Cost model per 64-row block (tensor work, one SM): QK 64 x 64 x 576 = 1,152 cycles (smem-bound: m64n64 SS
  reads 4 KiB per k16 step = 128 B/clk), PV 2 x 512 cycles in parallel on WG0/WG1; WG0's serial path QK +
  softmax (~400) + P store/syncs (~150) + PV_l 512 ~= 2,200-2,400 cycles.  Shared-memory traffic per block
  (Q 72 + K 72 KiB read by QK, P 2 x 8 + V 64 KiB by PV, 72 KiB cp.async writes) ~= 296 KiB = ~2,300 cycles
  at 128 B/clk.  Gather: ws1 needs ~7,000 cycles per block with <= 72 KiB in flight (and an empty pipe
  between blocks); if the per-SM rate is in-flight bound (Little's law), ~2x the in-flight volume gives
  ~3,500-4,500 cycles per block (1.6-2x, ~450-550 TFLOP/s); the floor is ~2,300-2,500 (shared memory /
  WG0's serial path), ~650 TFLOP/s.  If the limit is the L2 fabric instead, ws2 gains only the QK overlap
  (~1,000 cycles of the tail: a few %).
"""

import os

import tilelang.language as T

from . import _tl_common as tc
from .kernel_fwd_ws import (
    BAR_WG0, BLOCK_H, BLOCK_I, D_V, LOG2E, THREADS, WS1_REGS, _SUPPORTED_DQK, _SUPPORTED_H, _finish_macros, _ws_macros,
)

BAR_PROD = 11  # named barrier of the producer warpgroup (128 threads)
WS2_REGS = WS1_REGS  # (240, 176, 88): sum 504 = the __launch_bounds__(384, 1) pool (checked in kernel_fwd_ws)
CH = 64  # dims per sub-tile (one 128-byte swizzle atom wide)
_ASYNC = tc.ASYNC_GATHER


def build_ws2(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
):
    """The "ws2" schedule (see the module notes): ws1's roles, a sub-tiled, non-blocking gather."""
    assert dqk in _SUPPORTED_DQK and d_v == D_V, (dqk, d_v)
    assert heads in _SUPPORTED_H, heads
    assert sm_scale is not None and sm_scale > 0
    D = d_v
    DH = D // 2
    D_tail = dqk - D
    BH = BLOCK_H
    BI = BLOCK_I
    G = heads // BH
    NI = (int(topk) + BI - 1) // BI
    NP = (NI + 1) // 2  # buffer pairs
    NC = dqk // CH  # sub-tiles per block
    NCH = DH // CH  # sub-tiles per d_v half (4)
    assert NC * CH == dqk and NCH * CH == DH
    CHUNKS = tuple(range(NC))  # a Python tuple: `for k in CHUNKS` unrolls at trace time
    c_log2 = float(sm_scale) * LOG2E
    neg_big = tc.NEG_BIG
    # consumer-side fence.proxy.async after each ready / s_ready wait (see "Visibility"); FLASHDSA_WS2_PROXY_FENCE=0
    # drops them (FlashMLA's producer/consumer pair has no such fence) -- a timing experiment, not a default
    proxy_fence = os.environ.get("FLASHDSA_WS2_PROXY_FENCE", "1") != "0"

    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    _row = tc.make_slot_row(topk_dim)  # KV row of a top-k slot, -1 past topk_eff
    _ok = tc.make_row_ok(n_kv)
    online_softmax = tc.online_softmax_macro(BH=BH, BI=BI, D=DH, c_log2=c_log2)
    set_lim, load_q, _qk_first, _qk_second, normaliser, store_lse = _ws_macros(
        BH=BH, BI=BI, DH=DH, D=D, D_tail=D_tail, dqk=dqk, c_log2=c_log2, has_sink=has_sink,
        has_topk_length=has_topk_length, topk_dim=topk_dim,
    )
    # ready-barrier counts: per buffer, tile 0 gets the 128 deferred + 128 ordinary (Rows) arrivals
    READY_COUNTS = ([256] + [128] * (NC - 1)) * 2

    def _qa(k, Ql, Qr, Qt):
        """Q operand of sub-tile k (dims [64k, 64k + 64))."""
        if k < NCH:
            return Ql[:, k * CH : k * CH + CH]
        if k < 2 * NCH:
            return Qr[:, (k - NCH) * CH : (k - NCH) * CH + CH]
        return Qt

    def _kb(k, KVl, KVr, Kt):
        """K operand of sub-tile k of one buffer."""
        if k < NCH:
            return KVl[:, k * CH : k * CH + CH]
        if k < 2 * NCH:
            return KVr[:, (k - NCH) * CH : (k - NCH) * CH + CH]
        return Kt

    # ------------------------------------------------------------------ producer
    def make_produce(b):
        base = b * NC

        @T.macro
        def produce(KVl, KVr, Kt, Rows, ready, Indices, KV, tok, lim, blk):
            # Rows[r] = KV row of slot blk*64 + r, or -1 (out of topk_eff or out of [0, Tkv)): read once per
            # block here instead of once per cp.async row; also WG0's -inf mask.
            for r in T.Parallel(BI):
                row = _row(Indices, tok, lim, blk * BI + r)
                Rows[r] = T.if_then_else(_ok(row), row, -1)
            T.sync_threads(BAR_PROD, 128)  # Rows complete for every producer thread
            T.barrier_arrive(ready[base])  # ordinary (release) arrival: publishes Rows to WG0
            for k in CHUNKS:
                # one 8 KiB sub-tile: 4 x 16 B per thread, zero-filling predicated cp.async (src-size 0 for
                # row -1: nothing is read); no commit / wait: completion arrives on ready[base + k]
                for r, d in T.Parallel(BI, CH, annotations=_ASYNC):
                    rk = Rows[r]
                    if k < NCH:
                        KVl[r, k * CH + d] = T.if_then_else(rk >= 0, KV[rk, k * CH + d], T.cast(0, bf16))
                    elif k < 2 * NCH:
                        KVr[r, (k - NCH) * CH + d] = T.if_then_else(rk >= 0, KV[rk, k * CH + d], T.cast(0, bf16))
                    else:
                        Kt[r, d] = T.if_then_else(rk >= 0, KV[rk, k * CH + d], T.cast(0, bf16))
                T.cp_async_barrier_noinc(ready[base + k])

        return produce

    # ------------------------------------------------------------------ WG0 pieces
    def make_qk(nb, release):
        """QK of the block in buffer nb, sub-tile by sub-tile as it lands.  ``release``: PV_l of the previous
        block (buffer 1 - nb) is in flight: retire it after tile 0's issue and arrive kv_free (``free``)."""
        base = nb * NC

        @T.macro
        def qk(ready, phase, Rows, Ql, Qr, Qt, KVl, KVr, Kt, acc_s, free):
            for k in CHUNKS:
                T.barrier_wait(ready[base + k], phase)
                if proxy_fence:
                    T.fence_proxy_async()  # cp.async (generic proxy) writes -> wgmma (async proxy) reads
                if k == 0:
                    for h, r in T.Parallel(BH, BI):
                        acc_s[h, r] = T.if_then_else(Rows[r] >= 0, T.float32(0), -T.infinity(f32))
                T.wgmma_gemm(_qa(k, Ql, Qr, Qt), _kb(k, KVl, KVr, Kt), acc_s, transpose_B=True)
                if release:
                    if k == 0:
                        T.wait_wgmma(1)  # groups retire in order: PV_l of the previous block is done
                        T.barrier_arrive(free)

        return qk

    @T.macro
    def softmax_to_p(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk, P, Alpha_s):
        online_softmax(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk)
        # every WG0 warp retired its QK: the K rope tile (= P for Dqk 576) is free
        T.sync_threads(BAR_WG0, 128)
        T.copy(alpha, Alpha_s)
        T.copy(acc_s, P)
        T.fence_proxy_async()
        T.sync_threads(BAR_WG0, 128)  # whole P tile written before WG0's PV wgmma

    def make_wg0_step(b):
        nb = 1 - b
        qk_next = make_qk(nb, True)

        @T.macro
        def wg0_step(
            blk, nblk, nxt_phase, P, Alpha_s, s_rdy, kv_fr, KVl, ready, nRows, nKVl, nKVr, nKt,
            Ql, Qr, Qt, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
        ):
            # acc_s holds S of block blk (all its QK groups retired); blk's buffer: P / Alpha_s / KVl
            softmax_to_p(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk, P, Alpha_s)
            T.barrier_arrive(s_rdy)
            T.wgmma_gemm(P, KVl, acc_o)
            if blk + 1 < nblk:
                qk_next(ready, nxt_phase, nRows, Ql, Qr, Qt, nKVl, nKVr, nKt, acc_s, kv_fr)
                T.wait_wgmma(0)
            else:
                T.wait_wgmma(0)
                T.barrier_arrive(kv_fr)

        return wg0_step

    wg0_finish, wg1_role = _finish_macros(BH=BH, DH=DH, D=D, normaliser=normaliser, store_lse=store_lse,
                                          proxy_fence=proxy_fence)

    produce0, produce1 = make_produce(0), make_produce(1)
    qk_first_block = make_qk(0, False)
    wg0_step0, wg0_step1 = make_wg0_step(0), make_wg0_step(1)

    @T.prim_func
    def sparse_mla_fwd_ws2(
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
                Q_t = Q_r  # unused placeholders (no sub-tile 8 for Dqk 512)
                K0_t = KV0_r
                K1_t = KV1_r
                P0 = T.alloc_shared([BH, BI], bf16)
                P1 = T.alloc_shared([BH, BI], bf16)
            Rows0 = T.alloc_shared([BI], i32)
            Rows1 = T.alloc_shared([BI], i32)
            Alpha0 = T.alloc_shared([BH], f32)
            Alpha1 = T.alloc_shared([BH], f32)
            Fin_s = T.alloc_shared([BH], f32)

            ready = T.alloc_barrier(READY_COUNTS)  # [2 * NC]: buffer b, sub-tile k at b * NC + k
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
                T.set_max_nreg(WS2_REGS[0], 1)
                T.fill(acc_o, 0)
                T.fill(l_i, 0)
                T.fill(m_i, neg_big)
                if nblk[0] > 0:
                    qk_first_block(ready, 0, Rows0, Q_l, Q_r, Q_t, KV0_l, KV0_r, K0_t, acc_s, kv_free0)
                    T.wait_wgmma(0)
                for j in T.serial(NP):
                    if j * 2 < nblk[0]:
                        wg0_step0(
                            j * 2, nblk[0], j & 1, P0, Alpha0, s_ready0, kv_free0, KV0_l,
                            ready, Rows1, KV1_l, KV1_r, K1_t,
                            Q_l, Q_r, Q_t, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
                        )
                    if j * 2 + 1 < nblk[0]:
                        wg0_step1(
                            j * 2 + 1, nblk[0], (j + 1) & 1, P1, Alpha1, s_ready1, kv_free1, KV1_l,
                            ready, Rows0, KV0_l, KV0_r, K0_t,
                            Q_l, Q_r, Q_t, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
                        )

                wg0_finish(inv, l_i, m_i, acc_o, Sink, Fin_s, fin, Lse, MaxLogits, Q_l, Out, tok, h0)  # as ws1
            elif tx < 256:
                # ---------------------------------------------------------- WG1 (as ws1)
                wg1_role(WS2_REGS[1], NP, nblk, s_ready0, s_ready1, Alpha0, Alpha1, P0, P1, KV0_r, KV1_r, kv_free0,
                         kv_free1, acc_o1, fin, Fin_s, Q_r, Out, tok, h0)
            else:
                # ---------------------------------------------------------- producer
                T.set_max_nreg(WS2_REGS[2], 0)
                for j in T.serial(NP):
                    if j * 2 < nblk[0]:
                        T.barrier_wait(kv_free0, (j & 1) ^ 1)
                        produce0(KV0_l, KV0_r, K0_t, Rows0, ready, Indices, KV, tok, lim[0], j * 2)
                    if j * 2 + 1 < nblk[0]:
                        T.barrier_wait(kv_free1, (j & 1) ^ 1)
                        produce1(KV1_l, KV1_r, K1_t, Rows1, ready, Indices, KV, tok, lim[0], j * 2 + 1)
                # the consumers wait for every copy anyway; leave nothing in flight at thread exit
                T.ptx_commit_group()
                T.ptx_wait_group(0)

    return sparse_mla_fwd_ws2
