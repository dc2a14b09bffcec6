"""Paged indexer variant "pipelined_ws": the "pipelined" kernel with a producer warp and mbarriers (opt-in).

NOT YET RUN ON A GPU (written in session 4 after the device time was spent; lowered and compiled with ptxas only).

Notes
-----
Why: ncu of "pipelined" at next_n 2 (session 4) puts the per-tile CTA-wide barrier first among the stalls (1.31
warps per issued instruction), then the synchronous wgmma; more stages / more CTAs / 2-warpgroup CTAs did not help
(docs/PERFORMANCE.md).  In "pipelined" every warp of a CTA both issues the loads and computes, and every tile
starts with ``cp.async.wait_group`` + ``__syncthreads``.  Here the roles are split so the consumers never meet at a
CTA-wide barrier.  Built by ``kernel_paged.build_indexer_paged_pipelined(ws=True)`` (same buffers, block-table
validation, tile macros and epilogue as "pipelined"; this module holds the roles):

  * 160 threads: a consumer warpgroup (threads 0-127: wgmma + epilogue, exactly the "pipelined" tile math) and a
    producer warp (threads 128-159: cp.async of the pages with the shared ``issue`` macro; TileLang rebases the
    copy's thread index to the warp).
  * Ring of ``S`` stages with two mbarrier arrays.  ``full[s]`` (count 32): after issuing tile t into stage
    s = t % S, each producer thread executes ``cp.async.mbarrier.arrive.noinc full[s]``, which fires when all of that
    thread's earlier cp.async completed (no wait, no commit: the pattern of the GPU-verified sparse "ws2"
    schedule).  ``empty[s]`` (count 128): each consumer thread arrives after tile t's epilogue (the last read of
    stage s: the wgmma is awaited inside ``T.gemm`` and the epilogue reads ``ks_s[s]``).
  * Consumer, tile t: wait ``full[s]`` with parity ``(t // S) & 1``, ``fence.proxy.async`` (cp.async writes are
    generic-proxy writes, the wgmma reads through the async proxy), wgmma, epilogue, arrive ``empty[s]``.
  * Producer, tile t >= S: wait ``empty[s]`` with parity ``((t // S) - 1) & 1`` (the consumers released tile t - S),
    then issue tile t.  After the last tile: ``commit; wait_group 0`` (nothing in flight when the warp exits).
  * Start (shared with "pipelined"): the block-table entries of the chunk are validated into ``bt_s`` by all
    threads, one ``__syncthreads``; then the consumers load Q / weights, write the -inf tail, ``fence.proxy.async``
    and meet at a named barrier (id 1, 128 threads) before the first wgmma.
Registers: no ``setmaxnreg`` (the producer warp is not a whole warpgroup); ``__launch_bounds__(160, min_ctas)``.
Shared memory (fp8, D 128, next_n 2, H 64): Q 16 KiB + S x (8 KiB + 256 B) + bt + barriers: S = 6 -> ~66 KiB,
3 CTAs per SM; the consumer holds one stage, so up to 3 x 5 = 15 tiles are in flight per SM (12 for "pipelined").
ptxas (CUDA 13.0, sm_90a, 0 spills): 128 registers at next_n 2 / H 64 and next_n 4 / H 32 / D 64, 64 at next_n 1.
Generated CUDA read: mbarrier inits + fence + __syncthreads; consumer loop = full[it % S].wait((it / S) & 1),
fence.proxy.async, 4 wgmma m64n128k32 + wait, epilogue, empty[it % S].arrive(); producer loop = empty wait for
t >= S, 16 x 16-byte cp.async of the page + the scale copy, mbarrier_cp_async_arrive_noinc(full[t % S]).
First GPU commands: ``FLASHDSA_PAGED_VARIANT=pipelined_ws pytest -m gpu tests/indexer -k paged`` (hang canary:
run it before any benchmark), ``compute-sanitizer ... scripts/memcheck_small.py paged_ws``, then
``scripts/bench_paged_indexer.py --shapes nn1,nn2 --variants pipelined,pipelined_ws --sweep w4x1024m4,w8x1024m2``.
"""

import tilelang.language as T

WS_STAGES = 6
WS_MIN_CTAS = 3
CONSUMERS = 128
PRODUCERS = 32
BAR_CONSUMER = 1  # named barrier id of the consumer warpgroup (0 is __syncthreads)


def ws_roles_macro(*, heads, dim, next_n, block_size, num_stages, threads, macros):
    """The consumer / producer roles after the shared start (see the module notes); ``macros``: the shared tile
    macros of ``kernel_paged._tile_macros``."""
    H, NN, S = heads, next_n, num_stages
    issue, epilogue, fill_tail = macros.issue, macros.epilogue, macros.fill_tail
    BC = NN * H
    from .kernel_paged import BLOCK_N as BN  # keys per tile (imported here: kernel_paged imports this module lazily)
    assert threads == CONSUMERS + PRODUCERS

    @T.macro
    def ws_roles(Q, KCache, KScale, W, Out, Q_s, K_s, ks_s, bt_s, w_f, acc, acc3, logit, full, empty, tx, b, c0,
                 ctx_m, n_t, L):
        if tx < CONSUMERS:
            T.copy(Q[b * BC:b * BC + BC, :], Q_s)
            T.copy(W[b * BC:b * BC + BC], w_f)
            fill_tail(Out, tx, b, c0, n_t, L, CONSUMERS)
            T.fence_proxy_async()  # Q_s (generic-proxy stores) -> wgmma reads
            T.sync_threads(BAR_CONSUMER, CONSUMERS)
            for it in T.serial(n_t):
                st = it % S
                T.barrier_wait(full[st], (it // S) & 1)
                T.fence_proxy_async()  # the stage's cp.async writes -> wgmma (async proxy) reads
                T.gemm(K_s[st, :, :], Q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                epilogue(acc, acc3, logit, w_f, ks_s, bt_s, Out, it, st, c0 + it * BN, ctx_m, b, L)
                T.barrier_arrive(empty[st])
        else:
            for t in T.serial(n_t):
                st = t % S
                if t >= S:
                    T.barrier_wait(empty[st], ((t // S) + 1) & 1)
                issue(KCache, KScale, K_s, ks_s, bt_s, t, st)
                T.cp_async_barrier_noinc(full[st])
            T.ptx_commit_group()
            T.ptx_wait_group(0)

    return ws_roles
