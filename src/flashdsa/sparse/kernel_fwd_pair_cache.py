"""Sparse MLA forward over the 656-byte FP8 KV cache on the "pair" schedule (Hopper sm_90a).

Notes
-----
Contract, numerics and host interface as ``kernel_fwd_fp8cache.py`` (q bf16 [T, H, 576], kv the uint8 [Tkv, 656]
cache of :func:`flashdsa.quant.quantize_kv_fp8`, d_v 512, bf16 compute on ``bf16(float(e4m3) * scale)``, exact
for the format's power-of-two scales); schedule, buffers and consumer roles as ``kernel_fwd_pair.py`` (H 64 /
128, 384 threads, WG0 / WG1 consumers, a producer warpgroup), only the producer differs.

In-place conversion.  Shared memory is full (the pair kernel uses 230,912 of 232,448 B), so there is no staging
buffer: dims [16k, 16k + 16) of a row are 16 e4m3 bytes in the cache and 32 bytes of bf16 in the half tile; the
16 raw bytes are copied (cp.async, as if they were 8 bf16) into the bf16 slots of dims [16k, 16k + 8), and after
they landed one thread reads them back, converts (``fdsa_e4m3x64_to_bf16``) and writes dims [16k, 16k + 8) and
[16k + 8, 16k + 16).  Raw bytes of (row, k) only ever sit in slots that the owner of (row, k) rewrites after
reading them, so no thread can clobber another's raw data.  Thread t of the 128 converting threads: row t / 2,
dims [128 (t % 2), +128) of the half (one 128-dim scale tile); part 1 walks its chunks rotated by two so the 8
threads of a quarter warp touch 8 different 16-byte bank groups.

Who converts (``staging``):
  * "consumer" (default): the producer is ``kernel_fwd_pair.gather_producer`` (the bf16 kernel's non-blocking
    protocol, up to four half tiles in flight) copying raw bytes, plus each row's 16 bytes of scales into the
    slots of dims [8, 16) (free until chunk 0 is converted).  The consumer that reads a half first (WG0: a.L,
    a.R; WG1: b.R, b.L) converts it after its ready barrier: scale read, warpgroup barrier, conversion,
    ``fence.proxy.async``, warpgroup barrier, then its wgmma.
  * "inplace": the producer converts after ``cp.async.wait_group``, two halves in flight (the consumers' waits
    allow no more: fr_ar arrives only after WG1's QK on b.R, fr_bl only after WG0's QK on a.L):
        wait fr_al, publish Rows0, issue a.L | wait fr_br, publish Rows1, issue b.R (+ rope b)
        wait a.L, convert, rdy_al | wait b.R, convert, rdy_br
        wait fr_ar, issue a.R (+ rope a) | wait fr_bl, issue b.L | wait a.R, convert, rdy_ar | same for b.L
    with the scales from ordinary loads; every ready barrier counts the 128 producer threads.
  * "split" (written in session 9 after its last GPU call: lowering and nvcc only, not run on a GPU): the consumer
    converts dims [0, 128) of each half, the producer warpgroup (mostly idle) dims [128, 256) after the half's
    ready barrier, and signals a per-half ``cv`` barrier the consumer waits on before its wgmma
    (``_split_dequant_parts``); halves the conversion on the consumers' critical path.
Invalid slots are zero-filled (src-size 0, nothing read) with scale 0.  Outputs are bitwise those of
``kernel_fwd_pair`` on the dequantized cache (tests/sparse_mla/test_kernel_pair_cache_gpu.py).

Measured (H200, session 9, S 4096, H 128, topk 2048; ``--variants``; docs/PERFORMANCE.md): with one chunk per
conversion call and the f32 conversion (f29d7ee), SKV 8192: bf16 pair 5.39 ms, "consumer" 7.55 (0.71x),
"inplace" 8.22 (0.66x), a register-staged producer (raw bytes in 48 registers before the free-barrier wait, since
removed) 7.65 (0.70x), the pipelined fp8-cache kernel 9.76 (0.55x).  Four chunks per call and the 5-instruction
conversion (519baba): "consumer" 0.73x at SKV 8192 and 131072, "inplace" 0.70x / 0.75x; suite 0.741x / 0.742x.
ncu: the conversion adds ~3.9K warp instructions per 64-row block (+49% over the bf16 pair kernel); both kernels
stall most on the mbarrier waits for late half tiles (WG0 waiting for a.R is the largest single one).
"""

import functools

import torch

import tilelang
import tilelang.language as T

from .._tilelang import direct_launcher
from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from . import kernel_fwd, kernel_fwd_pair as kp
from ._tl_common import BLOCK_I, D_V

SUPPORTED_H = kp.SUPPORTED_H
_ASYNC = tc.ASYNC_GATHER
BAR_PROD = 11  # named barrier of the 128 producer threads
STAGINGS = ("consumer", "inplace", "split")
STAGING = "consumer"

_DEQUANT_SRC = r"""
// 16 e4m3 (4 words) -> bf16(float(e4m3) * s) (8 words), exact for the format's power-of-two scales: per pair,
// cvt.rn.f16x2.e4m3x2 (exact; every nonzero e4m3 is a normal f16 with 3 mantissa bits), then the f16 bits moved to
// bf16 positions without rebiasing (exponent field kept: the bf16 reads value * 2^-112, zero stays zero) and one
// exact bf16x2 multiply by 2^112 * s (two, 2^112 then s, for s > 2^15 where 2^112 * s is no bf16).  (A NaN e4m3
// would come out finite: the format's writer never stores one in a row.)
__device__ __forceinline__ void fdsa_cvt_e4m3x16(const unsigned in[4], unsigned o[8], float s) {
  const bool one = s <= 32768.0f;
  unsigned m1, m2;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(m1) : "f"(one ? s * 5.192296858534828e33f : 5.192296858534828e33f));
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(m2) : "f"(s));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const unsigned short b2 = (unsigned short)(in[i] >> (16 * k));
      unsigned h2, b;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(b2));
      const unsigned y = ((h2 & 0x7fff7fffu) >> 3) | (h2 & 0x80008000u);
      asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(b) : "r"(y), "r"(m1));
      if (!one) asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(b) : "r"(b), "r"(m2));
      o[2 * i + k] = b;
    }
  }
}
// in place, four chunks at once: the 16 bytes at lo_i (the bf16 slots of dims c..c+7 of chunk i) -> dims
// c..c+7 at lo_i and c+8..c+15 at hi_i; all four raw loads before any store, so the loads overlap (one
// chunk per call would serialise them: the compiler cannot prove a store does not alias the next chunk's raw bytes)
__device__ __forceinline__ void fdsa_e4m3x64_to_bf16(void *l0, void *h0, void *l1, void *h1, void *l2, void *h2,
                                                     void *l3, void *h3, float s) {
  void *lo[4] = {l0, l1, l2, l3}, *hi[4] = {h0, h1, h2, h3};
  uint4 w[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) w[c] = *reinterpret_cast<const uint4 *>(lo[c]);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const unsigned in[4] = {w[c].x, w[c].y, w[c].z, w[c].w};
    unsigned o[8];
    fdsa_cvt_e4m3x16(in, o, s);
    *reinterpret_cast<uint4 *>(lo[c]) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4 *>(hi[c]) = make_uint4(o[4], o[5], o[6], o[7]);
  }
}
__device__ __forceinline__ float fdsa_ld_f32(const void *p, int i) { return reinterpret_cast<const float *>(p)[i]; }
"""


def _pair_rows_macro(topk_dim):
    """Macro ``pair_rows(Indices, tok, lim, j, pt, n_rows, row_a, row_b)``: producer thread ``pt`` < 64 loads the
    KV rows of slot ``pt`` of blocks 2j / 2j + 1 (-1: past topk_eff or not in [0, n_rows)) before its waits, so
    the Indices latency overlaps them."""
    BI = BLOCK_I
    _row = tc.make_slot_row(topk_dim)

    @T.macro
    def pair_rows(Indices, tok, lim, j, pt, n_rows, row_a, row_b):
        if pt < BI:
            row_a[0] = _row(Indices, tok, lim[0], j * 2 * BI + pt)
            row_a[0] = T.if_then_else((row_a[0] >= 0) & (row_a[0] < n_rows), row_a[0], -1)
            row_b[0] = _row(Indices, tok, lim[0], (j * 2 + 1) * BI + pt)
            row_b[0] = T.if_then_else((row_b[0] >= 0) & (row_b[0] < n_rows), row_b[0], -1)

    return pair_rows


@T.macro
def convert_share(Half, sc, rw, part):
    """One thread's share of a half tile's in-place conversion: row ``rw``, chunks [8 part, 8 part + 8), walked
    rotated by 2 part (the 8 threads of a quarter warp, rows 4i..4i+3 x parts 0 / 1, then touch 8 different
    16-byte bank groups), four chunks per ``fdsa_e4m3x64_to_bf16``."""
    for g in T.unroll(2):
        T.call_extern("handle", "fdsa_e4m3x64_to_bf16",
                      *[T.address_of(Half[rw, (part * 8 + (g * 4 + i + 2 * part) % 8) * 16 + h * 8])
                        for i in range(4) for h in range(2)], sc[0])


def _cache_producer(*, topk_dim):
    """The producer over the 656-byte cache; ``kv_src`` = (KVf [n_ch, 4] f32, KVb [n_ch, 8] bf16, rs16, n_rows):
    two views of the cache as 16-byte chunks, the row stride in chunks and Tkv."""
    BI = BLOCK_I
    DH = D_V // 2
    bf16, f32 = "bfloat16", "float32"
    pair_rows = _pair_rows_macro(topk_dim)

    @T.macro
    def issue(Half, Kt, Rows, KVb, rs16, chunk0):
        # raw e4m3 of dims [16k, 16k+16) of the half -> bf16 slots [16k, 16k+8); rope (R halves) -> Kt
        for r, k, v in T.Parallel(BI, DH // 16, 8, annotations=_ASYNC):
            rk = Rows[r]
            Half[r, k * 16 + v] = T.if_then_else(rk >= 0, KVb[rk * rs16 + chunk0 + k, v], T.cast(0, bf16))
        if Kt is not None:
            for r, c, v in T.Parallel(BI, 8, 8, annotations=_ASYNC):
                rk = Rows[r]
                Kt[r, c * 8 + v] = T.if_then_else(rk >= 0, KVb[rk * rs16 + fc.ROPE_CHUNK0 + c, v], T.cast(0, bf16))
        T.ptx_commit_group()

    @T.macro
    def load_scale(sc, Rows, KVf, rs16, pt, tile0):
        rk = Rows[pt // 2]
        sc[0] = T.if_then_else(rk >= 0, KVf[rk * rs16 + fc.SCALE_CHUNK, tile0 + pt % 2], T.float32(0))

    @T.macro
    def dequant(Half, sc, pending, pt, rdy):
        T.ptx_wait_group(pending)
        T.sync_threads(BAR_PROD, 128)  # every producer thread's raw bytes of this half landed
        rw = pt // 2
        part = pt % 2
        convert_share(Half, sc, rw, part)
        T.fence_proxy_async()  # generic-proxy stores -> the consumers' wgmma reads
        T.barrier_arrive(rdy)

    @T.macro
    def producer(kv_src, Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
                 row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar, cvs):
        KVf = kv_src[0]
        KVb = kv_src[1]
        rs16 = kv_src[2]
        n_rows = kv_src[3]
        sc_al = T.alloc_local([1], f32)
        sc_br = T.alloc_local([1], f32)
        sc_ar = T.alloc_local([1], f32)
        sc_bl = T.alloc_local([1], f32)
        pt = tx - 256
        for j in T.serial(npair[0]):
            pair_rows(Indices, tok, lim, j, pt, n_rows, row_a, row_b)
            T.barrier_wait(fr_al, (j & 1) ^ 1)
            if pt < BI:
                Rows0[pt] = row_a[0]
            T.sync_threads(BAR_PROD, 128)
            issue(KVa_l, None, Rows0, KVb, rs16, 0)
            load_scale(sc_al, Rows0, KVf, rs16, pt, 0)
            T.barrier_wait(fr_br, (j & 1) ^ 1)
            if pt < BI:
                Rows1[pt] = row_b[0]
            T.sync_threads(BAR_PROD, 128)
            issue(KVb_r, Kb_t, Rows1, KVb, rs16, DH // 16)
            load_scale(sc_br, Rows1, KVf, rs16, pt, 2)
            dequant(KVa_l, sc_al, 1, pt, rdy_al)
            dequant(KVb_r, sc_br, 0, pt, rdy_br)
            T.barrier_wait(fr_ar, (j & 1) ^ 1)
            issue(KVa_r, Ka_t, Rows0, KVb, rs16, DH // 16)
            load_scale(sc_ar, Rows0, KVf, rs16, pt, 2)
            T.barrier_wait(fr_bl, (j & 1) ^ 1)
            issue(KVb_l, None, Rows1, KVb, rs16, 0)
            load_scale(sc_bl, Rows1, KVf, rs16, pt, 0)
            dequant(KVa_r, sc_ar, 1, pt, rdy_ar)
            dequant(KVb_l, sc_bl, 0, pt, rdy_bl)

    return producer


def _raw_gather_macro():
    """Macro ``gather_raw(Half, Kt, Rows, kv_src, chunk0)``: cp.async (no commit, no wait) of one half tile's raw
    bytes, e4m3 chunk k of a row into the bf16 slots of dims [16k, 16k + 8), the row's 16 bytes of scales into the
    slots of dims [8, 16), the rope (``Kt`` not None) into the rope tile; invalid rows zero-filled."""
    BI = BLOCK_I
    DH = D_V // 2
    bf16 = "bfloat16"

    @T.macro
    def gather_raw(Half, Kt, Rows, kv_src, chunk0):
        KVb = kv_src[1]
        rs16 = kv_src[2]
        for r, k, v in T.Parallel(BI, DH // 16, 8, annotations=_ASYNC):
            rk = Rows[r]
            Half[r, k * 16 + v] = T.if_then_else(rk >= 0, KVb[rk * rs16 + chunk0 + k, v], T.cast(0, bf16))
        for r, v in T.Parallel(BI, 8, annotations=_ASYNC):
            rk = Rows[r]
            Half[r, 8 + v] = T.if_then_else(rk >= 0, KVb[rk * rs16 + fc.SCALE_CHUNK, v], T.cast(0, bf16))
        if Kt is not None:
            for r, c, v in T.Parallel(BI, 8, 8, annotations=_ASYNC):
                rk = Rows[r]
                Kt[r, c * 8 + v] = T.if_then_else(rk >= 0, KVb[rk * rs16 + fc.ROPE_CHUNK0 + c, v], T.cast(0, bf16))

    return gather_raw


def _consumer_dequant_parts(*, topk_dim):
    """``staging="consumer"``: the producer is ``kernel_fwd_pair.gather_producer`` (non-blocking, up to four half
    tiles in flight) copying raw bytes: e4m3 chunk k of a row into the bf16 slots of dims [16k, 16k + 8), the
    row's four float32 scales (16 B) into the slots of dims [8, 16) (free until chunk 0 is converted), the rope
    straight into the rope tile.  The consumer that reads a half first converts it in place after its ready
    barrier (thread t: row t / 2, chunks [8 (t % 2), +8)): scale read, warpgroup barrier (the scales sit in slots
    that the conversion overwrites), conversion, ``fence.proxy.async``, warpgroup barrier, then its wgmma.
    Returns (producer, first_use)."""
    DH = D_V // 2
    f32 = "float32"
    gather_raw = _raw_gather_macro()

    @T.macro
    def gather_l(KVl, Rows, kv_src):
        gather_raw(KVl, None, Rows, kv_src, 0)

    @T.macro
    def gather_r(KVr, Kt, Rows, kv_src):
        gather_raw(KVr, Kt, Rows, kv_src, DH // 16)

    @T.macro
    def first_use(Half, tile0, wg_bar, t, cv, phase):
        rw = t // 2
        part = t % 2
        sc = T.alloc_local([1], f32)
        sc[0] = T.call_extern(f32, "fdsa_ld_f32", T.address_of(Half[rw, 8]), tile0 + part)
        T.sync_threads(wg_bar, 128)  # every scale read before the slots of dims [8, 16) are overwritten
        convert_share(Half, sc, rw, part)
        T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
        T.sync_threads(wg_bar, 128)  # the whole half converted before this warpgroup's wgmma reads it

    producer = kp.gather_producer(topk_dim=topk_dim, row_ok=lambda row, kv_src: (row >= 0) & (row < kv_src[3]),
                                  gather_l=gather_l, gather_r=gather_r)
    return producer, first_use


def _split_dequant_parts(*, topk_dim):
    """``staging="split"``: as "consumer", but each half's conversion is shared: the first-reading consumer converts
    dims [0, 128) of the half (scale from the parked slot), the producer warpgroup dims [128, 256) (scale from an
    ordinary load issued with the gather) and arrives on the half's ``cv`` barrier after its ``fence.proxy.async``;
    the consumer waits for it before its wgmma.  Producer order per pair: issue a.L, b.R (as ``gather_producer``),
    convert its parts of a.L, b.R (each after the half's ready barrier), issue a.R, b.L, convert a.R, b.L.
    Returns (producer, first_use)."""
    BI = BLOCK_I
    DH = D_V // 2
    f32 = "float32"
    pair_rows = _pair_rows_macro(topk_dim)
    gather_raw = _raw_gather_macro()

    def addrs(Half, rw, part, chunk0):
        # chunks chunk0 + 4 part + ((i + 2 part) & 3), i < 4: the 8 threads of a quarter warp (rows 4i..4i+3 x parts
        # 0 / 1) hit 8 different 16-byte bank groups
        return [T.address_of(Half[rw, (chunk0 + part * 4 + (i + 2 * part) % 4) * 16 + h * 8])
                for i in range(4) for h in range(2)]

    @T.macro
    def first_use(Half, tile0, wg_bar, t, cv, phase):
        rw = t // 2
        part = t % 2
        sc = T.alloc_local([1], f32)
        sc[0] = T.call_extern(f32, "fdsa_ld_f32", T.address_of(Half[rw, 8]), tile0)
        T.sync_threads(wg_bar, 128)  # every scale read before the slots of dims [8, 16) are overwritten
        T.call_extern("handle", "fdsa_e4m3x64_to_bf16", *addrs(Half, rw, part, 0), sc[0])
        T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
        T.sync_threads(wg_bar, 128)  # this warpgroup's part converted
        T.barrier_wait(cv, phase)  # the producer's part converted (and fenced)

    @T.macro
    def load_scale(sc, Rows, KVf, rs16, rw, tile):
        rk = Rows[rw]
        sc[0] = T.if_then_else(rk >= 0, KVf[rk * rs16 + fc.SCALE_CHUNK, tile], T.float32(0))

    @T.macro
    def convert_part(Half, sc, rdy, phase, cv, rw, part):
        T.barrier_wait(rdy, phase)  # the half's raw bytes landed (every producer thread's cp.async)
        T.call_extern("handle", "fdsa_e4m3x64_to_bf16", *addrs(Half, rw, part, 8), sc[0])
        T.fence_proxy_async()
        T.barrier_arrive(cv)

    @T.macro
    def producer(kv_src, Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
                 row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar, cvs):
        KVf = kv_src[0]
        rs16 = kv_src[2]
        n_rows = kv_src[3]
        cv_al = cvs[0]
        cv_br = cvs[1]
        cv_ar = cvs[2]
        cv_bl = cvs[3]
        sc_al = T.alloc_local([1], f32)
        sc_br = T.alloc_local([1], f32)
        sc_ar = T.alloc_local([1], f32)
        sc_bl = T.alloc_local([1], f32)
        pt = tx - 256
        rw = pt // 2
        part = pt % 2
        for j in T.serial(npair[0]):
            pair_rows(Indices, tok, lim, j, pt, n_rows, row_a, row_b)
            T.barrier_wait(fr_al, (j & 1) ^ 1)
            if pt < BI:
                Rows0[pt] = row_a[0]
            T.sync_threads(BAR_PROD, 128)
            T.barrier_arrive(rdy_al)
            gather_raw(KVa_l, None, Rows0, kv_src, 0)
            T.cp_async_barrier_noinc(rdy_al)
            load_scale(sc_al, Rows0, KVf, rs16, rw, 1)
            T.barrier_wait(fr_br, (j & 1) ^ 1)
            if pt < BI:
                Rows1[pt] = row_b[0]
            T.sync_threads(BAR_PROD, 128)
            T.barrier_arrive(rdy_br)
            gather_raw(KVb_r, Kb_t, Rows1, kv_src, DH // 16)
            T.cp_async_barrier_noinc(rdy_br)
            load_scale(sc_br, Rows1, KVf, rs16, rw, 3)
            convert_part(KVa_l, sc_al, rdy_al, j & 1, cv_al, rw, part)
            convert_part(KVb_r, sc_br, rdy_br, j & 1, cv_br, rw, part)
            T.barrier_wait(fr_ar, (j & 1) ^ 1)
            gather_raw(KVa_r, Ka_t, Rows0, kv_src, DH // 16)
            T.cp_async_barrier_noinc(rdy_ar)
            load_scale(sc_ar, Rows0, KVf, rs16, rw, 3)
            T.barrier_wait(fr_bl, (j & 1) ^ 1)
            gather_raw(KVb_l, None, Rows1, kv_src, 0)
            T.cp_async_barrier_noinc(rdy_bl)
            load_scale(sc_bl, Rows1, KVf, rs16, rw, 1)
            convert_part(KVa_r, sc_ar, rdy_ar, j & 1, cv_ar, rw, part)
            convert_part(KVb_l, sc_bl, rdy_bl, j & 1, cv_bl, rw, part)
        T.ptx_commit_group()
        T.ptx_wait_group(0)  # nothing in flight when the producer threads exit

    return producer, first_use


def build_sparse_mla_fwd_pair_cache(*, heads: int, topk: int, sm_scale: float, has_sink: bool = False,
                                    has_topk_length: bool = False, staging: str = STAGING, early_free: bool = False):
    """Return the TileLang prim_func: (Q[T,H,576] bf16, KVf[n_ch,4] f32, KVb[n_ch,8] bf16 (two views of the cache
    as 16-byte chunks), rs16 int32 (row stride in chunks), n_rows int32 (Tkv), Indices[T,topk] i32, TopkLen[n_tl]
    i32, Sink[n_sink] f32, Out[T,H,512] bf16, Lse[T,H] f32, MaxLogits[T,H] f32).  ``staging``: where the e4m3
    bytes are converted: "consumer" (``_consumer_dequant_parts``, default), "inplace" (the producer, after its
    own cp.async: ``_cache_producer``) or "split" (half each: ``_split_dequant_parts``; not run on a GPU yet).  ``early_free``: see ``kernel_fwd_pair.pair_body``."""
    assert staging in STAGINGS, staging
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    first_use = None
    if staging in ("consumer", "split"):
        parts = _consumer_dequant_parts if staging == "consumer" else _split_dequant_parts
        producer, first_use = parts(topk_dim=topk_dim)
        ready = (256, 256, 128, 128)  # as the bf16 producer: noinc cp.async arrivals (+ the rows for al / br)
    else:
        producer = _cache_producer(topk_dim=topk_dim)
        ready = (128, 128, 128, 128)  # the producer threads, after converting
    body = kp.pair_body(heads=heads, dqk=fc.DQK, topk=topk, sm_scale=sm_scale, has_sink=has_sink,
                        has_topk_length=has_topk_length, n_tok=n_tok, topk_dim=topk_dim, producer=producer,
                        ready_counts=ready, prelude=_DEQUANT_SRC, first_use=first_use,
                        early_free=early_free, conv_barriers=staging == "split")

    @T.prim_func
    def sparse_mla_fwd_pair_cache(
        Q: T.Tensor([n_tok, heads, fc.DQK], bf16),
        KVf: T.Tensor([n_ch, 4], f32),
        KVb: T.Tensor([n_ch, 8], bf16),
        rs16: T.int32,
        n_rows: T.int32,
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D_V], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        body(Q, (KVf, KVb, rs16, n_rows), Indices, TopkLen, Sink, Out, Lse, MaxLogits)

    return sparse_mla_fwd_pair_cache


def _pass_configs():
    return kp._pass_configs()  # explicit named barriers only (the automatic pass reuses ids across roles)


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool,
              staging: str = STAGING, build_kw: tuple = ()):
    """The compiled kernel; ``build_kw``: extra build keywords as sorted (name, value) pairs (timing builds)."""
    func = build_sparse_mla_fwd_pair_cache(heads=heads, topk=n_blocks * BLOCK_I, sm_scale=sm_scale,
                                           has_sink=has_sink, has_topk_length=has_topk_length, staging=staging,
                                           **dict(build_kw))
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments: ``kernel_fwd_fp8cache``'s rules and full 64-head tiles."""
    reason = fc.kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is None and q.shape[1] not in SUPPORTED_H:
        reason = f"H={q.shape[1]} not in {SUPPORTED_H} (the pair schedule needs full 64-head tiles)"
    return reason


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
                       staging: str = STAGING, build_kw: tuple = (), checked: bool = False):
    """Returns (out [T,H,512] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32).  ``staging``: see
    ``build_sparse_mla_fwd_pair_cache``."""
    if staging not in STAGINGS:
        raise ValueError(f"staging: expected one of {STAGINGS}, got {staging!r}")
    if not checked:
        reason = kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
        if reason is not None:
            raise ValueError(f"sparse_mla fwd pair fp8-cache kernel: {reason}")
    (out, lse, max_logits), done = tc.fwd_outputs(q, kv, sm_scale=sm_scale, d_v=d_v)
    if done:
        return out, lse, max_logits
    q = q.contiguous()
    indices = indices.contiguous()
    chunks = fc.cache_chunks(kv)
    has_sink, has_tl, tl_arg, sink_arg, n_blocks = tc.optional_args(indices, topk_length, attn_sink, q.device)
    kernel = _compiled(q.shape[1], n_blocks, float(sm_scale), has_sink, has_tl, staging, build_kw)
    direct_launcher(kernel)(q, chunks.view(torch.float32), chunks.view(torch.bfloat16), fc._rs16(kv), kv.shape[0],
                            indices, tl_arg, sink_arg, out, lse, max_logits)
    return out, lse, max_logits


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [(f"pair_cache_{st}_h128_topk2048_sink_tl",
             build_sparse_mla_fwd_pair_cache(heads=128, topk=2048, sm_scale=576**-0.5, has_sink=True,
                                             has_topk_length=True, staging=st)) for st in STAGINGS]


def _bench_variants(names=None, tkvs=(8192, 131072)):
    """Kernel times at S 4096, H 128, topk 2048 (``python -m flashdsa.sparse.kernel_fwd_pair_cache --variants
    [name,...] [--skv 8192,...]``): the bf16 pair kernel on the dequantized cache (the reference point, first),
    each staging, ``early_free`` builds, the pipelined fp8-cache kernel; checks each against the bf16 pair kernel
    bitwise."""
    from ..bench.harness import time_fn
    from ..quant import dequantize_kv_fp8, quantize_kv_fp8
    from . import kernel_fwd_pair

    gen = torch.Generator(device="cuda").manual_seed(0)
    n_tok, heads, topk, dqk = 4096, 128, 2048, fc.DQK
    ef = (("early_free", True),)
    for tkv in tkvs:
        q = (torch.randn(n_tok, heads, dqk, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
        kv8 = quantize_kv_fp8((torch.randn(tkv, dqk, generator=gen, device="cuda") * 0.1).to(torch.bfloat16))
        kv_deq = dequantize_kv_fp8(kv8)
        idx = torch.argsort(torch.rand(n_tok, tkv, generator=gen, device="cuda"), dim=1)[:, :topk].to(torch.int32)
        sm = dqk**-0.5
        flops = 2 * n_tok * heads * topk * (dqk + D_V)
        bf16 = lambda kw=(): kernel_fwd.launch(lambda *a: kernel_fwd_pair._compiled(*a, kw), q, kv_deq, idx,  # noqa
                                               sm_scale=sm, d_v=D_V)
        runs = {"bf16_pair": bf16, "bf16_pair_early_free": lambda: bf16(ef)}
        for st in STAGINGS:
            runs[f"cache_{st}"] = lambda st=st: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V, staging=st)
            runs[f"cache_{st}_early_free"] = lambda st=st: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V,
                                                                              staging=st, build_kw=ef)
        runs["cache_pipelined"] = lambda: fc.run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V, pair=False)
        ref = bf16()
        base = None
        for label in ["bf16_pair"] + [n for n in (names or runs) if n != "bf16_pair"]:
            fn = runs[label]
            same = all(torch.equal(a, b) for a, b in zip(fn(), ref))
            ms = time_fn(lambda _, f=fn: f(), [None], q.device, reps=10).ms_median
            base = base or ms
            print(f"variant SKV {tkv} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, {base / ms:.3f}x bf16 pair,"
                  f" bitwise equal to bf16 pair: {same}", flush=True)


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if "--variants" in args:
        i = args.index("--variants")
        names = args[i + 1].split(",") if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        skv = tuple(int(x) for x in args[args.index("--skv") + 1].split(",")) if "--skv" in args else (8192, 131072)
        _bench_variants(names, skv)
