"""Batched top-k indices -> flat kv rows in one launch (the host path of ``sparse_attn`` / batched forms).

The batched forms take ``indices [B, S, topk]`` as positions within each batch's ``kv [B, S_kv, D]``; the kernels
read one flat ``kv [B * S_kv, D]``.  Row ``r = b * S + s`` maps entry ``i`` to ``i + b * S_kv`` when
``0 <= i < S_kv`` and to -1 (invalid, skipped by every kernel) otherwise.  In PyTorch that is six element-wise
launches; here it is one, which is what a decode-sized call notices (host time per launch ~ the whole kernel).
"""

from __future__ import annotations

import functools

import torch

import tilelang
import tilelang.language as T

from .._tilelang import direct_launcher

THREADS = 256
EXPECTS_WGMMA = False  # element-wise: the lowering test must not look for matrix instructions


def build_offset_indices():
    """prim_func ``(Idx [n_rows, k] i32, Out [n_rows, k] i32, rows_per_batch, kv_per_batch)``."""
    n_rows, k = T.dynamic("n_rows"), T.dynamic("k")

    @T.prim_func
    def offset_indices(Idx: T.Tensor([n_rows, k], "int32"), Out: T.Tensor([n_rows, k], "int32"),
                       rows_per_batch: T.int32, kv_per_batch: T.int32):
        # rows on grid x (up to 2**31 - 1; grid y stops at 65535), 256-entry chunks of a row on y
        with T.Kernel(n_rows, T.ceildiv(k, THREADS), threads=THREADS) as (row, chunk):
            for j in T.Parallel(THREADS):
                c = chunk * THREADS + j
                if c < k:
                    v = Idx[row, c]
                    Out[row, c] = T.if_then_else((v >= 0) & (v < kv_per_batch),
                                                 v + (row // rows_per_batch) * kv_per_batch, -1)

    return offset_indices


@functools.lru_cache(maxsize=1)
def _compiled():
    return tilelang.compile(build_offset_indices(), target="cuda")


def offset_batched_indices(indices: torch.Tensor, kv_per_batch: int) -> torch.Tensor:
    """``indices [B, S, topk]`` int32 on CUDA -> ``[B * S, topk]`` flat kv rows (-1 where invalid)."""
    B, S, k = indices.shape
    src = indices.contiguous().view(B * S, k)
    out = torch.empty_like(src)
    if B * S > 0 and k > 0:
        direct_launcher(_compiled())(src, out, S, kv_per_batch)
    return out


def lowering_cases():
    return [("offset_indices", build_offset_indices())]
