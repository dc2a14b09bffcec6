"""The whole 656-byte FP8 KV cache dequantized to bf16 rows in one launch, and the rule for when the sparse forward
over the cache runs the bf16 pair kernel on such a copy instead of converting every gathered row.

Notes
-----
``dequantize_cache(kv)``: uint8 ``[Tkv, 656]`` (any row stride that is a multiple of 16 B) -> bf16 ``[Tkv, 576]``,
row r = ``bf16(float(e4m3) * scale)`` for the 512 latent dims (scale of the dim's 128-dim tile) and the 64 rope dims
copied: the same float32 product and rounding as :func:`flashdsa.quant.dequantize_kv_fp8`, so bitwise equal to it.
One CTA of 256 threads per ``ROWS_PER_CTA`` rows; the last CTA clamps its row numbers to Tkv - 1 (those threads
write the last row's values again), so there is no tail branch.  Every row of the cache is read, referenced or
not: an unused row full of NaN bytes gives NaN in the copy, which no valid index reads.

Why: in prefill each cache row is gathered many times (S 4096 tokens x topk 2048 over Tkv 8192 rows: ~1,000
times at H 128, once per 64-head CTA), and converting it in the forward costs ~0.18 ns per gathered row and
64-head CTA (``kernel_fwd_pair_cache``: 6.69 vs 5.16 ms for the bf16 pair kernel, H200, session 10), while a copy
costs ~1,808 B of traffic per cache row (656 read, 1,152 written) once.  ``use_dequant_once`` picks the copy when
``T * topk * H >= DEQUANT_ONCE_REUSE * 64 * Tkv`` (rows converted in the forward >= DEQUANT_ONCE_REUSE x rows
copied) and the copy stays within ``DEQUANT_ONCE_MAX_BYTES``.  Decode never qualifies (B 128 requests, topk 2048
over 32768 cached tokens each: gathers are 1/16 of the cache's rows).
"""

import functools
import os

import torch

import tilelang
import tilelang.language as T

from .._tilelang import direct_launcher
from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc

EXPECTS_WGMMA = False
ROWS_PER_CTA = 8
THREADS = 256
DEQUANT_ONCE_REUSE = 8  # rows converted per 64-head CTA (T * topk * H / 64) per cache row copied, at least
DEQUANT_ONCE_MAX_BYTES = 1 << 30  # the bf16 copy: Tkv * 1152 B
# "1": the sparse forward over the cache always dequantizes the cache first (H 64 / 128); "0": never; unset: the rule
DEQUANT_ONCE_ENV = "FLASHDSA_DEQUANT_ONCE"


def build_dequant656():
    """prim_func (KV8 [n_ch, 16] e4m3, KVf [n_ch, 4] f32, KVb [n_ch, 8] bf16 (three views of the cache as 16-byte
    chunks), rs16 int32 (row stride in chunks), Out [n_rows, 576] bf16); n_rows >= 1."""
    bf16, f32 = "bfloat16", "float32"
    RB, D, DT = ROWS_PER_CTA, fc.D_V, fc.D_TAIL
    n_ch, n_rows = tc.dynamic_dims("n_ch", "n_rows")

    @T.prim_func
    def dequant656(
        KV8: T.Tensor([n_ch, fc.CHUNK], fc.FP8),
        KVf: T.Tensor([n_ch, 4], f32),
        KVb: T.Tensor([n_ch, 8], bf16),
        rs16: T.int32,
        Out: T.Tensor([n_rows, fc.DQK], bf16),
    ):
        with T.Kernel(T.ceildiv(n_rows, RB), threads=THREADS) as bx:
            for r, c, v in T.Parallel(RB, fc.LAT_CHUNKS, fc.CHUNK):
                row = T.min(bx * RB + r, n_rows - 1)
                Out[row, c * fc.CHUNK + v] = T.cast(
                    T.cast(KV8[row * rs16 + c, v], f32) * KVf[row * rs16 + fc.SCALE_CHUNK, c * fc.CHUNK // fc.TILE],
                    bf16)
            for r, c, v in T.Parallel(RB, DT // 8, 8):
                row = T.min(bx * RB + r, n_rows - 1)
                Out[row, D + c * 8 + v] = KVb[row * rs16 + fc.ROPE_CHUNK0 + c, v]

    return dequant656


@functools.lru_cache(maxsize=1)
def _compiled():
    return tilelang.compile(build_dequant656(), target="cuda")


def dequantize_cache(kv: torch.Tensor) -> torch.Tensor:
    """bf16 ``[Tkv, 576]`` copy of the 656-byte cache ``kv`` (uint8 ``[Tkv, 656]`` on the GPU, row stride a
    multiple of 16 B, as ``kernel_fwd_fp8cache`` accepts it); bitwise ``quant.dequantize_kv_fp8(kv)``."""
    out = torch.empty(kv.shape[0], fc.DQK, dtype=torch.bfloat16, device=kv.device)
    if kv.shape[0] > 0:
        chunks = fc.cache_chunks(kv)
        direct_launcher(_compiled())(chunks.view(torch.float8_e4m3fn), chunks.view(torch.float32),
                                     chunks.view(torch.bfloat16), fc._rs16(kv), out)
    return out


def use_dequant_once(n_tok: int, topk: int, heads: int, n_rows: int, choice: bool | None = None) -> bool:
    """Whether the sparse forward over the cache runs on ``dequantize_cache``'s copy: ``choice`` if given, else
    ``$FLASHDSA_DEQUANT_ONCE`` ("1" / "0") if set, else the reuse rule of the module notes."""
    if choice is not None:
        return bool(choice)
    env = os.environ.get(DEQUANT_ONCE_ENV, "")
    if env in ("0", "1"):
        return env == "1"
    return (n_rows > 0 and n_rows * fc.DQK * 2 <= DEQUANT_ONCE_MAX_BYTES
            and n_tok * topk * heads >= DEQUANT_ONCE_REUSE * 64 * n_rows)


def lowering_cases():
    return [("dequant656", build_dequant656())]
