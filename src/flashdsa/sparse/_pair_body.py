"""``pair_body``: the pair schedule's kernel body shared by the KV formats (buffers, barriers, both consumer roles,
the producer / converter slots).  The schedule, the protocol and why each buffer is free when rewritten: the module
notes of ``kernel_fwd_pair``; the producers: ``kernel_fwd_pair`` (bf16), ``kernel_fwd_pair_cache`` (656-byte
cache)."""

import tilelang.language as T

from . import _tl_common as tc
from ._pair_parts import (BAR_BOTH, BAR_WG0, BAR_WG1, STAMP_SRC, adopt_max_macro, drain, item_parts, pair_phase,
                          q_load_macros, stamper)
from ._tl_common import BLOCK_H, BLOCK_I, D_V, LOG2E

_SUPPORTED_DQK = tc.SUPPORTED_DQK
SUPPORTED_H = (64, 128)
# how the consumers load Q (``pair_body``'s q_gate): "" at entry by 16-byte loads; "al" / "ar" the same after the
# first pair's a.L / a.R landed; "tma" by TMA at entry; "tma_al" by TMA after a.L landed; "next" (persistent grids)
# by TMA from the producer, each item's Q as soon as the previous item's last QK retired
Q_LOADS = ("", "al", "ar", "tma", "tma_al", "next")
THREADS = 384
# setmaxnreg (WG0, WG1, producer): the sum must stay within the launch pool of __launch_bounds__(384, 1),
# 3 x 168 = 504 (setmaxnreg.inc waits forever for registers the pool cannot give)
PAIR_REGS = (216, 216, 72)
assert sum(PAIR_REGS) <= 3 * ((65536 // THREADS) // 8 * 8)


def pair_body(*, heads, dqk, topk, sm_scale, has_sink, has_topk_length, n_tok, topk_dim, producer,
              prelude=None, regs=PAIR_REGS, first_use=None, overlap_qk=True, persistent=0, converter=None,
              out_f32=False, q_rows=None, cluster=False, stamps=False, q_gate=""):
    """The kernel body shared by the KV formats: macro ``body(Q, kv_src, Indices, TopkLen, Sink, Out, Lse,
    MaxLogits, Order, Stamps=None)`` (one ``T.Kernel``; ``Order``: None, or [T] int32: CTA i * G + g takes token
    Order[i], e.g. the longest rows first: buffers, barriers, the two consumer roles) that runs ``producer(kv_src,
    Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t, row_a, row_b, rdy_al,
    rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar, pb[, st])`` in the third warpgroup (``st``: stamps builds
    only).  ``kv_src``: whatever the
    producer reads (a tuple of buffers / scalars).  Ready barriers: rdy_al / rdy_br 256 arrivals per phase (128
    noinc cp.async + 128 ordinary: the producer publishes Rows0 / Rows1 before them), rdy_ar / rdy_bl 128.  ``regs``:
    setmaxnreg of (WG0, WG1, producer), at most 504 in all.  ``first_use(Half, tile0, wg_bar, t)``: run by the
    consumer that reads a half tile first (WG0: a.L, a.R; WG1: b.R, b.L) right after its ready barrier, before any
    wgmma reads it (``tile0``: the half's first 128-dim tile, 0 or 2; ``wg_bar``: that warpgroup's named barrier;
    ``t``: thread index in the warpgroup); it must leave the tile complete for the async proxy.
    ``overlap_qk`` (default since session 15): WG0 issues the next pair's QK on a.L while its remote PV is still in
    flight and retires that PV (frees b.L) only then, as FlashMLA's SM90 sparse prefill orders it; same products in
    the same order (bitwise equal to ``overlap_qk=False``, which retires the PV first; S 4096 / SKV 8192: H 64 2.697
    -> 2.664 ms, H 128 5.147 -> 5.129, the 656-byte cache kernel 6.685 -> 6.617).  (Freeing b.R before WG1 waits for
    P_a did not help: H 64 2.638 -> 2.623 ms, V4 0.880 -> 0.879, H 128 5.185 -> 5.223; removed, session 16.)
    ``persistent`` = P > 0 (``dispatched`` up to ``persistent_max_blocks()``; session 16, P 132: V4 prefill 0.880 ->
    0.854 ms, H 64 / Dqk 576 at topk 640 0.942 -> 0.916, topk 1024 1.390 -> 1.386, topk 2048 2.615 -> 2.712, H 128
    5.185 -> 5.357): P CTAs, CTA bx takes the items (token, head group) bx, bx + P, ... in order, each role looping
    over them after its ``setmaxnreg``, so the producer gathers the next item's first tiles during the consumers'
    epilogue and Q load; same products in the same order.  Every mbarrier keeps counting phases across items: with
    pb the role's count of the pairs of its earlier items, pair j waits parity (pb + j) & 1 (the producer's free
    waits ((pb + j) & 1) ^ 1).  Between items, the next load_q rewrites the Q halves only after both consumers
    retired every wgmma (finish's BAR_BOTH) and its own warpgroup read the staged O out (``end_item``'s barrier);
    with q_gate "next" the producer's TMA rewrites them once both consumers retired the item's last QK (q_dead) and
    no O is staged; see the comment above ``item_parts``'s call for each buffer.

    ``converter`` (the 656-byte cache's converter staging): a fourth warpgroup (threads 384-511, 512 in all) runs
    ``converter(npair, tx, KVa_l, KVa_r, KVb_l, KVb_r, ld_al, ld_br, ld_ar, ld_bl, rdy_al, rdy_br, rdy_ar, rdy_bl,
    pb[, st])`` per item: the producer's arrivals (rows + cp.async) go to the "landed" barriers ld_* (counts as the
    ready barriers above), the converter turns each landed half into what the consumers read and arrives on its ready
    barrier (count 128); ``regs`` then has four entries (at most 512 in all), and each PV is two m64n128 wgmmas
    into two O fragments (the bf16 kernel built that way: 3.996 -> 4.112 ms at S 4096 / SKV 8192 / H 128).

    ``out_f32``: Out is float32 (split-KV partials, ``decode/kernel_split.py``), written straight from the O
    fragments (no bf16 staging); ``q_rows``: Q's row count when it differs from n_tok (split-KV: token t reads q row
    t / (n_tok / q_rows), a token's chunks sharing its q row).

    ``cluster`` (H 128, one item per CTA): the two head-group CTAs of a token run as a 2-CTA cluster, so a
    producer may load a tile into both CTAs' shared memory at once (TMA multicast: ``kernel_pair_paged``).  A tile
    is then free only when the consumers of both CTAs freed it: each free barrier counts the 128 local consumer
    threads and lane 0 of each of the peer's 4 consumer warps (``T.mbarrier_arrive(bar, peer)``); TileLang syncs
    the cluster after the barriers' initialisation (cluster barriers), and a cluster sync at the end keeps a CTA
    from exiting while its peer may still arrive on it.

    ``stamps`` (timing builds): body's Stamps is an int32 [n_ctas, ``STAMP_WORDS``] buffer and one thread of each
    role writes clock64 at the points of ``_pair_parts.STAMPS`` (one item per CTA; the producer and the converter
    get ``st=`` too; ``kernel_fwd_pair_cache``'s do).  ``q_gate``, how Q is loaded (``Q_LOADS``): ""
    16-byte loads at entry; "al" / "ar" (builds with a converter, one item per CTA): the consumers load Q only once
    the first pair's a.L / a.R raw bytes landed (its "landed" barrier, parity 0: its phase 1 needs fr_al / fr_ar,
    i.e. a consumer past load_q's BAR_BOTH, so it cannot be passed before the wait), so the first gathers are not
    queued behind Q's loads (session 49); "tma" (one item per CTA, no cluster): Q by TMA at entry (``load_q_tma``);
    "tma_al": by TMA after a.L landed (converter builds); session 50, docs/PERFORMANCE.md.  "next" (``persistent``
    grids): the producer loads each item's Q by TMA (``load_q_next``) once both consumers retired the previous
    item's last QK (the q_dead barrier, 256 arrivals at the top of an item's last pair, or at its start when it has
    no pair), so the load overlaps that item's last pair and epilogue instead of following them; O then goes from
    the fragments straight to Out (the Q halves are no longer dead at ``finish``: no staging); session 51, measured
    8-9% slower on the V4 row in session 53 (off by default)."""
    n_wg = 3 if converter is None else 4
    threads = 128 * n_wg
    assert not cluster or (heads == 2 * BLOCK_H and not persistent and converter is None), "cluster: H 128 pairs"
    assert not (stamps and (persistent or cluster)), "stamps: one item per CTA"
    assert q_gate in Q_LOADS, q_gate
    q_tma = q_gate.startswith("tma")  # (bools: a str condition in a macro logs a builder warning)
    gate = "" if q_gate == "next" else q_gate.removeprefix("tma").removeprefix("_")
    assert not (q_tma and (persistent or cluster)), "q_gate tma: one item per CTA (its barrier's parity 0)"
    q_next = q_gate == "next"
    assert not q_next or (persistent and not stamps), "q_gate next: a persistent grid"
    assert not q_next or converter is None, "q_gate next: the bf16 kernel's build (not measured with a converter)"
    assert not (gate and (persistent or converter is None)), q_gate
    gated, gate_ar = gate != "", gate == "ar"
    prelude = (prelude or "") + tc.ROLE_BARRIER_PRELUDE  # BAR_BOTH: both consumers, each from its own code
    if stamps:
        prelude += STAMP_SRC
    assert len(regs) == n_wg and sum(regs) <= n_wg * ((65536 // threads) // 8 * 8), regs
    assert all(r % 8 == 0 for r in regs), regs
    assert dqk in _SUPPORTED_DQK, dqk
    assert heads in SUPPORTED_H, heads
    assert sm_scale is not None and sm_scale > 0
    D = D_V
    DH = D // 2
    D_tail = dqk - D
    BH, BI = BLOCK_H, BLOCK_I
    G = heads // BH
    NI = (int(topk) + BI - 1) // BI
    c_log2 = float(sm_scale) * LOG2E
    neg_big = tc.NEG_BIG
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    set_lim = tc.make_set_lim(has_topk_length, topk_dim)
    # the pipelined kernel's epilogue math (its padded-head guards are always true here: H is 64 or 128)
    _, normaliser, _, store_lse = tc.padded_head_macros(BH=BH, D=D, D_tail=D_tail, dqk=dqk, heads=heads,
                                                        c_log2=c_log2, has_sink=has_sink, dtype=bf16)

    load_q, load_q_tma, load_q_next, wait_q_next, q_dead_at = q_load_macros(dqk=dqk, n_tok=n_tok, q_rows=q_rows)

    # ------------------------------------------------------------------ consumer pieces
    @T.macro
    def wait_tile(bar, phase, half, tile0, wg_bar, t):
        T.barrier_wait(bar, phase)
        T.fence_proxy_async()  # cp.async (generic proxy) writes -> wgmma (async proxy) reads
        if first_use is not None:
            first_use(half, tile0, wg_bar, t)

    @T.macro
    def free(bar, tx):
        # a consumer thread is done with a tile (with ``cluster``: also lane 0 of each warp on the peer's barrier)
        T.barrier_arrive(bar)
        if cluster:
            if tx % 32 == 0:
                T.mbarrier_arrive(bar, 1 - T.block_rank_in_cluster())

    @T.macro
    def mask(Rows, acc_s):
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.if_then_else(Rows[r] >= 0, T.float32(0), -T.infinity(f32))

    @T.macro
    def qk_tail(Qt, Kt, acc_s):
        if D_tail > 0:
            T.wgmma_gemm(Qt, Kt, acc_s, transpose_B=True)

    @T.macro
    def qk_half(Qh, KVh, acc_s, rdy, phase, tile0, wg_bar, t, Rows):
        # S += Qh KVh^T once the half is ready (Rows: first half of the block: S = the mask first); issued, not
        # waited
        wait_tile(rdy, phase, KVh, tile0, wg_bar, t)
        if Rows is not None:
            mask(Rows, acc_s)
        T.wgmma_gemm(Qh, KVh, acc_s, transpose_B=True)

    @T.macro
    def qk_a_left(Q_l, KVa_l, Rows0, acc_s0, rdy_al, phase, tx):
        # WG0: S_a = mask, then += Q_l K_a[:, :256]^T (issued, not waited)
        qk_half(Q_l, KVa_l, acc_s0, rdy_al, phase, 0, BAR_WG0, tx, Rows0)

    @T.macro
    def qk_a_right(Q_r, Q_t, KVa_r, Ka_t, acc_s0, rdy_ar, phase, tx):
        # WG0: S_a += Q_r K_a[:, 256:]^T + the rope tail, then wait for every wgmma of the warpgroup
        qk_half(Q_r, KVa_r, acc_s0, rdy_ar, phase, 2, BAR_WG0, tx, None)
        qk_tail(Q_t, Ka_t, acc_s0)
        T.wait_wgmma(0)

    @T.macro
    def qk_b(Q_l, Q_r, Q_t, KVb_l, KVb_r, Kb_t, Rows1, acc_s1, rdy_br, rdy_bl, phase, tx):
        # WG1: S_b = mask, += Q_r K_b[:, 256:]^T + the rope tail, += Q_l K_b[:, :256]^T, all retired
        qk_half(Q_r, KVb_r, acc_s1, rdy_br, phase, 2, BAR_WG1, tx - 128, Rows1)
        qk_tail(Q_t, Kb_t, acc_s1)
        qk_half(Q_l, KVb_l, acc_s1, rdy_bl, phase, 0, BAR_WG1, tx - 128, None)
        T.wait_wgmma(0)

    adopt_max = adopt_max_macro(BH=BH, c_log2=c_log2)

    # O_l / O_r as n_o fragments of DO columns: one, or with a converter two (each PV then two m64n128 wgmmas:
    # at 512 threads ptxas checks every instruction against the launch's 128 registers per thread, and an
    # m64n256 wgmma needs ~158)
    n_o = 1 if converter is None else 2
    DO = DH // n_o

    @T.macro
    def o_mul(acc_o, f):
        # O *= f per head (acc_o: the tuple of fragments)
        # (no Python name is bound to a fragment here: TileLang names a buffer after its latest binding)
        for h, d in T.Parallel(BH, DO):
            acc_o[0][h, d] = acc_o[0][h, d] * f[h]
        if n_o == 2:
            for h, d in T.Parallel(BH, DO):
                acc_o[1][h, d] = acc_o[1][h, d] * f[h]

    @T.macro
    def pv(P, KV, acc_o):
        # O += P V
        if n_o == 1:
            T.wgmma_gemm(P, KV, acc_o[0])
        else:
            T.wgmma_gemm(P, KV[:, 0:DO], acc_o[0])
            T.wgmma_gemm(P, KV[:, DO:DH], acc_o[1])

    @T.macro
    def reset_acc(acc_o, l_acc, m_run):
        # an item's start: O = 0, l = 0, running max at the finite -1e30
        T.fill(acc_o[0], 0)
        if n_o == 2:
            T.fill(acc_o[1], 0)
        T.fill(l_acc, 0)
        T.fill(m_run, neg_big)

    @T.macro
    def exp_and_rescale(acc_s, acc_o, m_run, m_new, alpha, l_acc, l_blk):
        # m_new = the new running max (raw score units): O and l move from m_run to m_new, P = 2^(S c - m_new c)
        # in place (invalid -inf -> 0), l += rowsum(P)
        for h in T.Parallel(BH):
            alpha[h] = T.exp2((m_run[h] - m_new[h]) * c_log2)
            m_run[h] = m_new[h]
        for h, r in T.Parallel(BH, BI):
            acc_s[h, r] = T.exp2(acc_s[h, r] * c_log2 - m_run[h] * c_log2)
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(BH):
            l_acc[h] = l_acc[h] * alpha[h] + l_blk[h]
        o_mul(acc_o, alpha)

    @T.macro
    def softmax_local_pv(acc_s, acc_o, m_run, m_new, alpha, l_acc, l_blk, M_s, bar_m, p, KV):
        # m_new = max(m_new, rowmax S); softmax step; the new max to M_s (arrive bar_m); the local PV issued
        T.reduce_max(acc_s, m_new, dim=1, clear=False)
        exp_and_rescale(acc_s, acc_o, m_run, m_new, alpha, l_acc, l_blk)
        T.copy(m_run, M_s)
        T.barrier_arrive(bar_m)
        T.copy(acc_s, p)
        pv(p, KV, acc_o)

    @T.macro
    def finish(acc_o, l_acc, m_run, inv, Ls_own, Ls0, Ls1, Sink, Stage, Out, tok, h0, c0, own_bar):
        # total l = l_0 + l_1 (same operand order in both roles: bit-identical factors), O staged through
        # the dead Q half (not with out_f32 or q_gate "next"), written to Out[:, c0:c0+256]
        T.copy(l_acc, Ls_own)
        tc.role_barrier(BAR_BOTH, 256)  # both l halves written; both consumers past every wgmma (this item's Q
        #                                  is dead; with q_gate "next" the next item's may be landing)
        for h in T.Parallel(BH):
            l_acc[h] = Ls0[h] + Ls1[h]
        normaliser(inv, l_acc, m_run, Sink, h0)
        o_mul(acc_o, inv)
        if out_f32 or q_next:  # fp32 partials, or Q may be landing in Stage: from the fragments to global memory
            if n_o == 1:
                T.copy(acc_o[0], Out[tok, h0 : h0 + BH, c0 : c0 + DH])
            else:
                T.copy(acc_o[0], Out[tok, h0 : h0 + BH, c0 : c0 + DO])
                T.copy(acc_o[1], Out[tok, h0 : h0 + BH, c0 + DO : c0 + DH])
            if not q_next:  # (no shared buffer read here: kept for out_f32, whose build it is part of)
                T.sync_threads(own_bar, 128)
        else:
            if n_o == 1:
                T.copy(acc_o[0], Stage)
            else:
                T.copy(acc_o[0], Stage[:, 0:DO])
                T.copy(acc_o[1], Stage[:, DO:DH])
            T.sync_threads(own_bar, 128)
            T.copy(Stage, Out[tok, h0 : h0 + BH, c0 : c0 + DH], disable_tma=True)

    # ------------------------------------------------------------------ items (``persistent``: several per CTA)
    # Why each buffer is free when the next item rewrites it (phases continue: ``pair_phase``; every role counts
    # the same pairs, as all compute npair from the item's topk_eff):
    #   Q_l, Q_t (WG0's load_q) and Q_r (WG1's): their wgmma readers (WG0's QK reads Q_l, Q_r, Q_t; WG1's QK Q_r,
    #   Q_t, Q_l) retired before either warpgroup arrived at finish's BAR_BOTH; the Stage copy-out (Q_l in WG0, Q_r
    #   in WG1) is read by every thread of that warpgroup only, ordered before the next load_q by ``end_item``'s
    #   warpgroup barrier.  The new Q is read only after load_q's BAR_BOTH, i.e. once both halves are rewritten.
    #   With q_gate "next": Q_l, Q_r, Q_t are rewritten only by the producer's TMA for the next item, issued once
    #   q_dead completed, i.e. once both consumers retired this item's last QK (each QK ends with wait_wgmma(0));
    #   no O is staged (finish writes it from the fragments), so ``end_item`` needs no warpgroup barrier; the new Q
    #   is read after its q_bar phase (``wait_q_next``), whose BAR_BOTH also orders the Ls0 / Ls1 reads below.
    #   Ls0 / Ls1 (finish): the peer reads them before it arrives at the next item's load_q BAR_BOTH, which the
    #   writer passes before its next finish.
    #   Ma, Mb, P0, P1, Rows0 / Rows1, the KV halves: as within an item (the pair protocol of the module notes does
    #   not look at item boundaries: WG0 rewrites Ma after the last pair's bar_p1, WG1 Mb after the next bar_ma, P0
    #   after the next rdy_ar (the producer waited fr_ar, after WG1's remote PV), P1 after the next rdy_bl (after
    #   fr_bl, WG0's remote PV)); besides, both consumers retired every wgmma before finish's BAR_BOTH.
    #   Each item retires the wgmma it issued (no wgmma in flight at the item loop's back edge: no serialisation).
    n_ctas, items, item_tok, n_pairs, start_item, end_item = item_parts(G=G, NI=NI, n_tok=n_tok,
                                                                        persistent=persistent, set_lim=set_lim)

    @T.macro
    def produce_items(kv_src, Indices, TopkLen, Order, lim, npair, tx, bx, tok, h0, Rows0, Rows1, KVa_l, KVa_r,
                      KVb_l, KVb_r, Ka_t, Kb_t, row_a, row_b, ld_al, ld_br, ld_ar, ld_bl, fr_al, fr_bl, fr_br, fr_ar,
                      pb, extra, q_next_args):
        # the producer warpgroup (threads 256-383); its arrivals go to ld_* (the ready barriers without a converter)
        T.set_max_nreg(regs[2], 0)
        for it in items(bx):
            if persistent:
                tok, h0 = start_item(Order, TopkLen, lim, npair, bx + it * persistent)
            # q_gate "next": the producer runs the Q load once the item's first index loads are issued
            hook = {"q_hook": (load_q_next, (*q_next_args[:4], tok, h0, it, *q_next_args[4:]))} if q_next else {}
            producer(kv_src, Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
                     row_a, row_b, ld_al, ld_br, ld_ar, ld_bl, fr_al, fr_bl, fr_br, fr_ar, pb, *extra, **hook)
            if persistent:
                pb[0] = pb[0] + npair[0]
        if persistent:
            drain()

    def kernel_launch():
        if cluster:
            return T.ClusterKernel(n_ctas, cluster_dims=2, threads=threads, prelude=prelude)
        return T.Kernel(n_ctas, threads=threads, prelude=prelude)

    @T.macro
    def body(Q, kv_src, Indices, TopkLen, Sink, Out, Lse, MaxLogits, Order, Stamps=None):
        with kernel_launch() as bx:
            st = stamper(Stamps, bx)
            extra = () if Stamps is None else (st,)  # the producer's / converter's st= (stamps builds)
            Q_l = T.alloc_shared([BH, DH], bf16)
            Q_r = T.alloc_shared([BH, DH], bf16)
            KVa_l = T.alloc_shared([BI, DH], bf16)
            KVa_r = T.alloc_shared([BI, DH], bf16)
            KVb_l = T.alloc_shared([BI, DH], bf16)
            KVb_r = T.alloc_shared([BI, DH], bf16)
            P1 = T.alloc_shared([BH, BI], bf16)
            if D_tail > 0:
                Q_t = T.alloc_shared([BH, D_tail], bf16)
                Ka_t = T.alloc_shared([BI, D_tail], bf16)
                Kb_t = T.alloc_shared([BI, D_tail], bf16)
                # P of block a lives in a.R's rope tile: dead after WG0's QK, freed with fr_ar
                P0 = Ka_t
            else:
                Q_t = Q_r  # placeholders, never read
                Ka_t = KVa_r
                Kb_t = KVb_r
                P0 = T.alloc_shared([BH, BI], bf16)
            Rows0 = T.alloc_shared([BI], i32)
            Rows1 = T.alloc_shared([BI], i32)
            Ma = T.alloc_shared([BH], f32)
            Mb = T.alloc_shared([BH], f32)
            Ls0 = T.alloc_shared([BH], f32)
            Ls1 = T.alloc_shared([BH], f32)

            if converter is None:
                rdy_al = T.alloc_barrier(256)
                rdy_br = T.alloc_barrier(256)
                rdy_ar = T.alloc_barrier(128)
                rdy_bl = T.alloc_barrier(128)
            else:
                ld_al = T.alloc_barrier(256)
                ld_br = T.alloc_barrier(256)
                ld_ar = T.alloc_barrier(128)
                ld_bl = T.alloc_barrier(128)
                rdy_al = T.alloc_barrier(128)
                rdy_br = T.alloc_barrier(128)
                rdy_ar = T.alloc_barrier(128)
                rdy_bl = T.alloc_barrier(128)
            q_gate_bar = ((ld_ar,) if gate_ar else (ld_al,)) if gated else ()  # load_q's gate
            if q_tma or q_next:
                q_bar = T.alloc_barrier(128)
            if q_next:
                q_dead = T.alloc_barrier(256)
                q_next_args = (Q, Q_l, Q_r, Q_t, q_bar, q_dead)
            else:
                q_next_args = ()
            if cluster:  # the local consumers' 128 threads + lane 0 of the peer's 4 consumer warps
                fr_al = T.alloc_cluster_barrier(132)
                fr_bl = T.alloc_cluster_barrier(132)
                fr_br = T.alloc_cluster_barrier(132)
                fr_ar = T.alloc_cluster_barrier(132)
            else:
                fr_al = T.alloc_barrier(128)
                fr_bl = T.alloc_barrier(128)
                fr_br = T.alloc_barrier(128)
                fr_ar = T.alloc_barrier(128)
            bar_ma = T.alloc_barrier(128)
            bar_mb = T.alloc_barrier(128)
            bar_p0 = T.alloc_barrier(128)
            bar_p1 = T.alloc_barrier(128)

            # per-role fragments (one fragment shared by two role branches loses code in TileLang 0.1.15)
            if n_o == 1:
                acc_o0 = T.alloc_fragment([BH, DH], f32)
                acc_o1 = T.alloc_fragment([BH, DH], f32)
                O0, O1 = (acc_o0,), (acc_o1,)
            else:
                acc_o0a = T.alloc_fragment([BH, DO], f32)
                acc_o0b = T.alloc_fragment([BH, DO], f32)
                acc_o1a = T.alloc_fragment([BH, DO], f32)
                acc_o1b = T.alloc_fragment([BH, DO], f32)
                O0, O1 = (acc_o0a, acc_o0b), (acc_o1a, acc_o1b)
            acc_s0 = T.alloc_fragment([BH, BI], f32)
            p0 = T.alloc_fragment([BH, BI], bf16)
            m_run0 = T.alloc_fragment([BH], f32)
            m_new0 = T.alloc_fragment([BH], f32)
            alpha0 = T.alloc_fragment([BH], f32)
            l0 = T.alloc_fragment([BH], f32)
            lb0 = T.alloc_fragment([BH], f32)
            inv0 = T.alloc_fragment([BH], f32)
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
            row_a = T.alloc_local([1], i32)
            row_b = T.alloc_local([1], i32)
            if persistent:  # each thread's count of the pairs of its role's earlier items (pair_phase)
                pb = T.alloc_local([1], i32)
                pb[0] = 0
            else:
                pb = None
                tok = item_tok(Order, bx)
                h0 = (bx % G) * BH
            tx = T.get_thread_binding()

            if not persistent:
                set_lim(lim, TopkLen, tok)
                npair[0] = n_pairs(lim)

            if tx < 128:
                # ---------------------------------------------- WG0: QK of blocks 2j, O[:, 0:256]
                st("gt_entry", tx == 0)
                st("smid", tx == 0)
                T.set_max_nreg(regs[0], 1)
                for it in items(bx):
                    if persistent:
                        tok, h0 = start_item(Order, TopkLen, lim, npair, bx + it * persistent)
                    if q_next:
                        wait_q_next(it, q_bar, q_dead, npair)
                    elif q_tma:
                        load_q_tma(Q, Q_l, Q_r, Q_t, tok, h0, npair, q_bar, True, *q_gate_bar)
                    else:
                        load_q(Q, Q_l, Q_t, tok, h0, 0, npair, *q_gate_bar)
                    st("wg0_q", tx == 0)
                    reset_acc(O0, l0, m_run0)
                    if npair[0] > 0:
                        qk_a_left(Q_l, KVa_l, Rows0, acc_s0, rdy_al, pair_phase(pb, 0), tx)
                        st("wg0_al_ready", tx == 0)
                        qk_a_right(Q_r, Q_t, KVa_r, Ka_t, acc_s0, rdy_ar, pair_phase(pb, 0), tx)
                        st("wg0_qk0", tx == 0)
                    for j in T.serial(npair[0]):
                        st("wg0_pair", tx == 0, j)
                        if q_next:
                            q_dead_at(j, npair, q_dead)
                        T.copy(m_run0, m_new0)
                        # publish m_a; local PV: O_l += P_a V_a[:, :256], P from registers
                        softmax_local_pv(acc_s0, O0, m_run0, m_new0, alpha0, l0, lb0, Ma, bar_ma, p0, KVa_l)
                        T.wait_wgmma(0)
                        free(fr_al, tx)
                        # common max m_b: move O_l, l_0 and P_a to it
                        adopt_max(bar_mb, pair_phase(pb, j), Mb, m_new0, m_run0, alpha0, l0)
                        for h, r in T.Parallel(BH, BI):
                            p0[h, r] = T.cast(acc_s0[h, r] * alpha0[h], bf16)
                        T.sync_threads(BAR_WG0, 128)  # every WG0 warp is past its QK on a.R (P0 = its rope tile)
                        T.copy(p0, P0)
                        T.fence_proxy_async()
                        T.barrier_arrive(bar_p0)
                        o_mul(O0, alpha0)
                        # remote PV: O_l += P_b V_b[:, :256], P_b from WG1 via smem
                        T.barrier_wait(bar_p1, pair_phase(pb, j))
                        pv(P1, KVb_l, O0)
                        if overlap_qk:
                            if j + 1 < npair[0]:
                                qk_a_left(Q_l, KVa_l, Rows0, acc_s0, rdy_al, pair_phase(pb, j + 1), tx)
                                T.wait_wgmma(1)  # the remote PV retired (the QK on a.L may still run): b.L, P1 free
                                free(fr_bl, tx)
                                qk_a_right(Q_r, Q_t, KVa_r, Ka_t, acc_s0, rdy_ar, pair_phase(pb, j + 1), tx)
                            else:
                                T.wait_wgmma(0)
                                free(fr_bl, tx)
                        else:
                            T.wait_wgmma(0)  # the remote PV retired: b.L (and P1) free before a.L is awaited
                            free(fr_bl, tx)
                            if j + 1 < npair[0]:
                                qk_a_left(Q_l, KVa_l, Rows0, acc_s0, rdy_al, pair_phase(pb, j + 1), tx)
                                qk_a_right(Q_r, Q_t, KVa_r, Ka_t, acc_s0, rdy_ar, pair_phase(pb, j + 1), tx)
                    st("wg0_loop_end", tx == 0)
                    finish(O0, l0, m_run0, inv0, Ls0, Ls0, Ls1, Sink, Q_l, Out, tok, h0, 0, BAR_WG0)
                    st("wg0_finish", tx == 0)
                    store_lse(l0, m_run0, Lse, MaxLogits, tok, h0)
                    st("wg0_lse", tx == 0)
                    st("gt_end", tx == 0)
                    if persistent:
                        end_item(pb, npair, BAR_WG0, not q_next)
            elif tx < 256:
                # ---------------------------------------------- WG1: QK of blocks 2j+1, O[:, 256:512]
                st("wg1_entry", tx == 128)
                T.set_max_nreg(regs[1], 1)
                for it in items(bx):
                    if persistent:
                        tok, h0 = start_item(Order, TopkLen, lim, npair, bx + it * persistent)
                    if q_next:
                        wait_q_next(it, q_bar, q_dead, npair)
                    elif q_tma:
                        load_q_tma(Q, Q_l, Q_r, Q_t, tok, h0, npair, q_bar, False)
                    else:
                        load_q(Q, Q_r, None, tok, h0, DH, npair, *q_gate_bar)
                    st("wg1_q", tx == 128)
                    reset_acc(O1, l1, m_run1)
                    if npair[0] > 0:
                        qk_b(Q_l, Q_r, Q_t, KVb_l, KVb_r, Kb_t, Rows1, acc_s1, rdy_br, rdy_bl, pair_phase(pb, 0), tx)
                        st("wg1_qk0", tx == 128)
                    for j in T.serial(npair[0]):
                        st("wg1_pair", tx == 128, j)
                        if q_next:
                            q_dead_at(j, npair, q_dead)
                        # m_b = max(m_a, rowmax S_b) >= m_a >= the common max of the last pair
                        T.barrier_wait(bar_ma, pair_phase(pb, j))
                        for h in T.Parallel(BH):
                            m_new1[h] = Ma[h]
                        # publish m_b; local PV: O_r += P_b V_b[:, 256:] (P from registers); P_b to smem meanwhile
                        softmax_local_pv(acc_s1, O1, m_run1, m_new1, alpha1, l1, lb1, Mb, bar_mb, p1, KVb_r)
                        T.copy(p1, P1)
                        T.fence_proxy_async()
                        T.barrier_arrive(bar_p1)
                        # remote PV: O_r += P_a V_a[:, 256:], P_a already at m_b
                        T.barrier_wait(bar_p0, pair_phase(pb, j))
                        pv(P0, KVa_r, O1)
                        T.wait_wgmma(n_o)  # the local PV retired: b.R no longer read
                        free(fr_br, tx)
                        T.wait_wgmma(0)  # the remote PV retired: a.R, P0 free before b.R is awaited
                        free(fr_ar, tx)
                        if j + 1 < npair[0]:
                            qk_b(Q_l, Q_r, Q_t, KVb_l, KVb_r, Kb_t, Rows1, acc_s1, rdy_br, rdy_bl,
                                 pair_phase(pb, j + 1), tx)
                    st("wg1_loop_end", tx == 128)
                    finish(O1, l1, m_run1, inv1, Ls1, Ls0, Ls1, Sink, Q_r, Out, tok, h0, DH, BAR_WG1)
                    st("wg1_finish", tx == 128)
                    if persistent:
                        end_item(pb, npair, BAR_WG1, not q_next)
            else:
                tok0, h00 = (None, None) if persistent else (tok, h0)  # (persistent: set per item by start_item)
                st("prod_entry", tx == 256)
                st("conv_entry", tx == 384)
                if converter is None:
                    produce_items(kv_src, Indices, TopkLen, Order, lim, npair, tx, bx, tok0, h00, Rows0, Rows1, KVa_l,
                                  KVa_r, KVb_l, KVb_r, Ka_t, Kb_t, row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al,
                                  fr_bl, fr_br, fr_ar, pb, extra, q_next_args)
                    st("prod_end", tx == 256)
                elif tx < 384:
                    produce_items(kv_src, Indices, TopkLen, Order, lim, npair, tx, bx, tok0, h00, Rows0, Rows1, KVa_l,
                                  KVa_r, KVb_l, KVb_r, Ka_t, Kb_t, row_a, row_b, ld_al, ld_br, ld_ar, ld_bl, fr_al,
                                  fr_bl, fr_br, fr_ar, pb, extra, q_next_args)
                    st("prod_end", tx == 256)
                else:
                    # ------------------------------------------ converter (``converter`` builds)
                    T.set_max_nreg(regs[3], 0)
                    for it in items(bx):
                        if persistent:
                            tok, h0 = start_item(Order, TopkLen, lim, npair, bx + it * persistent)
                        converter(npair, tx, KVa_l, KVa_r, KVb_l, KVb_r, ld_al, ld_br, ld_ar, ld_bl, rdy_al, rdy_br,
                                  rdy_ar, rdy_bl, pb, *extra)
                        if persistent:
                            pb[0] = pb[0] + npair[0]
                    st("conv_end", tx == 384)
            if cluster:
                T.cluster_sync()  # the peer's last remote arrivals on this CTA's barriers have landed

    return body
