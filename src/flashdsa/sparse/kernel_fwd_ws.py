"""Sparse MLA forward, warp-specialised TileLang kernels for Hopper (sm_90a).

Notes
-----
Same contract, host interface and numerics as ``kernel_fwd.py`` (the pipelined kernel), for H in {64, 128},
Dqk in {512, 576}, d_v = 512.  One CTA per (token, 64-head group) on a 1-D grid (head group fastest, so the
two CTAs of one token at H = 128 gather the same rows back to back: the second gather hits L2); 384 threads =
two consumer warpgroups (WG0 threads 0-127, WG1 128-255) + one producer warpgroup (256-383), ``setmaxnreg``.
Two schedules (``schedule=``; env ``FLASHDSA_SPARSE_WS_SCHEDULE`` sets the default, "ws1"):

Measured (H200, 2026-11-30, scripts/bench_sparse_fwd.py, random per-token indices, median of 10; ms / TFLOP/s):
  | case                       | kernel_fwd   | ws1          | pair         |
  | V32 H128 SKV 8K topk 2048  | 8.74 / 267   | 8.08 / 289   | 11.55 / 202  |
  | V32 H64                    | 4.53 / 258   | 4.15 / 282   | 5.93 / 197   |
  | V32 H128 SKV 128K          | 8.78 / 266   | 8.82 / 265   | 13.08 / 179  |
  | V4 h64 d512 topk 640 sink  | 1.61 / 213   | 2.19 / 157   | 2.45 / 140   |
  "pair" passes all GPU tests (12/12) but is SLOWER: the binding limit is the KV gather, not the MMA schedule.
  All three kernels move 8192 CTAs x 2048 rows x 1152 B = 19.3 GB from L2 into shared memory at the headline
  shape; 8.1-8.7 ms is 2.2-2.4 TB/s, ~4 us per 72 KiB block per SM, i.e. ~7,000 cycles per block against
  ~2,200 tensor-core cycles of MMA.  Each producer keeps ONE 72 KiB cp.async nest in flight (the nest ends in
  wait_group 0), so an SM's gather rate is 72 KiB per L2 round trip + issue time.  "pair" is worse because
  its nest B of pair j+1 can only start after nest A of pair j+1 landed (free_b waits for the next QK issue),
  so two round trips per pair are exposed instead of overlapping compute.  Next step (both schedules): keep
  several nests in flight (cp.async without the per-nest wait_group 0, completion signalled by
  cp.async.mbarrier.arrive.noinc per buffer half, as FlashMLA's producer does; TileLang has
  T.cp_async_barrier_noinc and the loop annotation "parallel_async_without_async_commit_wait" - not yet tried)
  and issue nest B of pair j+1 as soon as the remote PVs of pair j retire.

"pair" -- both consumers compute QK (FlashMLA's sparse-prefill split on Hopper, our own code):
  * Blocks of 64 top-k slots go in pairs: block a = 2j in buffer 0, block b = 2j+1 in buffer 1.  WG0 computes
    S_a = Q K_a^T, WG1 S_b (64 heads x 64 keys x Dqk each, async SS wgmma, K split 256 | 256 | 64), in
    parallel.  WG0 owns O[:, 0:256], WG1 O[:, 256:512]; each does PV for its columns over BOTH blocks.
  * Running max chain (raw score units, exp2 with c = sm_scale*log2e folded): WG0: m_a = max(m, rowmax S_a),
    rescale O_l and l_0 by 2^((m - m_a) c), P_a = 2^(S_a c - m_a c) in registers, publish m_a (smem Ma,
    mbarrier bar_ma), O_l += P_a V_a[:, :256] (RS wgmma: P from registers).  WG1: m_b = max(m_a, rowmax S_b)
    (m_b >= m_a >= the common m of the last pair), rescale O_r, l_1, P_b = 2^(S_b c - m_b c), publish m_b
    (Mb, bar_mb), O_r += P_b V_b[:, 256:] (RS), store bf16 P_b to smem (bar_p1).  WG0 then moves O_l, l_0
    and P_a to m_b (factor 2^((m_a - m_b) c)), stores bf16 P_a to smem (bar_p0) and adds P_b V_b[:, :256]
    (SS); WG1 adds P_a V_a[:, 256:] (SS).  After each pair both consumers hold O and l at the same max m_b;
    at the end l = l_0 + l_1 (exchanged through smem, same operand order in both) and the sink term is
    folded as 1 / (l + 2^(sink log2e - m c)).
  * Next pair's QK is issued right behind the remote PV (tensor pipe stays fed), so WG0's softmax overlaps
    WG1's QK and vice versa.  P of a block lives in that block's rope tile (Dqk 576: dead after its QK)
    or in two 8 KiB tiles (Dqk 512).
  * Producer: two predicated, zero-filling cp.async nests per pair (invalid slots are never read), each
    72 KiB in flight: A = KV_a[:, :256] + KV_b[:, 256:512] + validity flags (what each consumer's first QK
    half and its local PV read), B = KV_a[:, 256:512] + KV_b[:, :256] + both rope tiles.  Consumers issue
    the first QK half after ready_a and the rest after ready_b.
  * mbarriers (one phase per pair, parity j & 1): ready_a/ready_b (128 producer arrivals, after wait_group 0
    + fence.proxy.async), free_a (256: WG0 after its local PV retired, WG1 likewise), free_b (256: each
    consumer after its remote PV retired, i.e. after the next pair's first QK half is issued and
    wait_wgmma(1)), bar_ma/bar_mb/bar_p0/bar_p1 (128).  Deadlock-freedom: every event of pair j+1 depends
    only on events of pair j (free_b(j) needs ready_a(j+1), which needs only free_a(j)); no barrier can run
    two phases ahead of its waiter (each arrive of phase j+1 is ordered after the waiter's wait of phase
    j through another barrier).  Named barriers: 8 (WG0), 9 (WG1), 10 (WG0+WG1, 256, epilogue).
  * Blocks past ceil(topk_eff / 64) are skipped by all roles (uniform condition); an odd block count makes
    block b of the last pair all-invalid (zero-filled, scores -inf, P = 0).
  * Count per pair and CTA: 2 x (QK 4.7 + PV 4.2) MFLOP = 17.8 MFLOP = 4352 tensor-core cycles at the
    2048 bf16 MAC/clk/SM peak; gathered 144 KiB (two nests).  Shared memory (Dqk 576): Q 72 KiB + 2 x 72 KiB
    KV + flags/max/l ~1.2 KiB ~= 217.3 KiB of 227 KiB; Dqk 512: 64 + 128 + 16 (P) KiB.
  * Registers: each consumer holds O 64x256 fp32 (128/thread) + S 64x64 fp32 (32) + P bf16 (16); setmaxnreg
    208 + 208 + 88 = 504 = 3 x 168, the launch pool of __launch_bounds__(384, 1) (a larger sum HANGS).
    ptxas -v (nvcc 13.0, sm_90a): consumers spill nothing at 208 (at 200 ptxas serialises the wgmmas, C7512);
    the producer (two rows per nest) spills ~190-240 B at 88 (none at 104, which the pool cannot give).
  * ptxas serialises EVERY wgmma of the kernel (C7515) when a wgmma is still in flight at the loop back edge
    (the accumulator phi copies) or when its issue and its wait_group are in different `if` blocks (TileLang
    splits a guarded body into one `if` per statement): hence the dynamic trip count and each iteration
    retiring what it issued.  Both lowering cases compile without C7515/C7512/C7517.

"ws1" -- the first schedule (GPU-verified at 48a0c95, 7.78 ms = 300 TFLOP/s at the headline shape): WG0 does
  QK + softmax of every block and PV on O[:, :256], WG1 only PV on O[:, 256:] (P, alpha via smem); the
  producer gathers one whole block per buffer (two buffers); setmaxnreg 240 + 176 + 88.  QK and softmax sit
  on one warpgroup's critical path, which is what "pair" removes.

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
Verification: both schedules pass tests/sparse_mla/test_kernel_ws_gpu.py on the H200 ("ws1" at 48a0c95, "pair"
2026-11-30); timings above.
"""

import functools
import os

import tilelang
import tilelang.language as T

from . import kernel_fwd

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

BLOCK_H = 64  # heads per CTA (wgmma M)
BLOCK_I = 64  # top-k slots per block
assert BLOCK_I == kernel_fwd.BLOCK_I  # kernel_fwd.launch sizes the top-k loop with it
D_V = 512
_SUPPORTED_DQK = (512, 576)
_SUPPORTED_H = (64, 128)
THREADS = 384
SCHEDULES = ("pair", "ws1")
DEFAULT_SCHEDULE = os.environ.get("FLASHDSA_SPARSE_WS_SCHEDULE", "ws1")  # the faster one measured (below)
assert DEFAULT_SCHEDULE in SCHEDULES, DEFAULT_SCHEDULE
# setmaxnreg budgets (WG0, WG1, producer).  The CTA's pool is what the launch allocated: a
# __launch_bounds__(384, 1) kernel gets floor(65536 / 384) rounded down to 8 = 168 registers per thread, i.e.
# 64,512 registers; setmaxnreg.inc blocks until the pool can supply the request, so the per-thread counts
# must sum to <= 3 * 168 = 504 (240 + 176 + 96 = 512 hung the H200 on 2026-11-30).
WS1_REGS = (240, 176, 88)
PAIR_REGS = (208, 208, 88)
_REG_LAUNCH = (65536 // THREADS) // 8 * 8  # 168
for _regs in (WS1_REGS, PAIR_REGS):
    assert sum(_regs) <= 3 * _REG_LAUNCH, "setmaxnreg requests exceed the CTA register pool"
    assert _regs[0] >= _REG_LAUNCH and _regs[1] >= _REG_LAUNCH and _regs[2] <= _REG_LAUNCH
BAR_WG0, BAR_WG1, BAR_BOTH = 8, 9, 10  # named barrier ids (128, 128, 256 threads); 0 is __syncthreads


def build_sparse_mla_fwd(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
    schedule: str = DEFAULT_SCHEDULE,
):
    """Return the warp-specialised TileLang prim_func (same signature as kernel_fwd).

    Signature: (Q[T,H,Dqk] bf16, KV[Tkv,Dqk] bf16, Indices[T,topk] i32, TopkLen[n_tl] i32, Sink[n_sink] f32,
    Out[T,H,d_v] bf16, Lse[T,H] f32, MaxLogits[T,H] f32).  ``schedule``: "ws1" or "pair" (default DEFAULT_SCHEDULE).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    build = _build_pair if schedule == "pair" else _build_ws1
    return build(heads=heads, dqk=dqk, d_v=d_v, topk=topk, sm_scale=sm_scale, has_sink=has_sink,
                 has_topk_length=has_topk_length)


def _build_ws1(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
):
    """The first warp-specialised schedule ("ws1", GPU-verified at 48a0c95: 300 TFLOP/s): WG0 does QK + softmax
    of every block and PV on O[:, :256], WG1 only PV on O[:, 256:]; see the module notes."""
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
    neg_big = -1.0e30
    n_qk_groups = 3 if D_tail > 0 else 2  # wgmma commit groups of one QK product

    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok = T.dynamic("n_tok")
    n_kv = T.dynamic("n_kv")
    n_tl = T.dynamic("n_tl")
    n_sink = T.dynamic("n_sink")
    topk_dim = T.dynamic("topk")

    # ------------------------------------------------------------------ producer
    def _row(Indices, tok, lim, slot):
        # KV row of top-k slot `slot`, or -1 past topk_eff (the Indices read stays in bounds)
        return T.if_then_else(slot < lim, Indices[tok, T.min(slot, topk_dim - 1)], -1)

    def _ok(row):
        return (row >= 0) & (row < n_kv)

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
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.if_then_else(Vld[r], T.float32(0), -T.infinity(f32))
        T.wgmma_gemm(Ql, KVl, acc_s, transpose_B=True)
        T.wgmma_gemm(Qr, KVr, acc_s, transpose_B=True)
        if D_tail > 0:
            T.wgmma_gemm(Qt, Kt, acc_s, transpose_B=True)

    @T.macro
    def softmax_to_p(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk, P, Alpha_s):
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        for h in T.Parallel(BH):
            alpha[h] = T.exp2((m_prev[h] - m_i[h]) * c_log2)
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.exp2(acc_s[h, r] * c_log2 - m_i[h] * c_log2)
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(BH):
            l_i[h] = l_i[h] * alpha[h] + l_blk[h]
        for h, d in T.Parallel(BH, DH):
            acc_o[h, d] = acc_o[h, d] * alpha[h]
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

    @T.macro
    def wg1_step(phase, s_rdy, Alpha_s, P, KVr, kv_fr, acc_o):
        T.barrier_wait(s_rdy, phase)
        for h, d in T.Parallel(BH, DH):
            acc_o[h, d] = acc_o[h, d] * Alpha_s[h]
        T.wgmma_gemm(P, KVr, acc_o)
        T.wait_wgmma(0)
        T.barrier_arrive(kv_fr)

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

            if has_topk_length:
                lim[0] = T.max(T.min(TopkLen[tok], topk_dim), 0)
            else:
                lim[0] = topk_dim
            nblk[0] = T.min((lim[0] + BI - 1) // BI, NI)

            # Q tile (all 384 threads), then make it visible to the async proxy
            T.copy(Q[tok, h0 : h0 + BH, 0:DH], Q_l)
            T.copy(Q[tok, h0 : h0 + BH, DH:D], Q_r)
            if D_tail > 0:
                T.copy(Q[tok, h0 : h0 + BH, D:dqk], Q_t)
            T.fence_proxy_async()
            T.sync_threads()

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

                # ---- epilogue: final scale (sink folded), lse, max_logits ----
                for h in T.Parallel(BH):
                    if has_sink:
                        inv[h] = T.if_then_else(
                            l_i[h] > 0,
                            1.0 / (l_i[h] + T.exp2(Sink[h0 + h] * T.float32(LOG2E) - m_i[h] * c_log2)),
                            T.float32(0),
                        )
                    else:
                        inv[h] = T.if_then_else(l_i[h] > 0, 1.0 / l_i[h], T.float32(0))
                T.copy(inv, Fin_s)
                T.barrier_arrive(fin)
                for h in T.Parallel(BH):
                    Lse[tok, h0 + h] = T.if_then_else(
                        l_i[h] > 0, (T.log2(l_i[h]) + m_i[h] * c_log2) * T.float32(LN2), T.infinity(f32)
                    )
                    MaxLogits[tok, h0 + h] = T.if_then_else(l_i[h] > 0, m_i[h] * c_log2 * T.float32(LN2), -T.infinity(f32))
                for h, d in T.Parallel(BH, DH):
                    acc_o[h, d] = acc_o[h, d] * inv[h]
                T.sync_threads(BAR_WG0, 128)  # all WG0 warps past their last QK (reads Q_l)
                T.copy(acc_o, Q_l)  # Q_l is dead: stage the output through it
                T.sync_threads(BAR_WG0, 128)
                T.copy(Q_l, Out[tok, h0 : h0 + BH, 0:DH])
            elif tx < 256:
                # ---------------------------------------------------------- WG1
                T.set_max_nreg(WS1_REGS[1], 1)
                T.fill(acc_o1, 0)
                for j in T.serial(NP):
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



def _build_pair(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
):
    """The "pair" schedule: WG0 does QK of even blocks, WG1 of odd blocks, both do PV on their
    256 output columns over every block; see the module notes for the per-pair protocol."""
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
    c_log2 = float(sm_scale) * LOG2E
    neg_big = -1.0e30

    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok = T.dynamic("n_tok")
    n_kv = T.dynamic("n_kv")
    n_tl = T.dynamic("n_tl")
    n_sink = T.dynamic("n_sink")
    topk_dim = T.dynamic("topk")

    def _row(Indices, tok, lim, slot):
        # KV row of top-k slot `slot`, or -1 past topk_eff (the Indices read stays in bounds)
        return T.if_then_else(slot < lim, Indices[tok, T.min(slot, topk_dim - 1)], -1)

    def _ok(row):
        return (row >= 0) & (row < n_kv)

    # ------------------------------------------------------------------ producer
    # Two cp.async nests per block pair (each one group, closed by wait_group 0 = 72 KiB in flight):
    #   A: KV0_l of block a (=2j) + KV1_r of block b (=2j+1) + both validity flag rows;
    #   B: KV0_r (+ rope K0_t) of block a + KV1_l (+ rope K1_t) of block b.
    # A holds what each consumer's first QK half reads and what its own local PV reads; B the rest.
    @T.macro
    def gather_a(KV0l, KV1r, Vld0, Vld1, Indices, KV, tok, lim, blk_a):
        for r in T.Parallel(BI):
            Vld0[r] = _ok(_row(Indices, tok, lim, blk_a * BI + r))
            Vld1[r] = _ok(_row(Indices, tok, lim, (blk_a + 1) * BI + r))
        for r, c, d in T.Parallel(BI, 4, 64, annotations={"parallel_prefer_async": True}):
            row_a = _row(Indices, tok, lim, blk_a * BI + r)
            row_b = _row(Indices, tok, lim, (blk_a + 1) * BI + r)
            ok_a = _ok(row_a)
            ok_b = _ok(row_b)
            KV0l[r, c * 64 + d] = T.if_then_else(ok_a, KV[row_a, c * 64 + d], T.cast(0, bf16))
            KV1r[r, c * 64 + d] = T.if_then_else(ok_b, KV[row_b, DH + c * 64 + d], T.cast(0, bf16))
        T.fence_proxy_async()

    @T.macro
    def gather_b(KV0r, KV1l, K0t, K1t, Indices, KV, tok, lim, blk_a):
        for r, c, d in T.Parallel(BI, 4, 64, annotations={"parallel_prefer_async": True}):
            row_a = _row(Indices, tok, lim, blk_a * BI + r)
            row_b = _row(Indices, tok, lim, (blk_a + 1) * BI + r)
            ok_a = _ok(row_a)
            ok_b = _ok(row_b)
            KV0r[r, c * 64 + d] = T.if_then_else(ok_a, KV[row_a, DH + c * 64 + d], T.cast(0, bf16))
            KV1l[r, c * 64 + d] = T.if_then_else(ok_b, KV[row_b, c * 64 + d], T.cast(0, bf16))
            if D_tail > 0:
                if c == 0:
                    K0t[r, d] = T.if_then_else(ok_a, KV[row_a, D + d], T.cast(0, bf16))
                    K1t[r, d] = T.if_then_else(ok_b, KV[row_b, D + d], T.cast(0, bf16))
        T.fence_proxy_async()

    # ------------------------------------------------------------------ consumer pieces
    @T.macro
    def qk_first(Qa, Ka, Vld, acc_s):
        # invalid slots start at -inf; the first K half (from nest A)
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.if_then_else(Vld[r], T.float32(0), -T.infinity(f32))
        T.wgmma_gemm(Qa, Ka, acc_s, transpose_B=True)

    @T.macro
    def qk_second(Qb, Kb, Qt, Kt, acc_s):
        T.wgmma_gemm(Qb, Kb, acc_s, transpose_B=True)
        if D_tail > 0:
            T.wgmma_gemm(Qt, Kt, acc_s, transpose_B=True)

    @T.macro
    def exp_and_rescale(acc_s, acc_o, m_run, m_new, alpha, l_acc, l_blk):
        # m_new holds the new running max (raw score units): rescale O and l from m_run to m_new,
        # P = exp2(S c - m_new c) in place (invalid -inf -> 0), l += rowsum(P)
        for h in T.Parallel(BH):
            alpha[h] = T.exp2((m_run[h] - m_new[h]) * c_log2)
            m_run[h] = m_new[h]
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.exp2(acc_s[h, r] * c_log2 - m_run[h] * c_log2)
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(BH):
            l_acc[h] = l_acc[h] * alpha[h] + l_blk[h]
        for h, d in T.Parallel(BH, DH):
            acc_o[h, d] = acc_o[h, d] * alpha[h]

    @T.macro
    def rescale_to(acc_o, m_run, m_new, alpha, l_acc):
        # move O and l from the running max m_run to m_new (>= m_run); alpha keeps the factor
        for h in T.Parallel(BH):
            alpha[h] = T.exp2((m_run[h] - m_new[h]) * c_log2)
            m_run[h] = m_new[h]
            l_acc[h] = l_acc[h] * alpha[h]
        for h, d in T.Parallel(BH, DH):
            acc_o[h, d] = acc_o[h, d] * alpha[h]

    @T.macro
    def final_scale(l_acc, m_run, inv, Ls0, Ls1, Sink, h0):
        # total l = l_WG0 + l_WG1 (both at the common final max; same operand order in both roles, so
        # both get bit-identical factors); inv = 1 / (l + sink term), 0 for empty rows
        for h in T.Parallel(BH):
            l_acc[h] = Ls0[h] + Ls1[h]
        for h in T.Parallel(BH):
            if has_sink:
                inv[h] = T.if_then_else(
                    l_acc[h] > 0,
                    1.0 / (l_acc[h] + T.exp2(Sink[h0 + h] * T.float32(LOG2E) - m_run[h] * c_log2)),
                    T.float32(0),
                )
            else:
                inv[h] = T.if_then_else(l_acc[h] > 0, 1.0 / l_acc[h], T.float32(0))

    @T.prim_func
    def sparse_mla_fwd_ws_pair(
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
                # P of a block (bf16, at the pair's common max) lives in that block's rope tile, dead
                # after the block's QK; it is refilled by nest B only after the peer's PV freed it
                P0 = K0_t
                P1 = K1_t
            else:
                Q_t = Q_r  # unused placeholders
                K0_t = KV0_r
                K1_t = KV1_r
                P0 = T.alloc_shared([BH, BI], bf16)
                P1 = T.alloc_shared([BH, BI], bf16)
            Vld0 = T.alloc_shared([BI], "bool")
            Vld1 = T.alloc_shared([BI], "bool")
            Ma = T.alloc_shared([BH], f32)  # WG0's running max after block 2j
            Mb = T.alloc_shared([BH], f32)  # common running max after block 2j+1 (WG1)
            Ls0 = T.alloc_shared([BH], f32)
            Ls1 = T.alloc_shared([BH], f32)

            ready_a = T.alloc_barrier(128)  # producer: nest A of pair j landed
            ready_b = T.alloc_barrier(128)  # producer: nest B of pair j landed
            free_a = T.alloc_barrier(256)  # consumers: nest-A tiles of pair j no longer read
            free_b = T.alloc_barrier(256)  # consumers: nest-B tiles (and P tiles) of pair j no longer read
            bar_ma = T.alloc_barrier(128)  # WG0 -> WG1: Ma written
            bar_mb = T.alloc_barrier(128)  # WG1 -> WG0: Mb written
            bar_p0 = T.alloc_barrier(128)  # WG0 -> WG1: P0 (at Mb) in smem
            bar_p1 = T.alloc_barrier(128)  # WG1 -> WG0: P1 (at Mb) in smem

            # per-role fragments (one fragment shared by two role branches loses code in TileLang 0.1.15)
            acc_o0 = T.alloc_fragment([BH, DH], f32)
            acc_s0 = T.alloc_fragment([BH, BI], f32)
            p0 = T.alloc_fragment([BH, BI], bf16)
            m_run0 = T.alloc_fragment([BH], f32)
            m_new0 = T.alloc_fragment([BH], f32)
            alpha0 = T.alloc_fragment([BH], f32)
            l0 = T.alloc_fragment([BH], f32)
            lb0 = T.alloc_fragment([BH], f32)
            inv0 = T.alloc_fragment([BH], f32)
            acc_o1 = T.alloc_fragment([BH, DH], f32)
            acc_s1 = T.alloc_fragment([BH, BI], f32)
            p1 = T.alloc_fragment([BH, BI], bf16)
            m_run1 = T.alloc_fragment([BH], f32)
            m_new1 = T.alloc_fragment([BH], f32)
            alpha1 = T.alloc_fragment([BH], f32)
            l1 = T.alloc_fragment([BH], f32)
            lb1 = T.alloc_fragment([BH], f32)
            inv1 = T.alloc_fragment([BH], f32)
            lim = T.alloc_local([1], i32)
            npair = T.alloc_local([1], i32)

            tok = bx // G
            h0 = (bx % G) * BH
            tx = T.get_thread_binding()

            if has_topk_length:
                lim[0] = T.max(T.min(TopkLen[tok], topk_dim), 0)
            else:
                lim[0] = topk_dim
            # blocks past ceil(topk_eff / 64) are skipped; an odd count leaves block 2j+1 all-invalid
            # (zero-filled, -inf scores, P = 0)
            npair[0] = (T.min((lim[0] + BI - 1) // BI, NI) + 1) // 2

            T.copy(Q[tok, h0 : h0 + BH, 0:DH], Q_l)
            T.copy(Q[tok, h0 : h0 + BH, DH:D], Q_r)
            if D_tail > 0:
                T.copy(Q[tok, h0 : h0 + BH, D:dqk], Q_t)
            T.fence_proxy_async()
            T.sync_threads()

            if tx < 128:
                # ------------------------------------------------ WG0: QK of blocks 2j, O[:, 0:256]
                T.set_max_nreg(PAIR_REGS[0], 1)
                T.fill(acc_o0, 0)
                T.fill(l0, 0)
                T.fill(m_run0, neg_big)
                # No wgmma may be in flight across the loop back edge or have its issue and its wait_group in
                # different `if` blocks: ptxas then serialises every wgmma of the kernel (C7515).  Hence a
                # dynamic trip count (no per-statement guards) and each iteration retires what it issued.
                if npair[0] > 0:
                    T.barrier_wait(ready_a, 0)
                    qk_first(Q_l, KV0_l, Vld0, acc_s0)
                    T.barrier_wait(ready_b, 0)
                    qk_second(Q_r, KV0_r, Q_t, K0_t, acc_s0)
                    T.wait_wgmma(0)
                for j in T.serial(npair[0]):
                    # acc_s0 = S of block 2j (retired)
                    T.copy(m_run0, m_new0)
                    T.reduce_max(acc_s0, m_new0, dim=1, clear=False)
                    exp_and_rescale(acc_s0, acc_o0, m_run0, m_new0, alpha0, l0, lb0)
                    T.copy(m_run0, Ma)
                    T.barrier_arrive(bar_ma)
                    # local PV: O_l += P(2j) V(2j)[:, 0:256], P from registers
                    T.copy(acc_s0, p0)
                    T.wgmma_gemm(p0, KV0_l, acc_o0)
                    T.wait_wgmma(0)
                    T.barrier_arrive(free_a)  # KV0_l, Vld0 done (WG0's share of nest A)
                    # common max after block 2j+1: rescale O_l, l, and P(2j) for WG1
                    T.barrier_wait(bar_mb, j & 1)
                    for h in T.Parallel(BH):
                        m_new0[h] = Mb[h]
                    rescale_to(acc_o0, m_run0, m_new0, alpha0, l0)
                    for h, r in T.Parallel(BH, BI):
                        p0[h, r] = T.cast(acc_s0[h, r] * alpha0[h], bf16)
                    T.sync_threads(BAR_WG0, 128)  # every WG0 warp is past QK(2j): rope tile free
                    T.copy(p0, P0)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_p0)
                    # remote PV: O_l += P(2j+1) V(2j+1)[:, 0:256], P from WG1 via smem
                    T.barrier_wait(bar_p1, j & 1)
                    T.wgmma_gemm(P1, KV1_l, acc_o0)
                    if j + 1 < npair[0]:
                        # QK(2j+2) queued right behind it (the tensor pipe does not drain)
                        T.barrier_wait(ready_a, (j + 1) & 1)
                        qk_first(Q_l, KV0_l, Vld0, acc_s0)
                        T.wait_wgmma(1)  # remote PV retired
                        T.barrier_arrive(free_b)  # KV1_l, P1 of pair j done (WG0's share of nest B)
                        T.barrier_wait(ready_b, (j + 1) & 1)
                        qk_second(Q_r, KV0_r, Q_t, K0_t, acc_s0)
                    T.wait_wgmma(0)
                T.wait_wgmma(0)
                T.copy(l0, Ls0)
                T.sync_threads(BAR_BOTH, 256)  # both l halves in smem; both consumers past every wgmma
                final_scale(l0, m_run0, inv0, Ls0, Ls1, Sink, h0)
                for h in T.Parallel(BH):
                    Lse[tok, h0 + h] = T.if_then_else(
                        l0[h] > 0, (T.log2(l0[h]) + m_run0[h] * c_log2) * T.float32(LN2), T.infinity(f32)
                    )
                    MaxLogits[tok, h0 + h] = T.if_then_else(
                        l0[h] > 0, m_run0[h] * c_log2 * T.float32(LN2), -T.infinity(f32)
                    )
                for h, d in T.Parallel(BH, DH):
                    acc_o0[h, d] = acc_o0[h, d] * inv0[h]
                T.copy(acc_o0, Q_l)  # Q_l is dead: every QK retired before BAR_BOTH
                T.sync_threads(BAR_WG0, 128)
                T.copy(Q_l, Out[tok, h0 : h0 + BH, 0:DH])
            elif tx < 256:
                # ------------------------------------------------ WG1: QK of blocks 2j+1, O[:, 256:512]
                T.set_max_nreg(PAIR_REGS[1], 1)
                T.fill(acc_o1, 0)
                T.fill(l1, 0)
                T.fill(m_run1, neg_big)
                if npair[0] > 0:
                    T.barrier_wait(ready_a, 0)
                    qk_first(Q_r, KV1_r, Vld1, acc_s1)
                    T.barrier_wait(ready_b, 0)
                    qk_second(Q_l, KV1_l, Q_t, K1_t, acc_s1)
                    T.wait_wgmma(0)
                for j in T.serial(npair[0]):
                    # acc_s1 = S of block 2j+1 (retired)
                    T.barrier_wait(bar_ma, j & 1)
                    for h in T.Parallel(BH):
                        m_new1[h] = Ma[h]
                    T.reduce_max(acc_s1, m_new1, dim=1, clear=False)
                    exp_and_rescale(acc_s1, acc_o1, m_run1, m_new1, alpha1, l1, lb1)
                    T.copy(m_run1, Mb)
                    T.barrier_arrive(bar_mb)
                    # local PV: O_r += P(2j+1) V(2j+1)[:, 256:512], P from registers
                    T.copy(acc_s1, p1)
                    T.wgmma_gemm(p1, KV1_r, acc_o1)
                    T.sync_threads(BAR_WG1, 128)  # every WG1 warp is past QK(2j+1): rope tile free
                    T.copy(p1, P1)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_p1)
                    T.wait_wgmma(0)
                    T.barrier_arrive(free_a)  # KV1_r, Vld1 done (WG1's share of nest A)
                    # remote PV: O_r += P(2j) V(2j)[:, 256:512], P0 already at the common max
                    T.barrier_wait(bar_p0, j & 1)
                    T.wgmma_gemm(P0, KV0_r, acc_o1)
                    if j + 1 < npair[0]:
                        T.barrier_wait(ready_a, (j + 1) & 1)
                        qk_first(Q_r, KV1_r, Vld1, acc_s1)
                        T.wait_wgmma(1)  # remote PV retired
                        T.barrier_arrive(free_b)  # KV0_r, P0 of pair j done (WG1's share of nest B)
                        T.barrier_wait(ready_b, (j + 1) & 1)
                        qk_second(Q_l, KV1_l, Q_t, K1_t, acc_s1)
                    T.wait_wgmma(0)
                T.wait_wgmma(0)
                T.copy(l1, Ls1)
                T.sync_threads(BAR_BOTH, 256)
                final_scale(l1, m_run1, inv1, Ls0, Ls1, Sink, h0)
                for h, d in T.Parallel(BH, DH):
                    acc_o1[h, d] = acc_o1[h, d] * inv1[h]
                T.copy(acc_o1, Q_r)
                T.sync_threads(BAR_WG1, 128)
                T.copy(Q_r, Out[tok, h0 : h0 + BH, DH:D])
            else:
                # ------------------------------------------------ producer
                T.set_max_nreg(PAIR_REGS[2], 0)
                for j in T.serial(npair[0]):
                    T.barrier_wait(free_a, (j & 1) ^ 1)  # fresh barrier: parity 1 passes
                    gather_a(KV0_l, KV1_r, Vld0, Vld1, Indices, KV, tok, lim[0], j * 2)
                    T.barrier_arrive(ready_a)
                    T.barrier_wait(free_b, (j & 1) ^ 1)
                    gather_b(KV0_r, KV1_l, K0_t, K1_t, Indices, KV, tok, lim[0], j * 2)
                    T.barrier_arrive(ready_b)

    return sparse_mla_fwd_ws_pair


def _pass_configs():
    return {
        tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        # All intra-role syncs are explicit named barriers (BAR_WG0 / BAR_WG1): the automatic
        # pass gave the producer warpgroup the same named-barrier id as WG0 (deadlock risk).
        tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    }


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, dqk: int, d_v: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool,
              schedule: str = DEFAULT_SCHEDULE):
    func = build_sparse_mla_fwd(
        heads=heads,
        dqk=dqk,
        d_v=d_v,
        topk=n_blocks * BLOCK_I,
        sm_scale=sm_scale,
        has_sink=has_sink,
        has_topk_length=has_topk_length,
        schedule=schedule,
    )
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason (shapes/dtypes only): the pipelined
    kernel's rules, and full 64-head tiles."""
    reason = kernel_fwd.kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is None and q.shape[1] not in _SUPPORTED_H:
        reason = f"H={q.shape[1]} not in {_SUPPORTED_H} (warp-specialised kernel needs full 64-head tiles)"
    return reason


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
                       schedule: str | None = None):
    """Returns (out [T,H,d_v] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32).

    ``schedule``: "pair" or "ws1" (None: DEFAULT_SCHEDULE)."""
    reason = kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is not None:
        raise ValueError(f"sparse_mla fwd ws kernel: {reason}")
    schedule = DEFAULT_SCHEDULE if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    compiled = functools.partial(_compiled, schedule=schedule)
    return kernel_fwd.launch(compiled, q, kv, indices, sm_scale=sm_scale, d_v=d_v, topk_length=topk_length,
                             attn_sink=attn_sink)


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test (lowering is slow)."""
    cases = []
    for sched, heads, dqk, topk, sink, tl in [
        ("ws1", 64, 512, 640, True, True),  # V4 shape: Dqk 512, sink, topk_length
        ("pair", 128, 576, 2048, False, False),  # headline shape
    ]:
        name = f"{sched}_h{heads}_d{dqk}_topk{topk}" + ("_sink" if sink else "") + ("_tl" if tl else "")
        fn = build_sparse_mla_fwd(heads=heads, dqk=dqk, d_v=D_V, topk=topk, sm_scale=dqk**-0.5, has_sink=sink,
                                  has_topk_length=tl, schedule=sched)
        cases.append((name, fn))
    return cases
