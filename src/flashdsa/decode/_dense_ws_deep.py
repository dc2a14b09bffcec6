"""Dense MLA decode, variant "ws_deep": the warp-specialised split-KV partial kernel with a deeper KV ring
(32-key tiles, 4 stages) for the memory-bound small-M case (TileLang, Hopper sm_90a).

NOT RUN ON A GPU.  Written and checked on a machine without a GPU only: nothing here has been executed, tested
against the reference or timed.  What was checked: it lowers to CUDA for sm_90a (~27 s per configuration on the
2-core dev box) for H 1 / 16 / 64 / 128, s_q 1 / 2 / 4, block sizes 16 / 32 / 64 / 128 / 256, causal or not, with
or without sink, both release orders; ptxas (nvcc 13.0, sm_90a): 168 registers at launch, 10 barriers, no
C7514/C7515/C7517 wgmma-serialisation remark, spills only in the producer warpgroup (bs 64 / 128: ~380-490 B of
stack, ~24 LDL + 24 STL per tile per producer thread; bs 16 / 32 / 256: <= 32 B; "ws" spills 216 B the same way),
WG0 / WG1 with 3 / 1 local loads outside the loop; the barrier waits, parities, stage and P-slot indices were read
back from the generated CUDA; the protocol passed a randomised simulation (a throwaway script, not in the repo:
0-13 tiles, both release orders, random interleavings and cp.async landing order; mutated parities or a missing
p_free wait fail it); the split plan with this tile covers every sequence exactly once (2,000 random shapes).
Opt-in only: ``run_mla_decode_dense(..., variant="ws_deep")`` or ``FLASHDSA_DECODE_VARIANT=ws_deep``; the default
stays "ws".  Same contract, split plan, partial buffers and combine kernel as ``kernel_dense.py`` / "ws".

Why.  The memory-bound target (B 64, H 16, s_q 1, cache 8192, one 128-tile split per CTA, 128 CTAs) runs at 1.64
  TB/s with "ws" (target 3.8).  ncu (docs/PERFORMANCE.md, "MLA decode", session 4): DRAM 1.51 TB/s, long-scoreboard
  stalls dominate, at most one 72 KB tile in flight per SM: "ws"'s producer gathers a 64-key tile and waits for
  all of it (TileLang's implicit ``cp.async.wait_group 0``) before it signals or issues anything else, and WG0
  releases tile i only after tile i + 1 landed, so with two buffers the next tile is issued only when the last
  one is complete (the in-flight volume drains to zero once per tile).
What changes (everything else, incl. roles, masks, softmax and epilogue, is "ws"'s):
  * 32-key tiles (36 KB: 32 x 576 bf16) in a ring of NSTAGE = 4 buffers (144 KB, the shared memory of "ws"'s
    2 x 72 KB).  Tile i lives in stage i % 4, its use u = i // 4.
  * The producer never waits for its copies: the 16-byte zero-filling cp.async of a tile go without commit /
    wait (loop annotation ``parallel_async_without_async_commit_wait``, as ``sparse/_fwd_ws2.py``, which passed
    its GPU tests) and their completion is an mbarrier arrival (``cp.async.mbarrier.arrive.noinc``).  So the
    producer runs ahead until every free stage is in flight: 4 x 36 KB per SM while the consumers wait for
    data, 3 while WG0 works on a tile (vs at most 1 x 72 KB in "ws").
  * Early release (default): WG0 retires PV_l(i) and releases stage i before it waits for tile i + 1, so a
    consumer that waits for data holds no stage.  This gives up "ws"'s overlap of QK(i + 1) with PV_l(i), which
    only matters when compute-bound.  ``$FLASHDSA_WS_DEEP_RELEASE=late`` builds "ws"'s order instead (release
    after QK(i + 1) was issued, so one stage is always held: <= 3 tiles in flight), an A/B knob.
  * P (64 x 32 bf16) no longer fits in the rope tile (32 x 64, other layout), so it gets two 4 KB slots of its
    own (tile i uses slot i % 2) with a p_free barrier from WG1; Alpha follows P's slot.
  * The split plan counts 32-key tiles (``BLOCK_N``; chunk starts are multiples of 32 tokens) with the same
    fixed cost per split as "ws" (3 x 64 keys = ``_OVERHEAD_TILES`` 6) and minimum chunk (128 keys = 4 tiles):
    B 64 x 8192 tokens gives 2 splits of 128 tiles per sequence, 128 CTAs, as "ws".
  * Dispatched only for ``s_q * H <= 64`` (one row tile, n_mt 1; ``applies``): for more rows the kernel is
    compute-bound and m64n32 QK re-reads the Q tile per 32 keys instead of per 64 (1.5x the shared-memory reads
    of QK), so ``run_mla_decode_dense`` falls back to "ws" there.  The kernel itself handles any n_mt (1-D grid
    ``item * n_mt + mt`` as "ws"); ``$FLASHDSA_WS_DEEP_ANY_M=1`` lifts the rule (A/B knob, tests).

Roles (384 threads, setmaxnreg 240 / 176 / 88 as "ws"):
  * WG0 (threads 0-127): S = Q K^T (64 rows x 32 keys over 576 dims: 3 wgmma m64n32), masks, online softmax,
    P and alpha to shared memory, O[:, 0:256] += P V[:, 0:256].
  * WG1 (128-255): O[:, 256:512] *= alpha; += P V[:, 256:512].
  * producer (256-383): Vld flags + the gather of tile i into stage i % 4 (one warp per row per pass, rows with
    p >= end or an out-of-range page id use the zero-filling form: src-size 0, nothing read; NaN in unused slots
    cannot reach shared memory).

Protocol (mbarriers, counts in brackets; i = 4 j + s: tile i, stage s, use j; P slot q = i % 2, its use v = i // 2;
a waiter waits for the completion of one phase of the barrier, parity = that use's index & 1):
  full[s]    [256]  tile i landed: 128 deferred arrivals (``cp.async.mbarrier.arrive.noinc``: fires once all of
                    that producer thread's earlier cp.async completed) + 128 ordinary (release) arrivals after
                    the thread wrote its Vld flags.  WG0 waits parity j & 1.
  kv_free[s] [256]  stage s free again: WG0 (PV_l(i) and QK(i) retired, Vld read) + WG1 (PV_r(i) retired).
                    Producer waits parity (j & 1) ^ 1 before refilling it with tile i + 4 (a fresh barrier
                    passes parity 1 at once, so the first round does not wait).
  s_ready[q] [128]  WG0 -> WG1: P and Alpha of tile i in slot q.  WG1 waits parity v & 1.
  p_free[q]  [128]  WG1 -> WG0: PV_r of tile i retired, P / Alpha slot q free.  WG0 waits parity (v & 1) ^ 1
                    before writing slot q for tile i (i.e. for WG1's release of tile i - 2; passes for v = 0).
  fin        [128]  WG0 -> WG1 after the loop: final row scale in Fin_s, Q no longer read.
  Producer, tile i: wait kv_free[s]; Vld[s] flags; cp.async (no commit); arrive.noinc full[s]; arrive full[s].
    After the last tile: commit + wait_group 0 (nothing in flight at thread exit).
  WG0: wait full[0] (parity 0), fence.proxy.async, QK(0), wait.  Tile i: softmax(i) in registers; wait
    p_free[q]; Alpha, P -> slot q; fence.proxy.async; named barrier 8; arrive s_ready[q]; PV_l(i);
    early: wait_wgmma 0, arrive kv_free[s], then (i + 1 < n) wait full[s'] (parity of its use), fence.proxy.async,
    mask from Vld[s'], QK(i + 1), wait_wgmma 0.  late ("ws"): wait full[s'], fence, QK(i + 1) behind PV_l(i),
    wait_wgmma 3 (PV_l retired), arrive kv_free[s], wait_wgmma 0.
  WG1, tile i: wait s_ready[q]; fence.proxy.async; O_r *= Alpha[q]; PV_r(i); wait_wgmma 0; arrive kv_free[s];
    arrive p_free[q].
  Visibility: cp.async writes are generic-proxy writes and the wgmma reads are async-proxy reads, so every
    consumer runs fence.proxy.async after the mbarrier wait that made the data visible to it and before its wgmma
    (WG1 sees the tile through WG0's chain full -> s_ready), as ``sparse/_fwd_ws2.py``.  WG0 fences its P stores
    before arriving s_ready (as "ws").
  No barrier runs two phases ahead of a waiter: full[s] use j + 1 needs kv_free[s] use j, which needs WG0's
    arrival after its wait on full[s] use j; kv_free[s] use j + 1 needs full[s] use j + 1, issued after the
    producer's wait on use j; s_ready[q] use v + 1 needs WG0 past p_free[q] use v, i.e. WG1 past s_ready[q] use
    v; p_free[q] use v + 1 needs s_ready[q] use v + 1, after WG0's p_free wait of use v.
  Deadlock-freedom: the producer's only wait (stage of tile i - 4 released) needs WG0 to have finished tile
    i - 4 (early: nothing later; late: tile i - 3 landed, issued before) and WG1's PV_r(i - 4) (needs only
    s_ready(i - 4)); WG0 waits for WG1's release of tile i - 2 and for tiles the producer issued before that
    wait; WG1 waits only for WG0.
  Named barriers: 8 (WG0), 9 (WG1); the automatic thread-storage-sync pass is off (as "ws").

Shared memory (TileLang's offsets): Q 64 x 576 (73,728 B) + 4 stages x 32 x 576 (147,456 B) + P 2 x 64 x 32
  (8,192 B) + Alpha 2 x 64 f32 + Fin 64 f32 = 230,144 B dynamic + 1,024 B static (13 mbarriers, Vld 4 x 32 B)
  = 231,168 B of the 232,448 B cap (1,280 B spare), one CTA per SM.
Cost model per 32-key tile (one SM, derived, not measured): QK 36 wgmma m64n32k16 steps, smem-bound at ~24 cycles
  (3 KB per step) = ~860 cycles; PV 2 x 64x256x32 in parallel on WG0 / WG1 (~160-320); softmax + P store ~300:
  ~1,400-1,600 cycles of WG0 per 36 KB tile.  3.8 TB/s over 128 busy SMs needs 36 KB per ~2,400 cycles
  (1.98 GHz) per SM, so the consumers keep up with 3.8 TB/s if the ring keeps HBM busy; m64n32 makes QK
  ~1.5x the cost per key of "ws"'s m64n64, which is why the compute-bound shapes stay on "ws".
"""

import functools
import os

import tilelang
import tilelang.language as T

from ..sparse._tl_common import NEG_BIG, online_softmax_macro
from . import kernel_dense_ws as _ws
from ._tl_common import D_ROPE, D_V, DQK, LOG2E, item_macros, partial_prim_func, partial_sizes

BLOCK_M = 64  # query rows per CTA (wgmma M)
BLOCK_N = 32  # cache positions per tile
NSTAGE = 4  # KV ring: tile i in stage i % NSTAGE (even: the P slot i % 2 is then static per unrolled stage)
_OVERHEAD_TILES = _ws._OVERHEAD_TILES * (_ws.BLOCK_N // BLOCK_N)  # the same fixed cost per split as "ws"
_MIN_CHUNK_TILES = _ws._MIN_CHUNK_TILES * (_ws.BLOCK_N // BLOCK_N)  # never split below 128 keys, as "ws"
MAX_ROWS = BLOCK_M  # dispatched for s_q * H <= 64 only (see ``applies``)
THREADS = _ws.THREADS
REG_WG0, REG_WG1, REG_PRODUCER = _ws.REG_WG0, _ws.REG_WG1, _ws.REG_PRODUCER
BAR_WG0, BAR_WG1 = _ws.BAR_WG0, _ws.BAR_WG1
RELEASE_ENV = "FLASHDSA_WS_DEEP_RELEASE"  # "early" (default) | "late"
ANY_M_ENV = "FLASHDSA_WS_DEEP_ANY_M"  # "1": also dispatch for s_q * H > 64
STAGES = tuple(range(NSTAGE))  # a Python tuple: `for s in STAGES` unrolls at trace time
# cp.async without TileLang's implicit commit + wait_group 0 (completion goes to an mbarrier instead)
_ASYNC = {"parallel_prefer_async": True, "parallel_async_without_async_commit_wait": True}
assert NSTAGE % 2 == 0 and NSTAGE >= 2


def applies(rows: int) -> bool:
    """Whether ``run_mla_decode_dense`` runs this kernel for ``s_q * H = rows`` (else it falls back to "ws")."""
    return rows <= MAX_ROWS or os.environ.get(ANY_M_ENV, "").strip() == "1"


def early_release() -> bool:
    """``$FLASHDSA_WS_DEEP_RELEASE``: "early" (default) or "late" ("ws"'s order)."""
    v = os.environ.get(RELEASE_ENV, "").strip().lower() or "early"
    if v not in ("early", "late"):
        raise ValueError(f"${RELEASE_ENV}={v!r}: expected 'early' or 'late'")
    return v == "early"


def build_partial_kernel(*, heads: int, s_q: int, block_size: int, causal: bool, sm_scale: float,
                         has_sink: bool, early_release: bool = True):
    """The "ws_deep" split-KV attention kernel; the signature of ``kernel_dense.build_partial_kernel``.

    Launch grid: max_items * n_mt CTAs (n_mt = ceil(s_q * heads / 64)), 384 threads, as "ws".
    """
    M = s_q * heads
    n_mt = (M + BLOCK_M - 1) // BLOCK_M
    BH, BI, D, DH, DT = BLOCK_M, BLOCK_N, D_V, D_V // 2, D_ROPE
    bs = int(block_size)
    c_log2 = float(sm_scale) * LOG2E
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    sizes = partial_sizes()
    _, nblk, maxb, nitem, _ = sizes  # (batch, num_blocks, max_blocks, max_items, n_sink)
    load_item, start_item, wg0_finish = item_macros(M=M, s_q=s_q, causal=causal, BH=BH, BI=BI, heads=heads,
                                                    has_sink=has_sink, c_log2=c_log2, bar_wg0=BAR_WG0)
    online_softmax = online_softmax_macro(BH=BH, BI=BI, D=DH, c_log2=c_log2)  # the statements "ws" writes out

    def _page(BlockTable, b, p):
        # page id of position p (the table read stays in bounds; p may run past the table on the last tile)
        return BlockTable[b, T.min(p // bs, maxb - 1)]

    def _ok(p, end, pg):
        return (p < end) & (pg >= 0) & (pg < nblk)

    # ------------------------------------------------------------------ producer
    def make_produce(s):
        @T.macro
        def produce(KVl, KVr, Kt, Vld, full, KV, BlockTable, b, p0, end):
            for r in T.Parallel(BI):
                pg = _page(BlockTable, b, p0 + r)
                Vld[r] = _ok(p0 + r, end, pg)
            # one warp per row per pass, 16 B per lane per statement; invalid rows: zero-filling form (nothing
            # read).  No commit / wait: the deferred arrival below fires when this thread's copies landed.
            for r, c, d in T.Parallel(BI, 4, 64, annotations=_ASYNC):
                pg = _page(BlockTable, b, p0 + r)
                ok = _ok(p0 + r, end, pg)
                pgc = T.if_then_else(ok, pg, 0)
                slot = (p0 + r) % bs
                KVl[r, c * 64 + d] = T.if_then_else(ok, KV[pgc, slot, c * 64 + d], T.cast(0, bf16))
                KVr[r, c * 64 + d] = T.if_then_else(ok, KV[pgc, slot, DH + c * 64 + d], T.cast(0, bf16))
                if c == 0:
                    Kt[r, d] = T.if_then_else(ok, KV[pgc, slot, D + d], T.cast(0, bf16))
            T.cp_async_barrier_noinc(full[s])
            T.barrier_arrive(full[s])  # ordinary (release) arrival: publishes this thread's Vld flags

        return produce

    # ------------------------------------------------------------------ WG0
    @T.macro
    def qk_issue(Ql, Qr, Qt, KVl, KVr, Kt, Vld, acc_s, p0, lim0, m0):
        T.fence_proxy_async()  # the tile came from cp.async (generic proxy): make it visible to wgmma
        for h, r in T.Parallel(BH, BI):
            if causal:
                acc_s[h, r] = T.if_then_else(Vld[r] & (p0 + r < lim0 + (m0 + h) // heads), T.float32(0),
                                             -T.infinity(f32))
            else:
                acc_s[h, r] = T.if_then_else(Vld[r], T.float32(0), -T.infinity(f32))
        T.wgmma_gemm(Ql, KVl, acc_s, transpose_B=True)
        T.wgmma_gemm(Qr, KVr, acc_s, transpose_B=True)
        T.wgmma_gemm(Qt, Kt, acc_s, transpose_B=True)

    def make_wg0_step(s):
        q, ns = s % 2, (s + 1) % NSTAGE

        @T.macro
        def wg0_step(i, nt, nxt_phase, P, Alpha_s, KVl, nKVl, nKVr, nKt, nVld, full, kv_free, s_ready, p_free,
                     Ql, Qr, Qt, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk, p_next, lim0, m0):
            # acc_s holds S of tile i (its QK retired); tile i is in stage s, its P / Alpha in slot q
            online_softmax(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk)
            T.barrier_wait(p_free[q], ((i >> 1) & 1) ^ 1)  # WG1 retired PV_r(i - 2): slot q is free
            T.copy(alpha, Alpha_s)
            T.copy(acc_s, P)
            T.fence_proxy_async()
            T.sync_threads(BAR_WG0, 128)  # whole P tile written before the PV wgmma
            T.barrier_arrive(s_ready[q])
            T.wgmma_gemm(P, KVl, acc_o)
            # (one if / else with a wait on each side: separately guarded wait statements make ptxas inject
            # waits and serialise the wgmma pipeline, C7514)
            if i + 1 < nt:
                if early_release:
                    T.wait_wgmma(0)  # PV_l(i) retired: release stage s before waiting for tile i + 1
                    T.barrier_arrive(kv_free[s])
                    T.barrier_wait(full[ns], nxt_phase)
                    qk_issue(Ql, Qr, Qt, nKVl, nKVr, nKt, nVld, acc_s, p_next, lim0, m0)
                    T.wait_wgmma(0)
                else:
                    # "ws"'s order: QK(i + 1) queued behind PV_l(i); retire PV_l, then release stage s
                    T.barrier_wait(full[ns], nxt_phase)
                    qk_issue(Ql, Qr, Qt, nKVl, nKVr, nKt, nVld, acc_s, p_next, lim0, m0)
                    T.wait_wgmma(3)
                    T.barrier_arrive(kv_free[s])
                    T.wait_wgmma(0)
            else:
                T.wait_wgmma(0)
                T.barrier_arrive(kv_free[s])

        return wg0_step

    # ------------------------------------------------------------------ WG1
    def make_wg1_step(s):
        q = s % 2

        @T.macro
        def wg1_step(i, P, Alpha_s, KVr, kv_free, s_ready, p_free, acc_o):
            T.barrier_wait(s_ready[q], (i >> 1) & 1)
            T.fence_proxy_async()  # KVr came from cp.async (seen through WG0's full -> s_ready chain)
            for h, d in T.Parallel(BH, DH):
                acc_o[h, d] = acc_o[h, d] * Alpha_s[h]
            T.wgmma_gemm(P, KVr, acc_o)
            T.wait_wgmma(0)
            T.barrier_arrive(kv_free[s])
            T.barrier_arrive(p_free[q])

        return wg1_step

    produce = [make_produce(s) for s in STAGES]
    wg0_step = [make_wg0_step(s) for s in STAGES]
    wg1_step = [make_wg1_step(s) for s in STAGES]

    @T.macro
    def body(Q, KV, BlockTable, SeqLens, Plan, Sink, Out, Lse, OPart, LsePart):
        with T.Kernel(nitem * n_mt, threads=THREADS) as bx:
            Q_l = T.alloc_shared([BH, DH], bf16)
            Q_r = T.alloc_shared([BH, DH], bf16)
            Q_t = T.alloc_shared([BH, DT], bf16)
            KV0_l = T.alloc_shared([BI, DH], bf16)
            KV1_l = T.alloc_shared([BI, DH], bf16)
            KV2_l = T.alloc_shared([BI, DH], bf16)
            KV3_l = T.alloc_shared([BI, DH], bf16)
            KV0_r = T.alloc_shared([BI, DH], bf16)
            KV1_r = T.alloc_shared([BI, DH], bf16)
            KV2_r = T.alloc_shared([BI, DH], bf16)
            KV3_r = T.alloc_shared([BI, DH], bf16)
            K0_t = T.alloc_shared([BI, DT], bf16)
            K1_t = T.alloc_shared([BI, DT], bf16)
            K2_t = T.alloc_shared([BI, DT], bf16)
            K3_t = T.alloc_shared([BI, DT], bf16)
            Vld0 = T.alloc_shared([BI], "bool")
            Vld1 = T.alloc_shared([BI], "bool")
            Vld2 = T.alloc_shared([BI], "bool")
            Vld3 = T.alloc_shared([BI], "bool")
            P0 = T.alloc_shared([BH, BI], bf16)
            P1 = T.alloc_shared([BH, BI], bf16)
            Alpha0 = T.alloc_shared([BH], f32)
            Alpha1 = T.alloc_shared([BH], f32)
            Fin_s = T.alloc_shared([BH], f32)
            KVl = (KV0_l, KV1_l, KV2_l, KV3_l)
            KVr = (KV0_r, KV1_r, KV2_r, KV3_r)
            Kt = (K0_t, K1_t, K2_t, K3_t)
            Vld = (Vld0, Vld1, Vld2, Vld3)
            P = (P0, P1)
            Alpha = (Alpha0, Alpha1)

            full = T.alloc_barrier([256] * NSTAGE)
            kv_free = T.alloc_barrier([256] * NSTAGE)
            s_ready = T.alloc_barrier([128] * 2)
            p_free = T.alloc_barrier([128] * 2)
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
            info = T.alloc_local([6], i32)

            item = bx // n_mt
            m0 = (bx % n_mt) * BH
            tx = T.get_thread_binding()
            load_item(Plan, info, item)

            if info[0] >= 0:
                b = info[0]
                start_item(Q, SeqLens, Q_l, Q_r, Q_t, info, b, m0, tx)

                if tx < 128:
                    # ------------------------------------------------------ WG0
                    T.set_max_nreg(REG_WG0, 1)
                    T.fill(acc_o, 0)
                    T.fill(l_i, 0)
                    T.fill(m_i, NEG_BIG)
                    if info[5] > 0:
                        T.barrier_wait(full[0], 0)
                        qk_issue(Q_l, Q_r, Q_t, KV0_l, KV0_r, K0_t, Vld0, acc_s, info[1], info[4], m0)
                        T.wait_wgmma(0)
                    for j in T.serial(T.ceildiv(info[5], NSTAGE)):
                        for s in STAGES:
                            if j * NSTAGE + s < info[5]:
                                wg0_step[s](j * NSTAGE + s, info[5], (j + (s + 1) // NSTAGE) & 1, P[s % 2],
                                            Alpha[s % 2], KVl[s], KVl[(s + 1) % NSTAGE], KVr[(s + 1) % NSTAGE],
                                            Kt[(s + 1) % NSTAGE], Vld[(s + 1) % NSTAGE], full, kv_free, s_ready,
                                            p_free, Q_l, Q_r, Q_t, acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
                                            info[1] + (j * NSTAGE + s + 1) * BI, info[4], m0)

                    # ---- epilogue ("ws"'s) ----
                    wg0_finish(inv, l_i, m_i, acc_o, Sink, Fin_s, fin, Lse, Out, LsePart, OPart, Q_l, info, b, item, m0)
                elif tx < 256:
                    # ------------------------------------------------------ WG1
                    T.set_max_nreg(REG_WG1, 1)
                    T.fill(acc_o1, 0)
                    for j in T.serial(T.ceildiv(info[5], NSTAGE)):
                        for s in STAGES:
                            if j * NSTAGE + s < info[5]:
                                wg1_step[s](j * NSTAGE + s, P[s % 2], Alpha[s % 2], KVr[s], kv_free, s_ready, p_free,
                                            acc_o1)
                    T.barrier_wait(fin, 0)
                    for h, d in T.Parallel(BH, DH):
                        acc_o1[h, d] = acc_o1[h, d] * Fin_s[h]
                    if info[3] == 1:
                        T.copy(acc_o1, Q_r)  # WG0 is past its last QK (fin): Q_r is dead
                        T.sync_threads(BAR_WG1, 128)
                        for h, d in T.Parallel(BH, DH):
                            if m0 + h < M:
                                Out[b, m0 + h, DH + d] = Q_r[h, d]
                    else:
                        for h, d in T.Parallel(BH, DH):
                            if m0 + h < M:
                                OPart[item, m0 + h, DH + d] = acc_o1[h, d]
                else:
                    # ------------------------------------------------------ producer
                    T.set_max_nreg(REG_PRODUCER, 0)
                    for j in T.serial(T.ceildiv(info[5], NSTAGE)):
                        for s in STAGES:
                            if j * NSTAGE + s < info[5]:
                                T.barrier_wait(kv_free[s], (j & 1) ^ 1)
                                produce[s](KVl[s], KVr[s], Kt[s], Vld[s], full, KV, BlockTable, b,
                                           info[1] + (j * NSTAGE + s) * BI, info[2])
                    # the consumers wait for every copy anyway; leave nothing in flight at thread exit
                    T.ptx_commit_group()
                    T.ptx_wait_group(0)

    return partial_prim_func("mla_decode_dense_partial_ws_deep", body, M=M, block_size=bs, sizes=sizes)


def _pass_configs():
    return _ws._pass_configs()


@functools.lru_cache(maxsize=64)
def _compiled(heads, s_q, block_size, causal, sm_scale, has_sink, early):
    func = build_partial_kernel(heads=heads, s_q=s_q, block_size=block_size, causal=causal, sm_scale=sm_scale,
                                has_sink=has_sink, early_release=early)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def compiled_partial(heads, s_q, block_size, causal, sm_scale, has_sink):
    """The compiled kernel (cached per configuration and ``$FLASHDSA_WS_DEEP_RELEASE``)."""
    return _compiled(heads, s_q, block_size, causal, sm_scale, has_sink, early_release())


def lowering_cases():
    """(name, prim_func) for the CPU lowering test (collected through ``kernel_dense.lowering_cases``)."""
    heads, s_q, bs, causal, sink = 16, 1, 16, True, True  # the dispatched small-M case, 2 pages per tile
    name = f"ws_deep_h{heads}_sq{s_q}_bs{bs}" + ("_causal" if causal else "") + ("_sink" if sink else "")
    return [(name, build_partial_kernel(heads=heads, s_q=s_q, block_size=bs, causal=causal, sm_scale=DQK ** -0.5,
                                        has_sink=sink))]
