"""The "pair" schedule of the warp-specialised sparse MLA forward (``kernel_fwd_ws.build_sparse_mla_fwd(...,
schedule="pair")``); same contract, roles, constants and host side as ``kernel_fwd_ws.py`` (its notes have the
measurements: GPU-verified, slower than "ws1" because the KV gather binds).

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

"""

import tilelang.language as T

from . import _tl_common as tc
from . import kernel_fwd_ws as ws
from .kernel_fwd_ws import (
    BAR_BOTH, BAR_WG0, BAR_WG1, BLOCK_H, BLOCK_I, D_V, LOG2E, PAIR_REGS, THREADS, _SUPPORTED_DQK, _SUPPORTED_H,
)


def build_pair(
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
    neg_big = tc.NEG_BIG

    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    _row = tc.make_slot_row(topk_dim)  # KV row of a top-k slot, -1 past topk_eff
    _ok = tc.make_row_ok(n_kv)
    set_lim, load_q, qk_first, qk_second, normaliser, store_lse = ws._ws_macros(
        BH=BH, BI=BI, DH=DH, D=D, D_tail=D_tail, dqk=dqk, c_log2=c_log2, has_sink=has_sink,
        has_topk_length=has_topk_length, topk_dim=topk_dim,
    )

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
    # qk_first (nest A: -inf mask + first K half) and qk_second (nest B: the rest) come from _ws_macros
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
        normaliser(inv, l_acc, m_run, Sink, h0)

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

            set_lim(lim, TopkLen, tok)
            # blocks past ceil(topk_eff / 64) are skipped; an odd count leaves block 2j+1 all-invalid
            # (zero-filled, -inf scores, P = 0)
            npair[0] = (T.min((lim[0] + BI - 1) // BI, NI) + 1) // 2
            load_q(Q, Q_l, Q_r, Q_t, tok, h0)

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
                store_lse(l0, m_run0, Lse, MaxLogits, tok, h0)
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
