"""Few-head sparse MLA forward over the 656-byte FP8 cache with QK on the FP8 wgmma from raw rows (H <= 16, sm_90a).

Notes
-----
Contract, signature and numerics as ``kernel_fwd_narrow656`` / ``kernel_fwd_mma656`` (q bf16 [T, H, 576], the cache
as 16-byte chunks, ``rs16`` / ``n_rows``, Indices [T, topk], topk_length, sink, out bf16 [T, H, 512], lse /
max_logits f32); one CTA of two warpgroups per token.  Why another form: ``kernel_fwd_mma656`` converts every e4m3
byte twice (once for QK, once for PV) and runs QK on ``mma.sync`` (~705 instructions per warp and 16-key step,
product-bound: PERFORMANCE.md "Session 34").  Here QK converts nothing:

  * **Key groups.**  Warpgroup g (0 / 1) takes the 64-key chunks g, g + 2, ... of the token's top-k with its own
    online softmax; the two are merged at the end (as split-KV).  Each has ``NST`` = 2 raw stages of 64 rows
    (one ``cp.async.bulk`` of 656 bytes per row, lanes 0-15 of warp w copy rows 16 w .. 16 w + 15; an invalid slot's
    row is zeroed and flagged in ``Valid``).  Row numbers come in blocks of 2 steps a block ahead (one load per
    lane), as in ``kernel_fwd_mma656``.
  * **QK as S^T = K Q'^T on ``wgmma.m64n32k32.e4m3`` with A from registers.**  The 64 keys are the M side (warp w:
    keys 16 w + r and 16 w + r + 8 for lane (r, q)), and because the contraction order inside a k32 step is free,
    a thread's A registers are 4-byte words of its raw rows (bytes [32 q, +32) of each 128-dim tile: two 16-byte
    loads per row and tile, no conversion).  N = 32: Q' = q 2^sh(head) as exact e4m3 hi (rows 0-15) and lo (rows
    16-31) parts (hi = e4m3(x), lo = e4m3(x - hi): exact for every bf16 element whose lowest bit is >= 2^-9 with
    the head's largest in [2^7, 2^8)), stored once per CTA K-major with the 64-byte swizzle in the order the raw
    words take: logical byte 32 s + 16 h + 4 q' + b of tile t's k step s holds dim 128 t + 32 q' + 8 s + 4 h + b.
    One accumulator per 128-dim tile (the row's tile scale multiplies an accumulator row); the bf16 rope the same
    way on ``wgmma.m64n16k16.bf16`` (A = raw rope words).  S = sum_t s_t(key) (hi_t + lo_t) 2^-sh + rope.
  * **Softmax over the warpgroup.**  Per-warp maxima per head (and per tile the largest row scale) go through
    shared memory; every thread derives the same exp reference from the same values (lazy: it moves only when a
    max grows by more than 2^8 in the exp2 domain, so P <= 2^8).  P is written once per tile t as
    P_t = P s_t(key) / sigma_t (f16, sigma_t the warpgroup's running largest tile scale: <= 1, a power-of-two ratio
    for the format's scales) in ``m16n8k16`` A-fragment order for warp t.
  * **PV per warp on ``mma.sync``**: warp w accumulates O [16 heads, tile w's 128 dims] over the step's 64 keys
    (4 k steps, one per producing warp), V's B fragments from raw bytes (one ``prmt`` pairs two rows' bytes, then
    the exact e4m3 -> f16 conversion), O in 64 fp32 registers.  The key order inside a k step pairs physical keys
    (x, x + 8) as logical (2 x, 2 x + 1), so a producer thread packs its two keys into one f16x2 word; lane (r, q)
    of the PV reads dims [16 perm(r), +16) of its tile, perm = (0, 4, 1, 5, 2, 6, 3, 7) (conflict-free loads), so
    it ends holding dims [16 q, +16) and [64 + 16 q, +16) of heads r, r + 8.
Numerics otherwise as the other kernels: fp32 accumulators and softmax state (the FP8 wgmma's own accumulation over
one 128-dim tile, then fp32), exp2 with ``sm_scale * log2(e)`` folded, a finite running-max start (-1e30), invalid
rows never read (zeroed, score -inf), natural-log lse without the sink, empty rows -> out 0, lse +inf, max_logits
-inf; ``inv = 1 / (l + 2^(sink log2 e - m c))``.

Shared memory: stages 2 x 2 x 64 x 656 B (167,936 B; warpgroup 1's hold its O for the merge), Q' 16 KB, rope 2 KB,
P 16 KB, maxima, flags and barriers (~205 KB).  The per-thread work is an extern device function
(``fdsa_w656_kernel``), as in ``kernel_fwd_mma656``.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import tilelang
import tilelang.language as T

from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from ._tl_common import LOG2E
from .kernel_fwd_narrow656 import _pass_configs

MAX_HEADS = 16
NST = 2  # raw stages of 64 rows per warpgroup
CHUNK = 64  # keys per warpgroup step
THREADS = 256
EXPECTS_WGMMA = True
# stages, Q', rope, P, maxima, flags, qf / stats / sig (1 KB), 1 KB to align the base to 1024 bytes (swizzle atoms)
SMEM_BYTES = 2 * NST * CHUNK * fc.ROW_BYTES + 16384 + 2048 + 16384 + 640 + 2 * NST * CHUNK * 4 + 1024 + 1024

_SRC = tc.FAST_EXP2_PRELUDE + f"""
#define FDSA_W656_NST {NST}
#define FDSA_W656_ROW {fc.ROW_BYTES}
""" + r"""
__device__ __forceinline__ unsigned fdsa_w656_cvt(unsigned v) {  // the low two e4m3 bytes of v -> f16x2 (exact)
  unsigned r;
  const unsigned short h = (unsigned short)(v & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
  return r;
}
__device__ __forceinline__ unsigned fdsa_w656_cvt_hi(unsigned v) {  // the high two bytes (PTX unpack, no shift)
  unsigned r;
  asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;\n\t}" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ unsigned fdsa_w656_pack(float lo, float hi) {  // f16x2 {lo, hi}
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned fdsa_w656_pack_bf16(float lo, float hi) {  // bf16x2 {lo, hi}
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned fdsa_w656_e4m3x4(float v0, float v1, float v2, float v3) {  // byte i = e4m3(vi)
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
  return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
}
__device__ __forceinline__ float fdsa_w656_byte(unsigned w, int i) {  // the value of e4m3 byte i of w
  const unsigned h = fdsa_w656_cvt(i < 2 ? w : w >> 16);
  unsigned short x = static_cast<unsigned short>((i & 1) ? h >> 16 : h & 0xffffu);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
#define FDSA_W656_INF __int_as_float(0x7f800000)
__device__ __forceinline__ unsigned fdsa_w656_prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ void fdsa_w656_mma_f16(float *c, const unsigned *a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// K-major B operand, 64-byte rows with the 64-byte swizzle (16-byte unit u of row n at u ^ ((n >> 1) & 3)):
// start address, LBO 16 (unused), SBO 512 (8 rows), mode 2
__device__ __forceinline__ unsigned long long fdsa_w656_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(512 >> 4) << 32) |
         (2ull << 62);
}
// S^T tile accumulator d (m64n32, f32) += K (e4m3 A registers) x Q'^T (desc); acc 0: d = product
__device__ __forceinline__ void fdsa_w656_qk(float *d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned long long desc, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
}
// the rope: d (m64n16, f32) += K rope (bf16 A registers) x Q rope^T (desc, K-major)
__device__ __forceinline__ void fdsa_w656_rope(float *d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned long long desc, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
}
__device__ __forceinline__ void fdsa_w656_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void fdsa_w656_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fdsa_w656_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// registers read or written by an in-flight wgmma stay allocated and untouched until after the caller's wait
__device__ __forceinline__ void fdsa_w656_keep(uint4 (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(w[i].x), "+r"(w[i].y), "+r"(w[i].z), "+r"(w[i].w) :: "memory");
}
template <int N>
__device__ __forceinline__ void fdsa_w656_keepf(float *d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
__device__ __forceinline__ void fdsa_w656_wait_bar(unsigned bar, unsigned parity) {
  asm volatile("{\n\t.reg .pred p;\n\tWAIT:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra WAIT;\n\t}\n"
               :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ float fdsa_w656_max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }
__device__ __forceinline__ float fdsa_w656_rmax(float x) {  // over the 8 lanes r of a quad position q
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
// One 656-byte row into the stage row at shared address dst, counted on the mbarrier bar; an invalid row (ok 0)
// is zeroed instead (nothing read).  The stage's earlier generic reads are ordered before the copy by the
// warpgroup barrier every warp passed after its PV; the zero fill's generic writes need the proxy fence.
__device__ __forceinline__ void fdsa_w656_row(unsigned dst, const void *src, unsigned bar, int ok, void *dst_g) {
  if (ok) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(656) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 656, [%2];"
                 :: "r"(dst), "l"(src), "r"(bar) : "memory");
  } else {
#pragma unroll
    for (int k = 0; k < 41; ++k) reinterpret_cast<uint4 *>(dst_g)[k] = make_uint4(0u, 0u, 0u, 0u);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
  }
}

// The whole CTA (256 threads) for token tok: see the module notes of kernel_fwd_wg656.py.
// ABL (timing builds, wrong results): 1 no PV products (nor their conversions), 2 no QK products
template <int H, int HAS_SINK, int HAS_TL, int ABL = 0>
__device__ __forceinline__ void fdsa_w656_kernel(
    const void *Qv, const void *KVv, int rs16, int n_rows, const int *Indices, int topk, const int *TopkLen,
    const float *Sink, void *Outv, float *Lse, float *MaxLogits, void *smem_v, void *bars_v, int tok, float c) {
  constexpr int NST = FDSA_W656_NST, ROW = FDSA_W656_ROW;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = warp >> 2, wi = warp & 3, r = lane >> 2, q = lane & 3;
  unsigned char *stage = reinterpret_cast<unsigned char *>(
      (reinterpret_cast<unsigned long long>(smem_v) + 1023ull) & ~1023ull);  // [2][NST][64][ROW]
  unsigned char *qb = stage + 2 * NST * 64 * ROW;  // Q' hi / lo: 8 chunks (tile, k-step pair) of [32][64 B]
  unsigned char *rb = qb + 16384;                  // Q rope: 2 chunks of [16][64 B]
  unsigned char *pb = rb + 2048;                   // P_t: [g][t][k step][32 units][16 B]
  float *xm = reinterpret_cast<float *>(pb + 16384);    // [g][20][4]: per-warp maxima (16 heads, 4 tile scales)
  int *valid = reinterpret_cast<int *>(xm + 160);        // [g][NST][64]
  float *misc = reinterpret_cast<float *>(valid + 2 * NST * 64);  // qf[16], stats [g][4][16], sig [g][4]
  float *qf = misc, *stats = misc + 16, *sigs = misc + 16 + 128;
  const unsigned char *kv = static_cast<const unsigned char *>(KVv);
  const long long rs = static_cast<long long>(rs16) * 16;
  const unsigned bars = static_cast<unsigned>(__cvta_generic_to_shared(bars_v));
  const unsigned stage_s = static_cast<unsigned>(__cvta_generic_to_shared(stage));
  int lim = topk;
  if (HAS_TL) {
    lim = TopkLen[tok];
    lim = lim < 0 ? 0 : (lim > topk ? topk : lim);
  }
  const int nc = (lim + 63) >> 6;
  const int nsteps = nc > g ? (nc - g + 1) >> 1 : 0;

  // step s of this warpgroup: chunk g + 2 s into stage s % NST; lanes 0-15 of warp wi copy its rows 16 wi + lane.
  // Row numbers in blocks of 2 steps (lane l: step 2 k + l / 16, row l % 16), loaded a block ahead
  auto block_rows = [&](int k) -> int {
    const int slot = (g + 2 * (2 * k + (lane >> 4))) * 64 + 16 * wi + (lane & 15);
    return slot < lim ? Indices[static_cast<long long>(tok) * topk + slot] : -1;
  };
  auto issue = [&](int step, int row) {
    if (lane < 16) {
      const int k = 16 * wi + lane, bi = g * NST + step % NST;
      const int ok = row >= 0 && row < n_rows;
      valid[bi * 64 + k] = ok;
      fdsa_w656_row(stage_s + (bi * 64 + k) * ROW, kv + (ok ? row : 0) * rs, bars + bi * 8, ok,
                    stage + (bi * 64 + k) * ROW);
    }
  };
  static_assert(NST == 2, "the row blocks hold 2 steps: the prologue issues block 0");
  int rows_cur = block_rows(0), rows_next = block_rows(1);

  {  // Q' = q 2^sh(head) as e4m3 hi / lo and the bf16 rope, as the wgmma's B operands: 16 threads per head
    const int h = tid >> 4, p = tid & 15;
    uint4 w[4] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u),
                  make_uint4(0u, 0u, 0u, 0u)};
    uint2 rw = make_uint2(0u, 0u);
    if (h < H) {
      const unsigned short *row = static_cast<const unsigned short *>(Qv) + (static_cast<long long>(tok) * H + h) * 576;
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const uint4 *>(row + 32 * p)[i];
      rw = *reinterpret_cast<const uint2 *>(row + 512 + 4 * p);
    }
    // block 0's copies go out while Q's loads are in flight
    for (int s = 0; s < NST && s < nsteps; ++s) issue(s, __shfl_sync(0xffffffffu, rows_cur, 16 * s + (lane & 15)));
    const unsigned *wu = reinterpret_cast<const unsigned *>(w);
    float mx = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      mx = fmaxf(mx, fmaxf(fabsf(__uint_as_float(wu[i] << 16)), fabsf(__uint_as_float(wu[i] & 0xffff0000u))));
#pragma unroll
    for (int x = 1; x < 16; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
    const int ex = mx > 0.f ? static_cast<int>((__float_as_uint(mx) >> 23) & 255u) - 127 : 0;
    const int sh = max(-120, min(120, 7 - ex));  // the head's largest * 2^sh in [2^7, 2^8)
    const float up = __uint_as_float(static_cast<unsigned>(sh + 127) << 23);
    if (p == 0) qf[h] = __uint_as_float(static_cast<unsigned>(127 - sh) << 23);
    // this thread holds dims [32 p, +32) = 128 t + 32 q' + 8 s + 4 hf + [0, 4) of head h (t = p / 4, q' = p % 4);
    // that word goes to logical byte 32 s + 16 hf + 4 q' of tile t: chunk 2 t + s / 2, unit 2 (s & 1) + hf
    const int t = p >> 2, qq = p & 3;
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const unsigned x0 = wu[4 * s + 2 * hf], x1 = wu[4 * s + 2 * hf + 1];
        const float v[4] = {__uint_as_float(x0 << 16) * up, __uint_as_float(x0 & 0xffff0000u) * up,
                            __uint_as_float(x1 << 16) * up, __uint_as_float(x1 & 0xffff0000u) * up};
        const unsigned hi = fdsa_w656_e4m3x4(v[0], v[1], v[2], v[3]);
        const unsigned lo = fdsa_w656_e4m3x4(v[0] - fdsa_w656_byte(hi, 0), v[1] - fdsa_w656_byte(hi, 1),
                                             v[2] - fdsa_w656_byte(hi, 2), v[3] - fdsa_w656_byte(hi, 3));
        const int u = 2 * (s & 1) + hf;
        unsigned char *ck = qb + (2 * t + (s >> 1)) * 2048 + 4 * qq;
        *reinterpret_cast<unsigned *>(ck + h * 64 + ((u ^ ((h >> 1) & 3)) << 4)) = hi;
        *reinterpret_cast<unsigned *>(ck + (16 + h) * 64 + ((u ^ (((16 + h) >> 1) & 3)) << 4)) = lo;
      }
    // the rope: dims [4 p, +4) = 16 q' + 4 s + 2 hf + [0, 2) (q' = p / 4, s = p % 4) -> logical byte
    // 32 s + 16 hf + 4 q': chunk s / 2, unit 2 (s & 1) + hf
    {
      const int s = p & 3;
      unsigned char *ck = rb + (s >> 1) * 1024 + h * 64 + 4 * (p >> 2);
      *reinterpret_cast<unsigned *>(ck + (((2 * (s & 1)) ^ ((h >> 1) & 3)) << 4)) = rw.x;
      *reinterpret_cast<unsigned *>(ck + (((2 * (s & 1) + 1) ^ ((h >> 1) & 3)) << 4)) = rw.y;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the wgmma reads them through the async proxy
  }
  __syncthreads();

  float o[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
  float acc[4][16], accr[8];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[0][i] = acc[1][i] = acc[2][i] = acc[3][i] = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) accr[i] = 0.f;
  // S heads of this thread: 2q, 2q + 1, 8 + 2q, 9 + 2q (slot k = 2 (j >> 2) + (j & 1) of accumulator register j);
  // O heads: r, r + 8.  Every thread derives m for its heads from the same shared maxima (bitwise the same)
  float mS[4], tS[4], lS[4], qfS[4], mO[2], sig[4], sinv[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    mS[k] = -1e30f;
    tS[k] = -1e30f;
    lS[k] = 0.f;
    qfS[k] = qf[8 * (k >> 1) + 2 * q + (k & 1)];
    sig[k] = 0.f;
    sinv[k] = 0.f;
  }
  mO[0] = mO[1] = -1e30f;
  const unsigned qb_s = static_cast<unsigned>(__cvta_generic_to_shared(qb));
  const unsigned rb_s = static_cast<unsigned>(__cvta_generic_to_shared(rb));
  float *xg = xm + g * 80;
  // per-thread byte offsets: QK rows 16 wi + r (+ 8) from byte 32 q; PV rows 16 i + q (+ 4, + 8, + 12) from byte
  // 128 wi + 16 perm(r); P units: lane ^ 4 ((lane >> 3) & 1) (conflict-free 4-byte stores, 16-byte loads)
  const int koff = (16 * wi + r) * ROW + 32 * q;
  const int voff = q * ROW + 128 * wi + 16 * ((r >> 1) + 4 * (r & 1));
  unsigned char *pw_me = pb + (g * 4 + wi) * 2048 + ((lane ^ (((lane >> 3) & 1) << 2)) << 4);

  for (int it = 0; it < nsteps; ++it) {
    const int bi = g * NST + (it & 1);
    fdsa_w656_wait_bar(bars + bi * 8, (it >> 1) & 1);
    const unsigned char *sb = stage + bi * 64 * ROW;
    // ---- QK: two commit groups of two tiles, then the rope
    uint4 ka[4], kb[4], kc[4], kd[4], kr[4];
    auto load_tile = [&](uint4 (&w)[4], int byte) {
      w[0] = *reinterpret_cast<const uint4 *>(sb + koff + byte);
      w[1] = *reinterpret_cast<const uint4 *>(sb + koff + byte + 16);
      w[2] = *reinterpret_cast<const uint4 *>(sb + koff + 8 * ROW + byte);
      w[3] = *reinterpret_cast<const uint4 *>(sb + koff + 8 * ROW + byte + 16);
    };
    auto qk_tile = [&](int t, uint4 (&w)[4]) {
      const unsigned *u = reinterpret_cast<const unsigned *>(&w[0]), *v = reinterpret_cast<const unsigned *>(&w[2]);
#pragma unroll
      for (int s = 0; s < 4; ++s)
        fdsa_w656_qk(acc[t], u[2 * s], v[2 * s], u[2 * s + 1], v[2 * s + 1],
                     fdsa_w656_desc(qb_s + (2 * t + (s >> 1)) * 2048) + 2 * (s & 1), s);
    };
    load_tile(ka, 0);
    load_tile(kb, 128);
    if (!(ABL & 2)) {
    fdsa_w656_fence();
    qk_tile(0, ka);
    qk_tile(1, kb);
    fdsa_w656_commit();
    load_tile(kc, 256);
    load_tile(kd, 384);
    fdsa_w656_fence();
    qk_tile(2, kc);
    qk_tile(3, kd);
    fdsa_w656_commit();
    fdsa_w656_wait<1>();
    fdsa_w656_keep(ka);
    fdsa_w656_keep(kb);
    load_tile(kr, 528);
    fdsa_w656_fence();
    {
      const unsigned *u = reinterpret_cast<const unsigned *>(&kr[0]), *v = reinterpret_cast<const unsigned *>(&kr[2]);
#pragma unroll
      for (int s = 0; s < 4; ++s)
        fdsa_w656_rope(accr, u[2 * s], v[2 * s], u[2 * s + 1], v[2 * s + 1],
                       fdsa_w656_desc(rb_s + (s >> 1) * 1024) + 2 * (s & 1), s);
    }
    fdsa_w656_commit();
    fdsa_w656_wait<0>();
    fdsa_w656_keep(kc);
    fdsa_w656_keep(kd);
    fdsa_w656_keep(kr);
#pragma unroll
    for (int t = 0; t < 4; ++t) fdsa_w656_keepf<16>(acc[t]);
    fdsa_w656_keepf<8>(accr);
    }

    // ---- S in true units: keys 16 wi + r (registers j with j & 2 == 0) and + 8
    const float4 sc0 = *reinterpret_cast<const float4 *>(sb + koff - 32 * q + 512);
    const float4 sc1 = *reinterpret_cast<const float4 *>(sb + koff - 32 * q + 8 * ROW + 512);
    const int vd0 = valid[bi * 64 + 16 * wi + r], vd1 = valid[bi * 64 + 16 * wi + r + 8];
    float S[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 sc = (j & 2) ? sc1 : sc0;
      float x = sc.x * (acc[0][j] + acc[0][j + 8]);
      x = fmaf(sc.y, acc[1][j] + acc[1][j + 8], x);
      x = fmaf(sc.z, acc[2][j] + acc[2][j + 8], x);
      x = fmaf(sc.w, acc[3][j] + acc[3][j + 8], x);
      S[j] = ((j & 2) ? vd1 : vd0) ? fmaf(x, qfS[2 * (j >> 2) + (j & 1)], accr[j]) : -FDSA_W656_INF;
    }
    // ---- the warpgroup's maxima: per head over its 64 keys, per tile the largest valid row scale
    {
      const float m0 = fdsa_w656_rmax(fmaxf(S[0], S[2])), m1 = fdsa_w656_rmax(fmaxf(S[1], S[3]));
      const float m2 = fdsa_w656_rmax(fmaxf(S[4], S[6])), m3 = fdsa_w656_rmax(fmaxf(S[5], S[7]));
      const float c0 = fdsa_w656_rmax(fmaxf(vd0 ? sc0.x : 0.f, vd1 ? sc1.x : 0.f));
      const float c1 = fdsa_w656_rmax(fmaxf(vd0 ? sc0.y : 0.f, vd1 ? sc1.y : 0.f));
      const float c2 = fdsa_w656_rmax(fmaxf(vd0 ? sc0.z : 0.f, vd1 ? sc1.z : 0.f));
      const float c3 = fdsa_w656_rmax(fmaxf(vd0 ? sc0.w : 0.f, vd1 ? sc1.w : 0.f));
      if (r == 0) {
        xg[(2 * q) * 4 + wi] = m0;
        xg[(2 * q + 1) * 4 + wi] = m1;
        xg[(8 + 2 * q) * 4 + wi] = m2;
        xg[(9 + 2 * q) * 4 + wi] = m3;
        xg[(16 + q) * 4 + wi] = q == 0 ? c0 : (q == 1 ? c1 : (q == 2 ? c2 : c3));
      }
    }
    asm volatile("bar.sync %0, 128;" :: "r"(8 + g) : "memory");
    float Mh[4], MO[2], CM[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      Mh[k] = fdsa_w656_max4(*reinterpret_cast<const float4 *>(xg + (8 * (k >> 1) + 2 * q + (k & 1)) * 4));
      CM[k] = fdsa_w656_max4(*reinterpret_cast<const float4 *>(xg + (16 + k) * 4));
    }
    MO[0] = fdsa_w656_max4(*reinterpret_cast<const float4 *>(xg + r * 4));
    MO[1] = fdsa_w656_max4(*reinterpret_cast<const float4 *>(xg + (r + 8) * 4));
    // ---- lazy exp reference (moves only when a max grows by more than 2^8 in the exp2 domain)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      tS[k] = fmaxf(tS[k], Mh[k]);
      if ((Mh[k] - mS[k]) * c > 8.f) {
        lS[k] *= fdsa_ex2((mS[k] - Mh[k]) * c);
        mS[k] = Mh[k];
      }
    }
    {
      const bool u0 = (MO[0] - mO[0]) * c > 8.f, u1 = (MO[1] - mO[1]) * c > 8.f;
      if (__any_sync(0xffffffffu, u0 || u1)) {
        const float n0 = u0 ? MO[0] : mO[0], n1 = u1 ? MO[1] : mO[1];
        const float al0 = fdsa_ex2((mO[0] - n0) * c), al1 = fdsa_ex2((mO[1] - n1) * c);
        mO[0] = n0;
        mO[1] = n1;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          o[i][0] *= al0;
          o[i][1] *= al0;
          o[i][2] *= al1;
          o[i][3] *= al1;
        }
      }
    }
    // ---- per-tile scale reference sigma_t (the warp of tile wi rescales its O when it grows)
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      if (CM[t] > sig[t]) {
        if (t == wi && sig[t] > 0.f) {
          const float ratio = sig[t] / CM[t];
#pragma unroll
          for (int i = 0; i < 16; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[i][e] *= ratio;
        }
        sig[t] = CM[t];
        sinv[t] = 1.f / CM[t];
      }
    }
    // ---- P, and P_t = P s_t(key) / sigma_t as f16 A fragments for warp t (k step wi)
    float P[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int k = 2 * (j >> 2) + (j & 1);
      P[j] = fdsa_ex2(fmaf(S[j], c, -mS[k] * c));
      lS[k] += P[j];
    }
    {
      const float s0[4] = {sc0.x, sc0.y, sc0.z, sc0.w}, s1[4] = {sc1.x, sc1.y, sc1.z, sc1.w};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float f0 = s0[t] * sinv[t], f1 = s1[t] * sinv[t];
        unsigned char *pt = pb + ((g * 4 + t) * 4 + wi) * 512;
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // head 8 (k >> 1) + 2 q + (k & 1): registers j0 = 4 (k >> 1) + (k & 1), + 2
          const int j0 = 4 * (k >> 1) + (k & 1), h = 8 * (k >> 1) + 2 * q + (k & 1);
          const int ln = 4 * (h & 7) + (r & 3), reg = (h >> 3) + 2 * (r >> 2);
          *reinterpret_cast<unsigned *>(pt + ((ln ^ (((ln >> 3) & 1) << 2)) << 4) + 4 * reg) =
              fdsa_w656_pack(P[j0] * f0, P[j0 + 2] * f1);
        }
      }
    }
    asm volatile("bar.sync %0, 128;" :: "r"(8 + g) : "memory");
    // ---- PV: warp wi, tile wi, k step i = the 16 keys of warp i (physical keys (x, x + 8) = logical 2x, 2x + 1)
#pragma unroll
    for (int i = 0; i < ((ABL & 1) ? 0 : 4); ++i) {
      const uint4 pa = *reinterpret_cast<const uint4 *>(pw_me + i * 512);
      const unsigned a[4] = {pa.x, pa.y, pa.z, pa.w};
      uint4 vw[4];  // keys q, q + 8 (b0) and q + 4, q + 12 (b1) of warp i's 16
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        vw[kk] = *reinterpret_cast<const uint4 *>(sb + voff + (16 * i + (kk >> 1) * 4 + (kk & 1) * 8) * ROW);
      const unsigned *v0 = reinterpret_cast<const unsigned *>(&vw[0]), *v1 = reinterpret_cast<const unsigned *>(&vw[1]);
      const unsigned *v2 = reinterpret_cast<const unsigned *>(&vw[2]), *v3 = reinterpret_cast<const unsigned *>(&vw[3]);
#pragma unroll
      for (int wd = 0; wd < 4; ++wd)
#pragma unroll
        for (int hb = 0; hb < 2; ++hb) {  // bytes 2 hb, 2 hb + 1 of each word: n-tiles 4 wd + 2 hb, + 1
          const unsigned sel = hb ? 0x7362u : 0x5140u;
          const unsigned x = fdsa_w656_prmt(v0[wd], v1[wd], sel), y = fdsa_w656_prmt(v2[wd], v3[wd], sel);
          fdsa_w656_mma_f16(o[4 * wd + 2 * hb], a, fdsa_w656_cvt(x), fdsa_w656_cvt(y));
          fdsa_w656_mma_f16(o[4 * wd + 2 * hb + 1], a, fdsa_w656_cvt_hi(x), fdsa_w656_cvt_hi(y));
        }
    }
    // every warp is past this step's PV: refill its stage with step it + 2 at once (issuing it at the next step's
    // first barrier instead put that step's data wait on the refill: 72.7 us at B 128, session 35)
    asm volatile("bar.sync %0, 128;" :: "r"(8 + g) : "memory");
    if (it + 2 < nsteps) {
      const int st = it + 2;
      if ((st & 1) == 0) {  // the first step of block st / 2: load block st / 2 + 1
        rows_cur = rows_next;
        rows_next = block_rows((st >> 1) + 1);
      }
      issue(st, __shfl_sync(0xffffffffu, rows_cur, 16 * (st & 1) + (lane & 15)));
    }
  }

  // ---- merge the two warpgroups: stats [g][m, l, t, -][16], sig [g][4]; warpgroup 1's O in its own stages
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    lS[k] += __shfl_xor_sync(0xffffffffu, lS[k], 4);
    lS[k] += __shfl_xor_sync(0xffffffffu, lS[k], 8);
    lS[k] += __shfl_xor_sync(0xffffffffu, lS[k], 16);
  }
  float *lw = xm + g * 80;  // [16 heads][4 warps] per-warp l (the maxima area is free now)
  __syncthreads();
  if (r == 0) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int h = 8 * (k >> 1) + 2 * q + (k & 1);
      lw[h * 4 + wi] = lS[k];
      if (wi == 0) {
        stats[(g * 4 + 0) * 16 + h] = mS[k];
        stats[(g * 4 + 2) * 16 + h] = tS[k];
      }
    }
  }
  if ((tid & 127) == 0) {
#pragma unroll
    for (int t = 0; t < 4; ++t) sigs[g * 4 + t] = sig[t];
  }
  float *mrg = reinterpret_cast<float *>(stage + NST * 64 * ROW);  // [wi][nt][lane][4]
  if (g == 1) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      *reinterpret_cast<float4 *>(mrg + ((wi * 16 + i) * 32 + lane) * 4) =
          make_float4(o[i][0], o[i][1], o[i][2], o[i][3]);
  }
  __syncthreads();
  if (tid < 32) {  // l per (warpgroup, head): the sum of the four warps'
    const int gg = tid >> 4, h = tid & 15;
    const float4 v = *reinterpret_cast<const float4 *>(xm + gg * 80 + h * 4);
    stats[(gg * 4 + 1) * 16 + h] = (v.x + v.y) + (v.z + v.w);
  }
  __syncthreads();
  if (g == 0) {
    unsigned short *out = static_cast<unsigned short *>(Outv) + static_cast<long long>(tok) * H * 512;
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {  // head r + 8 e2
      const int h = r + 8 * e2;
      const float ma = stats[h], mb = stats[64 + h];
      const float M = fmaxf(ma, mb);
      const float wa = fdsa_ex2((ma - M) * c), wb = fdsa_ex2((mb - M) * c);
      const float L = stats[16 + h] * wa + stats[64 + 16 + h] * wb;
      float sk = 0.f;
      if (HAS_SINK)
        sk = exp2f(__fsub_rn(__fmul_rn(Sink[min(h, H - 1)], 1.4426950408889634f), __fmul_rn(M, c)));
      const float inv = L > 0.f ? 1.f / (L + sk) : 0.f;
      const float fa = sigs[wi] * wa * inv, fb = sigs[4 + wi] * wb * inv;
      unsigned pk[2][8];  // dims 16 q + [0, 16) (e 0) and 64 + 16 q + [0, 16) (e 1) of tile wi, bf16 pairs
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const float4 x0 = *reinterpret_cast<const float4 *>(mrg + ((wi * 16 + i) * 32 + lane) * 4);
        const float4 x1 = *reinterpret_cast<const float4 *>(mrg + ((wi * 16 + i + 1) * 32 + lane) * 4);
        const float b00 = e2 ? x0.z : x0.x, b01 = e2 ? x0.w : x0.y, b10 = e2 ? x1.z : x1.x, b11 = e2 ? x1.w : x1.y;
        pk[0][i >> 1] = fdsa_w656_pack_bf16(o[i][2 * e2] * fa + b00 * fb, o[i + 1][2 * e2] * fa + b10 * fb);
        pk[1][i >> 1] = fdsa_w656_pack_bf16(o[i][2 * e2 + 1] * fa + b01 * fb, o[i + 1][2 * e2 + 1] * fa + b11 * fb);
      }
      if (h < H) {
        unsigned short *dst = out + h * 512 + 128 * wi + 16 * q;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          reinterpret_cast<uint4 *>(dst + 64 * e)[0] = make_uint4(pk[e][0], pk[e][1], pk[e][2], pk[e][3]);
          reinterpret_cast<uint4 *>(dst + 64 * e)[1] = make_uint4(pk[e][4], pk[e][5], pk[e][6], pk[e][7]);
        }
      }
    }
  }
  if (tid < H) {
    const float ma = stats[tid], mb = stats[64 + tid], M = fmaxf(ma, mb);
    const float L = stats[16 + tid] * exp2f((ma - M) * c) + stats[64 + 16 + tid] * exp2f((mb - M) * c);
    const float Mt = fmaxf(stats[32 + tid], stats[64 + 32 + tid]);
    Lse[static_cast<long long>(tok) * H + tid] = L > 0.f ? (log2f(L) + M * c) * 0.6931471805599453f : FDSA_W656_INF;
    MaxLogits[static_cast<long long>(tok) * H + tid] = L > 0.f ? Mt * c * 0.6931471805599453f : -FDSA_W656_INF;
  }
}
"""


def form(name: str) -> int:
    """The ``ablate`` bits of a form name: "wg" (0), or the timing builds "wg_a<N>" (the kernel's ABL bits N)."""
    rest = name.removeprefix("wg")
    if not name.startswith("wg") or (rest and not (rest.startswith("_a") and rest[2:].isdigit())):
        raise ValueError(f"narrow: unknown wg form {name!r}")
    return int(rest[2:] or 0)


def build_sparse_mla_fwd_wg656(*, heads: int, sm_scale: float, has_sink: bool = False,
                               has_topk_length: bool = False, ablate: int = 0):
    """prim_func with ``kernel_fwd_narrow656.build_sparse_mla_fwd_narrow656``'s signature (Q[T,H,576] bf16, KV8 /
    KVf / KVb: 16-byte-chunk views of the cache, rs16, n_rows, Indices[T,topk], TopkLen, Sink, Out, Lse,
    MaxLogits); H <= 16, any topk.  ``ablate``: the kernel's ABL bits (``form``; timing builds)."""
    assert 1 <= heads <= MAX_HEADS, heads
    assert sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E
    bf16, f32, i32, u8 = "bfloat16", "float32", "int32", "uint8"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    CH = fc.CHUNK
    fn = f"fdsa_w656_kernel<{heads}, {int(has_sink)}, {int(has_topk_length)}, {int(ablate)}>"

    @T.prim_func
    def sparse_mla_fwd_wg656(
        Q: T.Tensor([n_tok, heads, fc.DQK], bf16),
        KV8: T.Tensor([n_ch, CH], fc.FP8),
        KVf: T.Tensor([n_ch, CH // 4], f32),
        KVb: T.Tensor([n_ch, CH // 2], bf16),
        rs16: T.int32,
        n_rows: T.int32,
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, fc.D_V], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, threads=THREADS, prelude=_SRC) as bx:
            Smem = T.alloc_shared([SMEM_BYTES], u8)
            bars = T.alloc_barrier([CHUNK] * (2 * NST))
            T.call_extern("handle", fn, T.address_of(Q[0, 0, 0]), T.address_of(KV8[0, 0]), rs16, n_rows,
                          T.address_of(Indices[0, 0]), topk_dim, T.address_of(TopkLen[0]), T.address_of(Sink[0]),
                          T.address_of(Out[0, 0, 0]), T.address_of(Lse[0, 0]), T.address_of(MaxLogits[0, 0]),
                          T.address_of(Smem[0]), T.address_of(bars[0]), bx, c_log2)

    return sparse_mla_fwd_wg656


@functools.lru_cache(maxsize=64)
def compiled(heads: int, sm_scale: float, has_sink: bool, has_topk_length: bool, name: str = "wg"):
    func = build_sparse_mla_fwd_wg656(heads=heads, sm_scale=sm_scale, has_sink=has_sink,
                                      has_topk_length=has_topk_length, ablate=form(name))
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("wg656_h16_sink_tl", build_sparse_mla_fwd_wg656(heads=16, sm_scale=576 ** -0.5, has_sink=True,
                                                         has_topk_length=True)),
        ("wg656_h3", build_sparse_mla_fwd_wg656(heads=3, sm_scale=0.05)),
    ]
