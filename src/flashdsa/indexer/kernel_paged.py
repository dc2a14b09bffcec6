"""Lightning-indexer decode logits over a paged key cache in TileLang for Hopper (sm_90a).

Notes
-----
Math (contract of ``flashdsa.indexer_logits_paged``): row ``r = b*next_n + j`` scores positions
``p < context_lens[b] - next_n + 1 + j``: ``out[r, p] = k_scale(p) * sum_h w[r, h] * relu(q[b, j, h] . k(p))`` with
``k(p)`` slot ``p % bs`` of block ``block_table[b, p // bs]``; -inf elsewhere and where the block id is outside
``[0, num_blocks)``.

Variants (``run_indexer_logits_paged(..., variant=)``, else ``$FLASHDSA_PAGED_VARIANT``, else ``VARIANT``):

"pipelined" (``build_indexer_paged_pipelined``, the default): a streaming kernel.
  * Grid ``(ceil(max_context / CHUNK_P), B)``, CHUNK_P = 1024 positions = 16 tiles of 64 keys; CTA (c, b) writes
    every column of ``[c*CHUNK_P, (c+1)*CHUNK_P)`` of the ``next_n`` rows of sequence b exactly once (computed tiles
    up to the context length, -inf beyond). 128 threads (one warpgroup), several CTAs per SM (fp8 D=128: 5 at
    next_n=1, 4 at next_n=2, set by shared memory / registers; ``__launch_bounds__(128, 4)`` for next_n*H <= 128).
  * Start: the chunk's block-table entries are validated once into shared memory (``bt_s``: the physical block,
    or -1 when the id is out of range, past the table, or the page starts at/after the context length).
  * Hand-written ``PIPE_STAGES``-deep cp.async ring (TileLang's ``T.Pipelined`` takes no dynamic trip count):
    the prologue issues tiles 0..S-2 (one commit group per tile, empty groups for missing tiles, so the group
    count is uniform), then iteration ``it`` does ``cp.async.wait_group(S-2)`` (tile ``it`` landed for this
    thread) + ``__syncthreads`` (for all threads; and every thread is past its wgmma of tile ``it-1``), issues
    tile ``it+S-1`` into the stage just freed (``(it-1) % S``), commits, and computes tile ``it``.
    A tile is ``64 / bs`` whole pages (bs <= 64) or half a page (bs = 128): 16-byte cp.async.cg, a warp reads
    512 contiguous bytes, plus the pages' k_scale slices; pages with bt_s = -1 are not read at all (their smem
    rows keep stale data: each key is its own wgmma M row and is masked to -inf, so nothing leaks).
  * Compute per tile: ``S[key, j*H + h] = K_tile @ Q^T`` (keys as the wgmma M side: m64 n(next_n*H) k32 e4m3,
    so every loaded key serves all next_n rows), ``relu * w`` and the head sum in registers (+ a quad
    shuffle), ``* k_scale``, the causal / page-validity mask, direct stores (8 quads write 32 contiguous bytes).
  * The automatic thread-storage-sync pass is disabled (it put two __syncthreads around every block-table read
    of the issue loop and one before each wgmma); the two explicit barriers above are all the kernel needs
    (the Q / weight loads are ordered by the first loop barrier; reductions are shuffles only).
  Budget (B=128, ctx 32768, H=64, D=128, bs 64, fp8): reads = keys x 132 B = 554 MB -> 0.132 ms at 4.2 TB/s;
  per SM 31.8K keys = 497 tiles. In flight per SM: (S-1) x 8 KiB x CTAs = 96-120 KiB (Little: ~32 KiB needed).
  Tensor work at next_n=2: m64n128k32 x 4 per tile = 256 clk at the fp8 peak -> 55% of the memory time; the
  epilogue (~200 issue slots per tile per SM) ~43%: both must overlap with the loads and with each other, which
  the 4-5 resident CTAs per SM provide (one CTA's epilogue runs while another's wgmma and everyone's loads do).
  Shared memory (fp8, D=128): Q next_n*H x 128 + 4 x 8 KiB K + 4 x 256 B scales + bt_s = 42 KiB (next_n 1),
  51 KiB (next_n 2). Registers (ptxas 13.0 on the CPU box, 0 spills): 64 (nn1 H64), 128 (nn2 H64 / nn4 H32),
  230 (nn4 H64 -> 2 CTAs/SM), 32 (nn1 H8), bf16 nn1 H64 72.
  Session 18 (docs/PERFORMANCE.md): at next_n 2 the loads + wgmma alone take 148 us (``ablate="no_epilogue"``),
  the full kernel 208-216; the epilogue's arithmetic form does not matter (tf32 wgmma head sum, explicit FFMA, relu
  as x + |x| on the FMA pipe: all as fast or slower, removed): the per-tile chain of each CTA is latency-bound.
  Verified: lowering + ptxas on CPU only; generated CUDA read (cp_async_gs_conditional<16> of pages, one
  commit per tile, cp_async_wait<S-2> + one __syncthreads per tile, stage-offset wgmma descriptors,
  no other barrier in the loop). GPU (H200): the default; 3.69 / 3.03 TB/s at next_n 1 / 2.

"pipelined_async" (``build_indexer_paged_async``, opt-in; next_n*H <= 128, wider shapes run "pipelined"): the
  "pipelined" kernel with the tensor cores overlapping the epilogue inside the CTA. Two accumulators (acc_a: even
  tiles, acc_b: odd); step ``it`` = ``cp.async.wait_group(S-3)`` (tiles it and it+1 landed) + ``__syncthreads``,
  issue tile it+1's wgmma into the other accumulator (``T.wgmma_gemm``, no wait), refill stage ``(it-1) % S``
  (its wgmma retired in step it-2, its k_scale was read in step it-1), commit, tile it's epilogue,
  ``wgmma.wait_group 0``. Tile 0's wgmma runs (and is awaited) before the loop. The wait sits inside the step on
  purpose: with wgmma(it+1) still in flight across the loop's back edge (awaited with wait_group 1 in the next
  step), ptxas 13.0 serializes every wgmma (C7514) -- it does not track wgmma groups across loop iterations when
  the accumulators are read. Tiles run in pairs so that the accumulator choice is static; the last pair is peeled
  (no next wgmma in its second step) and an odd tile count is padded by tile n_t (stale stage data, masked, not
  stored). ``ASYNC_STAGES`` = 6 (S-2 = 4 tiles = 33 KiB in flight per CTA). Registers (ptxas 13.0, 0 spills, no
  C751x warning): 254 at next_n 2 / H 64 (``__launch_bounds__(128, 2)``; 3 CTAs would spill 96 B), 207 at bs 16,
  150 at next_n 1 / H 64 (3 CTAs), 206 nn4 H32 D64, bf16 nn1 128. Shared memory (fp8 D 128): 58 KiB (nn1),
  66 KiB (nn2). SASS checked: 4 QGMMA 64x128x32 of tile it+1, then the LDGSTS refill and tile it's
  FMNMX / FFMA epilogue, one WARPGROUP.DEPBAR at the end of the step.
  Per tile (next_n 2, one CTA alone): ~50 clk sync + max(256 clk wgmma, ~200-230 issue slots of epilogue per
  scheduler) ~= 300-330 clk instead of ~50 + 256 + ~30 (wgmma latency) + ~200 ~= 530; an SM needs one tile per
  ~490 clk at 4.2 TB/s (8448 B / 17.4 B/clk), so one CTA almost keeps up alone and the 2 resident CTAs share the
  tensor pipe (53% busy at the floor). GPU (H200, session 3): correct (paged tests pass) but slower: 151 / 224 us
  at next_n 1 / 2 vs 149 / 183 us for "pipelined" (2 CTAs per SM instead of 4); kept opt-in for reference.

"sync" (``build_indexer_paged``, the first draft, kept for comparison): grid ``(ceil(max_context / 2048), B)``;
  per 64-key stage the pages are loaded synchronously (16-byte ld.global + st.shared after a block-table read,
  TileLang 0.1.15 did not pipeline its ``T.Pipelined`` loop), then the same wgmma / epilogue. Measured on the
  H200: 2.58 TB/s (next_n 1) and 1.87 TB/s (next_n 2) at the budget shape above.

Risks for the first GPU run of "pipelined"
  * A wrong wait count or stage index reads a tile before it landed: the GPU tests (random page order, several
    block sizes, 5 bitwise-identical runs) and scripts/bench_paged_indexer.py (compares with "sync") catch it.
  * Performance: measured 3.69 TB/s (next_n 1) and 3.05 TB/s (next_n 2, 5% short of 3.2); "pipelined_async"
    is the overlap of tile it+1's wgmma with tile it's epilogue inside the CTA (opt-in, to be measured).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations with the function's
# closure, and the shared signature (`_paged_prim_func`) names its sizes only in the annotations
import functools
import os
import types

import torch

from .._tilelang import aligned, plain_pass_configs

try:
    import tilelang
    import tilelang.language as T
    from tilelang.language.annotations import annotate_min_blocks_per_sm
except Exception:  # pragma: no cover
    tilelang = None
    T = None

BLOCK_N = 64  # keys per stage (wgmma M)
CHUNK = 2048  # positions per CTA
NUM_STAGES = 3  # "sync" variant (its T.Pipelined is not actually pipelined by TileLang)
THREADS = 128
CHUNK_P = 1024  # "pipelined" variant: positions per CTA (16 tiles; 4096 CTAs at B=128, ctx 32768)
VARIANTS = ("pipelined", "sync", "pipelined_async")
VARIANT = "pipelined"  # default; ``$FLASHDSA_PAGED_VARIANT`` (read per call) overrides it when no variant is passed
VARIANT_ENV = "FLASHDSA_PAGED_VARIANT"
SUPPORTED_HEADS = (8, 16, 32, 64)
SUPPORTED_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
MAX_NEXT_N = 4
PIPE_STAGES = 4  # "pipelined" variant: cp.async ring depth (tiles of BLOCK_N keys; S-1 tiles in flight per CTA)
ASYNC_STAGES = 6  # "pipelined_async": ring depth (S-2 tiles in flight per CTA: one landed tile is ahead for the MMA)
ASYNC_MAX_COLS = 128  # "pipelined_async" needs next_n*H <= 128 (two accumulators); wider shapes run "pipelined"
_TL_DTYPES = {torch.float8_e4m3fn: "float8_e4m3", torch.bfloat16: "bfloat16"}


def _paged_sizes():
    """The symbolic sizes of the kernels' signature: (B, num_blocks, max_blocks, L)."""
    return T.dynamic("B"), T.dynamic("num_blocks"), T.dynamic("max_blocks"), T.dynamic("L")


def _paged_prim_func(name: str, body, *, heads: int, dim: int, next_n: int, block_size: int, dtype: str, sizes):
    """prim_func ``name`` with the signature both variants share (see ``build_indexer_paged``); its body is the
    variant's ``T.macro`` ``body(Q, KCache, KScale, W, ContextLens, BlockTable, Out)``, inlined when parsed (the
    generated CUDA is that of the prim_func written out in full)."""
    H, D, NN, BS = heads, dim, next_n, block_size
    f32, i32 = "float32", "int32"
    B, NB, MB, L = sizes

    @T.prim_func
    def indexer_paged(
        Q: T.Tensor([B * NN * H, D], dtype),
        KCache: T.Tensor([NB, BS, D], dtype),
        KScale: T.Tensor([NB, BS], f32),
        W: T.Tensor([B * NN * H], f32),
        ContextLens: T.Tensor([B], i32),
        BlockTable: T.Tensor([B, MB], i32),
        Out: T.Tensor([B * NN, L], f32),
    ):
        body(Q, KCache, KScale, W, ContextLens, BlockTable, Out)

    return indexer_paged.with_attr("global_symbol", name)


def build_indexer_paged(*, heads: int, dim: int, next_n: int, block_size: int, dtype: str = "float8_e4m3",
                        chunk: int = CHUNK, num_stages: int = NUM_STAGES, threads: int = THREADS):
    """prim_func ``(Q[B*next_n*H, D], KCache[num_blocks, bs, D], KScale[num_blocks, bs] f32, W[B*next_n*H] f32,
    ContextLens[B] i32, BlockTable[B, max_blocks] i32, Out[B*next_n, L] f32)``; B, num_blocks, max_blocks, L dynamic."""
    H, D, NN, BS, BN = heads, dim, next_n, block_size, BLOCK_N
    assert H in SUPPORTED_HEADS and D in SUPPORTED_DIMS and BS in SUPPORTED_BLOCK_SIZES and 1 <= NN <= MAX_NEXT_N
    BC = NN * H
    PPS = max(1, BN // BS)  # pages per stage
    KPP = min(BS, BN)  # keys copied per page per stage
    n_stage_chunk = chunk // BN
    f32, i32 = "float32", "int32"
    sizes = _paged_sizes()
    B, NB, MB, L = sizes

    @T.macro
    def body(Q, KCache, KScale, W, ContextLens, BlockTable, Out):
        with T.Kernel(T.ceildiv(L, chunk), B, threads=threads) as (bc, b):
            Q_s = T.alloc_shared([BC, D], dtype)
            K_s = T.alloc_shared([BN, D], dtype)
            ks_s = T.alloc_shared([BN], f32)
            ok_s = T.alloc_shared([BN], i32)
            w_f = T.alloc_fragment([BC], f32)
            acc = T.alloc_fragment([BN, BC], f32)
            acc3 = T.reshape(acc, [BN, NN, H])
            logit = T.alloc_fragment([BN, NN], f32)

            c0 = bc * chunk
            ctx_m = T.clamp(ContextLens[b], 0, 1 << 30)  # for the mask (may exceed L)
            ctx = T.min(ctx_m, L)  # computed positions: the longest row of this sequence sees ctx of them
            n_st = T.max(T.min(T.ceildiv(ctx - c0, BN), n_stage_chunk), 1)  # >= 1: Q load always awaited
            fill_b = T.min(c0 + n_st * BN, L)
            fill_e = T.min(c0 + chunk, L)

            T.copy(Q[b * BC:b * BC + BC, :], Q_s)
            tx = T.get_thread_binding()
            for j in T.serial(NN):
                for c in T.serial(T.ceildiv(fill_e - fill_b, threads)):
                    col = fill_b + c * threads + tx
                    if col < fill_e:
                        Out[b * NN + j, col] = -T.infinity(f32)
            T.copy(W[b * BC:b * BC + BC], w_f)

            for it in T.Pipelined(n_st, num_stages=num_stages):
                p0 = c0 + it * BN
                for pg in T.serial(PPS):
                    lp = (p0 + pg * KPP) // BS  # logical page
                    blk = BlockTable[b, T.min(lp, MB - 1)]
                    safe = T.if_then_else((blk >= 0) & (blk < NB) & (lp < MB), blk, 0)
                    off = (p0 + pg * KPP) % BS
                    T.copy(KCache[safe, off:off + KPP, :], K_s[pg * KPP:(pg + 1) * KPP, :])
                for n in T.Parallel(BN):
                    lp = (p0 + n) // BS
                    blk = BlockTable[b, T.min(lp, MB - 1)]
                    ok = (blk >= 0) & (blk < NB) & (lp < MB)
                    ks_s[n] = T.if_then_else(ok, KScale[T.if_then_else(ok, blk, 0), (p0 + n) % BS], T.float32(0))
                    ok_s[n] = T.if_then_else(ok, 1, 0)
                T.gemm(K_s, Q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for n, c in T.Parallel(BN, BC):
                    acc[n, c] = T.max(acc[n, c], 0) * w_f[c]
                T.reduce_sum(acc3, logit, dim=2)
                for n, j in T.Parallel(BN, NN):
                    logit[n, j] = T.if_then_else((p0 + n < ctx_m - NN + 1 + j) & (ok_s[n] != 0),
                                                 logit[n, j] * ks_s[n], -T.infinity(f32))
                for n, j in T.Parallel(BN, NN):
                    if p0 + n < L:
                        Out[b * NN + j, p0 + n] = logit[n, j]

    return _paged_prim_func("indexer_paged", body, heads=H, dim=D, next_n=NN, block_size=BS, dtype=dtype,
                            sizes=sizes)


def min_ctas_per_sm(heads: int, next_n: int) -> int:
    """``__launch_bounds__`` minimum: 4 CTAs (<= 128 registers) while the accumulator is <= 64 regs/thread."""
    return 4 if heads * next_n <= 128 else 2


def min_ctas_per_sm_async(heads: int, next_n: int) -> int:
    """"pipelined_async": two accumulators of next_n*H/2 regs/thread each. 3 CTAs (<= 168 registers) while both
    fit in 64 (next_n*H <= 64), else 2 (<= 255; next_n*H = 128: 128 accumulator + 32 weight registers)."""
    return 3 if heads * next_n <= 64 else 2


def _tile_macros(*, heads: int, next_n: int, block_size: int, chunk: int = CHUNK_P, ablate: str = ""):
    """Macros shared by the cp.async-ring variants (module notes): issue, epilogue, validate_pages, fill_tail,
    start_ring.  ``ablate`` (timing builds, wrong results): "no_relu_w" skips relu and the weights (the head sum
    stays), "no_epilogue" also the head sum (logits = 0 * k_scale)."""
    assert ablate in ("", "no_relu_w", "no_epilogue"), ablate
    H, NN, BS, BN = heads, next_n, block_size, BLOCK_N
    BC = NN * H
    PPS = max(1, BN // BS)  # page segments per tile
    KPP = min(BS, BN)  # keys per segment (contiguous in one page)
    f32 = "float32"
    no_commit = {"no_implicit_async_commit_wait": True}

    @T.macro
    def issue(KCache, KScale, K_s, ks_s, bt_s, t, st):
        # cp.async (no commit) of tile t (keys c0 + t*BN ...) into ring stage st: PPS page segments of KPP keys
        for sg in T.unroll(PPS):
            blk = bt_s[(t * BN + sg * KPP) // BS]
            if blk >= 0:
                off = (t * BN + sg * KPP) % BS
                T.async_copy(KCache[blk, off:off + KPP, :], K_s[st, sg * KPP:(sg + 1) * KPP, :], annotations=no_commit)
                T.async_copy(KScale[blk, off:off + KPP], ks_s[st, sg * KPP:(sg + 1) * KPP], annotations=no_commit)

    @T.macro
    def epilogue(acc, acc3, logit, w_f, ks_s, bt_s, Out, it, st, p0, ctx_m, b, L):
        # logits of tile it (ring stage st, first position p0) from its accumulator S[key, j*H + h]; columns
        # >= L are not stored (the parameter keeps the name L: a macro argument's variable takes the parameter's
        # name in the generated code)
        if ablate == "":
            for n, c in T.Parallel(BN, BC):
                acc[n, c] = T.max(acc[n, c], 0) * w_f[c]
        if ablate != "no_epilogue":
            T.reduce_sum(acc3, logit, dim=2)
        else:
            T.clear(logit)
        for n, j in T.Parallel(BN, NN):
            logit[n, j] = T.if_then_else((p0 + n < ctx_m - NN + 1 + j) & (bt_s[(it * BN + n) // BS] >= 0),
                                         logit[n, j] * ks_s[st, n], -T.infinity(f32))
        for n, j in T.Parallel(BN, NN):
            if p0 + n < L:
                Out[b * NN + j, p0 + n] = logit[n, j]

    NPG = chunk // BS  # block-table entries of one chunk

    @T.macro
    def validate_pages(BlockTable, bt_s, tx, b, c0, ctx, max_blocks, num_blocks):
        # validated physical block of every page of the chunk (-1: never read, keys masked); the parameters keep
        # the dynamic symbols' names (max_blocks / num_blocks), which the generated code uses
        if tx < NPG:
            lp = c0 // BS + tx
            raw = BlockTable[b, T.min(lp, max_blocks - 1)]
            bt_s[tx] = T.if_then_else((lp < max_blocks) & (lp * BS < ctx) & (raw >= 0) & (raw < num_blocks), raw, -1)

    @T.macro
    def fill_tail(Out, tx, b, c0, n_t, L, nthreads):
        # -inf in the chunk's columns past its computed tiles (uncomputed positions of the row)
        fill_b = c0 + n_t * BN
        fill_e = T.min(c0 + chunk, L)
        for j in T.serial(NN):
            for c in T.serial(T.ceildiv(fill_e - fill_b, nthreads)):
                col = fill_b + c * nthreads + tx
                if col < fill_e:
                    Out[b * NN + j, col] = -T.infinity(f32)

    @T.macro
    def start_ring(Q, W, KCache, KScale, Out, Q_s, K_s, ks_s, bt_s, w_f, tx, b, c0, n_t, L, stages, nthreads):
        # prologue: tiles 0..stages-2, one commit group each (empty when the tile does not exist); then Q / weights
        # / -inf tail while they are in flight (Q_s is read after the next barrier)
        for t in T.unroll(stages - 1):
            if t < n_t:
                issue(KCache, KScale, K_s, ks_s, bt_s, t, t)
            T.ptx_commit_group()
        T.copy(Q[b * BC:b * BC + BC, :], Q_s, disable_tma=True)
        T.copy(W[b * BC:b * BC + BC], w_f)
        fill_tail(Out, tx, b, c0, n_t, L, nthreads)

    return types.SimpleNamespace(issue=issue, epilogue=epilogue, validate_pages=validate_pages, fill_tail=fill_tail,
                                 start_ring=start_ring)


def build_indexer_paged_pipelined(*, heads: int, dim: int, next_n: int, block_size: int, dtype: str = "float8_e4m3",
                                  chunk: int = CHUNK_P, num_stages: int = PIPE_STAGES, threads: int = THREADS,
                                  min_ctas: int | None = None, ablate: str = ""):
    """"pipelined" variant (see the module notes); same prim_func signature as ``build_indexer_paged``:
    ``(Q[B*next_n*H, D], KCache[num_blocks, bs, D], KScale[num_blocks, bs] f32, W[B*next_n*H] f32,
    ContextLens[B] i32, BlockTable[B, max_blocks] i32, Out[B*next_n, L] f32)``; B, num_blocks, max_blocks, L dynamic.
    Compile with ``_pass_configs("pipelined")``; ``ablate``: ``_tile_macros``'s (timing builds, ``--sweep
    4x1024:no_epilogue`` in scripts/bench_paged_indexer.py).  (Session 15: the head weights read from shared memory
    instead of registers, 5 CTAs per SM at next_n 2, ran slower, 237.7 vs 225.0 us, and were removed.)"""
    H, D, NN, BS, BN, S = heads, dim, next_n, block_size, BLOCK_N, num_stages
    assert H in SUPPORTED_HEADS and D in SUPPORTED_DIMS and BS in SUPPORTED_BLOCK_SIZES and 1 <= NN <= MAX_NEXT_N
    assert S >= 2 and chunk % BN == 0 and chunk % BS == 0 and threads == 128
    BC = NN * H
    min_ctas = min_ctas_per_sm(H, NN) if min_ctas is None else min_ctas
    NPG = chunk // BS  # block-table entries of one chunk
    assert NPG <= threads
    n_tile_chunk = chunk // BN
    f32, i32 = "float32", "int32"
    M = _tile_macros(heads=H, next_n=NN, block_size=BS, chunk=chunk, ablate=ablate)
    validate_pages = M.validate_pages
    kw = dict(heads=H, dim=D, next_n=NN, block_size=BS, num_stages=S, threads=threads, macros=M)
    pipelined_loop = _pipelined_loop_macro(**kw)
    sizes = _paged_sizes()
    B, NB, MB, L = sizes

    @T.macro
    def body(Q, KCache, KScale, W, ContextLens, BlockTable, Out):
        with T.Kernel(T.ceildiv(L, chunk), B, threads=threads) as (bc, b):
            Q_s = T.alloc_shared([BC, D], dtype)
            K_s = T.alloc_shared([S, BN, D], dtype)
            ks_s = T.alloc_shared([S, BN], f32)
            bt_s = T.alloc_shared([NPG], i32)
            w_f = T.alloc_fragment([BC], f32)
            acc = T.alloc_fragment([BN, BC], f32)
            acc3 = T.reshape(acc, [BN, NN, H])
            logit = T.alloc_fragment([BN, NN], f32)
            annotate_min_blocks_per_sm(min_ctas)

            tx = T.get_thread_binding()
            c0 = bc * chunk
            ctx_m = T.clamp(ContextLens[b], 0, 1 << 30)
            ctx = T.min(ctx_m, L)
            n_t = T.clamp(T.ceildiv(ctx - c0, BN), 0, n_tile_chunk)  # computed tiles (0: only the -inf fill)
            validate_pages(BlockTable, bt_s, tx, b, c0, ctx, MB, NB)
            T.sync_threads()
            pipelined_loop(Q, KCache, KScale, W, Out, Q_s, K_s, ks_s, bt_s, w_f, acc, acc3, logit, tx, b, c0, ctx_m,
                           n_t, L)

    return _paged_prim_func("indexer_paged_pipelined", body, heads=H, dim=D, next_n=NN, block_size=BS, dtype=dtype,
                            sizes=sizes)


def _pipelined_loop_macro(*, heads, dim, next_n, block_size, num_stages, threads, macros):
    """The "pipelined" main loop (module notes): cp.async ring with one wait_group + __syncthreads per tile."""
    BN, S = BLOCK_N, num_stages
    issue, epilogue, start_ring = macros.issue, macros.epilogue, macros.start_ring

    @T.macro
    def pipelined_loop(Q, KCache, KScale, W, Out, Q_s, K_s, ks_s, bt_s, w_f, acc, acc3, logit, tx, b, c0, ctx_m, n_t,
                       L):
        start_ring(Q, W, KCache, KScale, Out, Q_s, K_s, ks_s, bt_s, w_f, tx, b, c0, n_t, L, S, threads)
        for it in T.serial(n_t):
            T.ptx_wait_group(S - 2)  # S-1+it groups committed: group it (tile it) is complete
            T.sync_threads()  # tile it visible to all; all wgmma reads of stage (it-1) % S retired
            if it + S - 1 < n_t:
                issue(KCache, KScale, K_s, ks_s, bt_s, it + S - 1, (it + S - 1) % S)
            T.ptx_commit_group()
            st = it % S
            T.gemm(K_s[st, :, :], Q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
            epilogue(acc, acc3, logit, w_f, ks_s, bt_s, Out, it, st, c0 + it * BN, ctx_m, b, L)

    return pipelined_loop


def build_indexer_paged_async(*, heads: int, dim: int, next_n: int, block_size: int, dtype: str = "float8_e4m3",
                              chunk: int = CHUNK_P, num_stages: int = ASYNC_STAGES, threads: int = THREADS,
                              min_ctas: int | None = None):
    """"pipelined_async" variant (see the module notes): the "pipelined" kernel with tile it+1's wgmma issued
    asynchronously into a second accumulator before tile it's epilogue. Same signature as ``build_indexer_paged``;
    compile with ``_pass_configs("pipelined_async")``. ``min_ctas``: ``__launch_bounds__`` minimum CTAs per SM
    (None: ``min_ctas_per_sm_async``)."""
    H, D, NN, BS, BN, S = heads, dim, next_n, block_size, BLOCK_N, num_stages
    assert H in SUPPORTED_HEADS and D in SUPPORTED_DIMS and BS in SUPPORTED_BLOCK_SIZES and 1 <= NN <= MAX_NEXT_N
    # S >= 3: the stage refilled in step it, (it-1) % S, is neither tile it+1's (wgmma) nor tile it's (k_scale)
    assert S >= 3 and chunk % BN == 0 and chunk % BS == 0 and threads == 128
    BC = NN * H
    assert BC <= ASYNC_MAX_COLS, "two m64 x next_n*H fp32 accumulators would spill"
    min_ctas = min_ctas_per_sm_async(H, NN) if min_ctas is None else min_ctas
    NPG = chunk // BS
    assert NPG <= threads
    n_tile_chunk = chunk // BN
    n_acc = BN * BC // threads  # accumulator registers per thread
    f32, i32 = "float32", "int32"
    M = _tile_macros(heads=H, next_n=NN, block_size=BS, chunk=chunk)
    issue, epilogue, validate_pages = M.issue, M.epilogue, M.validate_pages
    sizes = _paged_sizes()
    B, NB, MB, L = sizes

    @T.macro
    def step(KCache, KScale, Q_s, K_s, ks_s, bt_s, w_f, acc_c, acc3_c, acc_n, logit, Out, it, n_t, c0, ctx_m, b, nxt):
        # tile it, whose wgmma (into acc_c) retired in the previous step (or the prologue); nxt (Python bool): run
        # tile it+1's wgmma (into acc_n) during this epilogue. Tile n_t (the pad of an odd n_t) runs on stale stage
        # data, is masked to -inf and not stored.
        T.ptx_wait_group(S - 3)  # S-1+it groups committed: tiles it and it+1 complete (this thread's copies)
        T.sync_threads()  # tile it+1 visible to all; all threads are past step it-1 (its epilogue, its wgmma wait)
        if nxt:
            T.wgmma_gemm(K_s[(it + 1) % S, :, :], Q_s, acc_n, transpose_B=True, clear_accum=True,
                         policy=T.GemmWarpPolicy.FullRow)
        if it + S - 1 < n_t:  # stage (it-1) % S: its wgmma retired in step it-2, its k_scale read in step it-1
            issue(KCache, KScale, K_s, ks_s, bt_s, it + S - 1, (it + S - 1) % S)
        T.ptx_commit_group()
        epilogue(acc_c, acc3_c, logit, w_f, ks_s, bt_s, Out, it, it % S, c0 + it * BN, ctx_m, b,
                 T.min(L, c0 + n_t * BN))
        if nxt:
            # retired within the step: ptxas keeps wgmma asynchronous only when no wgmma is in flight across the
            # loop's back edge (else C7514: every wgmma serialized)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc_n, 0, n_acc)  # no read of acc_n hoisted above the wait

    @T.macro
    def body(Q, KCache, KScale, W, ContextLens, BlockTable, Out):
        with T.Kernel(T.ceildiv(L, chunk), B, threads=threads) as (bc, b):
            Q_s = T.alloc_shared([BC, D], dtype)
            K_s = T.alloc_shared([S, BN, D], dtype)
            ks_s = T.alloc_shared([S, BN], f32)
            bt_s = T.alloc_shared([NPG], i32)
            w_f = T.alloc_fragment([BC], f32)
            acc_a = T.alloc_fragment([BN, BC], f32)  # even tiles
            acc_b = T.alloc_fragment([BN, BC], f32)  # odd tiles
            acc3_a = T.reshape(acc_a, [BN, NN, H])
            acc3_b = T.reshape(acc_b, [BN, NN, H])
            logit = T.alloc_fragment([BN, NN], f32)
            annotate_min_blocks_per_sm(min_ctas)

            tx = T.get_thread_binding()
            c0 = bc * chunk
            ctx_m = T.clamp(ContextLens[b], 0, 1 << 30)
            ctx = T.min(ctx_m, L)
            n_t = T.clamp(T.ceildiv(ctx - c0, BN), 0, n_tile_chunk)
            validate_pages(BlockTable, bt_s, tx, b, c0, ctx, MB, NB)
            T.sync_threads()
            M.start_ring(Q, W, KCache, KScale, Out, Q_s, K_s, ks_s, bt_s, w_f, tx, b, c0, n_t, L, S, threads)
            if n_t > 0:
                T.ptx_wait_group(S - 2)  # tile 0 complete
                T.sync_threads()  # tile 0 and Q_s visible to all
                T.wgmma_gemm(K_s[0, :, :], Q_s, acc_a, transpose_B=True, clear_accum=True,
                             policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_a, 0, n_acc)
                # tiles in pairs (acc_a: even tiles, acc_b: odd) so that the accumulators alternate at compile time
                # (a fragment indexed by a runtime parity would go to local memory); the last pair is peeled (its
                # second step has no next wgmma); an odd n_t is padded by the masked tile n_t
                n_p = T.ceildiv(n_t, 2)
                for it2 in T.serial(n_p - 1):
                    step(KCache, KScale, Q_s, K_s, ks_s, bt_s, w_f, acc_a, acc3_a, acc_b, logit, Out, it2 * 2, n_t,
                         c0, ctx_m, b, True)
                    step(KCache, KScale, Q_s, K_s, ks_s, bt_s, w_f, acc_b, acc3_b, acc_a, logit, Out, it2 * 2 + 1,
                         n_t, c0, ctx_m, b, True)
                step(KCache, KScale, Q_s, K_s, ks_s, bt_s, w_f, acc_a, acc3_a, acc_b, logit, Out, n_p * 2 - 2, n_t,
                     c0, ctx_m, b, True)
                step(KCache, KScale, Q_s, K_s, ks_s, bt_s, w_f, acc_b, acc3_b, acc_a, logit, Out, n_p * 2 - 1, n_t,
                     c0, ctx_m, b, False)

    return _paged_prim_func("indexer_paged_async", body, heads=H, dim=D, next_n=NN, block_size=BS, dtype=dtype,
                            sizes=sizes)


def _pass_configs(variant: str = VARIANT) -> dict:
    if variant == "sync":
        return {}
    # explicit barriers only (see the notes)
    return plain_pass_configs({tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})


_BUILDERS = {"pipelined": build_indexer_paged_pipelined, "sync": build_indexer_paged,
             "pipelined_async": build_indexer_paged_async}


def build(variant: str = VARIANT, **kw):
    assert variant in VARIANTS, variant
    return _BUILDERS[variant](**kw)


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, dim: int, next_n: int, block_size: int, dtype: str, variant: str = VARIANT):
    func = build(variant, heads=heads, dim=dim, next_n=next_n, block_size=block_size, dtype=dtype)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs(variant))


def kernel_unsupported(q, k_cache, weights, context_lens, block_table, k_scale_cache=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason (shapes/dtypes only, no sync)."""
    if tilelang is None:
        return "tilelang is not importable"
    if q.dim() != 4 or k_cache.dim() != 3:
        return "expected q [B, next_n, H, D] and k_cache [num_blocks, block_size, D]"
    B, NN, H, D = q.shape
    nb, bs = k_cache.shape[:2]
    if q.dtype not in _TL_DTYPES or k_cache.dtype != q.dtype:
        return "q/k_cache must both be float8_e4m3fn or bfloat16"
    if H not in SUPPORTED_HEADS or D not in SUPPORTED_DIMS or k_cache.shape[2] != D:
        return f"H={H} / D={D} unsupported (H in {SUPPORTED_HEADS}, D in {SUPPORTED_DIMS})"
    if not 1 <= NN <= MAX_NEXT_N:
        return f"next_n={NN} not in 1..{MAX_NEXT_N}"
    if bs not in SUPPORTED_BLOCK_SIZES:
        return f"block_size={bs} not in {SUPPORTED_BLOCK_SIZES}"
    if nb == 0:
        return "k_cache has no blocks"
    if weights.dtype != torch.float32 or tuple(weights.shape) != (B * NN, H):
        return "weights must be float32 [B*next_n, H]"
    if context_lens.dtype != torch.int32 or block_table.dtype != torch.int32 or block_table.dim() != 2:
        return "context_lens / block_table must be int32"
    if k_scale_cache is not None and (k_scale_cache.dtype != torch.float32 or tuple(k_scale_cache.shape) != (nb, bs)):
        return "k_scale_cache must be float32 [num_blocks, block_size]"
    for name, x in (("q", q), ("k_cache", k_cache), ("weights", weights), ("context_lens", context_lens),
                    ("block_table", block_table), ("k_scale_cache", k_scale_cache)):
        if x is not None and (not x.is_cuda or x.device != q.device):
            return f"{name} must be a CUDA tensor on {q.device}"
    return None


def resolve_variant(variant: str | None, heads: int, next_n: int) -> str:
    """The variant that runs: ``variant``, else ``$FLASHDSA_PAGED_VARIANT`` (read per call), else ``VARIANT``;
    "pipelined_async" becomes "pipelined" when next_n*H > ``ASYNC_MAX_COLS``."""
    v = variant if variant is not None else (os.environ.get(VARIANT_ENV, "").strip().lower() or VARIANT)
    if v not in VARIANTS:
        raise ValueError(f"indexer paged kernel: variant {v!r} not in {VARIANTS} (argument or ${VARIANT_ENV})")
    return "pipelined" if v == "pipelined_async" and heads * next_n > ASYNC_MAX_COLS else v


def run_indexer_logits_paged(q, k_cache, weights, context_lens, block_table, k_scale_cache, max_context: int,
                             variant: str | None = None):
    """``[B*next_n, max_context]`` float32; no host sync (max_context is a host int). ``variant``: one of
    ``VARIANTS`` (None -> ``$FLASHDSA_PAGED_VARIANT`` or ``VARIANT``, see ``resolve_variant``); all give the same
    result ("pipelined_async" does the arithmetic of "pipelined" instruction for instruction: expected bitwise)."""
    reason = kernel_unsupported(q, k_cache, weights, context_lens, block_table, k_scale_cache)
    if reason is not None:
        raise ValueError(f"indexer paged kernel: {reason}")
    B, NN, H, D = q.shape
    variant = resolve_variant(variant, H, NN)
    nb, bs = k_cache.shape[:2]
    dev = q.device
    L = int(max_context)
    out = torch.empty((B * NN, L), dtype=torch.float32, device=dev)
    if B == 0 or L == 0:
        return out
    if nb == 0 or block_table.shape[1] == 0:  # no key can be valid
        return out.fill_(float("-inf"))
    ksc = aligned(k_scale_cache) if k_scale_cache is not None else torch.ones((nb, bs), dtype=torch.float32,
                                                                                 device=dev)
    kernel = _compiled(H, D, NN, bs, _TL_DTYPES[q.dtype], variant)
    kernel(aligned(q).view(B * NN * H, D), aligned(k_cache), ksc, aligned(weights).view(-1), aligned(context_lens),
           aligned(block_table), out)
    return out


def lowering_cases():
    """The "pipelined" variant (lowered with ``_pass_configs()``): several pages per tile (bs 16, next_n 2) and
    half a page per tile (bs 128) with the small-H / D=64 / next_n=4 shapes; "pipelined_async" (same pass
    configs) at the next_n=2 budget shape."""
    cases = []
    for dtype, H, D, nn, bs in [("float8_e4m3", 64, 128, 2, 16), ("float8_e4m3", 32, 64, 4, 128)]:
        name = f"{'fp8' if dtype.startswith('float8') else 'bf16'}_h{H}_d{D}_nn{nn}_bs{bs}"
        cases.append((name, build_indexer_paged_pipelined(heads=H, dim=D, next_n=nn, block_size=bs, dtype=dtype)))
    cases.append(("async_fp8_h64_d128_nn2_bs64", build_indexer_paged_async(heads=64, dim=128, next_n=2, block_size=64)))
    return cases
