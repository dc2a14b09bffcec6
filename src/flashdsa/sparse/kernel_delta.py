"""The backward's preprocess in one launch: ``delta[r] = sum_d out[r, d] * dout[r, d]`` in fp32.

Rows ``r`` are the (token, head) pairs of ``out`` / ``dout [T, H, d_v]`` (bf16).  In PyTorch this was the bf16
inputs widened to fp32 copies, their product and a sum: ~7 bytes moved per input byte (2.5 ms at T 4096, H 128,
d_v 512 on the H200, against 0.3 ms for reading both inputs once).  Here each CTA reads 16 rows of both inputs
once, multiplies in fp32 and reduces each row in a fixed order (bitwise repeatable: the deterministic backward
uses it too).
"""

import functools

import torch

import tilelang
import tilelang.language as T

from .._tilelang import direct_launcher

ROWS = 16  # rows per CTA: a [16, 512] fp32 product fragment is 64 registers per thread at 128 threads
THREADS = 128
EXPECTS_WGMMA = False  # element-wise: the lowering test must not look for matrix instructions


def build_row_dot(d: int):
    """prim_func ``(O [n_rows, d] bf16, dO [n_rows, d] bf16, Delta [n_rows] f32)``; rows past ``n_rows`` of the
    last CTA are neither read nor written."""
    n_rows = T.dynamic("n_rows")
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def row_dot(O: T.Tensor([n_rows, d], bf16), dO: T.Tensor([n_rows, d], bf16),
                Delta: T.Tensor([n_rows], f32)):
        with T.Kernel(T.ceildiv(n_rows, ROWS), threads=THREADS) as bx:
            prod = T.alloc_fragment([ROWS, d], f32)
            total = T.alloc_fragment([ROWS], f32)
            for i, j in T.Parallel(ROWS, d):
                r = bx * ROWS + i
                prod[i, j] = T.if_then_else(r < n_rows, T.cast(O[T.min(r, n_rows - 1), j], f32)
                                            * T.cast(dO[T.min(r, n_rows - 1), j], f32), T.float32(0))
            T.reduce_sum(prod, total, dim=1)
            for i in T.Parallel(ROWS):
                if bx * ROWS + i < n_rows:
                    Delta[bx * ROWS + i] = total[i]

    return row_dot


@functools.lru_cache(maxsize=4)
def _compiled(d: int):
    return tilelang.compile(build_row_dot(d), target="cuda")


def row_dot(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``out``, ``dout`` [..., d] bf16 on CUDA (same shape) -> ``(out.float() * dout.float()).sum(-1)`` fp32, up to
    the order of the fp32 additions."""
    d = out.shape[-1]
    o = out.reshape(-1, d).contiguous()
    do = dout.reshape(-1, d).contiguous()
    delta = torch.empty(o.shape[0], dtype=torch.float32, device=out.device)
    if o.shape[0] > 0:
        direct_launcher(_compiled(d))(o, do, delta)
    return delta.view(out.shape[:-1])


def lowering_cases():
    return [("row_dot_d512", build_row_dot(512))]
