"""Dense MLA decode over a paged bf16 cache for few query rows (``s_q * H <= 32``): cache positions on the wgmma M
side, query rows on N.

Notes
-----
Same contract, split plan, partial buffers and combine kernel as ``kernel_dense.py`` (which owns the host side and
picks this module through ``kernel_dense._ws_module``); only the partial kernel differs.

Why: the other partial kernels put the ``s_q * H`` query rows on the wgmma M side, padded to 64, so H = 16 pays for
64 rows of tensor work per 72 KB cache tile and runs the same per-tile chain as H = 64: the memory-bound decode
(B 64, H 16, cache 8192) ran at 1.64 TB/s (target 3.8), ~5.7 us per tile and SM.  Here a tile's 64 cache positions
are M and the (zero-padded) query rows are N, ``BR`` = 16 or 32:

  * ``S^T [64, BR] = K Q^T`` (A = the KV tile, K-major; B = the Q tile ``[BR, 576]``), staged through shared memory
    in fp32 and read back transposed as ``S [BR, 64]``, so the online softmax's row max / sum are row reductions;
  * ``O^T [512, BR] += V^T P^T`` (A = the V columns of the same tile read MN-major, i.e. transposed; B = P
    ``[BR, 64]`` bf16), fp32 accumulators (``512 * BR / threads`` registers per thread), rescaled by the per-row
    ``alpha`` broadcast through shared memory.

Schedule (one work item of the split plan per CTA, ``THREADS`` = 128: one warpgroup): two tile buffers; at the top of
iteration ``it`` tile ``it + 1`` is issued into the buffer tile ``it - 1`` released, then the CTA waits for tile
``it`` only and computes it, so up to two 72 KB tiles are in flight.  Loads (``LOADER``): "tma" -- one tensor-map
load per page segment and 64-column box on the buffer's mbarrier (thread 0 arrives after issuing, so the expected
bytes are registered before the phase can complete); "cpasync" -- 16-byte cp.async, used for pages smaller than a
tile (TileLang cannot lower a TMA into a 16/32-row slice of the swizzled tile).  T.Pipelined is not used: it cannot
take the data-dependent trip count.

Masking: page segments past the split's end or with an out-of-range page id are never read (a per-stage bit mask in
registers marks the copied ones); rows past ``end`` inside a copied segment (unused slots, may be NaN) are zeroed in
shared memory before the PV product; masked scores are -inf and the running max starts at the finite -1e30 (no
``-inf - -inf``).  Causal: row ``n`` (query ``n // H``) sees ``p < seqlen - s_q + 1 + n // H``.

Shared memory: 2 x 72 KB tiles + Q ``BR x 576`` bf16 + S^T fp32 ``64 x BR`` + P bf16 ``BR x 64``: 171 / 198 KB at
BR = 16 / 32, one CTA per SM.  ``STAGES = 1`` (one buffer, 97 KB, two CTAs per SM; the plan then makes twice the
work items) is kept as a build option for ``scripts/bench_decode.py``.

Measured (H200, scripts/bench_decode.py, partial + combine kernels, L2 flushed; ``docs/PERFORMANCE.md``): B 64, H 16,
cache 8192: ws 0.364 ms (1.66 TB/s) -> 256 threads / cp.async / 1 buffer-in-flight 0.191 ms -> 128 threads / TMA /
2 in flight **0.1625 ms, 3.73 TB/s**; H 32: 0.364 -> 0.173 ms (3.52 TB/s).
"""

import functools

import tilelang
import tilelang.language as T

from ..sparse._tl_common import narrow_macros
from . import kernel_dense as _kd
from ._tl_common import D_ROPE, D_V, DQK, LN2, LOG2E, item_macros, partial_prim_func, partial_sizes

BLOCK_N = 64  # cache positions per tile (the wgmma M)
MAX_ROWS = 32  # s_q * H handled here (BR = 16 or 32)
_OVERHEAD_TILES = 2  # fixed cost of one split in 64-key tiles (Q load, epilogue, combine)
_MIN_CHUNK_TILES = 2
THREADS = 128  # build defaults (module globals so that scripts/bench_decode.py can sweep them)
STAGES = 2  # KV tile buffers per CTA: 2 (tile it + 1 issued before waiting for tile it) or 1 (two CTAs per SM)
LOADER = "tma"  # "tma": tensor-map loads of whole page segments; "cpasync": 16-byte cp.async
_SMEM_CAP = 232_448


def rows_tile(rows: int) -> int:
    """The wgmma N (query rows per CTA, zero-padded) for ``s_q * H = rows``."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"narrow decode kernel: s_q*H={rows} not in 1..{MAX_ROWS}")
    return 16 if rows <= 16 else 32


def smem_bytes(rows: int, stages: int) -> int:
    """Shared memory of one CTA (TileLang adds up to ~1 KB of reduction scratch)."""
    BR = rows_tile(rows)
    return stages * BLOCK_N * DQK * 2 + BR * DQK * 2 + BLOCK_N * BR * 4 + BR * BLOCK_N * 2 + BR * 4 + 1024


def ctas_per_sm(rows: int) -> int:
    """Resident CTAs per SM for ``s_q * H = rows`` (the split plan sizes its work items with it)."""
    return max(1, min(2, _SMEM_CAP // smem_bytes(rows, STAGES)))


def _loader(loader: str | None, block_size: int) -> str:
    # TileLang 0.1.15 cannot lower a tensor-map load into a 16- or 32-row slice of the swizzled tile ("plain SMEM
    # layout is not a bijection"): pages smaller than a tile use cp.async
    loader = LOADER if loader is None else loader
    return loader if int(block_size) >= BLOCK_N else "cpasync"


def build_partial_kernel(*, heads: int, s_q: int, block_size: int, causal: bool, sm_scale: float,
                         has_sink: bool, threads: int | None = None, stages: int | None = None,
                         loader: str | None = None):
    """Split-KV partial kernel; same signature and launch (grid ``max_items``, ``n_mt = 1``) as
    ``kernel_dense.build_partial_kernel``.  ``threads`` (128 or 256), ``stages`` (1 or 2) and ``loader`` ("tma" or
    "cpasync") default to the module's ``THREADS`` / ``STAGES`` / ``LOADER``."""
    M = s_q * heads
    sizes = partial_sizes()
    nitem = sizes[3]
    threads, alloc_item, run_item = item_parts(heads=heads, s_q=s_q, block_size=block_size, causal=causal,
                                               sm_scale=sm_scale, has_sink=has_sink, threads=threads, stages=stages,
                                               loader=loader, sizes=sizes)
    load_item = item_macros(M=M, s_q=s_q, causal=causal, BH=rows_tile(M), BI=BLOCK_N)[0]

    @T.macro
    def body(Q, KV, BlockTable, SeqLens, Plan, Sink, Out, Lse, OPart, LsePart):
        with T.Kernel(nitem, threads=threads) as bx:
            bufs = alloc_item()
            tx = T.get_thread_binding()
            load_item(Plan, bufs[-2], bx)  # info[0:4] = b (-1: idle item), start (multiple of BLOCK_N), end, nsplit
            run_item(Q, KV, BlockTable, SeqLens, Sink, Out, Lse, OPart, LsePart, bufs, bx, tx)

    return partial_prim_func("mla_decode_dense_partial_narrow", body, M=M, block_size=int(block_size), sizes=sizes)


def item_parts(*, heads: int, s_q: int, block_size: int, causal: bool, sm_scale: float, has_sink: bool,
               threads: int | None, stages: int | None, loader: str | None, sizes):
    """(threads, alloc_item, run_item): the per-CTA work of the narrow partial kernel, shared with the single-launch
    variant (``kernel_dense_fused``).  ``threads`` / ``stages`` / ``loader`` None take the module defaults;
    ``sizes`` = ``partial_sizes()`` of the enclosing prim_func.

    * ``bufs = alloc_item()`` (first thing inside ``T.Kernel``): the shared / fragment / local buffers, in the
      order the kernel always allocated them; ``bufs[-2]`` is ``info`` (int32 [6]: b or -1, start, end, nsplit_b,
      causal offset, tiles), ``bufs[-1]`` the per-stage segment masks.
    * ``run_item(Q, KV, BlockTable, SeqLens, Sink, Out, Lse, OPart, LsePart, bufs, item, tx)``, with ``info[0:4]``
      set in every thread: nothing for ``info[0] < 0``; else attention over positions ``[start, end)`` of sequence
      b, written as the final bf16 out + natural-log lse when ``nsplit_b == 1``, else as the normalised fp32
      ``OPart[item]`` and base-2 ``LsePart[item]`` (-inf for a row without keys).
    """
    threads = THREADS if threads is None else threads
    stages = STAGES if stages is None else stages
    loader = _loader(loader, block_size)
    assert threads in (128, 256) and stages in (1, 2) and loader in ("tma", "cpasync"), (threads, stages, loader)
    M = s_q * heads
    BR = rows_tile(M)
    BN, D, DT = BLOCK_N, D_V, D_ROPE
    bs = int(block_size)
    SEG = min(bs, BN)  # rows of a tile contiguous in one page
    NSEG = BN // SEG
    GROUPS = 2 * NSEG  # cp.async commit groups per tile
    c_log2 = float(sm_scale) * LOG2E
    neg_big = -1.0e30
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    _, nblk, maxb, _, _ = sizes
    qk_t, softmax_pv, _ = narrow_macros(BR=BR, BI=BN, D=D, has_tail=True, c_log2=c_log2)

    @T.macro
    def issue_tile(KV, BlockTable, b, p0, end, KV_b, Kt_b, bar, seg_ok, st, tx):
        # The tile's page segments; a segment past the split's end or with an out-of-range page id is never read
        # (bit sg of seg_ok[st] = 0 masks its rows).
        #  * "tma": one tensor-map load per segment and 64-column box (TileLang splits the [SEG, 512] region) on the
        #    stage's mbarrier; thread 0 arrives after issuing, so the expected bytes are registered before the
        #    phase can complete (a tile without a valid segment completes on the arrival alone).
        #  * "cpasync": every T.async_copy closes its own commit group, so a skipped segment commits two empty
        #    groups: a tile is always GROUPS groups, which the loop's wait_group count relies on.
        seg_ok[st] = 0
        for sg in T.unroll(NSEG):
            pg = BlockTable[b, T.min((p0 + sg * SEG) // bs, maxb - 1)]
            if (p0 + sg * SEG < end) and (pg >= 0) and (pg < nblk):
                seg_ok[st] = seg_ok[st] | (1 << sg)
                if loader == "tma":
                    T.tma_copy(KV[pg, (p0 + sg * SEG) % bs:(p0 + sg * SEG) % bs + SEG, 0:D],
                               KV_b[sg * SEG:(sg + 1) * SEG, :], barrier=bar)
                    T.tma_copy(KV[pg, (p0 + sg * SEG) % bs:(p0 + sg * SEG) % bs + SEG, D:DQK],
                               Kt_b[sg * SEG:(sg + 1) * SEG, :], barrier=bar)
                else:
                    T.async_copy(KV[pg, (p0 + sg * SEG) % bs:(p0 + sg * SEG) % bs + SEG, 0:D],
                                 KV_b[sg * SEG:(sg + 1) * SEG, :])
                    T.async_copy(KV[pg, (p0 + sg * SEG) % bs:(p0 + sg * SEG) % bs + SEG, D:DQK],
                                 Kt_b[sg * SEG:(sg + 1) * SEG, :])
            elif loader == "cpasync":
                T.ptx_commit_group()
                T.ptx_commit_group()
        if loader == "tma":
            if tx == 0:
                T.barrier_arrive(bar)

    @T.macro
    def wait_tile(bar, phase, more):
        # tile it has landed (with "cpasync": all but tile it + 1's groups when it was issued just before)
        if loader == "tma":
            T.mbarrier_wait_parity(bar, phase)
        else:
            if more:
                T.ptx_wait_group(GROUPS)
            else:
                T.ptx_wait_group(0)
            T.sync_threads()

    @T.macro
    def attend_tile(p0, end, lim0, KV_b, Kt_b, seg_ok, st, Q_s, Qt_s, ST_s, P_s, Alpha_s, acc_t, acc_ot, s_f,
                    m_i, m_prev, alpha, l_i, l_blk):
        if p0 + BN > end:
            # rows past the end of a copied page segment may hold NaN: zero them before V^T P^T reads them
            for r, d in T.Parallel(BN, D):
                if p0 + r >= end:
                    KV_b[r, d] = T.cast(0, bf16)
            for r, d in T.Parallel(BN, DT):
                if p0 + r >= end:
                    Kt_b[r, d] = T.cast(0, bf16)
            T.sync_threads()
        qk_t(KV_b, Kt_b, Q_s, Qt_s, acc_t, ST_s)
        for n, r in T.Parallel(BR, BN):
            ok = (p0 + r < end) & (((seg_ok[st] >> (r // SEG)) & 1) != 0)
            if causal:
                ok = ok & (p0 + r < lim0 + n // heads)
            s_f[n, r] = T.if_then_else(ok, ST_s[r, n], -T.infinity(f32))
        softmax_pv(KV_b, s_f, P_s, Alpha_s, acc_ot, m_i, m_prev, alpha, l_i, l_blk)

    @T.macro
    def alloc_item():
        Q_s = T.alloc_shared([BR, D], bf16)
        Qt_s = T.alloc_shared([BR, DT], bf16)
        KV_0 = T.alloc_shared([BN, D], bf16)
        Kt_0 = T.alloc_shared([BN, DT], bf16)
        if stages == 2:
            KV_1 = T.alloc_shared([BN, D], bf16)
            Kt_1 = T.alloc_shared([BN, DT], bf16)
        else:
            KV_1, Kt_1 = KV_0, Kt_0
        ST_s = T.alloc_shared([BN, BR], f32)
        P_s = T.alloc_shared([BR, BN], bf16)
        Alpha_s = T.alloc_shared([BR], f32)
        bar0 = T.alloc_barrier(1)
        bar1 = T.alloc_barrier(1)

        acc_t = T.alloc_fragment([BN, BR], f32)
        acc_ot = T.alloc_fragment([D, BR], f32)
        s_f = T.alloc_fragment([BR, BN], f32)
        m_i = T.alloc_fragment([BR], f32)
        m_prev = T.alloc_fragment([BR], f32)
        alpha = T.alloc_fragment([BR], f32)
        l_i = T.alloc_fragment([BR], f32)
        l_blk = T.alloc_fragment([BR], f32)
        inv = T.alloc_fragment([BR], f32)
        lse2 = T.alloc_fragment([BR], f32)
        info = T.alloc_local([6], i32)
        seg_ok = T.alloc_local([2], i32)  # per stage: bit sg set = page segment sg copied
        return (Q_s, Qt_s, KV_0, Kt_0, KV_1, Kt_1, ST_s, P_s, Alpha_s, bar0, bar1, acc_t, acc_ot, s_f, m_i, m_prev,
                alpha, l_i, l_blk, inv, lse2, info, seg_ok)

    @T.macro
    def run_item(Q, KV, BlockTable, SeqLens, Sink, Out, Lse, OPart, LsePart, bufs, bx, tx):
        (Q_s, Qt_s, KV_0, Kt_0, KV_1, Kt_1, ST_s, P_s, Alpha_s, bar0, bar1, acc_t, acc_ot, s_f, m_i, m_prev, alpha,
         l_i, l_blk, inv, lse2, info, seg_ok) = bufs
        if info[0] >= 0:
            b = info[0]
            info[4] = SeqLens[b] - s_q + 1 if causal else 0  # causal: row n sees p < info[4] + n // heads
            info[5] = T.ceildiv(info[2] - info[1], BN)
            T.clear(KV_0)
            T.clear(Kt_0)
            if stages == 2:
                T.clear(KV_1)
                T.clear(Kt_1)
            for n, d in T.Parallel(BR, D):
                Q_s[n, d] = T.if_then_else(n < M, Q[b, T.min(n, M - 1), d], T.cast(0, bf16))
            for n, d in T.Parallel(BR, DT):
                Qt_s[n, d] = T.if_then_else(n < M, Q[b, T.min(n, M - 1), D + d], T.cast(0, bf16))
            T.fill(acc_ot, 0)
            T.fill(l_i, 0)
            T.fill(m_i, neg_big)
            T.fence_proxy_async()  # the zero fill above before the async-proxy (TMA) writes into the tiles
            T.sync_threads()
            if info[5] > 0:
                issue_tile(KV, BlockTable, b, info[1], info[2], KV_0, Kt_0, bar0, seg_ok, 0, tx)

            if stages == 2:
                for it in T.serial(info[5]):
                    # issue tile it + 1 (into the buffer tile it - 1 released at the end of the last iteration)
                    # BEFORE waiting for tile it: two tiles in flight per CTA
                    if it % 2 == 0:
                        if it + 1 < info[5]:
                            issue_tile(KV, BlockTable, b, info[1] + (it + 1) * BN, info[2], KV_1, Kt_1, bar1,
                                       seg_ok, 1, tx)
                        wait_tile(bar0, (it // 2) & 1, it + 1 < info[5])
                        attend_tile(info[1] + it * BN, info[2], info[4], KV_0, Kt_0, seg_ok, 0, Q_s, Qt_s, ST_s,
                                    P_s, Alpha_s, acc_t, acc_ot, s_f, m_i, m_prev, alpha, l_i, l_blk)
                    else:
                        if it + 1 < info[5]:
                            issue_tile(KV, BlockTable, b, info[1] + (it + 1) * BN, info[2], KV_0, Kt_0, bar0,
                                       seg_ok, 0, tx)
                        wait_tile(bar1, (it // 2) & 1, it + 1 < info[5])
                        attend_tile(info[1] + it * BN, info[2], info[4], KV_1, Kt_1, seg_ok, 1, Q_s, Qt_s, ST_s,
                                    P_s, Alpha_s, acc_t, acc_ot, s_f, m_i, m_prev, alpha, l_i, l_blk)
                    T.sync_threads()  # the buffer just read is refilled in the next iteration
            else:
                for it in T.serial(info[5]):
                    # one buffer: tile it is issued once tile it - 1 has been consumed
                    if it > 0:
                        issue_tile(KV, BlockTable, b, info[1] + it * BN, info[2], KV_0, Kt_0, bar0, seg_ok, 0, tx)
                    wait_tile(bar0, it & 1, False)
                    attend_tile(info[1] + it * BN, info[2], info[4], KV_0, Kt_0, seg_ok, 0, Q_s, Qt_s, ST_s,
                                P_s, Alpha_s, acc_t, acc_ot, s_f, m_i, m_prev, alpha, l_i, l_blk)
                    T.sync_threads()

            # ---- epilogue: the row scale goes through Alpha_s (acc_ot's layout differs from the rows') ----
            for n in T.Parallel(BR):
                lse2[n] = T.if_then_else(l_i[n] > 0, T.log2(l_i[n]) + m_i[n] * c_log2, -T.infinity(f32))
            if info[3] == 1:
                for n in T.Parallel(BR):
                    if has_sink:
                        inv[n] = T.if_then_else(
                            l_i[n] > 0,
                            1.0 / (l_i[n] + T.exp2(Sink[n % heads] * T.float32(LOG2E) - m_i[n] * c_log2)),
                            T.float32(0))
                    else:
                        inv[n] = T.if_then_else(l_i[n] > 0, 1.0 / l_i[n], T.float32(0))
                T.copy(inv, Alpha_s)
                T.sync_threads()
                for d, n in T.Parallel(D, BR):
                    Q_s[n, d] = T.cast(acc_ot[d, n] * Alpha_s[n], bf16)  # Q_s is dead: stage the output
                T.sync_threads()
                for n, d in T.Parallel(BR, D):
                    if n < M:
                        Out[b, n, d] = Q_s[n, d]
                for n in T.Parallel(BR):
                    if n < M:
                        Lse[b, n] = T.if_then_else(l_i[n] > 0, lse2[n] * T.float32(LN2), T.infinity(f32))
            else:
                for n in T.Parallel(BR):
                    inv[n] = T.if_then_else(l_i[n] > 0, 1.0 / l_i[n], T.float32(0))
                T.copy(inv, Alpha_s)
                T.sync_threads()
                for d, n in T.Parallel(D, BR):
                    if n < M:
                        OPart[bx, n, d] = acc_ot[d, n] * Alpha_s[n]
                for n in T.Parallel(BR):
                    if n < M:
                        LsePart[bx, n] = lse2[n]

    return threads, alloc_item, run_item


def _pass_configs():
    # no automatic warp specialisation, whichever the loader: the "tma" loader's tensor-map loads are explicit
    # ``T.tma_copy`` calls and no ``T.copy`` of these kernels moves global <-> shared
    return _kd._pass_configs()


@functools.lru_cache(maxsize=64)
def _compiled(heads, s_q, block_size, causal, sm_scale, has_sink, threads, stages, loader):
    func = build_partial_kernel(heads=heads, s_q=s_q, block_size=block_size, causal=causal, sm_scale=sm_scale,
                                has_sink=has_sink, threads=threads, stages=stages, loader=loader)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def compiled_partial(heads, s_q, block_size, causal, sm_scale, has_sink):
    return _compiled(heads, s_q, block_size, causal, sm_scale, has_sink, THREADS, STAGES, LOADER)


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    cases = []
    for heads, s_q, bs, causal, sink in [(16, 1, 64, False, False), (9, 3, 16, True, True)]:
        name = f"narrow_h{heads}_sq{s_q}_bs{bs}" + ("_causal" if causal else "") + ("_sink" if sink else "")
        cases.append((name, build_partial_kernel(heads=heads, s_q=s_q, block_size=bs, causal=causal,
                                                 sm_scale=DQK ** -0.5, has_sink=sink)))
    return cases
