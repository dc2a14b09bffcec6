"""Lightning-indexer decode logits over a paged key cache in TileLang for Hopper (sm_90a). FIRST DRAFT.

Notes
-----
Math (contract of ``flashdsa.indexer_logits_paged``): row ``r = b*next_n + j`` scores positions
``p < context_lens[b] - next_n + 1 + j``: ``out[r, p] = k_scale(p) * sum_h w[r, h] * relu(q[b, j, h] . k(p))`` with
``k(p)`` slot ``p % bs`` of block ``block_table[b, p // bs]``; -inf elsewhere and where the block id is outside
``[0, num_blocks)``.

Design
  * Grid ``(ceil(max_context / CHUNK), B)``, CHUNK = 2048 positions: CTA (c, b) owns columns
    ``[c*CHUNK, (c+1)*CHUNK)`` of the ``next_n`` rows of sequence b and writes every one of them exactly once
    (computed 64-key stages up to the sequence's context length, -inf beyond).
  * Per stage: 64 keys gathered page by page from the cache (``64 / bs`` pages per stage for bs <= 64, or half a
    page for bs = 128) with the physical block read from the block table (an invalid id is clamped to block 0
    for the load and masked to -inf afterwards), plus their scales. One consumer warpgroup computes
    ``S[key, j*H + h]`` with the keys as the wgmma M side (m64 x n(next_n*H) x k32 for fp8), then
    relu * w, the head sum (quad shuffles), * k_scale, the causal/validity mask, and stores.
  * M-side 64 keys x N = next_n*H columns: accumulator next_n*H/2 f32 registers per thread (32..128).
Budget (target B=128, next_n=1, ctx 32768, H=64, D=128, bs 64): bytes = keys x 132 = 553 MB -> 0.163 ms at
  3.4 TB/s; output 16.8 MB. 2048 CTAs of 32 stages. Shared memory: Q <= 32 KiB + 3 x 8 KiB K + scales.
Verified: lowering only (CPU, sm_90a; wgmma e4m3 present; ptxas: 72 registers, no spills). Never run on a GPU.
  TileLang 0.1.15 does NOT pipeline this loop (no TMA / cp.async / warp specialisation in the lowered source: the
  page gather is synchronous 16-byte loads + __syncthreads), so expect well under the 3.4 TB/s target: this is a
  correct baseline, not the fast kernel. Next step: a producer warpgroup issuing per-page TMA loads (or
  cp.async with T.Pipelined order/stage annotations) and 2+ CTAs per SM.
Risks for the first GPU run
  * The page gather is a TMA/cp.async copy with a block-table-dependent coordinate inside a warp-specialised
    pipeline; if TileLang hoists the block-table read wrongly the wrong page is read (test_paged_* catch it).
  * Speed is unmeasured; one warpgroup per CTA with m64 tiles is likely latency-bound at small next_n*H.
"""

from __future__ import annotations

import functools

import torch

try:
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover
    tilelang = None
    T = None

BLOCK_N = 64  # keys per stage (wgmma M)
CHUNK = 2048  # positions per CTA
NUM_STAGES = 3
THREADS = 128
SUPPORTED_HEADS = (8, 16, 32, 64)
SUPPORTED_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
MAX_NEXT_N = 4
_TL_DTYPES = {torch.float8_e4m3fn: "float8_e4m3", torch.bfloat16: "bfloat16"}


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
    B = T.dynamic("B")
    NB = T.dynamic("num_blocks")
    MB = T.dynamic("max_blocks")
    L = T.dynamic("L")

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

    return indexer_paged


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, dim: int, next_n: int, block_size: int, dtype: str):
    func = build_indexer_paged(heads=heads, dim=dim, next_n=next_n, block_size=block_size, dtype=dtype)
    return tilelang.compile(func, target="cuda")


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


def _aligned(x):
    x = x.contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def run_indexer_logits_paged(q, k_cache, weights, context_lens, block_table, k_scale_cache, max_context: int):
    """``[B*next_n, max_context]`` float32; no host sync (max_context is a host int)."""
    reason = kernel_unsupported(q, k_cache, weights, context_lens, block_table, k_scale_cache)
    if reason is not None:
        raise ValueError(f"indexer paged kernel: {reason}")
    B, NN, H, D = q.shape
    nb, bs = k_cache.shape[:2]
    dev = q.device
    L = int(max_context)
    out = torch.empty((B * NN, L), dtype=torch.float32, device=dev)
    if B == 0 or L == 0:
        return out
    if nb == 0 or block_table.shape[1] == 0:  # no key can be valid
        return out.fill_(float("-inf"))
    ksc = _aligned(k_scale_cache) if k_scale_cache is not None else torch.ones((nb, bs), dtype=torch.float32,
                                                                                 device=dev)
    kernel = _compiled(H, D, NN, bs, _TL_DTYPES[q.dtype])
    kernel(_aligned(q).view(B * NN * H, D), _aligned(k_cache), ksc, weights.contiguous().view(-1),
           context_lens.contiguous(), block_table.contiguous(), out)
    return out


def lowering_cases():
    cases = []
    for dtype, H, D, nn, bs in [("float8_e4m3", 64, 128, 2, 16)]:  # lowering is slow: one case
        name = f"{'fp8' if dtype.startswith('float8') else 'bf16'}_h{H}_d{D}_nn{nn}_bs{bs}"
        cases.append((name, build_indexer_paged(heads=H, dim=D, next_n=nn, block_size=bs, dtype=dtype)))
    return cases
