"""The paged indexer's "pipelined_split" variant: "pipelined" with one wgmma per query row (``kernel_paged``).

Per tile the ``next_n`` products ``S_j = K_tile Q_j^T`` (m64 nH k32, each into its own accumulator of H / 2
registers per thread: together the registers of "pipelined"'s single m64 n(next_n H) accumulator) are issued
back to back without a wait; row j's epilogue (relu, weights, head sum, mask, store) starts once its own product
retired (``wgmma.wait_group next_n - 1 - j``), so the tensor cores run row j + 1's product while the warpgroup
does row j's epilogue.  "pipelined" waits for the whole product before any epilogue, and the other way to overlap
("pipelined_async": the next tile's product in a second full accumulator) costs the registers of 2 CTAs per SM.
Cost: the key tile is read from shared memory once per row instead of once.  Same ring, barriers, mask and
results up to the summation order of the head sum (it runs per row here).
"""

import tilelang.language as T
from tilelang.language.annotations import annotate_min_blocks_per_sm

from . import kernel_paged as kp


def build_indexer_paged_split(*, heads: int, dim: int, next_n: int, block_size: int, dtype: str = "float8_e4m3",
                              chunk: int = kp.CHUNK_P, num_stages: int = kp.PIPE_STAGES, threads: int = kp.THREADS,
                              min_ctas: int | None = None):
    """Same signature and contract as ``kernel_paged.build_indexer_paged_pipelined``."""
    H, D, NN, BS, BN, S = heads, dim, next_n, block_size, kp.BLOCK_N, num_stages
    assert H in kp.SUPPORTED_HEADS and D in kp.SUPPORTED_DIMS and BS in kp.SUPPORTED_BLOCK_SIZES
    assert 1 <= NN <= kp.MAX_NEXT_N and S >= 2 and chunk % BN == 0 and chunk % BS == 0 and threads == 128
    BC = NN * H
    min_ctas = kp.min_ctas_per_sm(H, NN) if min_ctas is None else min_ctas
    NPG = chunk // BS
    n_tile_chunk = chunk // BN
    n_acc = BN * H // threads  # accumulator registers per thread and row
    f32, i32 = "float32", "int32"
    M = kp._tile_macros(heads=H, next_n=NN, block_size=BS, chunk=chunk)
    sizes = kp._paged_sizes()
    B, NB, MB, L = sizes

    @T.macro
    def epilogue_row(acc, logit, w, ks_s, bt_s, Out, it, st, p0, ctx_m, b, j, L):
        # query row j of tile it: relu(S_j) w_j summed over the heads, masked, scaled, stored (columns < L)
        for n, h in T.Parallel(BN, H):
            acc[n, h] = T.max(acc[n, h], 0) * w[h]
        T.reduce_sum(acc, logit, dim=1)
        for n in T.Parallel(BN):
            logit[n] = T.if_then_else((p0 + n < ctx_m - NN + 1 + j) & (bt_s[(it * BN + n) // BS] >= 0),
                                      logit[n] * ks_s[st, n], -T.infinity(f32))
        for n in T.Parallel(BN):
            if p0 + n < L:
                Out[b * NN + j, p0 + n] = logit[n]

    # loops over ROWS, a Python tuple, unroll at trace time (the rows' fragments are separate buffers, which a
    # traced loop variable could not index)
    ROWS = tuple(range(NN))

    @T.macro
    def load_weights(W, ws, b):
        for j in ROWS:
            T.copy(W[b * BC + j * H:b * BC + (j + 1) * H], ws[j])

    @T.macro
    def issue_products(K_s, Q_s, accs, st):
        for j in ROWS:
            T.wgmma_gemm(K_s[st, :, :], Q_s[j * H:(j + 1) * H, :], accs[j], transpose_B=True, clear_accum=True,
                         policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def epilogues(accs, logits, ws, ks_s, bt_s, Out, it, st, p0, ctx_m, b, L):
        for j in ROWS:
            T.wait_wgmma(NN - 1 - j)  # row j's product retired (the later rows' may still run)
            T.warpgroup_fence_operand(accs[j], 0, n_acc)
            epilogue_row(accs[j], logits[j], ws[j], ks_s, bt_s, Out, it, st, p0, ctx_m, b, j, L)

    @T.macro
    def body(Q, KCache, KScale, W, ContextLens, BlockTable, Out):
        with T.Kernel(T.ceildiv(L, chunk), B, threads=threads) as (bc, b):
            Q_s = T.alloc_shared([BC, D], dtype)
            K_s = T.alloc_shared([S, BN, D], dtype)
            ks_s = T.alloc_shared([S, BN], f32)
            bt_s = T.alloc_shared([NPG], i32)
            accs = [T.alloc_fragment([BN, H], f32) for _ in ROWS]
            ws = [T.alloc_fragment([H], f32) for _ in ROWS]
            logits = [T.alloc_fragment([BN], f32) for _ in ROWS]
            annotate_min_blocks_per_sm(min_ctas)

            tx = T.get_thread_binding()
            c0 = bc * chunk
            ctx_m = T.clamp(ContextLens[b], 0, 1 << 30)
            ctx = T.min(ctx_m, L)
            n_t = T.clamp(T.ceildiv(ctx - c0, BN), 0, n_tile_chunk)
            M.validate_pages(BlockTable, bt_s, tx, b, c0, ctx, MB, NB)
            T.sync_threads()
            for t in T.unroll(S - 1):  # the ring's prologue, as kernel_paged's start_ring
                if t < n_t:
                    M.issue(KCache, KScale, K_s, ks_s, bt_s, t, t)
                T.ptx_commit_group()
            T.copy(Q[b * BC:b * BC + BC, :], Q_s)
            load_weights(W, ws, b)
            M.fill_tail(Out, tx, b, c0, n_t, L, threads)
            for it in T.serial(n_t):
                T.ptx_wait_group(S - 2)
                T.sync_threads()
                if it + S - 1 < n_t:
                    M.issue(KCache, KScale, K_s, ks_s, bt_s, it + S - 1, (it + S - 1) % S)
                T.ptx_commit_group()
                st = it % S
                issue_products(K_s, Q_s, accs, st)
                epilogues(accs, logits, ws, ks_s, bt_s, Out, it, st, c0 + it * BN, ctx_m, b, L)

    return kp._paged_prim_func("indexer_paged_split", body, heads=H, dim=D, next_n=NN, block_size=BS, dtype=dtype,
                               sizes=sizes)


def _pass_configs():
    return kp._pass_configs("pipelined_split")


def lowering_cases():
    """next_n 2 / H 64 (the issue's decode shape) and next_n 3 / H 8 / bs 16 (several pages per tile)."""
    return [("split_fp8_h64_d128_nn2_bs64", build_indexer_paged_split(heads=64, dim=128, next_n=2, block_size=64)),
            ("split_fp8_h8_d128_nn3_bs16", build_indexer_paged_split(heads=8, dim=128, next_n=3, block_size=16))]
