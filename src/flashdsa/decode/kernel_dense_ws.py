"""Dense MLA decode over a paged bf16 cache: warp-specialised split-KV partial kernel (TileLang, Hopper sm_90a).

Notes
-----
Same contract, split plan, partial buffers and combine kernel as ``kernel_dense.py`` (which owns the host side and
dispatches here for ``variant="ws"``); only the partial kernel differs.  Its structure is the one that runs on the
H200 in the first warp-specialised sparse forward (``sparse/kernel_fwd_ws.py``, removed in session 42 once the
pair kernel had overtaken it everywhere; docs/PERFORMANCE.md "Session 2"): a producer warpgroup + two consumer
warpgroups splitting d_v, mbarrier hand-offs, 240 + 176 + 88 registers, with the paged-cache gather.

Why the pipelined kernel is slow (1.25 ms / 0.49 TB/s at B 64 H 16, 1.41 ms / 207 TFLOP/s at B 128 H 128):
  * 32-key tiles with one tile in flight, issued after the barrier that ends the previous tile: the HBM latency
    is exposed once per 36 KB per SM.
  * ``GemmWarpPolicy.FullRow`` splits the 32 keys of S between the two warpgroups (m64n16 wgmma, 32 serial k-steps
    each, smem-bound), so every row max / row sum is a cross-warpgroup reduction through shared memory: ~10
    ``__syncthreads`` per 32-key tile, and load, QK, softmax and PV never overlap.
  * The two 64-row tiles of one split (H 128) ran ``max_items`` CTAs apart, so each page was read from HBM twice.

Design
  * Work: the GPU split plan of ``kernel_dense._plan`` in 64-key tiles.  1-D grid ``max_items * n_mt``, row tile
    fastest (``bx = item * n_mt + mt``): the ``n_mt`` CTAs of one split are adjacent, run together, and the second
    read of each page is an L2 hit.  Idle items exit at once (uniform per CTA, before any barrier).
  * 384 threads = 3 warpgroups with ``setmaxnreg``:
      - WG0 (240 regs): S = Q K^T for 64 rows x 64 keys over the full 576 dims (3 async wgmma, 64x64), masks,
        online softmax (fp32, exp2, ``sm_scale*log2(e)`` folded), P (bf16) and alpha to shared memory,
        O[:, 0:256] += P V[:, 0:256]; QK of tile i+1 is issued right behind PV_l of tile i.
      - WG1 (176 regs): O[:, 256:512] *= alpha; += P V[:, 256:512].
      - producer (88 regs): copies the 64 cache rows of tile i into buffer i % 2 with 16-byte cp.async (one warp
        per row per pass); row r of the tile is position p = p0 + r, slot ``p % bs`` of page
        ``BlockTable[b, p // bs]``; rows with p >= end or an out-of-range page id use the zero-filling form
        (nothing is read, so NaN in unused slots or pages cannot leak) and get a 0 flag in ``Vld``.
  * Synchronisation (mbarriers; tile i uses buffer i % 2 with parity (i // 2) & 1): kv_ready[b] (128 producer
    arrivals after wait_group 0 + fence.proxy.async), s_ready[b] (128, WG0 -> WG1: P and alpha in smem),
    kv_free[b] (256, both consumers after their PV on buffer b retired), fin (128, WG0 -> WG1 after the loop:
    final row scale in smem, Q no longer read).  Intra-role syncs are named barriers 8 (WG0) / 9 (WG1); the
    automatic thread-storage-sync pass is off.
  * Masking: score (row m, position p) starts at 0 when Vld[p] (and, causal, p < seqlen - s_q + 1 + m // H), else
    -inf, before the QK wgmma accumulates; the running max starts at the finite -1e30 so an all-masked tile gives
    exp2(-inf) = 0.  Rows m >= s_q * H (padding of the last row tile) read q = 0 and are never written.
  * Output: nsplit_b == 1 writes bf16 out (staged through the dead Q tiles) and natural-log lse with the sink
    folded into the normaliser; otherwise fp32 normalised partial out + base-2 lse to OPart / LsePart for the
    combine kernel of ``kernel_dense``.

Shared memory: Q 64 x 576 (73,728 B) + 2 KV buffers 64 x 576 (147,456 B; the 64 x 64 rope tile of each doubles
  as P after QK) + Vld 2 x 64 B + alpha 2 x 64 f32 + final scale 64 f32 + 7 mbarriers ~= 222 KB of 232,448 B.
Registers: launch pool 168 x 384 = 64,512 -> setmaxnreg 240 + 176 + 88 = 504 per thread-slot (see the sparse
  kernel's post-mortem: asking for more hangs in setmaxnreg.inc).

Expected (derived, not measured): per 64-key tile 8.9 MFLOP of wgmma per CTA and 72 KB streamed.
  * B 64, H 16, s_q 1, cache 8192: 128 splits of 64 tiles (one wave); HBM-bound when a 72 KB tile lands faster
    than ~2 tiles of compute (~1.2 us tensor work each at the padded M = 64): ~2 tiles in flight per SM.
  * B 128, H 128 (n_mt 2): 256 CTAs, the pair of one sequence shares L2; bound by WG0's serial
    QK -> softmax -> PV_l chain (only WG1's PV_r overlaps WG0's softmax).
"""

import functools

import tilelang
import tilelang.language as T

from .._tilelang import plain_pass_configs
from ..sparse._tl_common import wg1_pv_step_macro
from . import kernel_dense as _kd
from ._tl_common import item_macros, partial_prim_func, partial_sizes

LOG2E = _kd.LOG2E
LN2 = _kd.LN2
DQK, D_V, D_ROPE = _kd.DQK, _kd.D_V, _kd.D_ROPE
BLOCK_M = 64  # query rows per CTA (wgmma M)
BLOCK_N = 64  # cache positions per tile
_OVERHEAD_TILES = 3  # fixed cost of one split in 64-key tiles (Q load, epilogue, combine)
_MIN_CHUNK_TILES = 2
THREADS = 384
# setmaxnreg budget: the pool is the launch allocation, (65536 // 384) // 8 * 8 = 168 registers x 384 threads,
# so the three per-thread counts must sum to <= 504 (512 hung the first sparse ws kernel on the H200).
REG_WG0, REG_WG1, REG_PRODUCER = 240, 176, 88
_REG_LAUNCH = (65536 // THREADS) // 8 * 8
assert REG_WG0 + REG_WG1 + REG_PRODUCER <= 3 * _REG_LAUNCH
BAR_WG0, BAR_WG1 = 8, 9  # named barriers of 128 threads (0 is __syncthreads)


def ctas_per_sm(rows: int) -> int:
    """Resident CTAs per SM (the split plan sizes its work items with it): ~222 KB of shared memory, one."""
    return 1


def build_partial_kernel(*, heads: int, s_q: int, block_size: int, causal: bool, sm_scale: float,
                         has_sink: bool):
    """Warp-specialised split-KV attention kernel; same signature as ``kernel_dense.build_partial_kernel``.

    Signature: (Q [B, M, 576] bf16, KV [num_blocks, block_size, 576] bf16, BlockTable [B, max_blocks] i32,
    SeqLens [B] i32, Plan [4, max_items] i32 (b or -1, start, end, nsplit_b), Sink [n_sink] f32,
    Out [B, M, 512] bf16, Lse [B, M] f32, OPart [max_items, M, 512] f32, LsePart [max_items, M] f32),
    M = s_q * heads.  Launch grid: max_items * n_mt CTAs (n_mt = ceil(M / 64)).
    """
    M = s_q * heads
    n_mt = (M + BLOCK_M - 1) // BLOCK_M
    BH, BI, D, DH, DT = BLOCK_M, BLOCK_N, D_V, D_V // 2, D_ROPE
    bs = int(block_size)
    c_log2 = float(sm_scale) * LOG2E
    neg_big = -1.0e30
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    sizes = partial_sizes()
    _, nblk, maxb, nitem, _ = sizes  # (batch, num_blocks, max_blocks, max_items, n_sink)
    load_item, start_item, wg0_finish = item_macros(M=M, s_q=s_q, causal=causal, BH=BH, BI=BI, heads=heads,
                                                    has_sink=has_sink, c_log2=c_log2, bar_wg0=BAR_WG0)

    def _page(BlockTable, b, p):
        # page id of position p (the table read stays in bounds; p may run past the table on the last tile)
        return BlockTable[b, T.min(p // bs, maxb - 1)]

    def _ok(p, end, pg):
        return (p < end) & (pg >= 0) & (pg < nblk)

    # ------------------------------------------------------------------ producer
    @T.macro
    def gather(KVl, KVr, Kt, Vld, KV, BlockTable, b, p0, end):
        for r in T.Parallel(BI):
            pg = _page(BlockTable, b, p0 + r)
            Vld[r] = _ok(p0 + r, end, pg)
        # one parallel nest = one cp.async group (TileLang closes it with commit + wait_group 0): one warp per row,
        # 16 B per lane per statement, the 64-column chunk c as a nest dimension, the rope tile by the c == 0
        # quarter; invalid rows use the zero-filling predicated form.  (No inner serial loop: it disables the
        # cp.async rewrite; `pg`/`ok` bound once per iteration keep the lowering fast.)
        for r, c, d in T.Parallel(BI, 4, 64, annotations={"parallel_prefer_async": True}):
            pg = _page(BlockTable, b, p0 + r)
            ok = _ok(p0 + r, end, pg)
            pgc = T.if_then_else(ok, pg, 0)
            slot = (p0 + r) % bs
            KVl[r, c * 64 + d] = T.if_then_else(ok, KV[pgc, slot, c * 64 + d], T.cast(0, bf16))
            KVr[r, c * 64 + d] = T.if_then_else(ok, KV[pgc, slot, DH + c * 64 + d], T.cast(0, bf16))
            if c == 0:
                Kt[r, d] = T.if_then_else(ok, KV[pgc, slot, D + d], T.cast(0, bf16))
        T.fence_proxy_async()  # landed tile + flags visible to the wgmma (async) proxy before the arrive

    # ------------------------------------------------------------------ WG0 pieces
    @T.macro
    def qk_issue(Ql, Qr, Qt, KVl, KVr, Kt, Vld, acc_s, p0, lim0, m0):
        for h, r in T.Parallel(BH, BI):
            if causal:
                acc_s[h, r] = T.if_then_else(Vld[r] & (p0 + r < lim0 + (m0 + h) // heads), T.float32(0),
                                             -T.infinity(f32))
            else:
                acc_s[h, r] = T.if_then_else(Vld[r], T.float32(0), -T.infinity(f32))
        T.wgmma_gemm(Ql, KVl, acc_s, transpose_B=True)
        T.wgmma_gemm(Qr, KVr, acc_s, transpose_B=True)
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
        T.sync_threads(BAR_WG0, 128)  # every WG0 warp is past its QK wait: the rope tile (= P) is free
        T.copy(alpha, Alpha_s)
        T.copy(acc_s, P)
        T.fence_proxy_async()
        T.sync_threads(BAR_WG0, 128)  # whole P tile written before the PV wgmma

    @T.macro
    def wg0_step(blk, nt, nxt_phase, P, Alpha_s, s_rdy, kv_fr, KVl, nkv_rdy, nKVl, nKVr, nKt, nVld, Ql, Qr, Qt,
                 acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk, p_next, lim0, m0):
        # acc_s holds S of tile blk (its QK retired)
        softmax_to_p(acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk, P, Alpha_s)
        T.barrier_arrive(s_rdy)
        T.wgmma_gemm(P, KVl, acc_o)
        if blk + 1 < nt:
            # queue QK(blk+1) behind PV_l(blk) (the tensor pipe does not drain); retire PV first to free buffer
            T.barrier_wait(nkv_rdy, nxt_phase)
            qk_issue(Ql, Qr, Qt, nKVl, nKVr, nKt, nVld, acc_s, p_next, lim0, m0)
            T.wait_wgmma(3)
            T.barrier_arrive(kv_fr)
            T.wait_wgmma(0)
        else:
            T.wait_wgmma(0)
            T.barrier_arrive(kv_fr)

    wg1_step = wg1_pv_step_macro(BH=BH, DH=DH)

    @T.macro
    def body(Q, KV, BlockTable, SeqLens, Plan, Sink, Out, Lse, OPart, LsePart):
        with T.Kernel(nitem * n_mt, threads=THREADS) as bx:
            Q_l = T.alloc_shared([BH, DH], bf16)
            Q_r = T.alloc_shared([BH, DH], bf16)
            Q_t = T.alloc_shared([BH, DT], bf16)
            KV0_l = T.alloc_shared([BI, DH], bf16)
            KV0_r = T.alloc_shared([BI, DH], bf16)
            KV1_l = T.alloc_shared([BI, DH], bf16)
            KV1_r = T.alloc_shared([BI, DH], bf16)
            K0_t = T.alloc_shared([BI, DT], bf16)
            K1_t = T.alloc_shared([BI, DT], bf16)
            P0 = K0_t  # P of a tile reuses its rope tile (dead after QK)
            P1 = K1_t
            Vld0 = T.alloc_shared([BI], "bool")
            Vld1 = T.alloc_shared([BI], "bool")
            Alpha0 = T.alloc_shared([BH], f32)
            Alpha1 = T.alloc_shared([BH], f32)
            Fin_s = T.alloc_shared([BH], f32)

            kv_ready0 = T.alloc_barrier(128)
            kv_ready1 = T.alloc_barrier(128)
            s_ready0 = T.alloc_barrier(128)
            s_ready1 = T.alloc_barrier(128)
            kv_free0 = T.alloc_barrier(256)
            kv_free1 = T.alloc_barrier(256)
            fin = T.alloc_barrier(128)

            acc_o = T.alloc_fragment([BH, DH], f32)  # WG0: O[:, 0:256]
            acc_o1 = T.alloc_fragment([BH, DH], f32)  # WG1: O[:, 256:512] (own fragment: see the sparse WS notes)
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
                    T.fill(m_i, neg_big)
                    if info[5] > 0:
                        T.barrier_wait(kv_ready0, 0)
                        qk_issue(Q_l, Q_r, Q_t, KV0_l, KV0_r, K0_t, Vld0, acc_s, info[1], info[4], m0)
                        T.wait_wgmma(0)
                    for j in T.serial(T.ceildiv(info[5], 2)):
                        wg0_step(j * 2, info[5], j & 1, P0, Alpha0, s_ready0, kv_free0, KV0_l,
                                 kv_ready1, KV1_l, KV1_r, K1_t, Vld1, Q_l, Q_r, Q_t,
                                 acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
                                 info[1] + (j * 2 + 1) * BI, info[4], m0)
                        if j * 2 + 1 < info[5]:
                            wg0_step(j * 2 + 1, info[5], (j + 1) & 1, P1, Alpha1, s_ready1, kv_free1, KV1_l,
                                     kv_ready0, KV0_l, KV0_r, K0_t, Vld0, Q_l, Q_r, Q_t,
                                     acc_s, acc_o, m_i, m_prev, alpha, l_i, l_blk,
                                     info[1] + (j * 2 + 2) * BI, info[4], m0)

                    # ---- epilogue ----
                    wg0_finish(inv, l_i, m_i, acc_o, Sink, Fin_s, fin, Lse, Out, LsePart, OPart, Q_l, info, b, item, m0)
                elif tx < 256:
                    # ------------------------------------------------------ WG1
                    T.set_max_nreg(REG_WG1, 1)
                    T.fill(acc_o1, 0)
                    for j in T.serial(T.ceildiv(info[5], 2)):
                        wg1_step(j & 1, s_ready0, Alpha0, P0, KV0_r, kv_free0, acc_o1)
                        if j * 2 + 1 < info[5]:
                            wg1_step(j & 1, s_ready1, Alpha1, P1, KV1_r, kv_free1, acc_o1)
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
                    for j in T.serial(T.ceildiv(info[5], 2)):
                        T.barrier_wait(kv_free0, (j & 1) ^ 1)
                        gather(KV0_l, KV0_r, K0_t, Vld0, KV, BlockTable, b, info[1] + j * 2 * BI, info[2])
                        T.barrier_arrive(kv_ready0)
                        if j * 2 + 1 < info[5]:
                            T.barrier_wait(kv_free1, (j & 1) ^ 1)
                            gather(KV1_l, KV1_r, K1_t, Vld1, KV, BlockTable, b, info[1] + (j * 2 + 1) * BI,
                                   info[2])
                            T.barrier_arrive(kv_ready1)

    return partial_prim_func("mla_decode_dense_partial_ws", body, M=M, block_size=bs, sizes=sizes)


def _pass_configs():
    # intra-role syncs are explicit named barriers (8 / 9): the automatic pass can hand the producer and WG0 the
    # same barrier id (seen in the first sparse ws kernel)
    return plain_pass_configs({tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})


@functools.lru_cache(maxsize=64)
def compiled_partial(heads, s_q, block_size, causal, sm_scale, has_sink):
    func = build_partial_kernel(heads=heads, s_q=s_q, block_size=block_size, causal=causal, sm_scale=sm_scale,
                                has_sink=has_sink)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test (lowering is slow)."""
    cases = []
    for heads, s_q, bs, causal, sink in [
        (63, 2, 16, True, True),  # odd H (row tiles straddle queries), small pages, causal, sink
    ]:
        name = f"ws_h{heads}_sq{s_q}_bs{bs}" + ("_causal" if causal else "") + ("_sink" if sink else "")
        cases.append((name, build_partial_kernel(heads=heads, s_q=s_q, block_size=bs, causal=causal,
                                                 sm_scale=DQK ** -0.5, has_sink=sink)))
    return cases
