"""The 2-CTA cluster form of the pair forward at H 128 (``kernel_fwd_pair.build_sparse_mla_fwd(cluster=True)``, a
timing build): the two head-group CTAs of a token share the gather of every block.

Notes
-----
Measured (H200, session 18, S 4096 / SKV 8192 / topk 2048, ``python -m flashdsa.sparse.kernel_fwd_pair --variants
--rows pair,cluster``): correct and bitwise equal to the default build (tests/sparse_mla/test_kernel_pair_gpu.py
``-k cluster``), but **slower**: 6.61 ms (353 TFLOP/s) against 5.24 (446) for the default, with the send issued by
the producer one half behind 7.78 ms.  The bound this was after, only head group 0 gathering, is 4.55 ms (514).
Why (docs/PERFORMANCE.md, session 18): a half tile is refilled only when the consumers of BOTH CTAs freed it, so
each CTA runs at the pace of the slower one, and a consumer's tile is complete only after the peer's gather and then
its DSMEM copy landed (two latencies in a row) while the two buffers of the pair schedule hide about one.

Protocol: the consumers arrive on their own free barrier and on the peer's (``fdsa_arrive_peer``; count 256); the
producer warpgroup's gatherers (threads 256-319) wait a half tile's free barrier at cluster scope, gather this CTA's
32 rows and arrive (noinc) on the local ready barrier and on the half's ``landed`` barrier, thread 256 adding an
``expect_tx`` arrival for the peer's 16 / 20 KiB; the forwarder warp (320-351) waits ``landed`` and bulk-copies the
rows into the peer's tile, completing on the peer's ready barrier.  All threads of both CTAs meet in a cluster
barrier after the barrier init and before exit.
"""

import tilelang.language as T

from . import _tl_common as tc
from ._pair_parts import BAR_PROD, drain, pair_rows_macro
from ._tl_common import BLOCK_I, D_V

_ASYNC = tc.ASYNC_GATHER

# ``cluster`` (H 128): the two head-group CTAs of a token form a cluster and each gathers half of every block's rows
# (rank r: rows 32 r .. 32 r + 31), then sends them into the peer's same tile.  In a half tile ([64, 256] bf16,
# 128-B-swizzled 64-column chunks of 8 KiB, rows in order) rows 32 r .. 32 r + 31 of chunk c are the contiguous 4 KiB
# at c * 8 KiB + r * 4 KiB (the rope tile [64, 64]: r * 4 KiB), so one bulk copy per chunk moves them, swizzle and all.
CLUSTER_PRELUDE = r"""
__device__ __forceinline__ unsigned fdsa_peer_addr(const void *p, unsigned peer) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(r) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "r"(peer));
  return r;
}

// all threads of both CTAs: barrier inits visible cluster-wide at the start; no CTA exits while its peer may
// still arrive on its barriers or write its tiles
__device__ __forceinline__ void fdsa_cluster_sync() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// one arrival on the peer CTA's copy of barrier `bar` (release: this thread's reads of the tile happen before)
__device__ __forceinline__ void fdsa_arrive_peer(void *bar, unsigned peer) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(fdsa_peer_addr(bar, peer))
               : "memory");
}

// wait for phase `parity` of a barrier that the peer's threads also arrive on (acquire at cluster scope)
__device__ __forceinline__ void fdsa_wait_cluster(void *bar, int parity) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(a), "r"(parity) : "memory");
}

// one arrival on the local barrier that also expects `bytes` from the peer's bulk copies in this phase
__device__ __forceinline__ void fdsa_arrive_expect_tx(void *bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "r"(bytes) : "memory");
}

// rows 32 rank .. 32 rank + 31 of the 4 chunks of a half tile (and of the rope tile when rope != 0) into the peer's
// same addresses, completing on the peer's `bar`
__device__ __forceinline__ void fdsa_send_rows(void *tile, void *rope, int has_rope, int rank, void *bar,
                                               unsigned peer) {
  const unsigned pbar = fdsa_peer_addr(bar, peer);
#pragma unroll
  for (int c = 0; c < 4 + 1; ++c) {
    if (c == 4 && !has_rope) break;
    char *src = c < 4 ? static_cast<char *>(tile) + c * 8192 + rank * 4096 : static_cast<char *>(rope) + rank * 4096;
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                 ::"r"(fdsa_peer_addr(src, peer)), "r"(static_cast<unsigned>(__cvta_generic_to_shared(src))),
                 "r"(pbar) : "memory");
  }
}
"""
CLUSTER_GATHERERS = 64  # producer threads 256-319 gather; warp 10 (320-351) sends the landed rows to the peer
CLUSTER_READY_COUNTS = (2 * CLUSTER_GATHERERS + 1, 2 * CLUSTER_GATHERERS + 1, CLUSTER_GATHERERS + 1,
                        CLUSTER_GATHERERS + 1)  # (noinc + rows) or noinc, + the expect_tx arrival of the peer's half
CLUSTER_FREE_COUNT = 256  # both CTAs' consumer warpgroup


def cluster_producer(*, dqk, n_kv, topk_dim):
    """``cluster``'s producer warpgroup (bf16 KV), returned as (gather, forward) macros.  Gatherers (threads
    256-351): per half tile, wait until both CTAs' consumers freed it (``fdsa_wait_cluster``), gather this CTA's 32
    rows (zero-filled where invalid), their completion arriving (noinc) on the local ready barrier and on the half's
    ``landed`` barrier; one thread adds the expect_tx arrival for the peer's bytes.  Forwarder (warp 10): per half,
    wait ``landed``, fence the proxies and send the rows to the peer (``fdsa_send_rows``).  The forwarder's bulk read
    of a half ends before the gatherers rewrite it: they wait for the peer's consumers, which waited for the bytes.
    Same order of half tiles as ``gather_producer``."""
    D = D_V
    DH = D // 2
    D_tail = dqk - D
    BI = BLOCK_I
    HALF = BI // 2
    NG = CLUSTER_GATHERERS
    L_BYTES = 4 * 4096
    R_BYTES = L_BYTES + (4096 if D_tail > 0 else 0)
    bf16 = "bfloat16"
    _ok = tc.make_row_ok(n_kv)
    pair_rows = pair_rows_macro(topk_dim, lambda row, kv_src: _ok(row))

    @T.macro
    def wait_free(fr, phase):
        T.call_extern("handle", "fdsa_wait_cluster", T.address_of(fr[0]), phase)

    @T.macro
    def half(rdy, landed, KVh, Kt, rope, Rows, KV, col0, rank, tx, nbytes):
        if tx == 256:
            T.call_extern("handle", "fdsa_arrive_expect_tx", T.address_of(rdy[0]), nbytes)
        for r, c, d in T.Parallel(HALF, 4, 64, annotations=_ASYNC):
            rk = Rows[rank * HALF + r]
            KVh[rank * HALF + r, c * 64 + d] = T.if_then_else(rk >= 0, KV[rk, col0 + c * 64 + d], T.cast(0, bf16))
            if rope:
                if c == 0:
                    Kt[rank * HALF + r, d] = T.if_then_else(rk >= 0, KV[rk, D + d], T.cast(0, bf16))
        T.cp_async_barrier_noinc(rdy)
        T.cp_async_barrier_noinc(landed)

    @T.macro
    def set_rows(Rows, row, rdy, tx):
        if tx - 256 < BI:
            Rows[tx - 256] = row[0]
        T.sync_threads(BAR_PROD, NG)
        T.barrier_arrive(rdy)  # the rows are published (ordinary arrival)

    @T.macro
    def gather(kv_src, Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
               row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar, landed):
        KV = kv_src[0]
        rank = T.block_rank_in_cluster()
        rope = D_tail > 0
        for j in T.serial(npair[0]):
            pair_rows(Indices, tok, lim, j, tx - 256, row_a, row_b, kv_src)
            free_phase = (j & 1) ^ 1
            wait_free(fr_al, free_phase)
            set_rows(Rows0, row_a, rdy_al, tx)
            half(rdy_al, landed[0], KVa_l, Ka_t, False, Rows0, KV, 0, rank, tx, L_BYTES)
            wait_free(fr_br, free_phase)
            set_rows(Rows1, row_b, rdy_br, tx)
            half(rdy_br, landed[1], KVb_r, Kb_t, rope, Rows1, KV, DH, rank, tx, R_BYTES)
            wait_free(fr_ar, free_phase)
            half(rdy_ar, landed[2], KVa_r, Ka_t, rope, Rows0, KV, DH, rank, tx, R_BYTES)
            wait_free(fr_bl, free_phase)
            half(rdy_bl, landed[3], KVb_l, Kb_t, False, Rows1, KV, 0, rank, tx, L_BYTES)
        drain()

    @T.macro
    def send(landed, phase, KVh, Kt, rope, rdy, rank, tx):
        T.barrier_wait(landed, phase)
        T.fence_proxy_async()  # the gathered rows (cp.async, generic proxy) -> the bulk copy's reads (async proxy)
        if tx == 256 + CLUSTER_GATHERERS:
            T.call_extern("handle", "fdsa_send_rows", T.address_of(KVh[0, 0]), T.address_of(Kt[0, 0]),
                          1 if rope else 0, rank, T.address_of(rdy[0]), 1 - rank)

    @T.macro
    def forward(npair, tx, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t, rdy_al, rdy_br, rdy_ar, rdy_bl, landed):
        rank = T.block_rank_in_cluster()
        rope = D_tail > 0
        for j in T.serial(npair[0]):
            send(landed[0], j & 1, KVa_l, Ka_t, False, rdy_al, rank, tx)
            send(landed[1], j & 1, KVb_r, Kb_t, rope, rdy_br, rank, tx)
            send(landed[2], j & 1, KVa_r, Ka_t, rope, rdy_ar, rank, tx)
            send(landed[3], j & 1, KVb_l, Kb_t, False, rdy_bl, rank, tx)

    return gather, forward
