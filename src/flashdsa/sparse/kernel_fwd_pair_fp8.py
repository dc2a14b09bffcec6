"""Sparse MLA forward with FP8 (e4m3) q and KV on the "pair" schedule: both products on FP8 wgmma (Hopper sm_90a).

Notes
-----
Contract, math and host interface as ``kernel_fwd_fp8.py`` (q8 [T, H, Dqk] + q_scale [T, H], kv8 [Tkv, Dqk] +
kv_scale [Tkv], the bf16 forward on the dequantized tensors); one CTA per (token, 64-head group), 384 threads:
consumer warpgroups WG0 / WG1 and a producer warpgroup, top-k blocks in pairs a = 2j, b = 2j + 1; WG0 computes
S_a and owns output dims [0, 256), WG1 S_b and [256, 512) (``kernel_fwd_pair.py``'s split).  What is FP8-specific:

* The PV runs transposed, O^T = V^T P'^T (``_fp8_ot.py``): the SM90 e4m3 wgmma takes only K-major operands and the
  PV contracts over the gathered keys, so V^T is the A operand, loaded from registers: ``ldmatrix.trans`` + byte
  permutes straight from the gathered K half tile.  No V^T tile and no transpose pass (session 20; the kernel
  before it transposed each half into V^T tiles in shared memory: 5.0 ms against 3.97 here at S 4096 / SKV 8192 /
  H 128).  The accumulators are O^T tiles (``float acc[128]`` per thread); per-head factors (the rescale, 1 / l)
  are columns there and come through shared memory (F0, F1, Inv0, Inv1).
* Two K sets (the 64 KiB the V^T tiles took): the producer gathers pair j + 1 while pair j computes, and pair j + 2
  as soon as pair j's PVs retired.  Each set's barriers serve every other pair (parity (j >> 1) & 1).
* Scores: S = (Q8 K8^T) q_scale[h] kv_scale[r] (m64n64k32 e4m3 wgmma, fp32), invalid slots -inf; 2^x as one
  ``ex2.approx.ftz`` (``_tl_common.ex2``).
* P for the PV: P' = P kv_scale[r] c with one c per pair, c = 256 / max |kv_scale| over the pair's 128 rows (the
  producer reduces it while publishing the rows), so |P'| <= 256 fits e4m3 (max 448).  P' is sent as hi = e4m3(P'),
  lo = e4m3(P' - hi) (~7 mantissa bits; the CPU emulation, tests/sparse_mla/test_fp8_pair_numerics.py: cos 1.5e-6 vs
  2.0e-6 for a bf16 P): two m64n64k32 wgmmas per k-step, the tensor time of one bf16 PV.  The accumulator changes
  unit with the max: O *= alpha c_pair / c_prev; l sums the unscaled P; out = O / (c l).
* One P per block at the pair's common max (WG0 publishes m_a, WG1 m_b = max(m_a, rowmax S_b) right after its row
  max; WG0 waits for m_b before its exp), read by both warpgroups' PVs.

Per pair j (K set s = j & 1):
  WG0: scale S_a; m_a -> Ma; wait m_b; P_a' (at m_b) -> P0 (after p0_free: WG1's last remote PV); bar_p0; QK of
       pair j + 1 issued (S tile free); O_l *= F0; local PV on a.L -> fr_al; remote PV with P1 (bar_p1) on b.L
       -> fr_bl, p1_free; (its wait retires the QK) -> fr_ar of set s ^ 1.
  WG1: scale S_b; wait m_a; m_b -> Mb; P_b' -> P1 (after p1_free); bar_p1; QK of pair j + 1 issued; O_r *= F1;
       local PV on b.R -> fr_br; remote PV with P0 (bar_p0) on a.R -> fr_ar, p0_free; -> fr_bl of set s ^ 1.
  Producer: pair j into set s after fr_al and fr_br of pair j - 2 (every read of row slot s is before those),
       publish rows / scales / max (ordinary arrivals on rdy_al / rdy_br), cp.async a.L, b.R, then a.R after
       fr_ar (WG0's QK + WG1's remote PV: 256), b.L after fr_bl (256); noinc arrivals.
The rope tiles travel with a.R / b.R (read by QK only).  Shared memory (Dqk 576): Q 36 KiB + 2 x (64 KiB K halves
+ 8 KiB rope) + P 4 x 4 KiB + ~2 KiB = ~198 KiB.  Measured (H200, session 20, docs/PERFORMANCE.md): S 4096 / SKV
8192 / H 128 / topk 2048 3.965 ms vs the bf16 pair kernel's 3.959 in the same run (0.998x); without the lo half
of P ("no_lo") 3.362 ms.  GPU tests: tests/sparse_mla/test_kernel_pair_fp8_gpu.py.
"""

import functools

import tilelang
import tilelang.language as T

from .._tilelang import aligned, direct_launcher
from . import _tl_common as tc
from . import kernel_fwd_fp8 as f8
from . import _pair_body
from . import _pair_parts as pp
from . import kernel_fwd_pair as kp
from ._fp8_ot import OT_PRELUDE
from ._pair_parts import BAR_BOTH, BAR_PROD, BAR_WG0, BAR_WG1
from ._tl_common import BLOCK_H, BLOCK_I, D_V, LOG2E

SUPPORTED_H = kp.SUPPORTED_H
THREADS = _pair_body.THREADS
P_RANGE = f8.P_RANGE  # |P'| <= P_RANGE (e4m3 max 448)
REGS = (232, 232, 40)  # setmaxnreg (WG0, WG1, producer); ptxas 13.0: no spills (216 / 216 / 72 spilled 16-40 B)


def build_sparse_mla_fwd_pair_fp8(*, heads: int, dqk: int, topk: int, sm_scale: float, has_sink: bool = False,
                                  has_topk_length: bool = False, regs=REGS, ablate: str = ""):
    """Return the TileLang prim_func (Q[T,H,Dqk] e4m3, QScale[T,H] f32, KV[Tkv,Dqk] e4m3, KVScale[Tkv] f32,
    Indices[T,topk] i32, TopkLen[n_tl] i32, Sink[n_sink] f32, Out[T,H,512] bf16, Lse[T,H] f32, MaxLogits[T,H]
    f32).  ``regs``: setmaxnreg of (WG0, WG1, producer).  ``ablate`` (timing build, wrong results): "no_lo" (one
    e4m3 P per PV: what the P split costs)."""
    assert ablate in ("", "no_lo"), ablate
    assert dqk in tc.SUPPORTED_DQK and heads in SUPPORTED_H, (dqk, heads)
    assert sum(regs) <= 3 * ((65536 // THREADS) // 8 * 8) and all(r % 8 == 0 for r in regs), regs
    assert sm_scale is not None and sm_scale > 0
    D, DH, D_tail = D_V, D_V // 2, dqk - D_V
    BH, BI = BLOCK_H, BLOCK_I
    G = heads // BH
    NI = (int(topk) + BI - 1) // BI
    c_log2 = float(sm_scale) * LOG2E
    lo = 0 if ablate == "no_lo" else 1
    fp8, bf16, f32, i32 = "float8_e4m3", "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    set_lim = tc.make_set_lim(has_topk_length, topk_dim)
    _ok = tc.make_row_ok(n_kv)
    pair_rows = pp.pair_rows_macro(topk_dim, pp.row_select(lambda row, kv_src: _ok(row)))
    _, normaliser, _, store_lse = tc.padded_head_macros(BH=BH, D=D, D_tail=D_tail, dqk=dqk, heads=heads,
                                                        c_log2=c_log2, has_sink=has_sink, dtype=fp8)

    # ------------------------------------------------------------------ consumer pieces
    def make_qk(rope_first, wait):
        # S = Q8 K8^T over the half that lands first, then the other (the rope tile comes with the R half);
        # retired before returning when ``wait``, else left in flight (the next PV's wait retires it)
        @T.macro
        def qk(Q_a, K_a, Q_b, K_b, Q_t, K_t, acc_s, rdy_a, rdy_b, k, phase):
            T.barrier_wait(rdy_a[k], phase)
            T.fence_proxy_async()
            T.wgmma_gemm(Q_a, K_a, acc_s, transpose_B=True, clear_accum=True)
            if D_tail > 0 and rope_first:
                T.wgmma_gemm(Q_t, K_t, acc_s, transpose_B=True)
            T.barrier_wait(rdy_b[k], phase)
            T.fence_proxy_async()
            T.wgmma_gemm(Q_b, K_b, acc_s, transpose_B=True)
            if D_tail > 0 and not rope_first:
                T.wgmma_gemm(Q_t, K_t, acc_s, transpose_B=True)
            if wait:
                T.wait_wgmma(0)

        return qk

    qk0, qk1 = make_qk(False, True), make_qk(True, True)

    def make_next_qk(qk_next):
        # the QK of pair j + 1 (K set (j + 1) & 1), left in flight: halves K_a (first) and K_b of each set
        @T.macro
        def next_qk(Q_a, Q_b, Q_t, Ka0, Kb0, Kt0, Ka1, Kb1, Kt1, acc_s, rdy_a, rdy_b, j):
            if (j & 1) == 0:
                qk_next(Q_a, Ka1, Q_b, Kb1, Q_t, Kt1, acc_s, rdy_a, rdy_b, 1, ((j + 1) >> 1) & 1)
            else:
                qk_next(Q_a, Ka0, Q_b, Kb0, Q_t, Kt0, acc_s, rdy_a, rdy_b, 0, ((j + 1) >> 1) & 1)

        return next_qk

    next_qk0, next_qk1 = make_next_qk(make_qk(False, False)), make_next_qk(make_qk(True, False))

    @T.macro
    def scale_scores(acc_s, qsc, Rows, Ks, slot, KsMax, c_new):
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.if_then_else(Rows[slot, r] >= 0, acc_s[h, r] * qsc[h] * Ks[slot, r], -T.infinity(f32))
        kmax = T.max(KsMax[slot, 0], KsMax[slot, 1])
        c_new[0] = T.if_then_else(kmax > 0, T.float32(P_RANGE) / kmax, c_new[0])

    @T.macro
    def softmax(acc_s, m_run, m_new, alpha, l_acc, l_blk, c_old, c_new):
        # P = 2^(S c - m c) in place; alpha: the factor moving O to (m_new, c_new) (the caller stages it)
        for h in T.Parallel(BH):
            alpha[h] = tc.ex2((m_run[h] - m_new[h]) * c_log2)
            m_run[h] = m_new[h]
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = tc.ex2(acc_s[h, r] * c_log2 - m_run[h] * c_log2)
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(BH):
            l_acc[h] = l_acc[h] * alpha[h] + l_blk[h]
            alpha[h] = alpha[h] * (c_new[0] / c_old[0])
        c_old[0] = c_new[0]

    @T.macro
    def stage_p(acc_s, Ph, Pl):
        for h, r in T.Parallel(BH, BI):
            Ph[h, r] = T.cast(acc_s[h, r], fp8)
            if lo:
                Pl[h, r] = T.cast(acc_s[h, r] - T.cast(T.cast(acc_s[h, r], fp8), f32), fp8)
        T.fence_proxy_async()

    def pv(acc, Kh0, Kh1, s, Ph, Pl, wt):
        # the K half of set s (one call site for both sets: the code is large)
        return T.call_extern("handle", f"fdsa_ot_pv<{lo}>", T.address_of(acc[0]), T.address_of(Kh0[0, 0]),
                             T.address_of(Kh1[0, 0]), s, T.address_of(Ph[0, 0]), T.address_of(Pl[0, 0]), wt)

    def scale_o(acc, f_first, wt):
        # f_first: the first of the 64 column factors (a shared-memory element)
        return T.call_extern("handle", "fdsa_ot_scale", T.address_of(acc[0]), T.address_of(f_first), wt)

    @T.macro
    def finish(acc_o, l_acc, m_run, inv, c_cur, Ls_own, Ls0, Ls1, Inv_s, bar, Sink, Out, tok, h0, c0, wt):
        # total l = l_0 + l_1 (same order in both roles), out = O / (c l), written from the accumulators
        T.copy(l_acc, Ls_own)
        tc.role_barrier(BAR_BOTH, 256)
        for h in T.Parallel(BH):
            l_acc[h] = Ls0[h] + Ls1[h]
        normaliser(inv, l_acc, m_run, Sink, h0)
        for h in T.Parallel(BH):
            Inv_s[h] = inv[h] / c_cur[0]
        T.sync_threads(bar, 128)
        T.call_extern("handle", "fdsa_ot_store", T.address_of(acc_o[0]), T.address_of(Inv_s[0]),
                      T.access_ptr(Out[tok, h0, c0], "w"), D, wt)

    # ------------------------------------------------------------------ producer pieces
    @T.macro
    def load_rows(Indices, KVScale, tok, lim, j, pt, row_a, row_b, ks_a, ks_b):
        pair_rows(Indices, tok, lim, j, pt, row_a, row_b, None)
        if pt < BI:
            ks_a[0] = T.if_then_else(row_a[0] >= 0, KVScale[T.max(row_a[0], 0)], T.float32(0))
            ks_b[0] = T.if_then_else(row_b[0] >= 0, KVScale[T.max(row_b[0], 0)], T.float32(0))

    @T.macro
    def publish(Rows0, Rows1, Ks0, Ks1, KsMax, slot, pt, row_a, row_b, ks_a, ks_b):
        if pt < BI:
            Rows0[slot, pt] = row_a[0]
            Rows1[slot, pt] = row_b[0]
            Ks0[slot, pt] = ks_a[0]
            Ks1[slot, pt] = ks_b[0]
            kmax = T.warp_reduce_max(T.max(T.abs(ks_a[0]), T.abs(ks_b[0])))
            if pt % 32 == 0:
                KsMax[slot, pt // 32] = kmax
        T.sync_threads(BAR_PROD, 128)  # the rows are read by every producer thread's gather

    def gather(KV, Kh0, Kh1, Kt0, Kt1, Rows, s, c0, pt):
        # one K half of set s (dims [c0, c0 + 256)) + for the R half the rope tile: cp.async, no commit, no wait
        return T.call_extern("handle", "fdsa_gather_set", T.address_of(Kh0[0, 0]), T.address_of(Kh1[0, 0]),
                             T.address_of(Kt0[0, 0]), T.address_of(Kt1[0, 0]), s,
                             1 if (D_tail > 0 and c0 > 0) else 0, T.address_of(KV[0, 0]), dqk, c0,
                             T.address_of(Rows[s, 0]), pt)

    @T.prim_func
    def sparse_mla_fwd_pair_fp8(
        Q: T.Tensor([n_tok, heads, dqk], fp8),
        QScale: T.Tensor([n_tok, heads], f32),
        KV: T.Tensor([n_kv, dqk], fp8),
        KVScale: T.Tensor([n_kv], f32),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        prelude = tc.ROW_GATHER_PRELUDE + tc.FAST_EXP2_PRELUDE + OT_PRELUDE + tc.ROLE_BARRIER_PRELUDE
        with T.Kernel(n_tok * G, threads=THREADS, prelude=prelude) as bx:
            Q_l = T.alloc_shared([BH, DH], fp8)
            Q_r = T.alloc_shared([BH, DH], fp8)
            Q_t = T.alloc_shared([BH, max(D_tail, 16)], fp8)
            # K set 0 / 1: a.L, a.R, b.L, b.R halves and the rope tiles of a and b
            Kal0 = T.alloc_shared([BI, DH], fp8)
            Kar0 = T.alloc_shared([BI, DH], fp8)
            Kbl0 = T.alloc_shared([BI, DH], fp8)
            Kbr0 = T.alloc_shared([BI, DH], fp8)
            Kal1 = T.alloc_shared([BI, DH], fp8)
            Kar1 = T.alloc_shared([BI, DH], fp8)
            Kbl1 = T.alloc_shared([BI, DH], fp8)
            Kbr1 = T.alloc_shared([BI, DH], fp8)
            Kat0 = T.alloc_shared([BI, max(D_tail, 16)], fp8)
            Kbt0 = T.alloc_shared([BI, max(D_tail, 16)], fp8)
            Kat1 = T.alloc_shared([BI, max(D_tail, 16)], fp8)
            Kbt1 = T.alloc_shared([BI, max(D_tail, 16)], fp8)
            P0h = T.alloc_shared([BH, BI], fp8)
            P0l = T.alloc_shared([BH, BI], fp8)
            P1h = T.alloc_shared([BH, BI], fp8)
            P1l = T.alloc_shared([BH, BI], fp8)
            Rows0 = T.alloc_shared([2, BI], i32)
            Rows1 = T.alloc_shared([2, BI], i32)
            Ks0 = T.alloc_shared([2, BI], f32)
            Ks1 = T.alloc_shared([2, BI], f32)
            KsMax = T.alloc_shared([2, 2], f32)
            Ma = T.alloc_shared([BH], f32)
            Mb = T.alloc_shared([BH], f32)
            Ls0 = T.alloc_shared([BH], f32)
            Ls1 = T.alloc_shared([BH], f32)
            F0 = T.alloc_shared([BH], f32)  # WG0's column factors (the O rescale); its mbarrier chain orders reuse
            F1 = T.alloc_shared([2, BH], f32)  # WG1's, by pair parity (one WG1 sync per pair)
            Inv0 = T.alloc_shared([BH], f32)
            Inv1 = T.alloc_shared([BH], f32)
            T.annotate_layout({P: tilelang.layout.make_half_bank_swizzled_layout(P)
                               for P in (P0h, P0l, P1h, P1l)})

            rdy_al = T.alloc_barrier([256, 256])
            rdy_br = T.alloc_barrier([256, 256])
            rdy_ar = T.alloc_barrier([128, 128])
            rdy_bl = T.alloc_barrier([128, 128])
            fr_al = T.alloc_barrier([128, 128])
            fr_br = T.alloc_barrier([128, 128])
            fr_ar = T.alloc_barrier([256, 256])
            fr_bl = T.alloc_barrier([256, 256])
            p0_free = T.alloc_barrier(128)
            p1_free = T.alloc_barrier(128)
            bar_ma = T.alloc_barrier(128)
            bar_mb = T.alloc_barrier(128)
            bar_p0 = T.alloc_barrier(128)
            bar_p1 = T.alloc_barrier(128)

            acc_o0 = T.alloc_local([128], f32)
            acc_s0 = T.alloc_fragment([BH, BI], f32)
            qsc0 = T.alloc_fragment([BH], f32)
            m_run0 = T.alloc_fragment([BH], f32)
            m_new0 = T.alloc_fragment([BH], f32)
            alpha0 = T.alloc_fragment([BH], f32)
            l0 = T.alloc_fragment([BH], f32)
            lb0 = T.alloc_fragment([BH], f32)
            inv0 = T.alloc_fragment([BH], f32)
            acc_o1 = T.alloc_local([128], f32)
            acc_s1 = T.alloc_fragment([BH, BI], f32)
            qsc1 = T.alloc_fragment([BH], f32)
            m_run1 = T.alloc_fragment([BH], f32)
            m_new1 = T.alloc_fragment([BH], f32)
            alpha1 = T.alloc_fragment([BH], f32)
            l1 = T.alloc_fragment([BH], f32)
            lb1 = T.alloc_fragment([BH], f32)
            inv1 = T.alloc_fragment([BH], f32)
            c_old0 = T.alloc_local([1], f32)
            c_new0 = T.alloc_local([1], f32)
            c_old1 = T.alloc_local([1], f32)
            c_new1 = T.alloc_local([1], f32)
            lim = T.alloc_local([1], i32)
            npair = T.alloc_local([1], i32)
            row_a = T.alloc_local([1], i32)
            row_b = T.alloc_local([1], i32)
            ks_a = T.alloc_local([1], f32)
            ks_b = T.alloc_local([1], f32)

            tok = bx // G
            h0 = (bx % G) * BH
            tx = T.get_thread_binding()
            set_lim(lim, TopkLen, tok)
            npair[0] = (T.min((lim[0] + BI - 1) // BI, NI) + 1) // 2

            if tx < 128:
                # ---------------------------------------------- WG0: S of blocks 2j, O[:, 0:256]
                T.set_max_nreg(regs[0], 1)
                T.copy(Q[tok, h0 : h0 + BH, 0:DH], Q_l, disable_tma=True)
                if D_tail > 0:
                    T.copy(Q[tok, h0 : h0 + BH, D:dqk], Q_t, disable_tma=True)
                for h in T.Parallel(BH):
                    qsc0[h] = QScale[tok, h0 + h]
                T.fence_proxy_async()
                tc.role_barrier(BAR_BOTH, 256)
                T.call_extern("handle", "fdsa_ot_zero", T.address_of(acc_o0[0]))
                T.fill(l0, 0)
                T.fill(m_run0, tc.NEG_BIG)
                c_old0[0] = 1.0
                c_new0[0] = 1.0
                if npair[0] > 0:
                    qk0(Q_l, Kal0, Q_r, Kar0, Q_t, Kat0, acc_s0, rdy_al, rdy_ar, 0, 0)
                    T.barrier_arrive(fr_ar[0])
                for j in T.serial(npair[0]):
                    s = j & 1
                    ph = (j >> 1) & 1
                    scale_scores(acc_s0, qsc0, Rows0, Ks0, s, KsMax, c_new0)
                    T.copy(m_run0, m_new0)
                    T.reduce_max(acc_s0, m_new0, dim=1, clear=False)
                    # one P_a' at the common max m_b, read by both PVs
                    T.copy(m_new0, Ma)
                    T.barrier_arrive(bar_ma)
                    T.barrier_wait(bar_mb, j & 1)
                    for h in T.Parallel(BH):
                        m_new0[h] = Mb[h]
                    softmax(acc_s0, m_run0, m_new0, alpha0, l0, lb0, c_old0, c_new0)
                    for h in T.Parallel(BH):
                        F0[h] = alpha0[h]
                    for h, r in T.Parallel(BH, BI):
                        acc_s0[h, r] = acc_s0[h, r] * (Ks0[s, r] * c_new0[0])
                    T.barrier_wait(p0_free, (j & 1) ^ 1)  # WG1's remote PV of the last pair no longer reads P0
                    stage_p(acc_s0, P0h, P0l)
                    T.sync_threads(BAR_WG0, 128)  # P0 and F0 complete
                    T.barrier_arrive(bar_p0)
                    if j + 1 < npair[0]:  # S_a of pair j + 1 in flight during the PVs (acc_s0 is free now)
                        next_qk0(Q_l, Q_r, Q_t, Kal0, Kar0, Kat0, Kal1, Kar1, Kat1, acc_s0, rdy_al, rdy_ar, j)
                    T.evaluate(scale_o(acc_o0, F0[0], tx))
                    # local PV: O_l^T += V_a[:, :256]^T P_a'^T
                    T.evaluate(pv(acc_o0, Kal0, Kal1, s, P0h, P0l, tx))
                    T.barrier_arrive(fr_al[s])
                    # remote PV: O_l^T += V_b[:, :256]^T P_b'^T (b.L was waited by WG1's QK; bar_p1 orders it)
                    T.barrier_wait(bar_p1, j & 1)
                    T.barrier_wait(rdy_bl[s], ph)
                    T.evaluate(pv(acc_o0, Kbl0, Kbl1, s, P1h, P1l, tx))
                    T.barrier_arrive(fr_bl[s])
                    T.barrier_arrive(p1_free)
                    if j + 1 < npair[0]:
                        T.barrier_arrive(fr_ar[s ^ 1])  # S_a of pair j + 1 retired with the PV
                finish(acc_o0, l0, m_run0, inv0, c_old0, Ls0, Ls0, Ls1, Inv0, BAR_WG0, Sink, Out, tok, h0, 0, tx)
                store_lse(l0, m_run0, Lse, MaxLogits, tok, h0)
            elif tx < 256:
                # ---------------------------------------------- WG1: S of blocks 2j+1, O[:, 256:512]
                T.set_max_nreg(regs[1], 1)
                T.copy(Q[tok, h0 : h0 + BH, DH:D], Q_r, disable_tma=True)
                for h in T.Parallel(BH):
                    qsc1[h] = QScale[tok, h0 + h]
                T.fence_proxy_async()
                tc.role_barrier(BAR_BOTH, 256)
                T.call_extern("handle", "fdsa_ot_zero", T.address_of(acc_o1[0]))
                T.fill(l1, 0)
                T.fill(m_run1, tc.NEG_BIG)
                c_old1[0] = 1.0
                c_new1[0] = 1.0
                if npair[0] > 0:
                    qk1(Q_r, Kbr0, Q_l, Kbl0, Q_t, Kbt0, acc_s1, rdy_br, rdy_bl, 0, 0)
                    T.barrier_arrive(fr_bl[0])
                for j in T.serial(npair[0]):
                    s = j & 1
                    ph = (j >> 1) & 1
                    scale_scores(acc_s1, qsc1, Rows1, Ks1, s, KsMax, c_new1)
                    # m_b = max(m_a, rowmax S_b) >= m_a >= the common max of the last pair
                    T.barrier_wait(bar_ma, j & 1)
                    for h in T.Parallel(BH):
                        m_new1[h] = Ma[h]
                    T.reduce_max(acc_s1, m_new1, dim=1, clear=False)
                    T.copy(m_new1, Mb)
                    T.barrier_arrive(bar_mb)
                    softmax(acc_s1, m_run1, m_new1, alpha1, l1, lb1, c_old1, c_new1)
                    for h in T.Parallel(BH):
                        F1[s, h] = alpha1[h]
                    for h, r in T.Parallel(BH, BI):
                        acc_s1[h, r] = acc_s1[h, r] * (Ks1[s, r] * c_new1[0])
                    T.barrier_wait(p1_free, (j & 1) ^ 1)  # WG0's remote PV of the last pair no longer reads P1
                    stage_p(acc_s1, P1h, P1l)
                    T.sync_threads(BAR_WG1, 128)  # P1 and F1[s] complete
                    T.barrier_arrive(bar_p1)
                    if j + 1 < npair[0]:  # S_b of pair j + 1 in flight during the PVs (acc_s1 is free now)
                        next_qk1(Q_r, Q_l, Q_t, Kbr0, Kbl0, Kbt0, Kbr1, Kbl1, Kbt1, acc_s1, rdy_br, rdy_bl, j)
                    T.evaluate(scale_o(acc_o1, F1[s, 0], tx - 128))
                    # local PV: O_r^T += V_b[:, 256:]^T P_b'^T; remote PV: O_r^T += V_a[:, 256:]^T P_a'^T
                    T.evaluate(pv(acc_o1, Kbr0, Kbr1, s, P1h, P1l, tx - 128))
                    T.barrier_arrive(fr_br[s])
                    T.barrier_wait(bar_p0, j & 1)
                    T.barrier_wait(rdy_ar[s], ph)
                    T.evaluate(pv(acc_o1, Kar0, Kar1, s, P0h, P0l, tx - 128))
                    T.barrier_arrive(fr_ar[s])
                    T.barrier_arrive(p0_free)
                    if j + 1 < npair[0]:
                        T.barrier_arrive(fr_bl[s ^ 1])
                finish(acc_o1, l1, m_run1, inv1, c_old1, Ls1, Ls0, Ls1, Inv1, BAR_WG1, Sink, Out, tok, h0, DH,
                       tx - 128)
            else:
                # ---------------------------------------------- producer
                T.set_max_nreg(regs[2], 0)
                pt = tx - 256
                for j in T.serial(npair[0]):
                    # pair j into K set s once pair j - 2's reads of it retired (pairs 0, 1: fresh barriers pass)
                    s = j & 1
                    ph = ((j >> 1) & 1) ^ 1
                    load_rows(Indices, KVScale, tok, lim, j, pt, row_a, row_b, ks_a, ks_b)
                    T.barrier_wait(fr_al[s], ph)
                    T.barrier_wait(fr_br[s], ph)
                    publish(Rows0, Rows1, Ks0, Ks1, KsMax, s, pt, row_a, row_b, ks_a, ks_b)
                    T.barrier_arrive(rdy_al[s])
                    T.barrier_arrive(rdy_br[s])
                    T.evaluate(gather(KV, Kal0, Kal1, Kat0, Kat1, Rows0, s, 0, pt))
                    T.cp_async_barrier_noinc(rdy_al[s])
                    T.evaluate(gather(KV, Kbr0, Kbr1, Kbt0, Kbt1, Rows1, s, DH, pt))
                    T.cp_async_barrier_noinc(rdy_br[s])
                    T.barrier_wait(fr_ar[s], ph)
                    T.evaluate(gather(KV, Kar0, Kar1, Kat0, Kat1, Rows0, s, DH, pt))
                    T.cp_async_barrier_noinc(rdy_ar[s])
                    T.barrier_wait(fr_bl[s], ph)
                    T.evaluate(gather(KV, Kbl0, Kbl1, Kbt0, Kbt1, Rows1, s, 0, pt))
                    T.cp_async_barrier_noinc(rdy_bl[s])
                pp.drain()

    return sparse_mla_fwd_pair_fp8


def _pass_configs():
    return kp._pass_configs()  # explicit named barriers only (the automatic pass reuses ids across roles)


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, dqk: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool,
              ablate: str = "", regs: tuple = REGS):
    func = build_sparse_mla_fwd_pair_fp8(heads=heads, dqk=dqk, topk=n_blocks * BLOCK_I, sm_scale=sm_scale,
                                         has_sink=has_sink, has_topk_length=has_topk_length, regs=regs,
                                         ablate=ablate)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, q_scale, kv_scale, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments: ``kernel_fwd_fp8``'s rules and full 64-head tiles."""
    reason = f8.kernel_unsupported(q, kv, indices, q_scale=q_scale, kv_scale=kv_scale, d_v=d_v,
                                   topk_length=topk_length, attn_sink=attn_sink)
    if reason is None and q.shape[1] not in SUPPORTED_H:
        reason = f"H={q.shape[1]} not in {SUPPORTED_H} (the pair schedule needs full 64-head tiles)"
    return reason


def run_sparse_mla_fwd_fp8(q, kv, indices, *, q_scale, kv_scale, sm_scale: float, d_v: int, topk_length=None,
                           attn_sink=None, checked: bool = False, ablate: str = "", regs: tuple = REGS):
    """Returns (out [T,H,512] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32) of the forward on
    q * q_scale[..., None], kv * kv_scale[:, None].  ``ablate`` / ``regs``: see ``build_sparse_mla_fwd_pair_fp8``."""
    if not checked:
        reason = kernel_unsupported(q, kv, indices, q_scale=q_scale, kv_scale=kv_scale, d_v=d_v,
                                    topk_length=topk_length, attn_sink=attn_sink)
        if reason is not None:
            raise ValueError(f"sparse_mla fp8 pair fwd kernel: {reason}")
    (out, lse, max_logits), done = tc.fwd_outputs(q, kv, sm_scale=sm_scale, d_v=d_v)
    if done:
        return out, lse, max_logits
    _, heads, dqk = q.shape
    has_sink, has_tl, tl_arg, sink_arg, n_blocks = tc.optional_args(indices, topk_length, attn_sink, q.device)
    kernel = _compiled(heads, dqk, n_blocks, float(sm_scale), has_sink, has_tl, ablate, tuple(regs))
    direct_launcher(kernel)(aligned(q), aligned(q_scale), aligned(kv), aligned(kv_scale), aligned(indices),
                            tl_arg, sink_arg, out, lse, max_logits)
    return out, lse, max_logits


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("pair_fp8_h128_d576_topk2048_sink_tl",
         build_sparse_mla_fwd_pair_fp8(heads=128, dqk=576, topk=2048, sm_scale=576**-0.5, has_sink=True,
                                       has_topk_length=True)),
        ("pair_fp8_h64_d512_topk640", build_sparse_mla_fwd_pair_fp8(heads=64, dqk=512, topk=640,
                                                                    sm_scale=512**-0.5)),
        ("pair_fp8_h128_d576_topk256_no_lo",
         build_sparse_mla_fwd_pair_fp8(heads=128, dqk=576, topk=256, sm_scale=576**-0.5, ablate="no_lo")),
    ]


if __name__ == "__main__":
    import sys

    from . import _fp8_timing

    args = sys.argv[1:]
    if "--variants" in args:
        _fp8_timing.bench_variants(
            tuple(int(x) for x in args[args.index("--skv") + 1].split(",")) if "--skv" in args else (8192, 131072),
            args[args.index("--rows") + 1].split(",") if "--rows" in args else None)
