"""Sparse MLA forward over the 656-byte FP8 cache with both products on register-A wgmma (H 64 / 128, sm_90a).

Notes
-----
Contract, numerics and host interface as ``kernel_fwd_pair_cache`` (q bf16 [T, H, 576], kv the uint8 [Tkv, 656]
cache of :func:`flashdsa.quant.quantize_kv_fp8`, d_v 512, bf16 products on ``bf16(e4m3 * scale)``, exact for the
format's power-of-two scales).  Why another kernel: session 28 measured that writing the converted bf16 tile into
the wgmma's shared memory alone holds any in-place converter at ~0.83x of the bf16 pair kernel.  Here no bf16 tile
exists: the raw rows stay in shared memory as they were copied, and each consumer converts what a product needs
into the wgmma's A registers.

  * **Both products transposed, A from registers.**  QK as S^T = K Q^T (M = the stage's 64 keys, N = the
    warpgroup's 32 heads, K = 576 dims): thread (warp w, lane 4 c + q) converts keys 16 w + c and 16 w + c + 8,
    dims 4 q .. 4 q + 3 of each 16-dim k step (one 32-bit load per key and step; the rope's bf16 words as they
    are).  Q^T is the B operand, K-major with the 128B swizzle, its dims permuted inside each k step to match
    (B column 2 q + e <-> dim 4 q + e, column 2 q + 8 + e <-> dim 4 q + 2 + e).  PV as O^T = V^T P^T (M = 512
    dims in 8 m-tiles, N = 32 heads, K = the 64 keys): ``ldmatrix.trans`` of 16-byte row pieces gives a thread
    keys 2 q, 2 q + 1 (and + 8) of dims 2 c, 2 c + 1, so one byte permute per register makes the A fragment with
    rows <-> dims in the order 2 c, 2 c + 1 (as ``_fp8_ot``).  P^T (bf16, [32 heads, 64 keys], K-major, 128B
    swizzle) is the B operand.
  * **Conversion** (``kernel_fwd_pair_cache``'s): a byte permute with sign replication, a shift and a mask give
    bf16 bits worth value * 2^-120; one bf16x2 multiply by 2^120 * scale (two where a scale exceeds 2^7: a vote
    per warp for QK, a barrier reduction per stage for PV).  QK pairs share a key (one scale); PV pairs are two keys
    (a packed scale pair).
  * **Roles.**  384 threads: warpgroups 0 / 1 take heads [32 w, +32) of the CTA's 64 (O^T 128 fp32 registers
    each, softmax of their own heads: no exchange between them); warpgroup 2 copies each stage's 64 rows (one
    ``cp.async.bulk`` per row, 16 rows per warp; an invalid row is zeroed, never read) into a ring of 3 stages.
    A stage is released as soon as both consumers have read its bytes (the PV's A registers hold what the wgmma
    still needs).  Grid: one CTA per (token, 64-head group).
Numerics as the other kernels: fp32 accumulators and softmax state, exp2 with ``sm_scale * log2(e)`` folded, a
finite running-max start (-1e30); the exp reference moves only when a stage's max exceeds it by more than 2^8
(exp2 domain); P rounded to bf16 only for PV; natural-log lse without the sink; empty rows -> out 0, lse +inf,
max_logits -inf; ``inv = 1 / (l + 2^(sink log2 e - m))``.

Shared memory (from a 1024-aligned base): Q^T 2 x 36 KiB, P^T 2 x 4 KiB, 3 stages x 64 x 656 B, the max and sum
exchanges, the row flags; 212,736 B in all.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import torch

import tilelang
import tilelang.language as T

from .._tilelang import direct_launcher
from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from ._tl_common import D_V, LOG2E
from ._warp_mma import WARP_MMA_PRELUDE

SUPPORTED_H = (64, 128)
DQK = 576
THREADS = 384
N_STAGES = 3
SMEM_BYTES = 1024 + 2 * 36864 + 2 * 4096 + N_STAGES * 64 * 656 + 2048 + 768 + 1024
EXPECTS_WGMMA = True

_SRC = tc.FAST_EXP2_PRELUDE + WARP_MMA_PRELUDE + r"""
#define RS_ROW 656
#define RS_NS 3
__device__ __forceinline__ unsigned long long rs_desc128(unsigned addr) {
  // K-major operand, 128-byte rows with the 128B swizzle: start address, LBO 16 (unused), SBO 1024 (8 rows), mode 1
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}
// d (m64n32 f32) += A (bf16, registers) x B (desc, K-major); acc 0: d = product
__device__ __forceinline__ void rs_mma(float *d, const unsigned *a, unsigned long long desc, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}
__device__ __forceinline__ void rs_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void rs_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void rs_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// registers an in-flight wgmma reads or writes stay untouched until after the caller's wait
template <int N>
__device__ __forceinline__ void rs_keep(unsigned *a) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i]) :: "memory");
}
template <int N>
__device__ __forceinline__ void rs_keepf(float *d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
__device__ __forceinline__ unsigned rs_lds32(unsigned a) {
  unsigned v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ float rs_ldsf(unsigned a) { return __uint_as_float(rs_lds32(a)); }
__device__ __forceinline__ void rs_lds64(unsigned a, unsigned &x, unsigned &y) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(x), "=r"(y) : "r"(a));
}
__device__ __forceinline__ void rs_ldm_t(unsigned a, unsigned (&x)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(a));
}
// two e4m3 bytes of x (picked by sel, sign-replicated into 16-bit lanes) -> bf16x2 value * scale: bits worth
// value * 2^-120, then m1 (2^120 * scale, or 2^120 when !ONE) and, when !ONE, m2 (scale)
template <int ONE>
__device__ __forceinline__ unsigned rs_cvt(unsigned x, unsigned sel, unsigned m1, unsigned m2) {
  unsigned p, b;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(p) : "r"(x), "r"(sel));
  const unsigned y = (p << 4) & 0x87f087f0u;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(b) : "r"(y), "r"(m1));
  if (!ONE) asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(b) : "r"(b), "r"(m2));
  return b;
}
__device__ __forceinline__ unsigned rs_pack(float lo, float hi) {  // bf16x2 {lo, hi}
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned short rs_bf16(float x) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}
#define RS_2P120 1.329227995784916e36f
// multipliers of a key pair (lo, hi) with scales sl, sh: m1 and m2 as rs_cvt takes them
template <int ONE>
__device__ __forceinline__ void rs_mults(float sl, float sh, unsigned &m1, unsigned &m2) {
  m1 = ONE ? rs_pack(sl * RS_2P120, sh * RS_2P120) : rs_pack(RS_2P120, RS_2P120);
  m2 = rs_pack(sl, sh);
}
// A fragment of QK k step kk (latent, kk < 32) from the raw rows at r0 / r1 (shared addresses)
template <int ONE>
__device__ __forceinline__ void rs_qk_frag(unsigned r0, unsigned r1, int kk, int q, unsigned m10, unsigned m20,
                                           unsigned m11, unsigned m21, unsigned *a) {
  const unsigned x0 = rs_lds32(r0 + 16 * kk + 4 * q), x1 = rs_lds32(r1 + 16 * kk + 4 * q);
  a[0] = rs_cvt<ONE>(x0, 0x9180u, m10, m20);
  a[1] = rs_cvt<ONE>(x1, 0x9180u, m11, m21);
  a[2] = rs_cvt<ONE>(x0, 0xB3A2u, m10, m20);
  a[3] = rs_cvt<ONE>(x1, 0xB3A2u, m11, m21);
}
// S^T (16 f32) = K Q^T over the stage's rows: qt = this warpgroup's Q^T (9 chunks of 4 KiB); r0 / r1 = the rows of
// keys 16 w + c, + 8.  Groups of two k steps, two register buffers, one wait per group.
__device__ __forceinline__ void rs_qk(float *S, unsigned qt, unsigned r0, unsigned r1, int q) {
  unsigned a[2][8];
#pragma unroll
  for (int t = 0; t < 4; ++t) {  // scale tile t: k steps 8 t .. 8 t + 7
    const float s0 = rs_ldsf(r0 + 512 + 4 * t), s1 = rs_ldsf(r1 + 512 + 4 * t);
    const bool one = __all_sync(0xffffffffu, s0 <= 128.f && s1 <= 128.f);
    unsigned m10, m20, m11, m21;
    if (one) {
      rs_mults<1>(s0, s0, m10, m20);
      rs_mults<1>(s1, s1, m11, m21);
    } else {
      rs_mults<0>(s0, s0, m10, m20);
      rs_mults<0>(s1, s1, m11, m21);
    }
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int kk = 8 * t + 2 * g, b = g & 1;
      if (g >= 2) {
        rs_wait<1>();
        rs_keep<8>(a[b]);
      } else if (t > 0) {
        rs_wait<1>();
        rs_keep<8>(a[b]);
      }
      if (one) {
        rs_qk_frag<1>(r0, r1, kk, q, m10, m20, m11, m21, a[b]);
        rs_qk_frag<1>(r0, r1, kk + 1, q, m10, m20, m11, m21, a[b] + 4);
      } else {
        rs_qk_frag<0>(r0, r1, kk, q, m10, m20, m11, m21, a[b]);
        rs_qk_frag<0>(r0, r1, kk + 1, q, m10, m20, m11, m21, a[b] + 4);
      }
      rs_fence();
      rs_mma(S, a[b], rs_desc128(qt + (kk >> 2) * 4096 + 32 * (kk & 3)), kk > 0);
      rs_mma(S, a[b] + 4, rs_desc128(qt + ((kk + 1) >> 2) * 4096 + 32 * ((kk + 1) & 3)), 1);
      rs_commit();
    }
  }
#pragma unroll
  for (int g = 0; g < 2; ++g) {  // the rope: k steps 32 .. 35, bf16 words as they are
    const int b = g & 1;
    rs_wait<1>();
    rs_keep<8>(a[b]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int kr = 2 * g + h;
      rs_lds64(r0 + 528 + 32 * kr + 8 * q, a[b][4 * h + 0], a[b][4 * h + 2]);
      rs_lds64(r1 + 528 + 32 * kr + 8 * q, a[b][4 * h + 1], a[b][4 * h + 3]);
    }
    rs_fence();
    rs_mma(S, a[b], rs_desc128(qt + 8 * 4096 + 32 * (2 * g)), 1);
    rs_mma(S, a[b] + 4, rs_desc128(qt + 8 * 4096 + 32 * (2 * g + 1)), 1);
    rs_commit();
  }
  rs_wait<0>();
  rs_keep<16>(&a[0][0]);
  rs_keepf<16>(S);
}
// O^T (8 m-tiles x 16 f32) += V^T P^T over the stage: st = the stage's first row, pt = this warpgroup's P^T
template <int ONE>
__device__ __forceinline__ void rs_pv(float *acc, unsigned st, unsigned pt, int w, int lane) {
  const int q = lane & 3;
  // ldmatrix row address of this lane: matrix lane >> 3 (0 / 1: keys 0-7 / 8-15 of the k step at m-tile 2 t;
  // 2 / 3: the same at m-tile 2 t + 1), row lane & 7
  const unsigned lrow = st + (8 * ((lane >> 3) & 1) + (lane & 7)) * RS_ROW + 64 * (lane >> 4) + 16 * w;
  unsigned a[2][8];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int b = t & 1;
      if (kk > 0 || t >= 2) {
        rs_wait<1>();
        rs_keep<8>(a[b]);
      }
      const unsigned k0 = st + (16 * kk + 2 * q) * RS_ROW + 512 + 4 * t;
      unsigned ml1, ml2, mh1, mh2;
      rs_mults<ONE>(rs_ldsf(k0), rs_ldsf(k0 + RS_ROW), ml1, ml2);
      rs_mults<ONE>(rs_ldsf(k0 + 8 * RS_ROW), rs_ldsf(k0 + 9 * RS_ROW), mh1, mh2);
      unsigned x[4];
      rs_ldm_t(lrow + 16 * kk * RS_ROW + 128 * t, x);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        a[b][4 * m + 0] = rs_cvt<ONE>(x[2 * m], 0xA280u, ml1, ml2);
        a[b][4 * m + 1] = rs_cvt<ONE>(x[2 * m], 0xB391u, ml1, ml2);
        a[b][4 * m + 2] = rs_cvt<ONE>(x[2 * m + 1], 0xA280u, mh1, mh2);
        a[b][4 * m + 3] = rs_cvt<ONE>(x[2 * m + 1], 0xB391u, mh1, mh2);
      }
      rs_fence();
      rs_mma(acc + 16 * (2 * t), a[b], rs_desc128(pt + 32 * kk), 1);
      rs_mma(acc + 16 * (2 * t + 1), a[b] + 4, rs_desc128(pt + 32 * kk), 1);
      rs_commit();
    }
  }
}

// The whole CTA: token tok, heads [64 hg, +64) of H.  smem: the kernel's byte buffer; bars: 3 full (64 arrivals)
// then 3 empty (8 arrivals) mbarriers.
template <int H, int HAS_SINK, int HAS_TL>
__device__ __forceinline__ void fdsa_rs_kernel(const void *Qv, const void *KVv, long long row_stride, int n_rows,
                                               const int *Indices, int topk, const int *TopkLen, const float *Sink,
                                               void *Outv, float *Lse, float *MaxLogits, void *smem_v, void *bars_v,
                                               int bid, float c) {
  const int tok = bid / (H / 64), hg = bid % (H / 64);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  unsigned char *smem = reinterpret_cast<unsigned char *>((reinterpret_cast<size_t>(smem_v) + 1023) & ~size_t(1023));
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned q_s = base, p_s = base + 2 * 36864, st_s = p_s + 2 * 4096, xch_s = st_s + RS_NS * 64 * RS_ROW;
  float *xch = reinterpret_cast<float *>(smem + (xch_s - base));         // [2 wg][2 parity][4 warps][32]
  int *flags = reinterpret_cast<int *>(smem + (xch_s - base) + 2048);   // [3 stages][64]
  float *lsum = reinterpret_cast<float *>(smem + (xch_s - base) + 2816);  // [2 wg][4 warps][32]
  const unsigned bars = static_cast<unsigned>(__cvta_generic_to_shared(bars_v));
  int lim = topk;
  if (HAS_TL) {
    lim = TopkLen[tok];
    lim = lim < 0 ? 0 : (lim > topk ? topk : lim);
  }
  const int nst = (lim + 63) >> 6;

  if (warp >= 8) {  // producer: warp pw copies rows 16 pw .. 16 pw + 15 of each stage
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    const int pw = warp - 8;
    if (lane < 16) {
      const int *idx = Indices + static_cast<long long>(tok) * topk;
      const unsigned char *kv = static_cast<const unsigned char *>(KVv);
      int slot = 16 * pw + lane;
      int row = slot < lim ? idx[slot] : -1;
      for (int n = 0; n < nst; ++n) {
        const int s = n % RS_NS;
        const int nslot = slot + 64, nrow = (n + 1 < nst && nslot < lim) ? idx[nslot] : -1;
        if (n >= RS_NS) fdsa_wait_parity(bars + 8 * (RS_NS + s), ((n / RS_NS) - 1) & 1);
        const int ok = row >= 0 && row < n_rows;
        flags[64 * s + 16 * pw + lane] = ok;
        const unsigned dst = st_s + s * 64 * RS_ROW + (16 * pw + lane) * RS_ROW;
        fdsa_bulk_row<RS_ROW>(dst, kv + (ok ? row : 0) * row_stride, bars + 8 * s, ok, smem + (dst - base));
        slot = nslot;
        row = nrow;
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int wg = warp >> 2, w = warp & 3, wt = tid & 127, cq = lane >> 2, q = lane & 3;
  const unsigned qt = q_s + wg * 36864, pt = p_s + wg * 4096;
  const int head0 = 64 * hg + 32 * wg;  // this warpgroup's first head
  {  // Q^T: head h, k step kk (16 dims) -> two 16-byte pieces of chunk kk / 4 with the k step's dim order
    const unsigned short *Q = static_cast<const unsigned short *>(Qv);
#pragma unroll
    for (int it = 0; it < 9; ++it) {
      const int item = it * 128 + wt, h = item / 36, kk = item % 36;
      const uint4 *src = reinterpret_cast<const uint4 *>(Q + (static_cast<long long>(tok) * H + head0 + h) * 576 +
                                                         16 * kk);
      const uint4 u = src[0], v = src[1];
      const unsigned row = qt + (kk >> 2) * 4096 + h * 128;
      const int p0 = 2 * (kk & 3);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(row + ((p0 ^ (h & 7)) << 4)), "r"(u.x), "r"(u.z),
                   "r"(v.x), "r"(v.z) : "memory");
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(row + (((p0 + 1) ^ (h & 7)) << 4)), "r"(u.y),
                   "r"(u.w), "r"(v.y), "r"(v.w) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
  }
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float mref[8], lsm[8], mtr[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    mref[i] = -1e30f;
    lsm[i] = 0.f;
    mtr[i] = -1e30f;
  }
  float *xw = xch + wg * 256;  // [2 parity][4 warps][32]
  for (int n = 0; n < nst; ++n) {
    const int s = n % RS_NS;
    fdsa_wait_parity(bars + 8 * s, (n / RS_NS) & 1);
    const unsigned st = st_s + s * 64 * RS_ROW;
    const int k0 = 16 * w + cq;
    const unsigned r0 = st + k0 * RS_ROW, r1 = r0 + 8 * RS_ROW;
    float S[16];
    rs_qk(S, qt, r0, r1, q);
    // this thread's scales all <= 2^7 (for the stage-wide PV vote)
    bool one = true;
#pragma unroll
    for (int t = 0; t < 4; ++t) one = one && rs_ldsf(r0 + 512 + 4 * t) <= 128.f && rs_ldsf(r1 + 512 + 4 * t) <= 128.f;
    const bool v0 = flags[64 * s + k0] != 0, v1 = flags[64 * s + k0 + 8] != 0;
    float bm[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        S[4 * j + e] = v0 ? S[4 * j + e] * c : -FDSA_INF;
        S[4 * j + 2 + e] = v1 ? S[4 * j + 2 + e] * c : -FDSA_INF;
        float m = fmaxf(S[4 * j + e], S[4 * j + 2 + e]);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        bm[2 * j + e] = m;
      }
    }
    float *xp = xw + (n & 1) * 128;
    if (cq == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<float2 *>(xp + 32 * w + 8 * j + 2 * q) = make_float2(bm[2 * j], bm[2 * j + 1]);
    }
    int all_one;
    asm volatile("{\n.reg .pred p, r;\nsetp.ne.b32 p, %1, 0;\nbar.red.and.pred r, %2, 128, p;\nselp.s32 %0, 1, 0, r;\n}\n"
                 : "=r"(all_one) : "r"((int)one), "r"(1 + wg) : "memory");
    bool moved = false;
    float alpha[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int ww = 0; ww < 4; ++ww) {
        const float2 v = *reinterpret_cast<const float2 *>(xp + 32 * ww + 8 * j + 2 * q);
        bm[2 * j] = ww ? fmaxf(bm[2 * j], v.x) : v.x;
        bm[2 * j + 1] = ww ? fmaxf(bm[2 * j + 1], v.y) : v.y;
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      mtr[i] = fmaxf(mtr[i], bm[i]);
      alpha[i] = 1.f;
      if (bm[i] > mref[i] + 8.f) {
        alpha[i] = fdsa_ex2(mref[i] - bm[i]);
        mref[i] = bm[i];
        moved = true;
      }
    }
    if (moved) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        lsm[i] *= alpha[i];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          acc[16 * m + 4 * (i >> 1) + (i & 1)] *= alpha[i];
          acc[16 * m + 4 * (i >> 1) + 2 + (i & 1)] *= alpha[i];
        }
      }
    }
    unsigned short *P = reinterpret_cast<unsigned short *>(smem + (pt - base));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * j + e, h = 8 * j + 2 * q + e;
        const float p0 = fdsa_ex2(S[4 * j + e] - mref[i]), p1 = fdsa_ex2(S[4 * j + 2 + e] - mref[i]);
        lsm[i] += p0 + p1;
        P[h * 64 + (((k0 >> 3) ^ (h & 7)) << 3) + (k0 & 7)] = rs_bf16(p0);
        P[h * 64 + ((((k0 + 8) >> 3) ^ (h & 7)) << 3) + (k0 & 7)] = rs_bf16(p1);
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
    if (all_one)
      rs_pv<1>(acc, st, pt, w, lane);
    else
      rs_pv<0>(acc, st, pt, w, lane);
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bars + 8 * (RS_NS + s)) : "memory");
    // retired here, not at the next QK's wait: ptxas serialises every wgmma (C7514) when the softmax's O rescale
    // follows PV groups that are still in flight at the loop's back edge
    rs_wait<0>();
    rs_keepf<128>(acc);
  }
  rs_wait<0>();
  rs_keepf<128>(acc);
  // row sums: over the 8 key rows of a warp, then the 4 warps
  float L[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v = lsm[i];
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    L[i] = v;
  }
  float *ls = lsum + wg * 128;
  if (cq == 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<float2 *>(ls + 32 * w + 8 * j + 2 * q) = make_float2(L[2 * j], L[2 * j + 1]);
  }
  asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
  float inv[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 2 * j + e, h = 8 * j + 2 * q + e;
      float tot = 0.f;
#pragma unroll
      for (int ww = 0; ww < 4; ++ww) tot += ls[32 * ww + h];
      L[i] = tot;
      float sk = 0.f;
      if (HAS_SINK)
        sk = exp2f(__fsub_rn(__fmul_rn(Sink[head0 + h], 1.4426950408889634f), mref[i]));
      inv[i] = tot > 0.f ? 1.f / (tot + sk) : 0.f;
    }
  }
  unsigned short *Out = static_cast<unsigned short *>(Outv);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 2 * j + e;
      unsigned short *o = Out + (static_cast<long long>(tok) * H + head0 + 8 * j + 2 * q + e) * 512 + 16 * w + 2 * cq;
#pragma unroll
      for (int m = 0; m < 8; ++m)
        *reinterpret_cast<unsigned *>(o + 64 * m) =
            rs_pack(acc[16 * m + 4 * j + e] * inv[i], acc[16 * m + 4 * j + 2 + e] * inv[i]);
    }
  }
  if (w == 0 && cq == 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const long long o = static_cast<long long>(tok) * H + head0 + 8 * (i >> 1) + 2 * q + (i & 1);
      Lse[o] = L[i] > 0.f ? (log2f(L[i]) + mref[i]) * 0.6931471805599453f : FDSA_INF;
      MaxLogits[o] = L[i] > 0.f ? mtr[i] * 0.6931471805599453f : -FDSA_INF;
    }
  }
}
"""


def build_sparse_mla_fwd_rs656(*, heads: int, sm_scale: float, has_sink: bool = False,
                               has_topk_length: bool = False):
    """prim_func (Q[T,H,576] bf16, KV8[n_ch,16] u8 (the cache as 16-byte chunks), rs16 i32 (row stride in chunks),
    n_rows i32 (Tkv), Indices[T,topk] i32, TopkLen[n_tl] i32, Sink[n_sink] f32, Out[T,H,512] bf16, Lse[T,H] f32,
    MaxLogits[T,H] f32) for H in ``SUPPORTED_H``, any topk."""
    if heads not in SUPPORTED_H:
        raise ValueError(f"sparse rs656 forward: H={heads} not in {SUPPORTED_H}")
    assert sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E
    bf16, f32, i32, u8 = "bfloat16", "float32", "int32", "uint8"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    groups = heads // 64
    fn = f"fdsa_rs_kernel<{heads}, {int(has_sink)}, {int(has_topk_length)}>"

    @T.prim_func
    def sparse_mla_fwd_rs656(
        Q: T.Tensor([n_tok, heads, DQK], bf16),
        KV8: T.Tensor([n_ch, 16], u8),
        rs16: T.int32,
        n_rows: T.int32,
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D_V], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok * groups, threads=THREADS, prelude=_SRC) as bx:
            Smem = T.alloc_shared([SMEM_BYTES], u8)
            bars = T.alloc_barrier([64] * N_STAGES + [8] * N_STAGES)
            T.call_extern("handle", fn, T.address_of(Q[0, 0, 0]), T.address_of(KV8[0, 0]),
                          T.cast(rs16, "int64") * 16, n_rows, T.address_of(Indices[0, 0]), topk_dim,
                          T.address_of(TopkLen[0]), T.address_of(Sink[0]), T.address_of(Out[0, 0, 0]),
                          T.address_of(Lse[0, 0]), T.address_of(MaxLogits[0, 0]), T.address_of(Smem[0]),
                          T.address_of(bars[0]), bx, c_log2)

    return sparse_mla_fwd_rs656


@functools.lru_cache(maxsize=32)
def _build(heads, sm_scale, has_sink, has_topk_length):
    func = build_sparse_mla_fwd_rs656(heads=heads, sm_scale=sm_scale, has_sink=has_sink,
                                      has_topk_length=has_topk_length)
    return tilelang.compile(func, target="cuda", pass_configs=tc.plain_pass_configs())


def launcher(heads: int, sm_scale: float, has_sink: bool, has_topk_length: bool):
    """This kernel's launch as ``(q, kv, indices, topk_length or dummy, attn_sink or dummy, out, lse, max_logits)``
    (q and indices contiguous; ``kernel_fwd_fp8cache.launcher``'s form)."""
    run = direct_launcher(_build(heads, float(sm_scale), has_sink, has_topk_length))

    def launch(q, kv, indices, tl_arg, sink_arg, out, lse, max_logits):
        if q.data_ptr() % 16 != 0:  # its Q loads are 16-byte vectors
            q = q.clone()
        run(q, fc.cache_chunks(kv), fc._rs16(kv), kv.shape[0], indices, tl_arg, sink_arg, out, lse, max_logits)

    return launch


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
                       checked: bool = False):
    """Returns (out [T,H,512] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32)."""
    from . import kernel_fwd_pair_cache

    if not checked:
        reason = kernel_fwd_pair_cache.kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length,
                                                          attn_sink=attn_sink)
        if reason is not None:
            raise ValueError(f"sparse_mla fwd rs656 fp8-cache kernel: {reason}")
    (out, lse, max_logits), done = tc.fwd_outputs(q, kv, sm_scale=sm_scale, d_v=d_v)
    if done:
        return out, lse, max_logits
    q = q.contiguous()
    indices = indices.contiguous()
    has_sink, has_tl, tl_arg, sink_arg, _ = tc.optional_args(indices, topk_length, attn_sink, q.device)
    launcher(q.shape[1], sm_scale, has_sink, has_tl)(q, kv, indices, tl_arg, sink_arg, out, lse, max_logits)
    return out, lse, max_logits


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [("rs656_h128_sink_tl", build_sparse_mla_fwd_rs656(heads=128, sm_scale=DQK ** -0.5, has_sink=True,
                                                              has_topk_length=True))]


def _bench_variants(json_path=None, note="", shapes=("prefill", "prefill128k", "decode64", "decode128")):
    """Kernel times of this kernel, ``kernel_fwd_pair_cache`` (its default staging) and the bf16 pair kernel on the
    dequantized cache, same inputs (``python -m flashdsa.sparse.kernel_fwd_rs656 --variants [--shapes a,b]
    [--json PATH] [--note TEXT]``): prefill S 4096 over SKV 8192 / 131072 at H 128; decode-shaped 128 tokens of H 64
    and 256 tokens of H 128 over 2^22 rows (topk 2048, random unique indices)."""
    import datetime
    import json
    import os

    from ..bench.flops import sparse_fwd_flops
    from ..bench.harness import time_fn
    from ..quant import quantize_kv_fp8
    from . import kernel_dequant656, kernel_fwd_pair, kernel_fwd_pair_cache

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in shapes:
        S, SKV, H = {"prefill": (4096, 8192, 128), "prefill128k": (4096, 131072, 128), "decode64": (128, 1 << 22, 64),
                     "decode128": (256, 1 << 22, 128)}[shape]
        q = (torch.randn(S, H, DQK, generator=gen, device="cuda") * 0.1).bfloat16()
        kv8 = quantize_kv_fp8((torch.randn(SKV, DQK, generator=gen, device="cuda") * 0.1).bfloat16())
        idx = torch.stack([torch.randperm(SKV, generator=gen, device="cuda")[:2048] for _ in range(S)]).int()
        kv_deq = kernel_dequant656.dequantize_cache(kv8)
        flops = sparse_fwd_flops(H, idx.numel(), DQK, D_V)
        kw = dict(sm_scale=DQK ** -0.5, d_v=D_V)
        fns = {"bf16_pair": lambda: kernel_fwd_pair.run_sparse_mla_fwd(q, kv_deq, idx, **kw),
               "pair_cache": lambda: kernel_fwd_pair_cache.run_sparse_mla_fwd(q, kv8, idx, **kw),
               "rs656": lambda: run_sparse_mla_fwd(q, kv8, idx, **kw)}
        ref = None
        for label, fn in fns.items():
            out = fn()
            ref = out if ref is None else ref
            err = [(a.float() - b.float()).abs().max().item() for a, b in zip(out, ref)]
            t = time_fn(lambda _, f=fn: f(), [None], q.device, reps=10)
            print(f"variant {shape} S {S} SKV {SKV} H {H} {label}: {t.ms_median:.4f} ms, "
                  f"{flops / t.ms_median / 1e9:.1f} TFLOP/s (max |out / lse / max_logits difference| vs bf16_pair "
                  f"{err[0]:.2e} / {err[1]:.2e} / {err[2]:.2e})", flush=True)
            rows.append(dict(case=f"{shape}_S{S}_SKV{SKV}_H{H}_topk2048", variant=label, ms=t.ms_median,
                             tflops=flops / t.ms_median / 1e9, max_abs_diff_vs_bf16_pair=err))
    if json_path:
        doc = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                   commit=os.environ.get("FLASHDSA_COMMIT", "unknown"), note=note, rows=rows)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    import sys

    argv = sys.argv[1:]
    if "--variants" in argv:
        opts = {k: argv[argv.index(k) + 1] for k in ("--json", "--note", "--shapes") if k in argv}
        _bench_variants(opts.get("--json"), opts.get("--note", ""),
                        tuple(opts.get("--shapes", "prefill,prefill128k,decode64,decode128").split(",")))
