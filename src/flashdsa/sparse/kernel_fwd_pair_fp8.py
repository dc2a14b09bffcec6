"""Sparse MLA forward with FP8 (e4m3) q and KV on the "pair" schedule: both products on FP8 wgmma (Hopper sm_90a).

Notes
-----
Contract, math and host interface as ``kernel_fwd_fp8.py`` (q8 [T, H, Dqk] + q_scale [T, H], kv8 [Tkv, Dqk] +
kv_scale [Tkv], the bf16 forward on the dequantized tensors); schedule as ``kernel_fwd_pair.py`` (H 64 / 128,
Dqk 576 / 512, one CTA per (token, 64-head group), 384 threads: consumer warpgroups WG0 / WG1, a producer
warpgroup; top-k blocks in pairs a = 2j, b = 2j + 1; WG0 computes S_a and owns O[:, :256], WG1 S_b and O[:, 256:];
the row max and P are exchanged through shared memory once per pair).  What differs:

* K and V^T live in separate buffers.  The producer gathers each block's e4m3 rows as two K-major half tiles
  (K_l = dims [0, 256), K_r = [256, 512), + the rope tile) and, once a half landed, transposes it into a V^T
  half [256 dims, 64 keys] (``flashdsa_fp8_vt_transpose`` of kernel_fwd_fp8 on its first four warps' dims: the
  SM90 e4m3 wgmma takes only K-major operands, and the PV contracts over keys).  A K half is free once its
  QK retired (the consumer's ``kf`` barrier), a V^T half once its PV retired (``vf``), so the producer loads
  pair j + 1's K while pair j's PVs run: QK of pair j + 1 waits for data issued a whole pair earlier.
* Scores: S = (Q8 K8^T) q_scale[h] kv_scale[r] (m64n64k32 e4m3 wgmma, fp32), invalid slots -inf.
* P for the PV wgmma: P' = P kv_scale[r] c with one c per pair, c = 256 / max |kv_scale| over the pair's 128
  rows (the producer reduces it while publishing the rows), so |P'| <= 256 fits e4m3 (max 448) and WG0 / WG1
  accumulate local and remote PVs in the same unit.  P' is sent as hi = e4m3(P'), lo = e4m3(P' - hi)
  (~7 mantissa bits; kernel_fwd_fp8's CPU emulation: cos 1.5e-6 vs 2.0e-6 for a bf16 P): two m64n256k32 SS
  wgmmas per PV, the tensor time of one bf16 PV.  The accumulator changes unit with the max: O *= alpha
  c_pair / c_prev; l sums the unscaled P; out = O / (c l).  Elements below e4m3's smallest subnormal (2^-9 of
  the unit) are lost: an absolute error of at most 2^-10 / 256 of the largest possible term per element.
* WG0 stages P_a twice (its local PV reads P0 in units of m_a before m_b is known; WG1's remote PV reads P0r
  at m_b); WG1's P_b (already at m_b) serves both PVs (P1).  All P operands come from shared memory.
* Output is written straight from the accumulators (no bf16 staging tile fits).

Per pair j (slot = j & 1 of the double-buffered rows / scales / pair max):
  WG0: scale + mask S_a; m_a; P_a; publish m_a; P0 = P_a'; wait vt_al; O_l += P0 V_a[:, :256]; retire,
       vf_al;  wait m_b; rescale O_l, l_0, P_a'; wait vf_ar (WG1's previous remote PV) ; P0r; bar_p0;  wait P1,
       vt_bl; O_l += P1 V_b[:, :256]; retire, vf_bl;  QK of pair j + 1 (wait rdy_al, rdy_ar); retire, kf_al,
       kf_ar.
  WG1: scale + mask S_b; wait m_a; m_b; P_b; publish m_b; wait vf_bl (WG0's previous remote PV); P1 = P_b';
       bar_p1; wait vt_br; O_r += P1 V_b[:, 256:]; wait P0r, vt_ar; O_r += P0r V_a[:, 256:]; retire local
       (vf_br), remote (vf_ar);  QK of pair j + 1 (rdy_br, rdy_bl); retire, kf_br, kf_bl.
  Producer: transposes of pair j (al, br, ar, bl; each after its rdy and the previous pair's vf), named
       barrier (every thread done reading K), then pair j + 1: wait kf_X, publish rows / scales / max (before
       rdy_al's ordinary arrival), cp.async the half (zero-filling, src-size 0 for invalid slots), noinc
       arrival on rdy_X.  (Interleaving the transposes with the next loads in consumer-event order measured
       no faster: 0.947x vs 0.957x of the bf16 pair kernel, session 10.)
Barriers (mbarriers, parity j & 1; a wait for "the previous pair's" event uses (j & 1) ^ 1, which a fresh
barrier passes): rdy_al / rdy_br 256 (128 cp.async noinc + 128 ordinary), rdy_ar / rdy_bl 128; kf_*, vf_*,
vt_*, bar_ma, bar_mb, bar_p0, bar_p1 128.  Why the slots are free when rewritten: the producer writes pair
j + 2's slot after kf_al of pair j + 1, which WG0 arrives at the end of its pair-j iteration, after waiting
bar_mb of pair j, i.e. after every WG1 read of the slot (WG1 reads it before publishing m_b).
Shared memory (Dqk 576): Q 36 KiB + 2 x (K 36 KiB + V^T 32 KiB) + P 3 x 8 KiB + rows / scales / max / l ~2 KiB
= ~198 KiB.
Measured (H200, session 10; docs/PERFORMANCE.md "FP8 sparse prefill"): S 4096 / SKV 8192 / H 128 / topk 2048
5.33-5.37 ms = 0.957-0.967x of the bf16 pair kernel (the pipelined FP8 kernel: 0.55x); ablations: without the
V^T transposes 1.21x, without the lo half of P 1.05x.  GPU tests: tests/sparse_mla/test_kernel_pair_fp8_gpu.py;
compute-sanitizer memcheck clean (scripts/memcheck_small.py sparse_fp8).
"""

import functools

import tilelang
import tilelang.language as T

from .._tilelang import direct_launcher
from . import _tl_common as tc
from . import kernel_fwd_fp8 as f8
from . import _pair_parts as pp
from . import kernel_fwd_pair as kp
from ._pair_parts import BAR_BOTH, BAR_PROD, BAR_WG0, BAR_WG1
from ._tl_common import BLOCK_H, BLOCK_I, D_V, LOG2E

SUPPORTED_H = kp.SUPPORTED_H
THREADS = kp.THREADS
P_RANGE = f8.P_RANGE  # |P'| <= P_RANGE (e4m3 max 448)
_ASYNC = tc.ASYNC_GATHER
# setmaxnreg (WG0, WG1, producer) per Dqk: the producer's transpose needs more than kernel_fwd_pair's 72 (ptxas
# 13.0 spilled 112 B at (216, 216, 72), none at these)
REGS = {576: (200, 200, 104), 512: (208, 208, 88)}


def build_sparse_mla_fwd_pair_fp8(*, heads: int, dqk: int, topk: int, sm_scale: float, has_sink: bool = False,
                                  has_topk_length: bool = False, regs=None, ablate: str = "", row_gather: bool = False):
    """Return the TileLang prim_func; signature as ``kernel_fwd_fp8.build_sparse_mla_fwd_fp8`` (Q[T,H,Dqk] e4m3,
    QScale[T,H] f32, KV[Tkv,Dqk] e4m3, KVScale[Tkv] f32, Indices[T,topk] i32, TopkLen[n_tl] i32, Sink[n_sink]
    f32, Out[T,H,512] bf16, Lse[T,H] f32, MaxLogits[T,H] f32).  ``regs``: setmaxnreg of (WG0, WG1, producer),
    default ``REGS[dqk]``.  ``ablate`` (timing builds, wrong results; ``--variants``): "no_lo" (one e4m3 P per
    PV), "no_transpose" (the producer signals V^T without transposing)."""
    assert ablate in ("", "no_lo", "no_transpose"), ablate
    # row_gather (dispatched since session 19: S 4096 / SKV 8192 / H 128 / topk 2048 5.330 -> 5.026 ms, bitwise
    # equal): the producer's copies by rows (``_tl_common.ROW_GATHER_PRELUDE``'s fdsa_gather_half<1>), as the bf16
    # pair kernel's
    assert dqk in tc.SUPPORTED_DQK and heads in SUPPORTED_H, (dqk, heads)
    regs = regs or REGS[dqk]
    assert sum(regs) <= 3 * ((65536 // THREADS) // 8 * 8) and all(r % 8 == 0 for r in regs), regs
    assert sm_scale is not None and sm_scale > 0
    D, DH, D_tail = D_V, D_V // 2, dqk - D_V
    BH, BI = BLOCK_H, BLOCK_I
    G = heads // BH
    NI = (int(topk) + BI - 1) // BI
    c_log2 = float(sm_scale) * LOG2E
    fp8, bf16, f32, i32 = "float8_e4m3", "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    set_lim = tc.make_set_lim(has_topk_length, topk_dim)
    _ok = tc.make_row_ok(n_kv)
    pair_rows = pp.pair_rows_macro(topk_dim, lambda row, kv_src: _ok(row))
    adopt_max = pp.adopt_max_macro(BH=BH, c_log2=c_log2)
    _, normaliser, _, store_lse = tc.padded_head_macros(BH=BH, D=D, D_tail=D_tail, dqk=dqk, heads=heads,
                                                        c_log2=c_log2, has_sink=has_sink, dtype=fp8)

    # ------------------------------------------------------------------ consumer pieces
    @T.macro
    def wait_data(bar, phase):
        T.barrier_wait(bar, phase)
        T.fence_proxy_async()  # generic-proxy writes (cp.async, the transpose) -> wgmma reads

    def make_qk(rope_first):
        # S = Q8 K8^T over the half that lands first, then the other; the rope tile (Dqk 576) comes with the R
        # half (first for WG1: b.R, second for WG0: a.R); retired before returning
        @T.macro
        def qk(Q_a, K_a, Q_b, K_b, Q_t, K_t, acc_s, rdy_a, rdy_b, phase):
            wait_data(rdy_a, phase)
            T.wgmma_gemm(Q_a, K_a, acc_s, transpose_B=True, clear_accum=True)
            if D_tail > 0 and rope_first:
                T.wgmma_gemm(Q_t, K_t, acc_s, transpose_B=True)
            wait_data(rdy_b, phase)
            T.wgmma_gemm(Q_b, K_b, acc_s, transpose_B=True)
            if D_tail > 0 and not rope_first:
                T.wgmma_gemm(Q_t, K_t, acc_s, transpose_B=True)
            T.wait_wgmma(0)

        return qk

    qk0, qk1 = make_qk(False), make_qk(True)

    @T.macro
    def scale_scores(acc_s, qsc, Rows, Ks, slot, KsMax, c_new):
        # S *= q_scale kv_scale, invalid slots -inf; this pair's unit c (kept when every scale is 0)
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.if_then_else(Rows[slot, r] >= 0, acc_s[h, r] * qsc[h] * Ks[slot, r], -T.infinity(f32))
        kmax = T.max(KsMax[slot, 0], KsMax[slot, 1])
        c_new[0] = T.if_then_else(kmax > 0, T.float32(P_RANGE) / kmax, c_new[0])

    @T.macro
    def softmax(acc_s, acc_o, m_run, m_new, alpha, l_acc, l_blk, c_old, c_new):
        # m_new: the new running max (raw score units); P = 2^(S c - m c) in place; O moves to (m_new, c_new)
        for h in T.Parallel(BH):
            alpha[h] = T.exp2((m_run[h] - m_new[h]) * c_log2)
            m_run[h] = m_new[h]
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.exp2(acc_s[h, r] * c_log2 - m_run[h] * c_log2)
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(BH):
            l_acc[h] = l_acc[h] * alpha[h] + l_blk[h]
            alpha[h] = alpha[h] * (c_new[0] / c_old[0])
        c_old[0] = c_new[0]
        for h, d in T.Parallel(BH, DH):
            acc_o[h, d] = acc_o[h, d] * alpha[h]

    @T.macro
    def stage_p(acc_s, Ph, Pl):
        # P' -> e4m3 hi + lo in shared memory (the fence makes the stores visible to the async proxy)
        for h, r in T.Parallel(BH, BI):
            Ph[h, r] = T.cast(acc_s[h, r], fp8)
            if ablate != "no_lo":
                Pl[h, r] = T.cast(acc_s[h, r] - T.cast(T.cast(acc_s[h, r], fp8), f32), fp8)
        T.fence_proxy_async()

    @T.macro
    def pv(Ph, Pl, Vt, acc_o):
        T.wgmma_gemm(Ph, Vt, acc_o, transpose_B=True)
        if ablate != "no_lo":
            T.wgmma_gemm(Pl, Vt, acc_o, transpose_B=True)

    @T.macro
    def finish(acc_o, l_acc, m_run, inv, c_cur, Ls_own, Ls0, Ls1, Sink, Out, tok, h0, c0):
        # total l = l_0 + l_1 (same order in both roles), out = O / (c l), stored from the accumulators
        T.copy(l_acc, Ls_own)
        T.sync_threads(BAR_BOTH, 256)
        for h in T.Parallel(BH):
            l_acc[h] = Ls0[h] + Ls1[h]
        normaliser(inv, l_acc, m_run, Sink, h0)
        for h in T.Parallel(BH):
            inv[h] = inv[h] / c_cur[0]
        for h, d in T.Parallel(BH, DH):
            Out[tok, h0 + h, c0 + d] = T.cast(acc_o[h, d] * inv[h], bf16)

    # ------------------------------------------------------------------ producer pieces
    @T.macro
    def load_rows(Indices, KVScale, tok, lim, j, pt, row_a, row_b, ks_a, ks_b):
        # pair j's KV rows (thread pt < 64: slot pt of blocks 2j, 2j + 1; -1 when invalid) and their scales
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

    @T.macro
    def gather_parallel(KV, Kh, Kt, Rows, slot, c0):
        for r, c, d in T.Parallel(BI, 2, 128, annotations=_ASYNC):
            rk = Rows[slot, r]
            Kh[r, c * 128 + d] = T.if_then_else(rk >= 0, KV[rk, c0 + c * 128 + d], T.cast(0, fp8))
        if D_tail > 0 and c0 > 0:
            for r, d in T.Parallel(BI, D_tail, annotations=_ASYNC):
                rk = Rows[slot, r]
                Kt[r, d] = T.if_then_else(rk >= 0, KV[rk, D + d], T.cast(0, fp8))

    @T.macro
    def gather(KV, Kh, Kt, Rows, slot, c0):
        # one K half (dims [c0, c0 + 256)) + for the R half (c0 > 0) the rope tile: cp.async, no commit, no wait
        if row_gather:
            T.call_extern("handle", "fdsa_gather_half<1>", T.address_of(Kh[0, 0]), T.address_of(Kt[0, 0]),
                          1 if (D_tail > 0 and c0 > 0) else 0, T.address_of(KV[0, 0]), dqk, c0,
                          T.address_of(Rows[slot, 0]), T.get_thread_binding() - 256)
        else:
            gather_parallel(KV, Kh, Kt, Rows, slot, c0)

    @T.macro
    def transpose(Kh, Vt, rdy, vt, vf, phase, pt):
        T.barrier_wait(rdy, phase)  # the half landed (every producer thread's cp.async)
        T.barrier_wait(vf, phase ^ 1)  # the previous pair's PV on this V^T half retired
        if ablate != "no_transpose":
            T.call_extern("handle", "flashdsa_fp8_vt_transpose", T.access_ptr(Kh[0, 0], "r", BI, DH),
                          T.access_ptr(Vt[0, 0], "w", DH, BI), pt)
        T.fence_proxy_async()
        T.barrier_arrive(vt)

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
        with T.Kernel(n_tok * G, threads=THREADS,
                      prelude=f8._TRANSPOSE_SRC + (tc.ROW_GATHER_PRELUDE if row_gather else "")) as bx:
            Q_l = T.alloc_shared([BH, DH], fp8)
            Q_r = T.alloc_shared([BH, DH], fp8)
            Ka_l = T.alloc_shared([BI, DH], fp8)
            Ka_r = T.alloc_shared([BI, DH], fp8)
            Kb_l = T.alloc_shared([BI, DH], fp8)
            Kb_r = T.alloc_shared([BI, DH], fp8)
            Va_l = T.alloc_shared([DH, BI], fp8)
            Va_r = T.alloc_shared([DH, BI], fp8)
            Vb_l = T.alloc_shared([DH, BI], fp8)
            Vb_r = T.alloc_shared([DH, BI], fp8)
            if D_tail > 0:
                Q_t = T.alloc_shared([BH, D_tail], fp8)
                Ka_t = T.alloc_shared([BI, D_tail], fp8)
                Kb_t = T.alloc_shared([BI, D_tail], fp8)
            else:
                Q_t = Q_l  # placeholders, never read
                Ka_t = Ka_l
                Kb_t = Kb_l
            P0h = T.alloc_shared([BH, BI], fp8)
            P0l = T.alloc_shared([BH, BI], fp8)
            P0rh = T.alloc_shared([BH, BI], fp8)
            P0rl = T.alloc_shared([BH, BI], fp8)
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

            rdy_al = T.alloc_barrier(256)
            rdy_br = T.alloc_barrier(256)
            rdy_ar = T.alloc_barrier(128)
            rdy_bl = T.alloc_barrier(128)
            kf_al = T.alloc_barrier(128)
            kf_ar = T.alloc_barrier(128)
            kf_br = T.alloc_barrier(128)
            kf_bl = T.alloc_barrier(128)
            vt_al = T.alloc_barrier(128)
            vt_br = T.alloc_barrier(128)
            vt_ar = T.alloc_barrier(128)
            vt_bl = T.alloc_barrier(128)
            vf_al = T.alloc_barrier(128)
            vf_bl = T.alloc_barrier(128)
            vf_br = T.alloc_barrier(128)
            vf_ar = T.alloc_barrier(128)
            bar_ma = T.alloc_barrier(128)
            bar_mb = T.alloc_barrier(128)
            bar_p0 = T.alloc_barrier(128)
            bar_p1 = T.alloc_barrier(128)

            acc_o0 = T.alloc_fragment([BH, DH], f32)
            acc_s0 = T.alloc_fragment([BH, BI], f32)
            qsc0 = T.alloc_fragment([BH], f32)
            m_run0 = T.alloc_fragment([BH], f32)
            m_new0 = T.alloc_fragment([BH], f32)
            alpha0 = T.alloc_fragment([BH], f32)
            l0 = T.alloc_fragment([BH], f32)
            lb0 = T.alloc_fragment([BH], f32)
            inv0 = T.alloc_fragment([BH], f32)
            acc_o1 = T.alloc_fragment([BH, DH], f32)
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
                T.copy(Q[tok, h0 : h0 + BH, 0:DH], Q_l)
                if D_tail > 0:
                    T.copy(Q[tok, h0 : h0 + BH, D:dqk], Q_t)
                for h in T.Parallel(BH):
                    qsc0[h] = QScale[tok, h0 + h]
                T.fence_proxy_async()
                T.sync_threads(BAR_BOTH, 256)
                T.fill(acc_o0, 0)
                T.fill(l0, 0)
                T.fill(m_run0, tc.NEG_BIG)
                c_old0[0] = 1.0
                c_new0[0] = 1.0
                if npair[0] > 0:
                    qk0(Q_l, Ka_l, Q_r, Ka_r, Q_t, Ka_t, acc_s0, rdy_al, rdy_ar, 0)
                    T.barrier_arrive(kf_al)
                    T.barrier_arrive(kf_ar)
                for j in T.serial(npair[0]):
                    scale_scores(acc_s0, qsc0, Rows0, Ks0, j & 1, KsMax, c_new0)
                    T.copy(m_run0, m_new0)
                    T.reduce_max(acc_s0, m_new0, dim=1, clear=False)
                    softmax(acc_s0, acc_o0, m_run0, m_new0, alpha0, l0, lb0, c_old0, c_new0)
                    T.copy(m_run0, Ma)
                    T.barrier_arrive(bar_ma)
                    for h, r in T.Parallel(BH, BI):
                        acc_s0[h, r] = acc_s0[h, r] * (Ks0[j & 1, r] * c_new0[0])
                    # local PV: O_l += P_a' V_a[:, :256] (units m_a)
                    stage_p(acc_s0, P0h, P0l)
                    T.sync_threads(BAR_WG0, 128)
                    wait_data(vt_al, j & 1)
                    pv(P0h, P0l, Va_l, acc_o0)
                    T.wait_wgmma(0)
                    T.barrier_arrive(vf_al)
                    # common max m_b: move O_l, l_0 and P_a' to it; P_a' -> P0r for WG1
                    adopt_max(bar_mb, j & 1, Mb, m_new0, m_run0, alpha0, l0)
                    for h, r in T.Parallel(BH, BI):
                        acc_s0[h, r] = acc_s0[h, r] * alpha0[h]
                    T.barrier_wait(vf_ar, (j & 1) ^ 1)  # WG1's remote PV of the last pair no longer reads P0r
                    stage_p(acc_s0, P0rh, P0rl)
                    T.barrier_arrive(bar_p0)
                    for h, d in T.Parallel(BH, DH):
                        acc_o0[h, d] = acc_o0[h, d] * alpha0[h]
                    # remote PV: O_l += P_b' V_b[:, :256]
                    T.barrier_wait(bar_p1, j & 1)
                    wait_data(vt_bl, j & 1)
                    pv(P1h, P1l, Vb_l, acc_o0)
                    T.wait_wgmma(0)
                    T.barrier_arrive(vf_bl)
                    if j + 1 < npair[0]:
                        qk0(Q_l, Ka_l, Q_r, Ka_r, Q_t, Ka_t, acc_s0, rdy_al, rdy_ar, (j + 1) & 1)
                        T.barrier_arrive(kf_al)
                        T.barrier_arrive(kf_ar)
                finish(acc_o0, l0, m_run0, inv0, c_old0, Ls0, Ls0, Ls1, Sink, Out, tok, h0, 0)
                store_lse(l0, m_run0, Lse, MaxLogits, tok, h0)
            elif tx < 256:
                # ---------------------------------------------- WG1: S of blocks 2j+1, O[:, 256:512]
                T.set_max_nreg(regs[1], 1)
                T.copy(Q[tok, h0 : h0 + BH, DH:D], Q_r)
                for h in T.Parallel(BH):
                    qsc1[h] = QScale[tok, h0 + h]
                T.fence_proxy_async()
                T.sync_threads(BAR_BOTH, 256)
                T.fill(acc_o1, 0)
                T.fill(l1, 0)
                T.fill(m_run1, tc.NEG_BIG)
                c_old1[0] = 1.0
                c_new1[0] = 1.0
                if npair[0] > 0:
                    qk1(Q_r, Kb_r, Q_l, Kb_l, Q_t, Kb_t, acc_s1, rdy_br, rdy_bl, 0)
                    T.barrier_arrive(kf_br)
                    T.barrier_arrive(kf_bl)
                for j in T.serial(npair[0]):
                    scale_scores(acc_s1, qsc1, Rows1, Ks1, j & 1, KsMax, c_new1)
                    # m_b = max(m_a, rowmax S_b) >= m_a >= the common max of the last pair
                    T.barrier_wait(bar_ma, j & 1)
                    for h in T.Parallel(BH):
                        m_new1[h] = Ma[h]
                    T.reduce_max(acc_s1, m_new1, dim=1, clear=False)
                    softmax(acc_s1, acc_o1, m_run1, m_new1, alpha1, l1, lb1, c_old1, c_new1)
                    for h, r in T.Parallel(BH, BI):  # the last read of this pair's slot (see the notes)
                        acc_s1[h, r] = acc_s1[h, r] * (Ks1[j & 1, r] * c_new1[0])
                    T.copy(m_run1, Mb)
                    T.barrier_arrive(bar_mb)
                    T.barrier_wait(vf_bl, (j & 1) ^ 1)  # WG0's remote PV of the last pair no longer reads P1
                    stage_p(acc_s1, P1h, P1l)
                    T.sync_threads(BAR_WG1, 128)
                    T.barrier_arrive(bar_p1)
                    # local PV: O_r += P_b' V_b[:, 256:]; remote PV: O_r += P_a' V_a[:, 256:]
                    wait_data(vt_br, j & 1)
                    pv(P1h, P1l, Vb_r, acc_o1)
                    T.barrier_wait(bar_p0, j & 1)
                    wait_data(vt_ar, j & 1)
                    pv(P0rh, P0rl, Va_r, acc_o1)
                    T.wait_wgmma(2)
                    T.barrier_arrive(vf_br)
                    T.wait_wgmma(0)
                    T.barrier_arrive(vf_ar)
                    if j + 1 < npair[0]:
                        qk1(Q_r, Kb_r, Q_l, Kb_l, Q_t, Kb_t, acc_s1, rdy_br, rdy_bl, (j + 1) & 1)
                        T.barrier_arrive(kf_br)
                        T.barrier_arrive(kf_bl)
                finish(acc_o1, l1, m_run1, inv1, c_old1, Ls1, Ls0, Ls1, Sink, Out, tok, h0, DH)
            else:
                # ---------------------------------------------- producer
                T.set_max_nreg(regs[2], 0)
                pt = tx - 256
                if npair[0] > 0:
                    load_rows(Indices, KVScale, tok, lim, 0, pt, row_a, row_b, ks_a, ks_b)
                    publish(Rows0, Rows1, Ks0, Ks1, KsMax, 0, pt, row_a, row_b, ks_a, ks_b)
                    T.barrier_arrive(rdy_al)
                    T.barrier_arrive(rdy_br)
                    gather(KV, Ka_l, Ka_t, Rows0, 0, 0)
                    T.cp_async_barrier_noinc(rdy_al)
                    gather(KV, Kb_r, Kb_t, Rows1, 0, DH)
                    T.cp_async_barrier_noinc(rdy_br)
                    gather(KV, Ka_r, Ka_t, Rows0, 0, DH)
                    T.cp_async_barrier_noinc(rdy_ar)
                    gather(KV, Kb_l, Kb_t, Rows1, 0, 0)
                    T.cp_async_barrier_noinc(rdy_bl)
                for j in T.serial(npair[0]):
                    if j + 1 < npair[0]:
                        load_rows(Indices, KVScale, tok, lim, j + 1, pt, row_a, row_b, ks_a, ks_b)
                    transpose(Ka_l, Va_l, rdy_al, vt_al, vf_al, j & 1, pt)
                    transpose(Kb_r, Vb_r, rdy_br, vt_br, vf_br, j & 1, pt)
                    transpose(Ka_r, Va_r, rdy_ar, vt_ar, vf_ar, j & 1, pt)
                    transpose(Kb_l, Vb_l, rdy_bl, vt_bl, vf_bl, j & 1, pt)
                    T.sync_threads(BAR_PROD, 128)  # every thread is done reading pair j's K halves
                    if j + 1 < npair[0]:
                        s = (j + 1) & 1
                        T.barrier_wait(kf_al, j & 1)
                        publish(Rows0, Rows1, Ks0, Ks1, KsMax, s, pt, row_a, row_b, ks_a, ks_b)
                        T.barrier_arrive(rdy_al)
                        T.barrier_arrive(rdy_br)
                        gather(KV, Ka_l, Ka_t, Rows0, s, 0)
                        T.cp_async_barrier_noinc(rdy_al)
                        T.barrier_wait(kf_br, j & 1)
                        gather(KV, Kb_r, Kb_t, Rows1, s, DH)
                        T.cp_async_barrier_noinc(rdy_br)
                        T.barrier_wait(kf_ar, j & 1)
                        gather(KV, Ka_r, Ka_t, Rows0, s, DH)
                        T.cp_async_barrier_noinc(rdy_ar)
                        T.barrier_wait(kf_bl, j & 1)
                        gather(KV, Kb_l, Kb_t, Rows1, s, 0)
                        T.cp_async_barrier_noinc(rdy_bl)
                T.ptx_commit_group()
                T.ptx_wait_group(0)  # nothing in flight when the producer threads exit

    return sparse_mla_fwd_pair_fp8


def _pass_configs():
    return kp._pass_configs()  # explicit named barriers only (the automatic pass reuses ids across roles)


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, dqk: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool,
              ablate: str = "", row_gather: bool = False):
    func = build_sparse_mla_fwd_pair_fp8(heads=heads, dqk=dqk, topk=n_blocks * BLOCK_I, sm_scale=sm_scale,
                                         has_sink=has_sink, has_topk_length=has_topk_length, ablate=ablate,
                                         row_gather=row_gather)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, q_scale, kv_scale, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments: ``kernel_fwd_fp8``'s rules and full 64-head tiles."""
    reason = f8.kernel_unsupported(q, kv, indices, q_scale=q_scale, kv_scale=kv_scale, d_v=d_v,
                                   topk_length=topk_length, attn_sink=attn_sink)
    if reason is None and q.shape[1] not in SUPPORTED_H:
        reason = f"H={q.shape[1]} not in {SUPPORTED_H} (the pair schedule needs full 64-head tiles)"
    return reason


def run_sparse_mla_fwd_fp8(q, kv, indices, *, q_scale, kv_scale, sm_scale: float, d_v: int, topk_length=None,
                           attn_sink=None, checked: bool = False, ablate: str = "", row_gather: bool = True):
    """Returns (out [T,H,512] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32) of the forward on
    q * q_scale[..., None], kv * kv_scale[:, None].  ``ablate`` / ``row_gather`` (False: the ``T.Parallel``
    gather, same outputs): see ``build_sparse_mla_fwd_pair_fp8``."""
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
    kernel = _compiled(heads, dqk, n_blocks, float(sm_scale), has_sink, has_tl, ablate, row_gather)
    direct_launcher(kernel)(q.contiguous(), q_scale.contiguous(), kv.contiguous(), kv_scale.contiguous(),
                            indices.contiguous(), tl_arg, sink_arg, out, lse, max_logits)
    return out, lse, max_logits


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("pair_fp8_h128_d576_topk2048_sink_tl_row_gather",
         build_sparse_mla_fwd_pair_fp8(heads=128, dqk=576, topk=2048, sm_scale=576**-0.5, has_sink=True,
                                       has_topk_length=True, row_gather=True)),
        ("pair_fp8_h64_d512_topk640_row_gather", build_sparse_mla_fwd_pair_fp8(heads=64, dqk=512, topk=640,
                                                                               sm_scale=512**-0.5, row_gather=True)),
        ("pair_fp8_h128_d576_topk2048",  # the T.Parallel gather (timing build)
         build_sparse_mla_fwd_pair_fp8(heads=128, dqk=576, topk=2048, sm_scale=576**-0.5)),
    ]


def _bench_variants(tkvs=(8192, 131072), rows=None):
    """Kernel times at S 4096, H 128, Dqk 576, topk 2048 (``python -m flashdsa.sparse.kernel_fwd_pair_fp8
    --variants [--skv 8192,...]``): the bf16 pair kernel on the dequantized inputs (the reference point), this
    kernel, its ablations (timing only: their outputs are wrong), the pipelined FP8 kernel (``pair=False``); max
    |out - bf16 pair| of each; ``rows``: only these labels (and the reference point)."""
    import torch

    from ..bench.flops import sparse_fwd_flops
    from ..bench.harness import time_fn
    from ..quant import quantize_fp8
    from . import kernel_fwd_pair

    gen = torch.Generator(device="cuda").manual_seed(0)
    n_tok, heads, topk, dqk = 4096, 128, 2048, 576
    for tkv in tkvs:
        q8, q_scale = quantize_fp8((torch.randn(n_tok, heads, dqk, generator=gen, device="cuda") * 0.1), block=dqk)
        kv8, kv_scale = quantize_fp8((torch.randn(tkv, dqk, generator=gen, device="cuda") * 0.1), block=dqk)
        q_scale, kv_scale = q_scale[..., 0].contiguous(), kv_scale[..., 0].contiguous()
        qd = (q8.float() * q_scale.unsqueeze(-1)).bfloat16()
        kvd = (kv8.float() * kv_scale.unsqueeze(-1)).bfloat16()
        idx = torch.argsort(torch.rand(n_tok, tkv, generator=gen, device="cuda"), dim=1)[:, :topk].to(torch.int32)
        sm = dqk**-0.5
        flops = sparse_fwd_flops(heads, idx.numel(), dqk, D_V)  # every index is valid here
        kw = dict(q_scale=q_scale, kv_scale=kv_scale, sm_scale=sm, d_v=D_V)
        runs = {"bf16_pair": lambda: kernel_fwd_pair.run_sparse_mla_fwd(qd, kvd, idx, sm_scale=sm, d_v=D_V),
                "fp8_pair": lambda: run_sparse_mla_fwd_fp8(q8, kv8, idx, **kw),
                "fp8_pair_no_lo": lambda: run_sparse_mla_fwd_fp8(q8, kv8, idx, ablate="no_lo", **kw),
                "fp8_pair_no_transpose": lambda: run_sparse_mla_fwd_fp8(q8, kv8, idx, ablate="no_transpose", **kw),
                "fp8_pair_parallel_gather": lambda: run_sparse_mla_fwd_fp8(q8, kv8, idx, row_gather=False, **kw),
                "fp8_pipelined": lambda: f8.run_sparse_mla_fwd_fp8(q8, kv8, idx, pair=False, **kw)}
        ref = runs["bf16_pair"]()[0].float()
        base = None
        for label, fn in runs.items():
            if rows and label not in rows and label != "bf16_pair":
                continue
            err = (fn()[0].float() - ref).abs().max().item()
            ms = time_fn(lambda _, f=fn: f(), [None], q8.device, reps=10).ms_median
            base = base or ms
            print(f"variant SKV {tkv} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, {base / ms:.3f}x bf16 pair,"
                  f" max |out - bf16 pair| {err:.2e}", flush=True)


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if "--variants" in args:
        _bench_variants(tuple(int(x) for x in args[args.index("--skv") + 1].split(",")) if "--skv" in args
                        else (8192, 131072), args[args.index("--rows") + 1].split(",") if "--rows" in args else None)
