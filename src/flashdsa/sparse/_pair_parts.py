"""Pieces shared by the pair-schedule kernels (``kernel_fwd_pair`` and its 656-byte-cache / FP8 relatives): the
named-barrier ids, the Q loads (``q_load_macros``), the producer's row prefetch and non-blocking gather loop,
and WG0's step to the pair's common max.  The module notes of ``kernel_fwd_pair`` describe the schedule and the
protocol."""

import tilelang.language as T

from . import _tl_common as tc
from ._tl_common import BLOCK_I, D_V

# named barrier ids (128 / 128 / 256 threads); 0 is __syncthreads.  BAR_BOTH joins the two consumers, each from its
# own code: always through _tl_common.role_barrier (the unaligned barrier.sync; tests/test_lowering.py checks)
BAR_WG0, BAR_WG1, BAR_BOTH = 8, 9, 10
BAR_PROD = 11  # named barrier of the 128 producer threads


def pair_phase(pb, j):
    """The mbarrier phase parity of pair ``j`` of the current item: ``j & 1`` with one item per CTA (``pb`` None:
    the default builds' literal expression), else ``(pb[0] + j) & 1``, ``pb`` the local count of the pairs of this
    role's earlier items (``pair_body``'s ``persistent``: every barrier's phases continue across items)."""
    return j & 1 if pb is None else (pb[0] + j) & 1


def q_load_parity(it):
    """q_gate "next": the q_bar phase parity of item ``it``'s Q (one phase per item: the producer's 128 arrivals
    and the TMA bytes).  Works on ints (the CPU model, tests/sparse_mla/test_q_next_protocol.py) and TIR vars."""
    return it & 1


def q_dead_parity(it):
    """q_gate "next": the q_dead phase parity the producer waits before item ``it``'s Q (``it`` >= 1): item
    ``it`` - 1's phase (256 consumer arrivals), written ``(it + 1) & 1`` to stay non-negative."""
    return (it + 1) & 1


def q_load_macros(*, dqk, n_tok, q_rows):
    """How ``pair_body`` loads Q (its ``q_gate``, ``_pair_body.Q_LOADS``).  Returns the macros (load_q, load_q_tma,
    load_q_next, wait_q_next, q_dead_at): ``load_q(Q, Q_half, Q_t, tok, h0, c0, npair, gate=None)`` (a consumer's
    half by 16-byte loads), ``load_q_tma(Q, Q_l, Q_r, Q_t, tok, h0, npair, q_bar, issuer, gate=None)`` (q_gate
    "tma*"), ``load_q_next(Q, Q_l, Q_r, Q_t, tok, h0, it, q_bar, q_dead)`` (the producer, q_gate "next"),
    ``wait_q_next(it, q_bar, q_dead, npair)`` and ``q_dead_at(j, npair, q_dead)`` (the consumers, q_gate
    "next"); ``dqk``, ``n_tok``, ``q_rows``: ``pair_body``'s."""
    BH = tc.BLOCK_H
    D = D_V
    DH = D // 2
    D_tail = dqk - D

    def q_row(tok):
        # Q's row for token ``tok`` (split-KV: a token's chunks share its q row)
        return tok if q_rows is None else tok // (n_tok // q_rows)

    @T.macro
    def issue_q_tma(Q, Q_l, Q_r, Q_t, tok, h0, q_bar):
        # all of Q by TMA (8 or 9 boxes of 64 heads x 64 dims, 128B-swizzled as the wgmma reads them) on q_bar, from
        # one elected thread of the calling warpgroup, whose 128 threads then arrive
        q_tok = q_row(tok)
        T.tma_copy(Q[q_tok, h0 : h0 + BH, 0:DH], Q_l, barrier=q_bar, leader_scope_threads=128)
        T.tma_copy(Q[q_tok, h0 : h0 + BH, DH:D], Q_r, barrier=q_bar, leader_scope_threads=128)
        if D_tail > 0:
            T.tma_copy(Q[q_tok, h0 : h0 + BH, D:dqk], Q_t, barrier=q_bar, leader_scope_threads=128)
        T.barrier_arrive(q_bar)

    @T.macro
    def load_q(Q, Q_half, Q_t, tok, h0, c0, npair, gate=None):
        # one consumer warpgroup loads Q[:, c0:c0+256] (+ the rope tail): 16 B per thread and load.  (Loaded by all
        # 384 threads, the 64 x 256 tile is not a multiple of 384 x 8 elements and lowered to 2-byte loads, which
        # cost ~45 us per CTA: measured on the H200, session 8.)  Both halves are complete after BAR_BOTH.
        q_tok = q_row(tok)
        if gate is not None:  # q_gate: after the first pair's a.L / a.R landed (parity 0: one item per CTA; no
            if npair[0] > 0:  # pair, no gather: nothing to wait for)
                T.barrier_wait(gate, 0)
        T.copy(Q[q_tok, h0 : h0 + BH, c0 : c0 + DH], Q_half, disable_tma=True)
        if Q_t is not None:
            if D_tail > 0:
                T.copy(Q[q_tok, h0 : h0 + BH, D:dqk], Q_t, disable_tma=True)
        T.fence_proxy_async()
        tc.role_barrier(BAR_BOTH, 256)

    @T.macro
    def load_q_tma(Q, Q_l, Q_r, Q_t, tok, h0, npair, q_bar, issuer, gate=None):
        # q_gate "tma*": WG0 (``issuer``) loads all of Q by TMA (9 boxes of 64 heads x 64 dims, 8 at Dqk 512,
        # 128B-swizzled as the wgmma reads them) on q_bar; both consumers wait for its bytes.  The copies occupy no
        # thread and no load / store slot, so the producer's index loads and the converter do not queue behind them
        # (session 50: measured; at one wave the first QK still comes no sooner, the memory system is the wait).
        if issuer:
            if gate is not None:
                if npair[0] > 0:
                    T.barrier_wait(gate, 0)
            issue_q_tma(Q, Q_l, Q_r, Q_t, tok, h0, q_bar)
        T.barrier_wait(q_bar, 0)

    @T.macro
    def load_q_next(Q, Q_l, Q_r, Q_t, tok, h0, it, q_bar, q_dead):
        # q_gate "next", the producer warpgroup in item ``it`` (``gather_producer``'s q_hook: after pair 0's index
        # loads are issued, or at once for an item without pairs): once both consumers retired item it - 1's
        # last QK (q_dead, phase it - 1), every Q tile is dead and this item's Q goes in by TMA on q_bar (phase it).
        # At most one Q is in flight: q_dead's phase it - 1 needs the consumers past q_bar's phase it - 1.
        if it > 0:
            T.barrier_wait(q_dead, q_dead_parity(it))
        issue_q_tma(Q, Q_l, Q_r, Q_t, tok, h0, q_bar)

    @T.macro
    def wait_q_next(it, q_bar, q_dead, npair):
        # a consumer at item ``it``'s start (q_gate "next"): its Q landed; BAR_BOTH as load_q's (Ls0 / Ls1: the
        # peer read them before the writer's next finish); an item without pairs reads no Q
        T.barrier_wait(q_bar, q_load_parity(it))
        tc.role_barrier(BAR_BOTH, 256)
        if npair[0] == 0:
            T.barrier_arrive(q_dead)

    @T.macro
    def q_dead_at(j, npair, q_dead):
        # q_gate "next": at the top of the item's last pair this consumer's QKs have all retired (each QK ends
        # with wait_wgmma(0)): nothing of it reads Q any more
        if j == npair[0] - 1:
            T.barrier_arrive(q_dead)

    return load_q, load_q_tma, load_q_next, wait_q_next, q_dead_at


def item_parts(*, G, NI, n_tok, persistent, set_lim):
    """The items of ``pair_body`` (item i: token i // G, or Order[i // G]; head group i % G): one per CTA, or with
    ``persistent`` = P > 0 CTA bx takes bx, bx + P, ... < n_tok * G.  Returns (n_ctas, ``items(bx)``: the loop over
    CTA bx's items, a Python 1-tuple with one item per CTA (no loop), ``item_tok(Order, item)``,
    ``n_pairs(lim)``: the pair count at topk_eff lim[0], macro ``start_item(Order, TopkLen, lim, npair, item)`` ->
    (tok, h0): an item's token, head offset, topk_eff and pair count, macro ``end_item(pb, npair, own_bar)``: a
    consumer's item end (warpgroup barrier: its Stage read out before the next load_q, unless ``sync`` is False:
    no Stage; pb += npair))."""
    BH, BI = tc.BLOCK_H, BLOCK_I

    def items(bx):
        return T.serial((n_tok * G - bx + persistent - 1) // persistent) if persistent else (0,)

    def item_tok(Order, item):
        return Order[item // G] if Order is not None else item // G

    def n_pairs(lim):
        return (T.min((lim[0] + BI - 1) // BI, NI) + 1) // 2

    @T.macro
    def start_item(Order, TopkLen, lim, npair, item):
        tok = item_tok(Order, item)
        set_lim(lim, TopkLen, tok)
        npair[0] = n_pairs(lim)
        return tok, (item % G) * BH

    @T.macro
    def end_item(pb, npair, own_bar, sync=True):
        if sync:
            T.sync_threads(own_bar, 128)
        pb[0] = pb[0] + npair[0]

    return persistent if persistent else n_tok * G, items, item_tok, n_pairs, start_item, end_item


def adopt_max_macro(*, BH, c_log2):
    """``adopt_max(bar, phase, M_s, m_new, m_run, alpha, l_acc)``: WG0's step to the pair's common max -- wait for
    WG1's max ``M_s`` on ``bar``, then alpha = 2^((m_run - M) c), m_run = M, l *= alpha (the caller rescales O and
    P by alpha).  Shared by the bf16 and FP8 pair kernels."""

    @T.macro
    def adopt_max(bar, phase, M_s, m_new, m_run, alpha, l_acc):
        T.barrier_wait(bar, phase)
        for h in T.Parallel(BH):
            m_new[h] = M_s[h]
        for h in T.Parallel(BH):
            alpha[h] = T.exp2((m_run[h] - m_new[h]) * c_log2)
            m_run[h] = m_new[h]
            l_acc[h] = l_acc[h] * alpha[h]

    return adopt_max


@T.macro
def drain():
    T.ptx_commit_group()
    T.ptx_wait_group(0)  # nothing in flight when the producer threads exit


def row_select(row_ok, row_base=None):
    """``select(row, tok, kv_src)``: the KV row an Indices entry names, or -1 where ``row_ok(row, kv_src)`` fails;
    ``row_base(tok, kv_src)`` (the batched forms: ``(tok // S) * S_kv``) is added to an accepted entry."""
    if row_base is None:
        return lambda row, tok, kv_src: T.if_then_else(row_ok(row, kv_src), row, -1)
    return lambda row, tok, kv_src: T.if_then_else(row_ok(row, kv_src), row + row_base(tok, kv_src), -1)


def pair_rows_macro(topk_dim, select):
    """Macro ``pair_rows(Indices, tok, lim, j, pt, row_a, row_b, kv_src)``: producer thread ``pt`` < 64 loads the
    KV rows of slot ``pt`` of blocks 2j / 2j + 1 into registers (``select`` of ``row_select``: -1 past topk_eff or
    where the entry is out of range), so the Indices latency overlaps the waits that follow."""
    BI = BLOCK_I
    _row = tc.make_slot_row(topk_dim)

    @T.macro
    def pair_rows(Indices, tok, lim, j, pt, row_a, row_b, kv_src):
        if pt < BI:
            row_a[0] = _row(Indices, tok, lim[0], j * 2 * BI + pt)
            row_a[0] = select(row_a[0], tok, kv_src)
            row_b[0] = _row(Indices, tok, lim[0], (j * 2 + 1) * BI + pt)
            row_b[0] = select(row_b[0], tok, kv_src)

    return pair_rows


def gather_producer(*, topk_dim, row_ok, gather_l, gather_r, prefetch_rows=True, row_base=None):
    """The non-blocking producer of the module notes for any KV format: ``gather_l(KVl, Rows, kv_src)`` /
    ``gather_r(KVr, Kt, Rows, kv_src)`` issue one half tile's cp.async (no commit, no wait); their completion
    arrives on the half's ready barrier (noinc).  ``row_ok(row, kv_src)``: the row exists; ``row_base``: as in
    ``row_select``.  ``pb``: None, or the pairs of this CTA's earlier items (``pair_phase``; the caller then drains
    the cp.async after its item loop).  ``q_hook`` (``pair_body``'s q_gate "next"): (macro, args), run once per
    item: after pair 0's index loads are issued (``prefetch_rows``) and before its first free wait, or at once for
    an item without pairs, so those loads' latency overlaps the hook's q_dead wait."""
    BI = BLOCK_I
    _row = tc.make_slot_row(topk_dim)
    select = row_select(row_ok, row_base)
    pair_rows = pair_rows_macro(topk_dim, select)

    @T.macro
    def publish_rows(Rows, Indices, tok, lim, blk, kv_src):
        # Rows[r] = KV row of slot blk*64 + r, or -1 (past topk_eff / out of [0, Tkv)); all producer
        # threads see them after the named barrier, the consumers through the ready barrier's ordinary arrival
        for r in T.Parallel(BI):
            Rows[r] = select(_row(Indices, tok, lim, blk * BI + r), tok, kv_src)
        T.sync_threads(BAR_PROD, 128)

    @T.macro
    def set_rows(Rows, row, Indices, tok, lim, blk, kv_src, tx):
        # Rows of block blk from the prefetched registers (prefetch_rows) or loaded now
        if prefetch_rows:
            if tx - 256 < BI:
                Rows[tx - 256] = row[0]
            T.sync_threads(BAR_PROD, 128)
        else:
            publish_rows(Rows, Indices, tok, lim[0], blk, kv_src)

    @T.macro
    def producer(kv_src, Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
                 row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar, pb, st=None, q_hook=None):
        # st: ``stamper``'s macro (timestamp builds): pair 0's rows published and its four gathers issued
        for j in T.serial(npair[0]):
            if prefetch_rows:  # this pair's rows into registers before the waits
                pair_rows(Indices, tok, lim, j, tx - 256, row_a, row_b, kv_src)
            if q_hook is not None:
                if j == 0:
                    q_hook[0](*q_hook[1])
            T.barrier_wait(fr_al, pair_phase(pb, j) ^ 1)
            set_rows(Rows0, row_a, Indices, tok, lim, j * 2, kv_src, tx)
            if st is not None:
                st("prod_rows0", (tx == 256) & (j == 0))
            T.barrier_arrive(rdy_al)
            gather_l(KVa_l, Rows0, kv_src)
            T.cp_async_barrier_noinc(rdy_al)
            T.barrier_wait(fr_br, pair_phase(pb, j) ^ 1)
            set_rows(Rows1, row_b, Indices, tok, lim, j * 2 + 1, kv_src, tx)
            T.barrier_arrive(rdy_br)
            gather_r(KVb_r, Kb_t, Rows1, kv_src)
            T.cp_async_barrier_noinc(rdy_br)
            T.barrier_wait(fr_ar, pair_phase(pb, j) ^ 1)
            gather_r(KVa_r, Ka_t, Rows0, kv_src)
            T.cp_async_barrier_noinc(rdy_ar)
            T.barrier_wait(fr_bl, pair_phase(pb, j) ^ 1)
            gather_l(KVb_l, Rows1, kv_src)
            T.cp_async_barrier_noinc(rdy_bl)
            if st is not None:
                st("prod_issued0", (tx == 256) & (j == 0))
        if q_hook is not None:
            if npair[0] == 0:
                q_hook[0](*q_hook[1])
        if pb is None:
            drain()

    return producer


def hop_converter():
    """The fourth warpgroup of ``kernel_fwd_pair``'s ``hop`` timing build: the converter staging's barrier hop with
    nothing to convert (wait each half's landed barrier in the producer's order, fence, arrive on its ready
    barrier)."""

    @T.macro
    def hop(ld, rdy, phase):
        T.barrier_wait(ld, phase)
        T.fence_proxy_async()
        T.barrier_arrive(rdy)

    @T.macro
    def converter(npair, tx, KVa_l, KVa_r, KVb_l, KVb_r, ld_al, ld_br, ld_ar, ld_bl, rdy_al, rdy_br, rdy_ar, rdy_bl,
                  pb):
        for j in T.serial(npair[0]):
            hop(ld_al, rdy_al, pair_phase(pb, j))
            hop(ld_br, rdy_br, pair_phase(pb, j))
            hop(ld_ar, rdy_ar, pair_phase(pb, j))
            hop(ld_bl, rdy_bl, pair_phase(pb, j))

    return converter


# ---------------------------------------------------------------- per-CTA timestamps (timing builds only)
# ``pair_body(stamps=True)``: the kernel takes one more argument, Stamps [n_ctas, STAMP_WORDS] int32, and one thread
# of each role writes the low 32 bits of clock64 (SM cycles) at the points below (scripts/pair_timestamps.py reads
# them); words 0 / 1 and 27 / 28 hold the globaltimer (ns) at WG0's entry / end, read with words 2 / 29's clocks.
STAMP_WORDS = 64
STAMP_PAIRS = 16  # pairs stamped per consumer (the first ones)
STAMPS = dict(gt_entry=0, wg0_entry=2, wg0_q=3, wg0_al_ready=4, wg0_qk0=5, smid=6, wg0_pair=8, wg0_loop_end=24,
              wg0_finish=25, wg0_lse=26, gt_end=27, wg0_end=29, wg1_q=30, wg1_qk0=31, wg1_pair=32, wg1_loop_end=48,
              wg1_finish=49, prod_entry=50, prod_end=51, conv_entry=52, conv_end=53, wg1_entry=54,
              prod_rows0=55, prod_issued0=56, conv_landed_al=57, conv_landed_br=58, conv_landed_ar=59,
              conv_landed_bl=60, conv_done_al=61, conv_done_br=62, conv_done_ar=63)  # the last 9: pair 0 only
STAMP_SRC = r"""
// timestamps (timing builds): every thread of the warp calls (warp-uniform control flow around the wgmmas), the one
// with on != 0 stores
__device__ __forceinline__ void fdsa_stamp(int *p, int on) {
  const long long c = clock64();
  if (on) *p = static_cast<int>(c);
}
__device__ __forceinline__ void fdsa_stamp_gt(int *p, int on) {  // globaltimer lo / hi, then clock64
  unsigned long long g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
  const long long c = clock64();
  if (on) { p[0] = static_cast<int>(g); p[1] = static_cast<int>(g >> 32); p[2] = static_cast<int>(c); }
}
__device__ __forceinline__ void fdsa_stamp_smid(int *p, int on) {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  if (on) *p = static_cast<int>(s);
}
"""


def stamper(Stamps, bx):
    """Macro ``st(name, on, j=None)``: the stamp ``STAMPS[name]`` (+ ``j``, clamped to the ``STAMP_PAIRS`` words:
    a stamp per pair, only the first ones) into Stamps[bx], stored by the threads with ``on``; with ``Stamps``
    None it emits nothing (the default builds' kernels are unchanged)."""
    if Stamps is None:
        return lambda name, on, j=None: None
    fns = dict(gt_entry="fdsa_stamp_gt", gt_end="fdsa_stamp_gt", smid="fdsa_stamp_smid")

    @T.macro
    def st(name, on, j=None):
        word = STAMPS[name] if j is None else STAMPS[name] + T.min(j, STAMP_PAIRS - 1)
        ok = on if j is None else on & (j < STAMP_PAIRS)
        T.call_extern("handle", fns.get(name, "fdsa_stamp"), T.address_of(Stamps[bx, word]), ok)

    return st
