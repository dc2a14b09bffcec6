"""Sparse MLA forward over the 656-byte FP8 KV cache on the "pair" schedule (Hopper sm_90a).

Notes
-----
Contract, numerics and host interface as ``kernel_fwd_fp8cache.py`` (q bf16 [T, H, 576], kv the uint8 [Tkv, 656]
cache of :func:`flashdsa.quant.quantize_kv_fp8`, d_v 512, bf16 compute on ``bf16(float(e4m3) * scale)``, exact
for the format's power-of-two scales); schedule, buffers and consumer roles as ``kernel_fwd_pair.py`` (H 64 /
128, 384 threads, WG0 / WG1 consumers, a producer warpgroup), only the producer differs.

Producer.  Shared memory is full (the pair kernel uses 230,912 of 232,448 B), so there is no staging buffer: the
raw e4m3 bytes are dequantized in place.  Dims [16k, 16k + 16) of a row are 16 e4m3 bytes in the cache and
32 bytes of bf16 in the half tile; the producer copies the 16 raw bytes (cp.async, as if they were 8 bf16)
into the bf16 slots of dims [16k, 16k + 8), and after they landed one thread reads them back, converts and
writes dims [16k, 16k + 8) and [16k + 8, 16k + 16).  Raw bytes of (row, k) only ever sit in slots that the
owner of (row, k) rewrites after reading them, so no thread can clobber another's raw data (no ordering beyond
"all raw bytes landed", a named barrier after ``cp.async.wait_group``).  Per half: 64 rows x 16 cp.async of
16 B (the rope tail of an R half: 8 more per row, bf16 already, straight into the rope tile), one scale per
thread (thread t: row t / 2, dims [128 (t % 2), +128) of the half, i.e. one 128-dim scale tile; loaded with an
ordinary load when the half is issued).  Part 1 of a row walks its chunks rotated by two so the 8 threads of a
quarter warp touch 8 different 16-byte bank groups (conflict-free 128-bit accesses).
Order per pair (two halves in flight; the consumers' waits allow no other: fr_ar arrives only after WG1's QK on
b.R, fr_bl only after WG0's QK on a.L):
    wait fr_al, publish Rows0, issue a.L | wait fr_br, publish Rows1, issue b.R (+ rope b)
    wait a.L, dequant, rdy_al | wait b.R, dequant, rdy_br
    wait fr_ar, issue a.R (+ rope a) | wait fr_bl, issue b.L | wait a.R, dequant, rdy_ar | wait b.L, dequant, rdy_bl
Every ready barrier counts the 128 producer threads (ordinary arrivals after ``fence.proxy.async``: the
dequantized tiles are generic-proxy stores read by wgmma).  Invalid slots are zero-filled (src-size 0, nothing
read) with scale 0.
"""

import functools

import torch

import tilelang
import tilelang.language as T

from .._tilelang import direct_launcher
from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from . import kernel_fwd_pair as kp
from ._tl_common import BLOCK_I, D_V

SUPPORTED_H = kp.SUPPORTED_H
_ASYNC = tc.ASYNC_GATHER
BAR_PROD = 11  # named barrier of the 128 producer threads
STAGINGS = ("consumer", "inplace", "regs")
STAGING = "consumer"
# setmaxnreg (WG0, WG1, producer): the register-staged producer holds 48 words of raw bytes per thread
REGS = {"regs": (208, 208, 88), "inplace": kp.PAIR_REGS, "consumer": kp.PAIR_REGS}

_DEQUANT_SRC = r"""
// 16 e4m3 (4 words) -> bf16(float(e4m3) * s) (8 words); cvt.rn.f16x2.e4m3x2 is exact, the f32 product by the format's
// power-of-two scale is exact, and so is the bf16 rounding (4 significant bits)
__device__ __forceinline__ void fdsa_cvt_e4m3x16(const unsigned in[4], unsigned o[8], float s) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const unsigned short b2 = (unsigned short)(in[i] >> (16 * k));
      unsigned h2, b;
      float f0, f1;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(b2));
      asm("{.reg .f16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u;}"
          : "=f"(f0), "=f"(f1) : "r"(h2));
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(b) : "f"(f1 * s), "f"(f0 * s));
      o[2 * i + k] = b;
    }
  }
}
// in place: the 16 bytes at `raw` (bf16 slots of dims c..c+7) -> dims c..c+7 at `raw`, c+8..c+15 at `hi`
__device__ __forceinline__ void fdsa_e4m3x16_to_bf16(void *raw, void *hi, float s) {
  const uint4 w = *reinterpret_cast<const uint4 *>(raw);
  const unsigned in[4] = {w.x, w.y, w.z, w.w};
  unsigned o[8];
  fdsa_cvt_e4m3x16(in, o, s);
  *reinterpret_cast<uint4 *>(raw) = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4 *>(hi) = make_uint4(o[4], o[5], o[6], o[7]);
}
// from registers: v[0..3] (16 e4m3) -> dims c..c+7 at `lo`, c+8..c+15 at `hi`
__device__ __forceinline__ void fdsa_e4m3x16_store(void *lo, void *hi, const unsigned *v, float s) {
  const unsigned in[4] = {v[0], v[1], v[2], v[3]};
  unsigned o[8];
  fdsa_cvt_e4m3x16(in, o, s);
  *reinterpret_cast<uint4 *>(lo) = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4 *>(hi) = make_uint4(o[4], o[5], o[6], o[7]);
}
// one producer thread's share of a half tile, into registers: cache row `row` (< 0: zeros, nothing read), chunks
// chunk0 + 8 part + ((i + 2 part) & 7) -> v[4 i..4 i + 3] (i < 8), the row's float32 scale of tile `tile` -> *sc;
// kRope: also rope chunks 33 + 4 part + i -> v[32 + 4 i..] (i < 4)
template <bool kRope>
__device__ __forceinline__ void fdsa_load_half(unsigned *v, float *sc, const void *cache, int row, int rs16,
                                               int chunk0, int tile, int part) {
  const bool ok = row >= 0;
  const uint4 *src = reinterpret_cast<const uint4 *>(cache) + (long long)(ok ? row : 0) * rs16;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (ok) x = __ldg(src + chunk0 + 8 * part + ((i + 2 * part) & 7));
    v[4 * i] = x.x; v[4 * i + 1] = x.y; v[4 * i + 2] = x.z; v[4 * i + 3] = x.w;
  }
  *sc = ok ? __ldg(reinterpret_cast<const float *>(src + 32) + tile) : 0.0f;
  if (kRope) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 x = make_uint4(0u, 0u, 0u, 0u);
      if (ok) x = __ldg(src + 33 + 4 * part + i);
      v[32 + 4 * i] = x.x; v[33 + 4 * i] = x.y; v[34 + 4 * i] = x.z; v[35 + 4 * i] = x.w;
    }
  }
}
__device__ __forceinline__ float fdsa_ld_f32(const void *p, int i) { return reinterpret_cast<const float *>(p)[i]; }
__device__ __forceinline__ void fdsa_st16(void *dst, const unsigned *v) {
  *reinterpret_cast<uint4 *>(dst) = make_uint4(v[0], v[1], v[2], v[3]);
}
"""


def _cache_producer(*, topk_dim):
    """The producer over the 656-byte cache; ``kv_src`` = (KVf [n_ch, 4] f32, KVb [n_ch, 8] bf16, rs16, n_rows):
    two views of the cache as 16-byte chunks, the row stride in chunks and Tkv."""
    BI = BLOCK_I
    DH = D_V // 2
    bf16, f32 = "bfloat16", "float32"
    _row = tc.make_slot_row(topk_dim)

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
        for i in T.unroll(8):
            k = part * 8 + (i + 2 * part) % 8
            T.call_extern("handle", "fdsa_e4m3x16_to_bf16", T.address_of(Half[rw, k * 16]),
                          T.address_of(Half[rw, k * 16 + 8]), sc[0])
        T.fence_proxy_async()  # generic-proxy stores -> the consumers' wgmma reads
        T.barrier_arrive(rdy)

    @T.macro
    def producer(kv_src, Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
                 row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar):
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
            if pt < BI:  # this pair's rows before the waits (the Indices latency overlaps them)
                row_a[0] = _row(Indices, tok, lim[0], j * 2 * BI + pt)
                row_a[0] = T.if_then_else((row_a[0] >= 0) & (row_a[0] < n_rows), row_a[0], -1)
                row_b[0] = _row(Indices, tok, lim[0], (j * 2 + 1) * BI + pt)
                row_b[0] = T.if_then_else((row_b[0] >= 0) & (row_b[0] < n_rows), row_b[0], -1)
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


def _cache_producer_regs(*, topk_dim):
    """The register-staged producer (``staging="regs"``): a half tile's raw bytes are loaded into registers
    (``fdsa_load_half``: 8 x 16 B per thread, + 4 x 16 B of rope for R halves) BEFORE the producer waits for the
    half's free barrier, then converted and stored to shared memory.  After a free only the conversion and the
    stores are left (no gather latency), while the next half's loads are in flight during the wait."""
    BI = BLOCK_I
    DH = D_V // 2
    f32, u32 = "float32", "uint32"
    _row = tc.make_slot_row(topk_dim)

    @T.macro
    def load_half(v, sc, KVb, rs16, rk, chunk0, tile0, part, rope):
        # thread: row rk of the block, chunks [8 part, 8 part + 8) of the half, rotated by 2 part (so the stores of
        # a quarter warp hit 8 different 16-byte bank groups)
        T.call_extern("handle", "fdsa_load_half<true>" if rope else "fdsa_load_half<false>", T.address_of(v[0]),
                      T.address_of(sc[0]), KVb.data, rk, rs16, chunk0, tile0 + part, part)

    @T.macro
    def store_half(Half, Kt, v, sc, rw, part, rdy):
        for i in T.unroll(8):
            k = part * 8 + (i + 2 * part) % 8
            T.call_extern("handle", "fdsa_e4m3x16_store", T.address_of(Half[rw, k * 16]),
                          T.address_of(Half[rw, k * 16 + 8]), T.address_of(v[4 * i]), sc[0])
        if Kt is not None:
            for i in T.unroll(4):
                T.call_extern("handle", "fdsa_st16", T.address_of(Kt[rw, (part * 4 + i) * 8]),
                              T.address_of(v[32 + 4 * i]))
        T.fence_proxy_async()  # generic-proxy stores -> the consumers' wgmma reads
        T.barrier_arrive(rdy)

    @T.macro
    def block_row(Indices, tok, lim, blk, rw, n_rows, dst):
        dst[0] = _row(Indices, tok, lim[0], blk * BI + rw)
        dst[0] = T.if_then_else((dst[0] >= 0) & (dst[0] < n_rows), dst[0], -1)

    @T.macro
    def producer(kv_src, Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
                 row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar):
        KVb = kv_src[1]
        rs16 = kv_src[2]
        n_rows = kv_src[3]
        v = T.alloc_local([48], u32)
        sc = T.alloc_local([1], f32)
        pt = tx - 256
        rw = pt // 2
        part = pt % 2
        if npair[0] > 0:
            block_row(Indices, tok, lim, 0, rw, n_rows, row_a)
            load_half(v, sc, KVb, rs16, row_a[0], 0, 0, part, False)
        for j in T.serial(npair[0]):
            # v holds a.L of this pair; row_a / row_b: this thread's row of blocks 2j / 2j + 1
            T.barrier_wait(fr_al, (j & 1) ^ 1)
            if part == 0:
                Rows0[rw] = row_a[0]
            store_half(KVa_l, None, v, sc, rw, part, rdy_al)
            block_row(Indices, tok, lim, j * 2 + 1, rw, n_rows, row_b)
            load_half(v, sc, KVb, rs16, row_b[0], DH // 16, 2, part, True)
            T.barrier_wait(fr_br, (j & 1) ^ 1)
            if part == 0:
                Rows1[rw] = row_b[0]
            store_half(KVb_r, Kb_t, v, sc, rw, part, rdy_br)
            load_half(v, sc, KVb, rs16, row_a[0], DH // 16, 2, part, True)
            T.barrier_wait(fr_ar, (j & 1) ^ 1)
            store_half(KVa_r, Ka_t, v, sc, rw, part, rdy_ar)
            load_half(v, sc, KVb, rs16, row_b[0], 0, 0, part, False)
            T.barrier_wait(fr_bl, (j & 1) ^ 1)
            store_half(KVb_l, None, v, sc, rw, part, rdy_bl)
            if j + 1 < npair[0]:
                block_row(Indices, tok, lim, j * 2 + 2, rw, n_rows, row_a)
                load_half(v, sc, KVb, rs16, row_a[0], 0, 0, part, False)

    return producer


def _consumer_dequant_parts(*, topk_dim):
    """``staging="consumer"``: the producer is ``kernel_fwd_pair.gather_producer`` (non-blocking, up to four half
    tiles in flight) copying raw bytes: e4m3 chunk k of a row into the bf16 slots of dims [16k, 16k + 8), the
    row's four float32 scales (16 B) into the slots of dims [8, 16) (free until chunk 0 is converted), the rope
    straight into the rope tile.  The consumer that reads a half first converts it in place after its ready
    barrier (thread t: row t / 2, chunks [8 (t % 2), +8)): scale read, warpgroup barrier (the scales sit in slots
    that the conversion overwrites), conversion, ``fence.proxy.async``, warpgroup barrier, then its wgmma.
    Returns (producer, first_use)."""
    BI = BLOCK_I
    DH = D_V // 2
    bf16, f32 = "bfloat16", "float32"

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

    @T.macro
    def gather_l(KVl, Rows, kv_src):
        gather_raw(KVl, None, Rows, kv_src, 0)

    @T.macro
    def gather_r(KVr, Kt, Rows, kv_src):
        gather_raw(KVr, Kt, Rows, kv_src, DH // 16)

    @T.macro
    def first_use(Half, tile0, wg_bar, t):
        rw = t // 2
        part = t % 2
        sc = T.alloc_local([1], f32)
        sc[0] = T.call_extern(f32, "fdsa_ld_f32", T.address_of(Half[rw, 8]), tile0 + part)
        T.sync_threads(wg_bar, 128)  # every scale read before the slots of dims [8, 16) are overwritten
        for i in T.unroll(8):
            k = part * 8 + (i + 2 * part) % 8
            T.call_extern("handle", "fdsa_e4m3x16_to_bf16", T.address_of(Half[rw, k * 16]),
                          T.address_of(Half[rw, k * 16 + 8]), sc[0])
        T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
        T.sync_threads(wg_bar, 128)  # the whole half converted before this warpgroup's wgmma reads it

    producer = kp.gather_producer(topk_dim=topk_dim, row_ok=lambda row, kv_src: (row >= 0) & (row < kv_src[3]),
                                  gather_l=gather_l, gather_r=gather_r)
    return producer, first_use


def build_sparse_mla_fwd_pair_cache(*, heads: int, topk: int, sm_scale: float, has_sink: bool = False,
                                    has_topk_length: bool = False, staging: str = STAGING):
    """Return the TileLang prim_func: (Q[T,H,576] bf16, KVf[n_ch,4] f32, KVb[n_ch,8] bf16 (two views of the cache
    as 16-byte chunks), rs16 int32 (row stride in chunks), n_rows int32 (Tkv), Indices[T,topk] i32, TopkLen[n_tl]
    i32, Sink[n_sink] f32, Out[T,H,512] bf16, Lse[T,H] f32, MaxLogits[T,H] f32).  ``staging``: where the e4m3
    bytes are converted: "consumer" (``_consumer_dequant_parts``), "inplace" (the producer, after its own
    cp.async) or "regs" (the producer, from registers)."""
    assert staging in STAGINGS, staging
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    first_use = None
    if staging == "consumer":
        producer, first_use = _consumer_dequant_parts(topk_dim=topk_dim)
        ready = (256, 256, 128, 128)  # as the bf16 producer: noinc cp.async arrivals (+ the rows for al / br)
    else:
        producer = (_cache_producer_regs if staging == "regs" else _cache_producer)(topk_dim=topk_dim)
        ready = (128, 128, 128, 128)  # the producer threads, after converting
    body = kp.pair_body(heads=heads, dqk=fc.DQK, topk=topk, sm_scale=sm_scale, has_sink=has_sink,
                        has_topk_length=has_topk_length, n_tok=n_tok, topk_dim=topk_dim, producer=producer,
                        ready_counts=ready, prelude=_DEQUANT_SRC, regs=REGS[staging], first_use=first_use)

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
              staging: str = STAGING):
    func = build_sparse_mla_fwd_pair_cache(heads=heads, topk=n_blocks * BLOCK_I, sm_scale=sm_scale,
                                           has_sink=has_sink, has_topk_length=has_topk_length, staging=staging)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments: ``kernel_fwd_fp8cache``'s rules and full 64-head tiles."""
    reason = fc.kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is None and q.shape[1] not in SUPPORTED_H:
        reason = f"H={q.shape[1]} not in {SUPPORTED_H} (the pair schedule needs full 64-head tiles)"
    return reason


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
                       staging: str = STAGING, checked: bool = False):
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
    chunks = kv.as_strided((fc._n_chunks(kv), fc.CHUNK), (fc.CHUNK, 1))  # no copy, any 16-byte row stride
    has_sink, has_tl, tl_arg, sink_arg, n_blocks = tc.optional_args(indices, topk_length, attn_sink, q.device)
    kernel = _compiled(q.shape[1], n_blocks, float(sm_scale), has_sink, has_tl, staging)
    direct_launcher(kernel)(q, chunks.view(torch.float32), chunks.view(torch.bfloat16), fc._rs16(kv), kv.shape[0],
                            indices, tl_arg, sink_arg, out, lse, max_logits)
    return out, lse, max_logits


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [(f"pair_cache_{st}_h128_topk2048_sink_tl",
             build_sparse_mla_fwd_pair_cache(heads=128, topk=2048, sm_scale=576**-0.5, has_sink=True,
                                             has_topk_length=True, staging=st)) for st in STAGINGS]


def _bench_variants():
    """Kernel times at S 4096, H 128, topk 2048, SKV 8192 and 131072 (``python -m
    flashdsa.sparse.kernel_fwd_pair_cache --variants``): each staging, the pipelined fp8-cache kernel, and the
    bf16 pair kernel on the dequantized cache; checks every variant is bitwise equal to the bf16 pair kernel."""
    from ..bench.harness import time_fn
    from ..quant import dequantize_kv_fp8, quantize_kv_fp8
    from . import kernel_fwd_pair

    gen = torch.Generator(device="cuda").manual_seed(0)
    n_tok, heads, topk, dqk = 4096, 128, 2048, fc.DQK
    for tkv in (8192, 131072):
        q = (torch.randn(n_tok, heads, dqk, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
        kv8 = quantize_kv_fp8((torch.randn(tkv, dqk, generator=gen, device="cuda") * 0.1).to(torch.bfloat16))
        kv_deq = dequantize_kv_fp8(kv8)
        idx = torch.argsort(torch.rand(n_tok, tkv, generator=gen, device="cuda"), dim=1)[:, :topk].to(torch.int32)
        sm = dqk**-0.5
        flops = 2 * n_tok * heads * topk * (dqk + D_V)
        runs = [("bf16_pair", lambda: kernel_fwd_pair.run_sparse_mla_fwd(q, kv_deq, idx, sm_scale=sm, d_v=D_V))]
        runs += [(f"cache_{st}", lambda st=st: run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V, staging=st))
                 for st in STAGINGS]
        runs.append(("cache_pipelined", lambda: fc.run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V, pair=False)))
        ref = runs[0][1]()
        base = None
        for label, fn in runs:
            same = all(torch.equal(a, b) for a, b in zip(fn(), ref))
            ms = time_fn(lambda _, f=fn: f(), [None], q.device, reps=10).ms_median
            base = base or ms
            print(f"variant SKV {tkv} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, {base / ms:.3f}x bf16 pair,"
                  f" bitwise equal to bf16 pair: {same}", flush=True)


if __name__ == "__main__":
    import sys

    if "--variants" in sys.argv[1:]:
        _bench_variants()
