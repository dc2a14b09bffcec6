"""Sparse MLA forward, warp-specialised TileLang kernel for Hopper (sm_90a).

Notes
-----
Same contract, host interface and numerics as ``kernel_fwd.py`` (the simple pipelined
kernel); this module is a drop-in alternative for the dispatcher, for a narrower
subset: H a multiple of 64 (64 or 128), Dqk in {512, 576}, d_v = 512.

Design
  * Grid: 1-D, ``T * (H / 64)`` CTAs, head group fastest (block b -> token b // G,
    head group b % G), so the two head groups of one token run in adjacent CTAs and
    the second gather of the same KV rows is an L2 hit.  1-D also avoids the 65535
    limit of gridDim.y for T > 65535.
  * 384 threads = 3 warpgroups with ``setmaxnreg``:
      - WG0 (threads 0-127, 240 regs): S = Q K^T for all 64 heads x 64 keys over the
        full Dqk (2 or 3 async wgmma, K split 256 | 256 | 64), online softmax (fp32,
        exp2, ``sm_scale*log2(e)`` folded), writes P (bf16) and the per-row rescale
        factor alpha to shared memory, then O[:, 0:256] += P V[:, 0:256].
      - WG1 (threads 128-255, 176 regs): O[:, 256:512] *= alpha; += P V[:, 256:512].
      - producer (threads 256-383, 88 regs): gathers the 64 KV rows of block i into
        buffer i % 2 with 16-byte cp.async (one warp per row per pass: 32 lanes x 16 B
        = 256 columns of KV_l and of KV_r, lanes 0-7 also the 64 rope columns; 16
        passes of 4 rows);
        rows of invalid slots use the predicated, zero-filling form (src-size 0:
        nothing is read, NaN in unreferenced rows cannot leak), and a per-row
        validity flag is written to shared memory.
  * Synchronisation (mbarriers, parity = (i // 2) & 1 for block i in buffer b = i % 2):
      kv_ready[b]  (128 producer arrivals: each thread waited its own cp.async group
                    (wait_group 0), stored its validity flags, fence.proxy.async, then a
                    plain release arrive; WG0's wait acquires tile + flags)
      s_ready[b]   (128, WG0 -> WG1: P and alpha of block i are in shared memory)
      kv_free[b]   (256, WG0 + WG1 after their PV wgmma on buffer b retired)
      fin          (128, WG0 -> WG1 after the loop: final 1/(l + sink term) in smem,
                    and WG0 is done reading Q, so WG1 may stage its output in Q_r)
    Intra-warpgroup syncs are explicit named barriers (ids 8 = WG0, 9 = WG1, 128
    threads); TileLang's automatic thread-storage-sync pass is disabled (see pitfalls).
  * WG0 schedule per block i: wait kv_ready -> QK (async) -> wait -> softmax ->
    bar(WG0) -> alpha + P into the K-rope tile of block i (Dqk = 576: the rope tile is
    dead after QK, saves 8 KiB; Dqk = 512 uses two separate P tiles) ->
    fence.proxy.async -> bar(WG0) -> arrive s_ready -> issue PV_l(i) async -> wait
    kv_ready of block i+1 and issue its QK right behind PV_l(i) (the tensor pipe does
    not drain between them) -> wait_group(#QK groups) retires PV_l(i) -> arrive
    kv_free -> wait_group(0) -> softmax(i+1) ...  WG1's PV_r(i) overlaps WG0's
    QK(i+1).  P and alpha are per buffer, so WG0 never waits for WG1 (WG1 only gates
    buffer reuse through kv_free).
  * Blocks past ceil(topk_eff / 64) (topk_eff = min(topk_length[t], topk)) are skipped
    by all three roles (uniform condition, only at the tail, so barrier parities stay
    in step): short rows cost nothing.
  * Masking / numerics exactly as kernel_fwd.py: slot j valid iff j < topk_eff and
    0 <= idx < Tkv; invalid columns start at -inf before the QK wgmma accumulates;
    running max starts at -1e30 (finite); empty row -> out 0, lse +inf,
    max_logits -inf; sink folded as 1 / (l + exp2(sink*log2e - m*c)).
  * Static trip count ceil(ceil(topk/64)/2) pairs per compiled kernel; T, Tkv and the
    indices width are dynamic.  One compile per (H, Dqk, ceil(topk/64), sm_scale,
    has_sink, has_topk_length).

Shared memory (Dqk = 576, as laid out by TileLang): Q 64x576 (73,728 B) + 2 KV
  buffers 64x576 (147,456 B; the 64x64 rope tile of each doubles as P) + alpha 2x64 f32
  + final scale 64 f32 + flags 2x64 B + 7 mbarriers ~= 222.1 KB of the 232,448 B cap.
  Dqk = 512: Q 64 KiB + 2 x 64 KiB + 2 separate P tiles 8 KiB each + ~0.9 KB ~= 214 KB.
Registers: WG0 acc_o 64x256 fp32 = 128/thread + acc_s 64x64 = 32/thread (+ row
  stats) under 240; WG1 128 + few under 176; producer 88.  The setmaxnreg pool is the
  launch allocation, 168 regs/thread x 384 = 64,512 (NOT 65,536), so the three counts
  must sum to <= 504: 240 + 176 + 88 = 504.  (The first version asked for
  240 + 176 + 96 = 512: setmaxnreg.inc blocks until the pool has the registers, so one
  consumer warpgroup waited forever -> the H200 hang of 2026-11-30.)

Verified (CPU only, TileLang 0.1.15, sm_90a): the three ``lowering_cases()`` lower in
  11-14 s each (H128/576/topk2048: 13.3 s; H64/512/topk640 sink tl: 12.2 s;
  H128/576/topk100 sink tl: 10.9 s).  The generated CUDA was read: wgmma_ss
  m64n64k16 (QK) and m64n256k16 (PV), warpgroup_reg_alloc<240>/<176> and
  warpgroup_reg_dealloc<88>, mbarrier wait/arrive per role with the parities above,
  wait_wgmma<3> (<2> for Dqk 512) between PV_l(i) and QK(i+1), one unrolled 16-pass
  loop of 2 (+1 for lanes 0-7 with Dqk 576) cp_async_gs_conditional<16> per buffer
  followed by one commit + wait_group 0, named
  barriers 8/9 only, sink read at Sink[h0 + h], 1-D grid index split bx >> 1 / bx & 1.
  Compiled by nvcc 13.0 (sm_90a, TileLang's flags) after the deadlock fix below: 168
  registers, 0 spills, no wgmma-serialisation warning, 10 barriers (ids 0, 8, 9 used).
Deadlock post-mortem (2026-11-30, CPU only): the first H200 run hung in every test.  The
  mbarrier protocol was re-checked on the generated CUDA (init by one elected thread,
  fence.mbarrier_init + __syncthreads before the role split; every role runs the same
  guarded iterations; arrival counts 128/128/256/128 match the arriving threads; the
  producer's first kv_free wait uses parity 1 = passes on a fresh barrier; only bar.sync
  ids 8/9 with 128 threads inside the roles, no __syncthreads; a role-level simulation of
  all nblk <= NI <= 8 finds no deadlock and no parity aliasing).  The hang was the
  register budget: nvcc 13.0 ptxas -v reports "Used 168 registers" (launch pool 64,512),
  and 240 + 176 + 96 = 512 > 504 registers/thread were requested with setmaxnreg.inc.
TileLang 0.1.15 pitfalls met here (in addition to kernel_fwd.py's):
  * Using ONE fragment (acc_o) in two role branches made TileLang silently drop WG1's
    element-wise loops (the alpha and final rescale vanished from the CUDA): give each
    role its own fragment (acc_o / acc_o1).
  * The automatic thread-storage-sync pass inserted ``bar.sync 3, 128`` in both the
    producer and WG0 branches (same id, different warps: a cross-role barrier mix-up);
    hence TL_DISABLE_THREAD_STORAGE_SYNC and explicit T.sync_threads(id, 128).
  * ``T.attr(..., "async_scope", 1)`` on manual vectorized loops is ignored (plain
    ld/st); the zero-fill cp.async comes from a T.Parallel nest annotated
    ``{"parallel_prefer_async": True}`` whose body is if_then_else(ok, KV[row, c], 0).
    An inner T.unroll loop inside that nest silently disables the rewrite; the 64-column
    chunk index is a third T.Parallel dimension instead (the nine written-out statements
    of the first version cost ~1 s of LayoutInference each), and the rope tile is a
    ``if c == 0`` statement in the same nest (still rewritten: one cp.async group).  The
    nest always ends in wait_group 0.
  * Repeating the Indices-based row expression in every statement made lowering take
    320 s; binding ``row = ...`` once in the nest body (a Let) brings it to ~13 s.
  * Barrier buffers passed into T.macro must be whole Buffers (an element
    ``bar[1]`` becomes a Var inside the macro and T.barrier_arrive rejects it): one
    T.alloc_barrier per barrier.
Risks (check first on the GPU):
  * Deadlock/hang = a parity or arrival-count mistake: run the small cases first with a
    timeout.  ptxas -v: look for spills under the 240/176/88 budgets and for "wgmma
    serialized" warnings (would kill the PV/QK overlap).
  * The producer is serialised per buffer (wait_group 0 before arriving): if the
    gather is exposed (ncu: tensor pipe idle while kv_ready waits), go to 3 buffers of
    BI = 32 or split the free barrier per half (FlashMLA style).
  * Performance model: 8.9 MFLOP of wgmma per block per CTA; WG0's softmax is not
    overlapped with its own QK (only with WG1's PV) and the QK SS-wgmma at N = 64 is
    at the 128 B/clk shared-memory read limit; expect ~80% of the wgmma ceiling at
    best, i.e. likely short of 700 TFLOP/s.  The next step toward the target is
    FlashMLA's schedule (each consumer does QK of alternate blocks, P of the peer via
    smem, rescale after the max exchange).
"""

import functools

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
# setmaxnreg budget.  The CTA's register pool is what the launch allocated: ptxas gives a
# __launch_bounds__(384, 1) kernel floor(65536 / 384) rounded down to the 8-register granularity
# = 168 registers per thread ("Used 168 registers"), i.e. 168 * 384 = 64,512 registers, NOT
# 65,536.  setmaxnreg.inc blocks until the pool can supply the request, so the three per-thread
# counts must sum to <= 3 * 168 = 504.  240 + 176 + 96 = 512 deadlocked on the H200 (one consumer
# warpgroup waited forever in setmaxnreg.inc, everything else then waited on its mbarriers).
# ptxas -v (sm_90a, nvcc 13.0): 240/176/88 has no spills in any region (the producer fits far
# below 88; WG1 at 120 spills).
REG_WG0, REG_WG1, REG_PRODUCER = 240, 176, 88
_REG_LAUNCH = (65536 // THREADS) // 8 * 8  # 168
assert REG_WG0 + REG_WG1 + REG_PRODUCER <= 3 * _REG_LAUNCH, "setmaxnreg requests exceed the CTA register pool"
assert REG_WG0 >= _REG_LAUNCH and REG_WG1 >= _REG_LAUNCH and REG_PRODUCER <= _REG_LAUNCH
BAR_WG0, BAR_WG1 = 8, 9  # named barrier ids (128 threads each); 0 is __syncthreads


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

    Signature: (Q[T,H,Dqk], KV[Tkv,Dqk], Indices[T,topk], TopkLen[n_tl], Sink[n_sink],
    Out[T,H,d_v], Lse[T,H], MaxLogits[T,H]).
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
                T.set_max_nreg(REG_WG0, 1)
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
                T.set_max_nreg(REG_WG1, 1)
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
                T.set_max_nreg(REG_PRODUCER, 0)
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
    return {
        tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        # All intra-role syncs are explicit named barriers (BAR_WG0 / BAR_WG1): the automatic
        # pass gave the producer warpgroup the same named-barrier id as WG0 (deadlock risk).
        tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    }


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
        (64, 512, 640, True, True),  # lowering is slow on CPU: one case
    ]:
        name = f"ws_h{heads}_d{dqk}_topk{topk}" + ("_sink" if sink else "") + ("_tl" if tl else "")
        fn = build_sparse_mla_fwd(
            heads=heads, dqk=dqk, d_v=D_V, topk=topk, sm_scale=dqk**-0.5, has_sink=sink, has_topk_length=tl
        )
        cases.append((name, fn))
    return cases
