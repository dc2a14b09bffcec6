"""Lightning-indexer prefill logits in TileLang for Hopper (sm_90a): FP8 (or bf16) wgmma, fused relu/weight/head sum.

Notes
-----
Math (contract of ``flashdsa.indexer_logits``)::

    out[m, n] = k_scale[n] * sum_h w[m, h] * relu(q[m, h] . k[n])     for clamp(k_start[m]) <= n < clamp(k_end[m])
    out[m, n] = -inf                                                 elsewhere (every element is written)

Design
  * One CTA per query block of ``BQ = COLS / H`` rows (``COLS = 256``: H=64 -> 4 rows, 32 -> 8, 16 -> 16,
    8 -> 32). Its Q tile ``[BQ*H, D]`` (the rows' heads, flattened: q viewed as ``[M*H, D]``) stays in shared
    memory; the CTA streams key blocks of ``BN = 128`` keys through a TMA pipeline (3 stages) and for each
    block computes ``S[key, row*H + h] = K_blk @ Q_tile^T`` with the *key block as the wgmma M side* and the
    query heads x rows as N (m64n256k32 e4m3 x e4m3 -> f32, both operands K-major from 128B-swizzled smem).
  * TileLang warp-specialises the loop: warpgroup 0 is the TMA producer (K tile + the 128 k_scale values per
    stage, registers dropped to 24 with setmaxnreg), warpgroups 1-2 are consumers (240 registers each;
    GemmWarpPolicy.FullRow: each owns 64 keys x all 256 columns, accumulator = 128 f32 regs/thread).
  * Schedules (``schedule=``, default ``SCHEDULE``):
      - "lockstep" (measured default): both consumers wait for the same stage and issue their wgmma at the
        same time, so their MMA phases and epilogue phases coincide and the tensor cores idle during the
        epilogue (per 128-key block ~ 2 t_mma + epilogue).
      - "pingpong": same data flow, plus two named barriers (ids PP_BAR, PP_BAR + 1; 256 threads = the two
        consumer warpgroups) that make the wgmma issues alternate, FA3 style: warpgroup w waits for its turn
        (bar.sync PP_BAR + w), issues its wgmma asynchronously (T.wgmma_gemm), hands the turn to the peer
        (bar.arrive PP_BAR + 1 - w), then waits for its wgmma (wait_wgmma 0) and runs its epilogue while the
        peer's wgmma (queued right behind its own) runs: per block ~ max(2 t_mma, t_mma + epilogue). Warpgroup
        1 gives the first turn at it == 0 and skips its last hand-over, so every barrier phase is completed
        (no arrival left pending at exit). The WS pass releases a stage after the last access of K_s in the
        consumer body; with an async wgmma that would be before the wait, so a never-true read of K_s after
        the wait pins the release behind it (checked in the generated CUDA: "empty" arrive after wait_wgmma).
      - "pingpong_sync": as "pingpong" with the synchronous T.gemm (the hand-over comes after the own wgmma
        retired: a small tensor-pipe bubble per turn, but no async subtleties).
  * Column order (``head_major=``, default ``HEAD_MAJOR``): tile column c = q*H + h (False: Q tile = one TMA box,
    the accumulator layout puts a row's H heads on the 4 lanes of a quad -> per-thread sums + a 2-step quad
    all-reduce, and all 4 lanes hold every (key, row) logit: 8 (H64) / 16 (H32) logits per thread are masked,
    scaled and stored by lane 0 of each quad) or c = h*BQ + q (True: the wgmma m64nNk32 accumulator gives thread
    (lane) the columns 8j + 2*(lane%4) + {0,1}, i.e. rows q = c % BQ that are distinct per lane for BQ >= 8 (H <= 32:
    the head sum is entirely in-thread, no shuffle) and shared by 2 lanes for BQ = 4 (H64: one xor-2 shuffle); 4
    logits per thread to mask/scale/store). Per-iteration consumer PTX: H32/D64 951 -> 604 instructions, H64/D128
    783 -> 630 (of which 128 max + 128 mul + 128 add, fused to FFMA by ptxas). Cost: the Q tile is loaded by a
    transposing SIMT copy (16-byte vectors, all 384 threads, once per CTA, before the -inf fill) instead of one TMA
    box, and the 256 weights by scalar loads; rows past M are clamped to M - 1 (their logits are never stored).
    The head sum runs in a different order: results differ from the q-major kernel by fp32 rounding (~1e-7 rel).
  * Epilogue in registers: ``S = max(S, 0) * w[col]`` (FMNMX + FFMA after contraction with the sum), the sum
    over each row's H columns is a per-thread sum plus a 2-step quad shuffle (``T.reduce_sum`` on a
    ``[BN, BQ, H]`` reshape of the accumulator), then ``* k_scale[n]``, the per-row range mask, and a direct
    store (no shared staging: lanes of one quad hold one key, 8 quads write 8 consecutive keys = 32 B).
  * Epilogue chains (``chains=``, default ``default_chains(H, D)``: 4 for H 16 / 32, 2 for H 8, 1 for H 64; needs
    head_major). With ``chains=1`` each logit is one serial sum over its H in-thread columns, and the masking
    select after it let nvcc sink every logit's sum into its own branch: at H32/D64 the SASS did the 4 logits one
    after another as 32-deep dependent FADD chains, the FMULs uncontracted (per iteration and warp 527
    instructions: 128 FMNMX + 100 FMUL + 96 FADD + 32 FFMA + ~170 other; H64: 550, 4 chains interleaved but
    also uncontracted). ``chains=G`` splits head h = j*G + g into G partial sums (``T.reduce_sum`` over j of a
    ``[BN, H/G, G, BQ]`` reshape, then over g) and masks branch-free, ``min(logit * ks, +inf | -inf)``: SASS
    H32/D64 424 instructions (128 FMNMX + 128 FFMA + 16 FADD + ...), 16 independent 8-long FFMA chains per
    thread, interleaved with the FMNMX; H64/D128 446. Summation order differs from chains=1 (~1e-7 rel).
    ``relu_add=True`` (variant) computes relu as ``(x + |x|) * (w/2)`` (FADD with an |x| operand, FMA pipe
    instead of the ALU pipe's FMNMX; for finite inputs bitwise equal to chains alone: halving w is exact).
  * Range skipping: the CTA loops only over key blocks that intersect the union ``[min start, max end)`` of
    its non-empty rows; every other column of its rows is filled with -inf by the same CTA (coalesced scalar
    stores, all 384 threads, before the pipeline starts) -> each output element is written exactly once.
    Query blocks are visited heaviest-first (blockIdx 0 takes the last rows: causal rows grow with m).
  * M, N are dynamic (one compile per (dtype, H, D)); H, D, tile sizes are compile-time.

Shared memory (fp8, D=128): Q 256x128 (32 KiB) + K 3 x 128x128 (48 KiB) + k_scale 3 x 512 B + row ranges
  ~= 82 KiB (D=64: 41 KiB; bf16 D=128: 160 KiB). 1 CTA / SM (384 threads, register-bound).
Target workload (M=4096, N=8192, k_end = m + 4097, H=64, D=128, fp8):
  sum(k_end - k_start) = 25.17e6 -> FLOPs = 2*64*128*25.17e6 = 412 GFLOP (0.55 ms at 750 TFLOP/s).
  The kernel computes whole 128-key blocks: ~ +1.5 % wasted MMA on diagonal blocks.
  Output written once: 4096*8192*4 B = 134 MB (~0.03 ms of HBM time, overlapped with MMA). K read from L2
  once per query block: 1024 blocks x ~0.75 MB ~= 0.8 GB (~1.5 TB/s of L2 at 0.55 ms). Epilogue: ~2.7
  CUDA-core ops per accumulator element (1.6e9 elements) ~= 0.14 ms if not overlapped with the MMA.
Verified (chains / relu_add, CPU only): lower for fp8 H32/D64, H16/D64, H8/D64, H16/D128, H64/D128 and bf16 H32/D64;
  ptxas (nvcc 13.0, sm_90a): 168 registers, 0 spills, 0 stack; SASS counts above (nvdisasm). GPU: see below.
Verified (schedule / head_major options, CPU only): "pingpong" and "pingpong_sync", with and without head_major,
  lower for fp8 H64/D128, H32/D64 (m64n256k32), H16/D64 (m64n128k32) and bf16 H64/D128; generated CUDA read (turn
  sync before the stage wait, async wgmma, peer arrive, wait_wgmma<0>, then the stage release; head-major: 16-byte
  Q vectors at the right (row, head) with the 128B/64B swizzle, AllReduce<Sum,4,2> for H64, none for H <= 32);
  ptxas (nvcc 13.0, sm_90a): 0 spills, 0 stack (16 barriers reserved for the dynamic named-barrier id). The
  default (lockstep, q-major) CUDA is byte-identical to the pre-option kernel.
Verified: lowering only (CPU, sm_90a): every lowering case issues wgmma (m64n256k32 e4m3 for H >= 32, m64n128k32
  for H <= 16, m64n256k16 bf16), TMA loads for Q / K / k_scale, setmaxnreg 24/240; ptxas (nvcc 13.0, sm_90a, on the
  CPU box): 0 spills, 0 stack for all cases. Lowering costs ~5-12 s CPU per config (TileLang layout inference).
  GPU (H200): tests/indexer GPU tests pass; 841 / 930 / 512 TFLOP/s on the issue shapes (docs/PERFORMANCE.md).
Risks for the first GPU run
  * A CTA whose rows are all empty runs zero pipeline iterations; the Q TMA load is skipped for it (an
    un-awaited TMA into the smem of an exiting CTA would be undefined). If TileLang's WS codegen mis-handles a
    zero trip count, force at least one block (and mask everything).
  * TMA needs 16-byte aligned base addresses: the launcher clones misaligned q / k / k_scale views.
  * bf16 uses the same code with m64n256k16; not tuned.
  * Performance: one CTA per SM means the Q load + fill at each CTA start is not hidden (~1-2 us per CTA,
    ~5-8 % at the target size). A persistent grid would remove it.
"""

from __future__ import annotations

import functools

import torch

from .._tilelang import aligned

try:  # the package must import without tilelang (CPU CI); kernels are built lazily
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover - depends on the machine
    tilelang = None
    T = None

BLOCK_N = 128  # keys per pipeline stage (wgmma M side: 2 consumer warpgroups x 64)
COLS = 256  # wgmma N: query rows x heads per CTA (H >= 32)
COLS_SMALL_H = 128  # H <= 16: keeps weights + per-row logits + accumulator within 240 registers
NUM_STAGES = 2  # 2 beat 3 and 4 at H64/D128 and H32/D64 (benchmarks/results/2026-11-30_h200_61a94777_variants.json)
SCHEDULES = ("lockstep", "pingpong", "pingpong_sync")
# ping-pong + head-major: 824 vs 681 TFLOP/s (H64 D128) and 418 vs 313 (H32 D64), causal M 4096, N 8192, same
# results up to head-summation order (benchmarks/results/2026-11-30_h200_48a0c95_variants_indexer.json)
SCHEDULE = "pingpong"  # default of build_indexer_prefill / the dispatcher (see the notes: "Schedules")
HEAD_MAJOR = True  # tile column order default (see the notes: "Column order")
PP_BAR = 8  # named barriers 8 and 9: ping-pong turns of consumer warpgroups 0 and 1 (0 is __syncthreads)
THREADS = 256  # consumer threads (TileLang adds one producer warpgroup)
SUPPORTED_HEADS = (8, 16, 32, 64)
SUPPORTED_DIMS = (64, 128)
_TL_DTYPES = {torch.float8_e4m3fn: "float8_e4m3", torch.bfloat16: "bfloat16"}


CHAINS = (1, 2, 4, 8)  # partial head sums per logit in the epilogue (1: the single serial sum of 98d26d6)


def default_chains(heads: int, dim: int) -> int:
    """Epilogue chains per (H, D): 4-long FFMA chains for H <= 32 (H 8: 2 chains of 4); H 64 keeps the measured
    serial sum (841 / 927 TFLOP/s) until the chains variant is timed there (scripts/variants.py)."""
    return 1 if heads >= 64 else min(4, heads // 4)


def default_cols(heads: int) -> int:
    return COLS if heads >= 32 else COLS_SMALL_H


def build_indexer_prefill(*, heads: int, dim: int, dtype: str = "float8_e4m3", block_n: int = BLOCK_N,
                          cols: int | None = None, num_stages: int = NUM_STAGES, threads: int = THREADS,
                          schedule: str | None = None, head_major: bool | None = None, chains: int | None = None,
                          relu_add: bool = False):
    """TileLang prim_func ``(Q[M*H, D], K[N, D], W[M*H] f32, KScale[N] f32, KStart[M] i32, KEnd[M] i32,
    Out[M, N] f32)``; M, N dynamic. ``schedule``: one of ``SCHEDULES`` (None -> ``SCHEDULE``); ``head_major``:
    tile column order (None -> ``HEAD_MAJOR``); ``chains``: partial head sums per logit (None ->
    ``default_chains``); ``relu_add``: relu as (x + |x|) * w/2; all described in the notes. Same signature for
    every option."""
    H, D, BN = heads, dim, block_n
    cols = cols or default_cols(H)
    assert cols % H == 0 and H in SUPPORTED_HEADS and D in SUPPORTED_DIMS, (H, D, cols)
    schedule = schedule or SCHEDULE
    assert schedule in SCHEDULES, schedule
    head_major = HEAD_MAJOR if head_major is None else head_major
    chains = default_chains(H, D) if chains is None else chains
    assert chains in CHAINS and H % chains == 0 and (chains == 1 or head_major), (chains, H, head_major)
    assert not relu_add or chains > 1, "relu_add needs the chains epilogue"
    vec_q = 16 if dtype == "float8_e4m3" else 8  # elements per 16-byte vector of the head-major Q copy
    pingpong = schedule != "lockstep"
    async_issue = schedule == "pingpong"
    BQ = cols // H  # query rows per CTA
    BC = BQ * H
    fill_chunk = threads  # columns per -inf fill step
    f32, i32 = "float32", "int32"
    M = T.dynamic("M")
    N = T.dynamic("N")

    @T.prim_func
    def indexer_prefill(
        Q: T.Tensor([M * H, D], dtype),
        K: T.Tensor([N, D], dtype),
        W: T.Tensor([M * H], f32),
        KScale: T.Tensor([N], f32),
        KStart: T.Tensor([M], i32),
        KEnd: T.Tensor([M], i32),
        Out: T.Tensor([M, N], f32),
    ):
        with T.Kernel(T.ceildiv(M, BQ), threads=threads) as bx:
            Q_s = T.alloc_shared([BC, D], dtype)
            K_s = T.alloc_shared([BN, D], dtype)
            ks_s = T.alloc_shared([BN], f32)
            row_lo = T.alloc_shared([BQ], i32)
            row_hi = T.alloc_shared([BQ], i32)
            w_f = T.alloc_fragment([BC], f32)
            acc = T.alloc_fragment([BN, BC], f32)
            # column c of the tile = (row q, head h): c = q*H + h (default) or c = h*BQ + q (head_major)
            acc3 = T.reshape(acc, [BN, H, BQ] if head_major else [BN, BQ, H])
            logit = T.alloc_fragment([BN, BQ], f32)
            if chains > 1:  # head h = j*chains + g: chains independent partial sums per logit (see "Epilogue")
                acc4 = T.reshape(acc, [BN, H // chains, chains, BQ])
                part = T.alloc_fragment([BN, chains, BQ], f32)
            lo = T.alloc_local([1], i32)
            hi = T.alloc_local([1], i32)

            T.annotate_producer_reg_dealloc(24)
            T.annotate_consumer_reg_alloc(240)

            m0 = (T.ceildiv(M, BQ) - 1 - bx) * BQ  # heaviest (last) query rows first
            # ---- per-row ranges, clamped to [0, N]; rows past M are empty ----
            for q in T.Parallel(BQ):
                m = T.min(m0 + q, M - 1)
                s = T.if_then_else(m0 + q < M, T.clamp(KStart[m], 0, N), 0)
                e = T.if_then_else(m0 + q < M, T.clamp(KEnd[m], 0, N), 0)
                row_lo[q] = s
                row_hi[q] = T.max(e, s)
            # ---- union of the non-empty ranges, in key blocks ----
            lo[0] = N
            hi[0] = 0
            for q in T.serial(BQ):
                if row_hi[q] > row_lo[q]:
                    lo[0] = T.min(lo[0], row_lo[q])
                    hi[0] = T.max(hi[0], row_hi[q])
            # At least one block, even when every row is empty (then block 0, fully masked): the pipeline never
            # runs zero iterations and the Q TMA load is always awaited.
            kb_lo = T.if_then_else(hi[0] > lo[0], lo[0] // BN, 0)
            kb_hi = T.max(T.ceildiv(hi[0], BN), kb_lo + 1)
            fill_a = kb_lo * BN  # columns [0, fill_a) and [fill_b, N) are never computed: -inf
            fill_b = T.min(kb_hi * BN, N)

            if head_major:  # transposing SIMT copy (rows past M: clamped, their logits are never stored)
                for c, d in T.Parallel(BC, D, coalesced_width=T.int32(vec_q)):
                    Q_s[c, d] = Q[T.min(m0 + c % BQ, M - 1) * H + c // BQ, d]
            else:
                T.copy(Q[m0 * H:m0 * H + BC, :], Q_s)  # TMA, issued before the fill so that the two overlap

            # ---- -inf outside the computed key blocks (raw thread index: a T.Parallel over a symbolic range
            # makes layout inference slow). Every thread of the CTA runs this, including the producer warpgroup
            # TileLang adds; threads >= fill_chunk repeat columns of the next chunk (same value: harmless).
            tx = T.get_thread_binding()
            for q in T.serial(BQ):
                for c in T.serial(T.ceildiv(fill_a, fill_chunk)):
                    col = c * fill_chunk + tx
                    if (col < fill_a) & (m0 + q < M):
                        Out[m0 + q, col] = -T.infinity(f32)
                for c in T.serial(T.ceildiv(N - fill_b, fill_chunk)):
                    col = fill_b + c * fill_chunk + tx
                    if (col < N) & (m0 + q < M):
                        Out[m0 + q, col] = -T.infinity(f32)

            if relu_add:  # weights / 2 (exact): see the epilogue
                for c in T.Parallel(BC):
                    w_f[c] = W[T.min(m0 + c % BQ, M - 1) * H + c // BQ] * T.float32(0.5)
            elif head_major:
                for c in T.Parallel(BC):
                    w_f[c] = W[T.min(m0 + c % BQ, M - 1) * H + c // BQ]
            else:
                T.copy(W[m0 * H:m0 * H + BC], w_f)

            for it in T.Pipelined(kb_hi - kb_lo, num_stages=num_stages):
                n0 = (kb_lo + it) * BN
                T.copy(K[n0:n0 + BN, :], K_s)
                T.copy(KScale[n0:n0 + BN], ks_s)
                if pingpong:
                    # consumer warpgroup 0 / 1 (the WS pass rebases the thread index to the consumer branch)
                    wg = T.get_thread_binding() // 128
                    if (it == 0) & (wg == 1):
                        T.named_barrier_arrive(PP_BAR, 256)  # warpgroup 0 issues first
                    T.call_extern("handle", "tl::__sync_thread_partial", PP_BAR + wg, 256)  # my turn
                    if async_issue:
                        T.wgmma_gemm(K_s, Q_s, acc, transpose_B=True, clear_accum=True,
                                     policy=T.GemmWarpPolicy.FullRow)
                        if (wg == 0) | (it + 1 < kb_hi - kb_lo):  # keeps the barrier arrivals balanced
                            T.named_barrier_arrive(PP_BAR + 1 - wg, 256)  # the peer may issue behind mine
                        T.wait_wgmma(0)
                        # as CUTLASS after warpgroup_wait: keeps nvcc from hoisting accumulator reads above the wait
                        T.warpgroup_fence_operand(acc, 0, BN * BC // threads)
                        # never true at run time; a read of K_s after the wait moves the WS pass's release of the
                        # K stage (its "empty" mbarrier arrive) behind the wait: the peer's issue may not free it early
                        if kb_hi < 0:
                            lo[0] = T.cast(K_s[0, 0], i32)
                    else:
                        T.gemm(K_s, Q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        if (wg == 0) | (it + 1 < kb_hi - kb_lo):
                            T.named_barrier_arrive(PP_BAR + 1 - wg, 256)
                else:
                    T.gemm(K_s, Q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if relu_add:  # (x + |x|) * (w / 2) == max(x, 0) * w exactly; FADD runs on the FMA pipe
                    for n, c in T.Parallel(BN, BC):
                        acc[n, c] = (acc[n, c] + T.abs(acc[n, c])) * w_f[c]
                else:
                    for n, c in T.Parallel(BN, BC):
                        acc[n, c] = T.max(acc[n, c], 0) * w_f[c]
                if chains > 1:
                    T.reduce_sum(acc4, part, dim=1)  # chains x BQ independent in-thread FFMA chains per key
                    T.reduce_sum(part, logit, dim=1)  # + the xor-2 shuffle at H64
                    # Branch-free mask. The select form below makes nvcc sink each logit's whole head sum into its
                    # own branch (4 serial FADD chains, FMUL no longer contracted). min(v, +inf) = v and
                    # min(v, -inf) = -inf whatever v is (PTX min.f32 returns the non-NaN operand).
                    for n, q in T.Parallel(BN, BQ):
                        logit[n, q] = T.min(logit[n, q] * ks_s[n], T.if_then_else(
                            (n0 + n >= row_lo[q]) & (n0 + n < row_hi[q]), T.infinity(f32), -T.infinity(f32)))
                else:
                    T.reduce_sum(acc3, logit, dim=1 if head_major else 2)
                    # mask + scale in registers first: folding this into the store statement makes TileLang's
                    # layout inference ~3x slower (12 s more per config)
                    for n, q in T.Parallel(BN, BQ):
                        logit[n, q] = T.if_then_else((n0 + n >= row_lo[q]) & (n0 + n < row_hi[q]),
                                                     logit[n, q] * ks_s[n], -T.infinity(f32))
                for n, q in T.Parallel(BN, BQ):
                    if (m0 + q < M) & (n0 + n < N):
                        Out[m0 + q, n0 + n] = logit[n, q]

    return indexer_prefill


def _pass_configs():
    return {}


@functools.lru_cache(maxsize=32)
def _compiled(heads: int, dim: int, dtype: str, schedule: str = SCHEDULE, head_major: bool = HEAD_MAJOR):
    func = build_indexer_prefill(heads=heads, dim=dim, dtype=dtype, schedule=schedule, head_major=head_major)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, k, weights, k_scale=None, k_start=None, k_end=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason. Reads shapes/dtypes only (no sync)."""
    if tilelang is None:
        return "tilelang is not importable"
    if q.dim() != 3 or k.dim() != 2 or weights.dim() != 2:
        return "expected q [M, H, D], k [N, D], weights [M, H]"
    M, H, D = q.shape
    N = k.shape[0]
    if q.dtype not in _TL_DTYPES:
        return f"q dtype {q.dtype} not in (float8_e4m3fn, bfloat16)"
    if k.dtype != q.dtype:
        return "k dtype must equal q dtype"
    if H not in SUPPORTED_HEADS:
        return f"H={H} not in {SUPPORTED_HEADS}"
    if D not in SUPPORTED_DIMS or k.shape[1] != D:
        return f"D={D} not in {SUPPORTED_DIMS} (or k's last dim differs)"
    if weights.dtype != torch.float32 or tuple(weights.shape) != (M, H):
        return "weights must be float32 [M, H]"
    tensors = {"q": q, "k": k, "weights": weights, "k_scale": k_scale, "k_start": k_start, "k_end": k_end}
    for name, x in tensors.items():
        if x is not None and (not x.is_cuda or x.device != q.device):
            return f"{name} must be a CUDA tensor on {q.device}"
    if k_scale is not None and (k_scale.dtype != torch.float32 or tuple(k_scale.shape) != (N,)):
        return "k_scale must be float32 [N]"
    for name, x in (("k_start", k_start), ("k_end", k_end)):
        if x is not None and (x.dtype != torch.int32 or tuple(x.shape) != (M,)):
            return f"{name} must be int32 [M]"
    if M * H >= 2**31 or N >= 2**31:
        return "sizes exceed int32 indexing"
    return None


def run_indexer_logits(q, k, weights, k_scale, k_start=None, k_end=None) -> torch.Tensor:
    """``[M, N]`` float32 logits (see module notes). CUDA tensors; no host sync; every element written."""
    reason = kernel_unsupported(q, k, weights, k_scale, k_start, k_end)
    if reason is not None:
        raise ValueError(f"indexer prefill kernel: {reason}")
    M, H, D = q.shape
    N = k.shape[0]
    dev = q.device
    out = torch.empty((M, N), dtype=torch.float32, device=dev)
    if M == 0 or N == 0:
        return out
    q2 = aligned(q).view(M * H, D)  # (TMA descriptors need a 16-byte aligned base)
    k2 = aligned(k)
    w = aligned(weights).view(M * H)
    ks = aligned(k_scale) if k_scale is not None else torch.ones(N, dtype=torch.float32, device=dev)
    ks0 = aligned(k_start) if k_start is not None else torch.zeros(M, dtype=torch.int32, device=dev)
    ke0 = aligned(k_end) if k_end is not None else torch.full((M,), N, dtype=torch.int32, device=dev)
    kernel = _compiled(H, D, _TL_DTYPES[q.dtype], SCHEDULE, HEAD_MAJOR)
    kernel(q2, k2, w, ks, ks0, ke0, out)
    return out


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    cases = []
    # lowering takes 10-40 s a case on a 2-core CPU: the two wgmma widths (H >= 32: n256, H <= 16: n128)
    for dtype, H, D in [("float8_e4m3", 64, 128), ("float8_e4m3", 16, 64)]:
        name = f"{'fp8' if dtype.startswith('float8') else 'bf16'}_h{H}_d{D}"
        cases.append((name, build_indexer_prefill(heads=H, dim=D, dtype=dtype)))
    # the non-default options together (named-barrier ping-pong, head-major columns); ~10-20 s more
    other = "pingpong" if SCHEDULE == "lockstep" else "lockstep"
    cases.append((f"fp8_h64_d128_{other}_hm{int(not HEAD_MAJOR)}",
                  build_indexer_prefill(heads=64, dim=128, schedule=other, head_major=not HEAD_MAJOR)))
    return cases
