"""Dense decode's pair-path step inputs in one launch: each query token's attended length and the CTA order.

``_pair_path.prepare`` needs, per decode call, ``lengths`` [B * s_q] (query i of sequence b attends
``clamp(cache_seqlens[b] + shift_i, 0, L)`` positions, shift_i = i - (s_q - 1) if causal else 0) and ``order``
[B * s_q] (the sequences longest first -- a stable descending sort of each sequence's longest query length
``clamp(cache_seqlens[b], 0, L)`` -- a sequence's s_q tokens adjacent and in order).  As PyTorch ops that is ~11
small launches per call (arange, clamps, adds, amax, argsort, a cast: ``_pair_path.query_lengths`` /
``token_order``, which stay the CPU path and the reference here), each a few microseconds of GPU time inside
``mla_decode``'s interval.  This kernel computes both in one launch and without a host sync (CUDA graphs).

The sort is a rank count: thread b counts the sequences j with m_j > m_b, or m_j == m_b and j < b (stable), i.e.
its position in the descending order, reading every m_j through a shared-memory tile (B^2 compares over B
threads).  Sequence b's tokens then go to positions rank_b * s_q + i.  Measured (H100, sessions 46-47, B 128):
6.5 us at s_q 1, 7.1 us at s_q 2 (profiler); against the PyTorch ops, CUDA-graph replay equal within 0.5% and an
eager ``mla_decode`` 0.90 -> 0.63 ms (host 0.37 -> 0.16 ms per call, docs/PERFORMANCE.md "Session 47").
Values of ``cache_seqlens`` are never trusted: any int32 (negative, past L) clamps as in ``query_lengths``, whose
first clamp to [-s_q, L + s_q] keeps the int32 sum from wrapping.  ``$FLASHDSA_DECODE_ORDER_KERNEL=0``: the
PyTorch ops instead (for timing).
"""

import functools
import os

import torch

from .._tilelang import direct_launcher

ORDER_ENV = "FLASHDSA_DECODE_ORDER_KERNEL"
THREADS = 128
EXPECTS_WGMMA = False


def enabled() -> bool:
    """Whether ``_pair_path.prepare`` computes lengths and order with this kernel (CUDA inputs)."""
    return os.environ.get(ORDER_ENV, "1") != "0"


def build_order_kernel(*, threads: int = THREADS):
    """prim_func ``(Seqlens [B] i32, Lengths [B * s_q] i32, Order [B * s_q] i32, L i32, s_q i32, causal i32)``;
    grid ceil(B / threads) CTAs of ``threads`` (module notes)."""
    import tilelang.language as T

    i32 = "int32"
    B, n = T.dynamic("B"), T.dynamic("n")

    @T.prim_func
    def mla_decode_token_order(
        Seqlens: T.Tensor((B,), i32),
        Lengths: T.Tensor((n,), i32),
        Order: T.Tensor((n,), i32),
        L: T.int32,
        s_q: T.int32,
        causal: T.int32,
    ):
        with T.Kernel(T.ceildiv(B, threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            tile = T.alloc_shared((threads,), i32)
            mine = T.alloc_var(i32)
            rank = T.alloc_var(i32)
            lc = T.alloc_var(i32)
            b = bx * threads + tx
            mine = -1
            if b < B:
                mine = T.max(T.min(Seqlens[b], L), 0)
            rank = 0
            for c in T.serial(T.ceildiv(B, threads)):
                # every thread of the CTA runs every tile (the barriers), also those past B
                j = c * threads + tx
                tile[tx] = -1
                if j < B:
                    tile[tx] = T.max(T.min(Seqlens[j], L), 0)
                T.sync_threads()
                for k in T.serial(threads):
                    jj = c * threads + k
                    if jj < B:
                        if tile[k] > mine or (tile[k] == mine and jj < b):
                            rank = rank + 1
                T.sync_threads()
            if b < B:
                lc = T.max(T.min(Seqlens[b], L + s_q), -s_q)
                for i in T.serial(s_q):
                    shift = T.if_then_else(causal != 0, i - (s_q - 1), 0)
                    Lengths[b * s_q + i] = T.max(T.min(lc + shift, L), 0)
                    Order[rank * s_q + i] = b * s_q + i

    return mla_decode_token_order


@functools.lru_cache(maxsize=1)
def _compiled():
    import tilelang

    return direct_launcher(tilelang.compile(build_order_kernel(), target="cuda"))


def lengths_and_order(cache_seqlens, L: int, s_q: int, causal: bool):
    """(lengths [B * s_q] int32, order [B * s_q] int32) for CUDA ``cache_seqlens`` [B] int32 (any values) and L =
    max_blocks * block_size < 2^30: equal to ``_pair_path.query_lengths`` / ``token_order`` (module notes)."""
    B = cache_seqlens.shape[0]
    lengths = torch.empty(B * s_q, dtype=torch.int32, device=cache_seqlens.device)
    order = torch.empty(B * s_q, dtype=torch.int32, device=cache_seqlens.device)
    if B > 0:
        _compiled()(cache_seqlens.contiguous(), lengths, order, L, s_q, 1 if causal else 0)
    return lengths, order


def lowering_cases():
    """(name, prim_func) for the CPU lowering test (no matrix products: ``EXPECTS_WGMMA``)."""
    return [("token_order", build_order_kernel())]
