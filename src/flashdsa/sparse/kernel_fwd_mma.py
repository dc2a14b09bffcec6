"""Few-head sparse MLA forward (bf16 q / kv, H <= 32) on per-warp ``mma.sync`` chains (sm_90a).

Notes
-----
Contract, host interface (``kernel_fwd.launch``: Q [T, H, Dqk], KV [Tkv, Dqk], Indices [T, topk], TopkLen, Sink,
Out [T, H, 512], Lse, MaxLogits) and numerics as ``kernel_fwd.py``; Dqk 576 (V = the first 512 dims) or 512
(K = V).  One CTA of ``2 G T`` warps per token.  Why a third form next to ``kernel_fwd_narrow`` (rows on the wgmma M
side, heads on N = 16): there every 64-row block costs 36 + 32 ``m64n16k16`` wgmmas at ~65 cycles each (session 36),
so the tensor work of 16 heads is paid at a quarter of the wgmma's rate.  ``m16n8k16`` fits 16 heads exactly, and
``kernel_fwd_mma656`` (the same schedule over the FP8 cache, conversions included) already ran prefill S 4096 in
1.985 ms against the narrow kernel's 2.22 ms on bf16 rows.  The schedule (``kernel_fwd_mma656``'s, without its
FP8 conversions and scales):

  * **Key groups.**  2 T consecutive warps form group g (``G`` groups); group g takes the 16-key chunks g, g + G, ..
    of the token's top-k with its own online softmax; the groups are merged at the end (as split-KV).  No CTA-wide
    barrier inside the loop.
  * **Rows.**  Each group has ``NST`` stages of 16 rows; a row is one ``cp.async.bulk`` of ``2 Dqk`` bytes counted
    on the stage's mbarrier (an invalid slot's row is zeroed by its issuing lane instead: never read, score -inf).
    Stage rows are ``2 Dqk + 16`` bytes apart, so the 8 rows an ``ldmatrix`` reads fall in distinct bank quads.
    The row numbers come in blocks of 4 (8 at T 2) steps, one load per lane a block ahead, handed out by shuffles.
  * **A pair splits the dims.**  Per head tile t (heads 16 t .. 16 t + 15), warp h (0 / 1) of the pair takes latent
    dims [256 h, +256) and rope dims [512 + 32 h, +32): its QK partial (A = Q, from registers or by ``ldmatrix``
    from shared memory; B = the rows by ``ldmatrix``) goes through shared memory, both warps add the two partials
    (``a + b`` is exact-commutative: the same S in both), run the same softmax and each accumulates O for its own
    256 output dims (128 fp32 registers per thread) with V by ``ldmatrix.trans``.
Numerics as the other kernels: fp32 accumulators and softmax state, exp2 with ``sm_scale * log2(e)`` folded, a finite
running-max start (-1e30) -- the exp reference moves only when a chunk's max exceeds it by more than 2^8 in the exp2
domain (P <= 2^8; the true max is kept apart for max_logits) --, P rounded to bf16 only for PV, invalid rows never
read, natural-log lse without the sink, empty rows -> out 0, lse +inf, max_logits -inf;
``inv = 1 / (l + 2^(sink log2 e - m c))``.

Forms (``FORMS``): G key groups per CTA, NST stages, Q k steps in registers, T head tiles of 16 (2 T warps per
group, each warp 16 heads x 256 output dims).  Dispatched (``dispatched``): H <= 16 with at least 2 tokens per SM
``mma_c2q18`` (2 groups per CTA, two CTAs per SM: one token's prologue and merge run under the other's loop; all of
Q's A fragments in registers, 254 registers), from 4 tokens per SM "mma_ws" (``kernel_fwd_mma_ws``: c4's consumers,
four token groups per CTA, the copies issued by a producer warpgroup; before session 39 ``mma_c4``: one group per
CTA, four CTAs per SM, no merge, Q's fragments loaded from global memory), fewer tokens ``mma_q18`` (4 groups per
token), H 17..32 ``mma_t2``.

Measured (H200, topk 2048, Dqk 576, ``--variants``; docs/PERFORMANCE.md "Session 37"): S 4096 over SKV 8192, H 16:
narrow 2.23 ms -> 4 groups 1.575 -> + Q in registers, two CTAs per SM 1.43 ms (suite 1.429 / 1.432 = 204 TFLOP/s)
-> four CTAs per SM (c4) 1.421 (suite 1.427 against c2q18's 1.436 in the same call);
the same without products (timing build ``_a48``) 1.316 ms = 7.3 TB/s of gathered rows, while a pure bulk-copy gather
of these rows reaches 13.8 TB/s (``scripts/row_gather_probe.py --row 1152 --shapes prefill``): what binds is one copy
round trip per 16-key step and group (two stages: one read, one in flight).  128 tokens over SKV 65536: 0.0738 vs
narrow 0.0816 ms.
H 32 (``mma_t2``): 2.62 vs narrow 2.85 ms; 128 tokens 0.097 vs 0.100 ms.  Measured slower: 3 groups x 3 stages,
5 groups (spills), the refill issued at the top of a step on a per-stage free mbarrier (1.639 vs 1.575 ms), one
group of 3 stages per CTA and three CTAs per SM (c3n3: 1.878 vs 1.421 ms).

Shared memory (Dqk 576): stages G x NST x 16 x 1168 B (G 4, NST 2: 149,504 B; they hold the merge buffer at the end),
Q 16 T x 1168 B (read once where all of Q stays in registers), partial-S exchange G x T x 4 KB, flags and
barriers.  The per-warp fragment work is an extern device function (``fdsa_mma_kernel``): TileLang's tile operators
express block-wide gemms, not per-warp ``mma.sync`` chains with their own softmax state.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools
import os

import tilelang
import tilelang.language as T

from .._tilelang import plain_pass_configs
from . import _tl_common as tc
from ._tl_common import D_V, LOG2E
from ._warp_mma import WARP_MMA_PRELUDE

MAX_HEADS = 32  # two head tiles of 16 (forms with T 2) above 16 heads
CHUNK = 16  # keys per step
# form name -> (key groups G per CTA, stages per group NST, k steps of Q held in registers, head tiles T: 2 T warps
# per group, Q's fragments loaded from global memory: no Q in shared memory).  c2: two CTAs of 2 groups per SM
# (102 KB of shared memory each); c4 / c3n3: one group per CTA (no merge), four / three CTAs per SM.  The stages of
# 4 groups x 3 do not fit shared memory; T 2 needs NST 4 (the stages hold the merge buffer).
FORMS = {"mma": (4, 2, 0, 1, 0), "mma_q18": (4, 2, 18, 1, 0), "mma_g3": (3, 3, 0, 1, 0), "mma_c2": (2, 2, 0, 1, 0),
         "mma_c2q6": (2, 2, 6, 1, 0), "mma_c2q18": (2, 2, 18, 1, 0), "mma_t2": (2, 4, 18, 2, 0),
         "mma_c4": (1, 2, 18, 1, 1), "mma_c3n3": (1, 3, 18, 1, 1)}
DEFAULT_FORM = "mma"
# what the dispatcher runs at H <= 16: from 4 tokens per SM one group per CTA and four CTAs per SM (no merge; one
# token's prologue under the others' loops), from 2 tokens per SM two CTAs of two groups, else four key groups per
# token (fewer tokens than SMs: each token's chain is the time); H 17..32: two head tiles
# (session 39: "mma_ws", ``kernel_fwd_mma_ws``: c4's consumers with the copies issued by a producer warpgroup, S 4096
# over SKV 8192 1.386 vs c4's 1.422 ms; its form name is taken by ``_compiled``)
MANY_TOKEN_FORM, TWO_PER_SM_FORM, FEW_TOKEN_FORM, TWO_TILE_FORM = "mma_ws", "mma_c2q18", "mma_q18", "mma_t2"
EXPECTS_WGMMA = False  # tests/test_lowering.py: mma.sync by design (m16n8k16 fits 16 heads)

_SRC = tc.FAST_EXP2_PRELUDE + WARP_MMA_PRELUDE + r"""
// timing builds (ABL 64): the cycles since c0 go to acc, and c0 moves on
__device__ __forceinline__ void fdsa_clock_lap(unsigned &acc, unsigned &c0) {
  const unsigned c1 = clock();
  acc += c1 - c0;
  c0 = c1;
}
// timing builds (ABL 64): a warp's six counter words at w
__device__ __forceinline__ void fdsa_put_counters(unsigned *w, unsigned a, unsigned b, unsigned c, unsigned d,
                                                  unsigned e, unsigned f) {
  w[0] = a;
  w[1] = b;
  w[2] = c;
  w[3] = d;
  w[4] = e;
  w[5] = f;
}
__device__ __forceinline__ void fdsa_mma_ldm(unsigned addr, unsigned *x) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(addr));
}
__device__ __forceinline__ void fdsa_mma_ldm_t(unsigned addr, unsigned *x) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(addr));
}

// The steps the per-warp kernels share (kernel_fwd_mma, kernel_fwd_mma_ws).  A pair of warps splits the dims: each
// leaves its QK partial (the two k-step chains summed) at xb[hh] ([hh][j][lane][4]) ...
__device__ __forceinline__ void fdsa_mma_xch_put(const float (&acc)[2][2][4], float *xb, int hh, int lane,
                                                 float (&part)[2][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[j][e] = acc[0][j][e] + acc[1][j][e];
#pragma unroll
  for (int j = 0; j < 2; ++j)
    *reinterpret_cast<float4 *>(xb + hh * 256 + (j * 32 + lane) * 4) =
        make_float4(part[j][0], part[j][1], part[j][2], part[j][3]);
}
// ... and after the pair's barrier adds the other's (a + b == b + a: both warps get the same S); -inf where invalid
__device__ __forceinline__ void fdsa_mma_xch_sum(const float (&part)[2][4], const int (&vd)[2][2], const float *xb,
                                                 int hh, int lane, float (&S)[2][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float4 ot = *reinterpret_cast<const float4 *>(xb + (1 - hh) * 256 + (j * 32 + lane) * 4);
    S[j][0] = vd[j][0] ? part[j][0] + ot.x : -FDSA_INF;
    S[j][1] = vd[j][1] ? part[j][1] + ot.y : -FDSA_INF;
    S[j][2] = vd[j][0] ? part[j][2] + ot.z : -FDSA_INF;
    S[j][3] = vd[j][1] ? part[j][3] + ot.w : -FDSA_INF;
  }
}
// the online softmax of rows r, r + 8 (identical in both warps; few O rescales: _warp_mma's notes), then (PV) the PV
// over this warp's 256 output dims: A = P (the S accumulator layout), B = V by ldmatrix.trans from the lane's address
template <int PV>
__device__ __forceinline__ void fdsa_mma_softmax_pv(const float (&S)[2][4], float c, float &m0, float &m1, float &t0,
                                                    float &t1, float &l0, float &l1, float (&o)[32][4],
                                                    unsigned v_addr) {
  float P[2][4];
  fdsa_lazy_softmax_step(S, c, m0, m1, t0, t1, l0, l1, P, [&](float al0, float al1) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      o[i][0] *= al0;
      o[i][1] *= al0;
      o[i][2] *= al1;
      o[i][3] *= al1;
    }
  });
  if (PV) {
    const unsigned a[4] = {fdsa_pack_bf16x2(P[0][0], P[0][1]), fdsa_pack_bf16x2(P[0][2], P[0][3]),
                           fdsa_pack_bf16x2(P[1][0], P[1][1]), fdsa_pack_bf16x2(P[1][2], P[1][3])};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      unsigned b[4];
      fdsa_mma_ldm_t(v_addr + 32 * i, b);
      fdsa_mma_bf16_16816(o[2 * i], a, b[0], b[1]);
      fdsa_mma_bf16_16816(o[2 * i + 1], a, b[2], b[3]);
    }
  }
}
// A single group's outputs for heads r / r + 8 of token tok (l summed over the quad): each warp its 256 dims of out,
// warp 0's quad leader lse (natural log, without the sink; +inf if empty) and max_logits (-inf if empty);
// inv = 1 / (l + 2^(sink log2 e - m c))
template <int H, int HAS_SINK>
__device__ __forceinline__ void fdsa_mma_store_group(const float (&o)[32][4], float m0, float m1, float t0, float t1,
                                                     float l0, float l1, float c, const float *Sink, void *Outv,
                                                     float *Lse, float *MaxLogits, int tok, int r, int q, int hh) {
  float sk0 = 0.f, sk1 = 0.f;
  if (HAS_SINK) {
    sk0 = exp2f(__fsub_rn(__fmul_rn(Sink[min(r, H - 1)], 1.4426950408889634f), __fmul_rn(m0, c)));
    sk1 = exp2f(__fsub_rn(__fmul_rn(Sink[min(r + 8, H - 1)], 1.4426950408889634f), __fmul_rn(m1, c)));
  }
  const float inv0 = l0 > 0.f ? 1.f / (l0 + sk0) : 0.f, inv1 = l1 > 0.f ? 1.f / (l1 + sk1) : 0.f;
  unsigned *out = static_cast<unsigned *>(Outv) + static_cast<long long>(tok) * H * 256;  // bf16 pairs
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    const int w = 128 * hh + 4 * n + q;
    if (r < H) out[r * 256 + w] = fdsa_pack_bf16x2(o[n][0] * inv0, o[n][1] * inv0);
    if (r + 8 < H) out[(r + 8) * 256 + w] = fdsa_pack_bf16x2(o[n][2] * inv1, o[n][3] * inv1);
  }
  if (hh == 0 && q == 0) {
    const long long b = static_cast<long long>(tok) * H;
    if (r < H) {
      Lse[b + r] = l0 > 0.f ? (log2f(l0) + m0 * c) * 0.6931471805599453f : FDSA_INF;
      MaxLogits[b + r] = l0 > 0.f ? t0 * c * 0.6931471805599453f : -FDSA_INF;
    }
    if (r + 8 < H) {
      Lse[b + r + 8] = l1 > 0.f ? (log2f(l1) + m1 * c) * 0.6931471805599453f : FDSA_INF;
      MaxLogits[b + r + 8] = l1 > 0.f ? t1 * c * 0.6931471805599453f : -FDSA_INF;
    }
  }
}

// The whole CTA (64 G T threads) for token tok: see the module notes of kernel_fwd_mma.py.
// ABL (timing builds, wrong results): 16 no PV, 32 no QK products, 64 per-warp clock counters instead of out (u32
// words 8 w + 0..5 of each token: cycles in the steps' mbarrier waits, in the exchange barriers, in the refill issue,
// the loop's total, the step count, from a wait's end to the barrier: QK + exchange store).
template <int H, int DQK, int HAS_SINK, int HAS_TL, int G, int NST, int QREG, int T, int QG, int ABL = 0>
__device__ __forceinline__ void fdsa_mma_kernel(
    const void *Qv, const void *KVv, int n_rows, const int *Indices, int topk, const int *TopkLen,
    const float *Sink, void *Outv, float *Lse, float *MaxLogits, void *stage_v, void *qs_v, float *xch, int *valid,
    float *misc, void *bars_v, int tok, float c) {
  constexpr int ROW = 2 * DQK, RS = ROW + 16, NROPE = (DQK - 512) / 32;  // rope k steps per warp: 2 or 0
  constexpr int W = 2 * T, RPW = 16 / W, BS = 32 / RPW;  // warps per group, rows each copies per step, steps per
                                                         // block of row numbers
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = warp / W, wg = warp % W, t = T == 1 ? 0 : wg >> 1, hh = wg & 1, r = lane >> 2, q = lane & 3;
  unsigned char *stage = static_cast<unsigned char *>(stage_v);
  const unsigned char *kv = static_cast<const unsigned char *>(KVv);
  const unsigned stage_s = static_cast<unsigned>(__cvta_generic_to_shared(stage));
  const unsigned qs_s = static_cast<unsigned>(__cvta_generic_to_shared(qs_v));
  const unsigned bars = static_cast<unsigned>(__cvta_generic_to_shared(bars_v));
  float *mlx = misc;               // [T][G][2][16]: each group's m and l per head of head tile t
  float *mtx = misc + T * G * 32;  // [T][G][16]: each group's true max score per head (max_logits)
  int lim = topk;
  if (HAS_TL) {
    lim = TopkLen[tok];
    lim = lim < 0 ? 0 : (lim > topk ? topk : lim);
  }
  const int nc = (lim + 15) >> 4;
  unsigned cyc_wait = 0, cyc_qk = 0, cyc_bar = 0, cyc_issue = 0, cyc_loop = 0;
  auto dbg_out = [&](int nst) {  // ABL 64: every thread is past its output writes
    __syncthreads();
    if (lane == 0)
      fdsa_put_counters(static_cast<unsigned *>(Outv) + static_cast<long long>(tok) * H * 256 + 8 * warp, cyc_wait,
                        cyc_bar, cyc_issue, cyc_loop, nst, cyc_qk);
  };
  const int nsteps = nc > g ? (nc - g + G - 1) / G : 0;
  const int *idx = Indices + static_cast<long long>(tok) * topk;

  // step s of this group: chunk g + G s into stage s % NST; lanes 0 .. RPW - 1 of each warp copy RPW of its 16
  // rows after writing the rows' flags.  Row numbers in blocks of BS steps (lane l: step BS k + l / RPW, row
  // l % RPW of the warp's share), loaded a block ahead of their use
  auto slot_row = [&](int step) -> int {
    const int slot = (g + G * step) * 16 + wg * RPW + lane % RPW;
    return slot < lim ? idx[slot] : -1;
  };
  auto block_rows = [&](int k) -> int { return slot_row(BS * k + lane / RPW); };
  auto issue = [&](int step, int row) {
    if (lane < RPW) {
      const int k = wg * RPW + lane, bi = g * NST + step % NST;
      const int ok = row >= 0 && row < n_rows;
      valid[bi * 16 + k] = ok;
      fdsa_bulk_row<ROW>(stage_s + (bi * 16 + k) * RS, kv + static_cast<long long>(ok ? row : 0) * ROW,
                        bars + bi * 8, ok, stage + (bi * 16 + k) * RS);
    }
  };
  static_assert(NST <= BS, "the prologue issues its steps from row block 0");
  int rows_cur = block_rows(0), rows_next = block_rows(1);
  for (int s = 0; s < NST && s < nsteps; ++s) issue(s, __shfl_sync(0xffffffffu, rows_cur, RPW * s + lane % RPW));
  // Q (heads past H -> 0) into shared memory, rows RS bytes apart (QG: straight into the fragments below)
  for (int i = tid; i < (QG ? 0 : 16 * T * (DQK / 8)); i += 64 * G * T) {
    const int h = i / (DQK / 8), p = i - h * (DQK / 8);
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (h < H) w = reinterpret_cast<const uint4 *>(static_cast<const unsigned short *>(Qv) +
                                                   (static_cast<long long>(tok) * H + h) * DQK)[p];
    *reinterpret_cast<uint4 *>(static_cast<unsigned char *>(qs_v) + h * RS + 16 * p) = w;
  }
  __syncthreads();

  float o[32][4];
#pragma unroll
  for (int i = 0; i < 32; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
  float m0 = -1e30f, m1 = -1e30f, t0 = -1e30f, t1 = -1e30f, l0 = 0.f, l1 = 0.f;
  // per-lane ldmatrix addresses.  A (Q, m16 x k16): lane l gives row l % 16, dims + 8 (l / 16).  B of QK (rows as
  // n, non-transposed): key l % 8 + 8 (l / 16), dims + 8 ((l / 8) % 2) -> {b0, b1} of keys 0-7, {b0, b1} of 8-15.
  // B of PV (transposed): key l % 8 + 8 ((l / 8) % 2), dims + 8 (l / 16) -> {b0, b1} of 8 dims, then the next 8
  const unsigned qa = qs_s + (16 * t + (lane & 15)) * RS + 16 * (lane >> 4) + 512 * hh;
  const unsigned qr = qs_s + (16 * t + (lane & 15)) * RS + 16 * (lane >> 4) + 1024 + 64 * hh;
  const unsigned ka = ((lane & 7) + 8 * (lane >> 4)) * RS + 16 * ((lane >> 3) & 1) + 512 * hh;
  const unsigned kr = ((lane & 7) + 8 * (lane >> 4)) * RS + 16 * ((lane >> 3) & 1) + 1024 + 64 * hh;
  const unsigned va = ((lane & 7) + 8 * ((lane >> 3) & 1)) * RS + 16 * (lane >> 4) + 512 * hh;
  constexpr int NQ = QREG < 16 + NROPE ? QREG : 16 + NROPE;  // k steps whose Q fragments stay in registers
  static_assert(!QG || NQ == 16 + NROPE, "Q from global memory: all of it in registers");
  unsigned qreg[NQ > 0 ? NQ : 1][4];  // the A fragments of k steps 0 .. NQ - 1, loaded once
  if (QG) {  // {a0, a1, a2, a3} = heads r / r + 8 of the tile, dims d + 2 q (+1) / d + 8 + 2 q (+1)
    const int h0 = 16 * t + r, h1 = h0 + 8;
    const unsigned *q0 = static_cast<const unsigned *>(Qv) + (static_cast<long long>(tok) * H + h0) * (DQK / 2);
    const unsigned *q1 = q0 + 4 * DQK;  // 8 heads on
#pragma unroll
    for (int s = 0; s < NQ; ++s) {
      const int d = (s < 16 ? 256 * hh + 16 * s : 512 + 32 * hh + 16 * (s - 16)) / 2 + q;
      qreg[s][0] = h0 < H ? q0[d] : 0u;
      qreg[s][1] = h1 < H ? q1[d] : 0u;
      qreg[s][2] = h0 < H ? q0[d + 4] : 0u;
      qreg[s][3] = h1 < H ? q1[d + 4] : 0u;
    }
  } else {
#pragma unroll
    for (int s = 0; s < NQ; ++s) fdsa_mma_ldm(s < 16 ? qa + 32 * s : qr + 32 * (s - 16), qreg[s]);
  }

  const unsigned c_loop = (ABL & 64) ? clock() : 0u;
  for (int it = 0; it < nsteps; ++it) {
    const int bi = g * NST + it % NST;
    unsigned c0 = (ABL & 64) ? clock() : 0u;
    fdsa_wait_parity(bars + bi * 8, (it / NST) & 1);
    if (ABL & 64) fdsa_clock_lap(cyc_wait, c0);
    const unsigned sb = stage_s + bi * 16 * RS;
    // ---- QK partial over this warp's dims: two chains per key n-tile (even / odd k steps)
    float acc[2][2][4];
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[e >> 3][(e >> 2) & 1][e & 3] = 0.f;
    if (!(ABL & 32)) {
#pragma unroll
      for (int s = 0; s < 16 + NROPE; ++s) {
        unsigned a[4], b[4];
        if (s >= NQ) fdsa_mma_ldm(s < 16 ? qa + 32 * s : qr + 32 * (s - 16), a);
        fdsa_mma_ldm(sb + (s < 16 ? ka + 32 * s : kr + 32 * (s - 16)), b);
        const unsigned *af = s < NQ ? qreg[s < NQ ? s : 0] : a;
        fdsa_mma_bf16_16816(acc[s & 1][0], af, b[0], b[1]);
        fdsa_mma_bf16_16816(acc[s & 1][1], af, b[2], b[3]);
      }
    }
    // the lane's S columns: keys 8 j + 2 q + b
    int vd[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int b = 0; b < 2; ++b) vd[j][b] = valid[bi * 16 + 8 * j + 2 * q + b];
    float part[2][4];
    // exchange the partials (a + b == b + a: both warps get the same S)
    float *xb = xch + ((g * T + t) * 2 + (it & 1)) * 512;  // [hh][j][lane][4]
    fdsa_mma_xch_put(acc, xb, hh, lane, part);
    if (ABL & 64) fdsa_clock_lap(cyc_qk, c0);
    asm volatile("bar.sync %0, %1;" :: "r"(8 + g), "r"(32 * W) : "memory");
    if (ABL & 64) fdsa_clock_lap(cyc_bar, c0);
    // the stage of step it - 1 is free (the group's warps are past its PV): refill it with step it + NST - 1
    if (it >= 1 && it + NST - 1 < nsteps) {
      const int st = it + NST - 1;
      if (st % BS == 0) {  // the first step of block st / BS: load block st / BS + 1
        rows_cur = rows_next;
        rows_next = block_rows(st / BS + 1);
      }
      issue(st, __shfl_sync(0xffffffffu, rows_cur, RPW * (st % BS) + lane % RPW));
    }
    if (ABL & 64) cyc_issue += clock() - c0;
    float S[2][4];
    fdsa_mma_xch_sum(part, vd, xb, hh, lane, S);
    fdsa_mma_softmax_pv<!(ABL & 16)>(S, c, m0, m1, t0, t1, l0, l1, o, sb + va);
  }
  if (ABL & 64) cyc_loop = clock() - c_loop;

  // ---- merge the groups
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  if (G == 1 && T == 1) {  // one group: both warps hold the final m, l; each stores its own dims
    fdsa_mma_store_group<H, HAS_SINK>(o, m0, m1, t0, t1, l0, l1, c, Sink, Outv, Lse, MaxLogits, tok, r, q, hh);
    if (ABL & 64) dbg_out(nsteps);
    return;
  }
  if (hh == 0 && q == 0) {
    float *ml = mlx + (t * G + g) * 32, *mt = mtx + (t * G + g) * 16;
    ml[r] = m0;
    ml[r + 8] = m1;
    ml[16 + r] = l0;
    ml[16 + r + 8] = l1;
    mt[r] = t0;
    mt[r + 8] = t1;
  }
  __syncthreads();  // every group is done: no copy in flight, the stages hold the merge buffer now
  float *mrg = reinterpret_cast<float *>(stage);  // [g][t][hh][n-tile 0..31][lane][4]
#pragma unroll
  for (int i = 0; i < 32; ++i)
    *reinterpret_cast<float4 *>(mrg + ((((g * T + t) * 2 + hh) * 32 + i) * 32 + lane) * 4) =
        make_float4(o[i][0], o[i][1], o[i][2], o[i][3]);
  __syncthreads();
  float wgt[G][2], inv0, inv1;
  constexpr int H1 = H > 16 ? H - 16 : 1;  // heads of tile 1 (T 2)
  if (t == 0)
    fdsa_groups_weights<G, (H < 16 ? H : 16), HAS_SINK>(mlx, Sink, r, c, wgt, inv0, inv1);
  else
    fdsa_groups_weights<G, H1, HAS_SINK>(mlx + G * 32, Sink + 16, r, c, wgt, inv0, inv1);
  // warp (g, t, hh) merges n-tiles g, g + G, .. of dim half hh: dims 256 hh + 8 n + 2 q (+1) of heads r and
  // r + 8 of tile t
  unsigned *out = static_cast<unsigned *>(Outv) + static_cast<long long>(tok) * H * 256;  // bf16 pairs
  for (int n = g; n < 32; n += G) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int gg = 0; gg < G; ++gg) {
      const float4 v = *reinterpret_cast<const float4 *>(mrg + ((((gg * T + t) * 2 + hh) * 32 + n) * 32 + lane) * 4);
      sum.x += v.x * wgt[gg][0];
      sum.y += v.y * wgt[gg][0];
      sum.z += v.z * wgt[gg][1];
      sum.w += v.w * wgt[gg][1];
    }
    const int w = 128 * hh + 4 * n + q;  // bf16-pair index of dims 256 hh + 8 n + 2 q, + 1 within a head
    if (16 * t + r < H) out[(16 * t + r) * 256 + w] = fdsa_pack_bf16x2(sum.x * inv0, sum.y * inv0);
    if (16 * t + r + 8 < H) out[(16 * t + r + 8) * 256 + w] = fdsa_pack_bf16x2(sum.z * inv1, sum.w * inv1);
  }
  fdsa_groups_lse<G, H, T>(mlx, mtx, tid, tok, c, Lse, MaxLogits);
  if (ABL & 64) dbg_out(nsteps);
}
"""


def form_shape(name: str) -> tuple:
    """(groups, stages, Q k steps in registers, head tiles, Q from global memory, ablate bits) of a form name: a
    ``FORMS`` key, optionally + "_a<N>" (timing builds)."""
    base, _, abl = name.partition("_a")
    if base not in FORMS or (abl and not abl.isdigit()):
        raise ValueError(f"sparse mma forward: unknown form {name!r}; expected one of {sorted(FORMS)} [+ '_a<N>']")
    return (*FORMS[base], int(abl or 0))


def build_sparse_mla_fwd_mma(*, heads: int, dqk: int, sm_scale: float, has_sink: bool = False,
                             has_topk_length: bool = False, form: str = DEFAULT_FORM):
    """prim_func (Q[T,H,dqk] bf16, KV[Tkv,dqk] bf16, Indices[T,topk] i32, TopkLen, Sink, Out[T,H,512] bf16,
    Lse[T,H] f32, MaxLogits[T,H] f32) for H <= 16 (16 T with a form of T head tiles), dqk in {512, 576}, any topk;
    ``form``: ``form_shape``."""
    groups, stages, qreg, tiles, qglobal, ablate = form_shape(form)
    lo = 1 if tiles == 1 else 17  # a second head tile only above 16 heads
    if not lo <= heads <= 16 * tiles:
        raise ValueError(f"sparse mma forward: H={heads} not in {lo}..{16 * tiles} (form {form!r} has {tiles} head "
                         f"tile(s) of 16)")
    if dqk not in (512, 576):
        raise ValueError(f"sparse mma forward: Dqk={dqk} not in (512, 576)")
    assert sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E
    bf16, f32, i32, u8 = "bfloat16", "float32", "int32", "uint8"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    row_stride = 2 * dqk + 16
    stage_bytes = groups * stages * CHUNK * row_stride
    assert stage_bytes >= groups * tiles * 2 * 32 * 32 * 16, form  # the merge buffer
    fn = (f"fdsa_mma_kernel<{heads}, {dqk}, {int(has_sink)}, {int(has_topk_length)}, {groups}, {stages}, {qreg}, "
          f"{tiles}, {qglobal}, {ablate}>")

    @T.prim_func
    def sparse_mla_fwd_mma(
        Q: T.Tensor([n_tok, heads, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D_V], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, threads=64 * groups * tiles, prelude=_SRC) as bx:
            Stage = T.alloc_shared([stage_bytes], u8)
            Qs = T.alloc_shared([16 if qglobal else 16 * tiles * row_stride], u8)
            Xch = T.alloc_shared([groups * tiles * 2 * 512], f32)
            Valid = T.alloc_shared([groups * stages * CHUNK], i32)
            Misc = T.alloc_shared([tiles * groups * 48], f32)
            bars = T.alloc_barrier([CHUNK] * (groups * stages))
            T.call_extern("handle", fn, T.address_of(Q[0, 0, 0]), T.address_of(KV[0, 0]), n_kv,
                          T.address_of(Indices[0, 0]), topk_dim, T.address_of(TopkLen[0]), T.address_of(Sink[0]),
                          T.address_of(Out[0, 0, 0]), T.address_of(Lse[0, 0]), T.address_of(MaxLogits[0, 0]),
                          T.address_of(Stage[0]), T.address_of(Qs[0]), T.address_of(Xch[0]),
                          T.address_of(Valid[0]), T.address_of(Misc[0]), T.address_of(bars[0]), bx,
                          c_log2)

    return sparse_mla_fwd_mma


def _pass_configs():
    return plain_pass_configs()


def _compiled(heads: int, dqk: int, d_v: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool,
              form: str = DEFAULT_FORM):
    """``kernel_fwd.launch``'s compiled-kernel signature; n_blocks is not a build parameter (dynamic trip count).
    ``form`` "mma_ws" (+ "_a<N>": a timing build): ``kernel_fwd_mma_ws`` (H <= 16)."""
    assert d_v == D_V, d_v
    base, _, abl = form.partition("_a")
    if base == "mma_ws":
        from . import kernel_fwd_mma_ws

        return kernel_fwd_mma_ws._build(heads, dqk, sm_scale, has_sink, has_topk_length, int(abl or 0))
    return _build(heads, dqk, sm_scale, has_sink, has_topk_length, form)


def dispatched(n_tok: int, device_index: int, heads: int = 16):
    """``_compiled`` with the form the dispatcher runs for ``n_tok`` tokens of ``heads`` heads on that CUDA device
    (shapes, not tensor values: the choice is fixed per call signature, so CUDA graphs replay it)."""
    from .. import _dispatch

    per_sm = n_tok / _dispatch.sm_count(device_index)
    if heads > 16:
        form = TWO_TILE_FORM
    elif per_sm >= 4:  # $FLASHDSA_MMA_MANY_TOKEN_FORM: another form (timing runs)
        form = os.environ.get("FLASHDSA_MMA_MANY_TOKEN_FORM") or MANY_TOKEN_FORM
    else:
        form = TWO_PER_SM_FORM if per_sm >= 2 else FEW_TOKEN_FORM
    return functools.partial(_compiled, form=form)


@functools.lru_cache(maxsize=64)
def _build(heads, dqk, sm_scale, has_sink, has_topk_length, form):
    func = build_sparse_mla_fwd_mma(heads=heads, dqk=dqk, sm_scale=sm_scale, has_sink=has_sink,
                                    has_topk_length=has_topk_length, form=form)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("mma_h16_d576_sink_tl", build_sparse_mla_fwd_mma(heads=16, dqk=576, sm_scale=576 ** -0.5, has_sink=True,
                                                          has_topk_length=True)),
        ("mma_g3_h3_d512", build_sparse_mla_fwd_mma(heads=3, dqk=512, sm_scale=0.05, form="mma_g3")),
        ("mma_t2_h24_d576_sink", build_sparse_mla_fwd_mma(heads=24, dqk=576, sm_scale=0.05, has_sink=True,
                                                          form="mma_t2")),
    ]


def _bench_variants(forms=("mma", "mma_g3"), json_path=None, note="", shapes=("prefill",), heads=16):
    """Kernel times at Dqk 576, topk 2048 (``python -m flashdsa.sparse.kernel_fwd_mma --variants [FORM ..]
    [--shapes prefill,sorted,decode] [--heads H] [--json PATH] [--note TEXT]``, H 16 by default; prefill: S 4096
    over SKV 8192 (sorted: each row's indices ascending, the suite's pattern), decode: 128 tokens over SKV
    65536): the narrow kernel, then each form, outputs compared with the narrow kernel's; rows written to
    ``json_path`` (benchmarks/results schema)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in shapes:
        S, SKV = {"prefill": (4096, 8192), "sorted": (4096, 8192), "decode": (128, 65536)}[shape]
        rows += _time_forms(forms, gen, S, SKV, heads, sort=shape == "sorted")
    if json_path:
        import datetime
        import json
        import os

        doc = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                   commit=os.environ.get("FLASHDSA_COMMIT", "unknown"), note=note, rows=rows)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)


def _time_forms(forms, gen, S, SKV, heads=16, topk=2048, sort=False):
    """``_bench_variants``' rows of one shape (random unique indices; ascending per row if ``sort``, as the suite's)."""
    from ..bench.flops import sparse_fwd_flops
    from ..bench.harness import time_fn
    from . import kernel_fwd, kernel_fwd_narrow

    q, kv, idx = kernel_fwd._prefill_inputs(gen, S=S, SKV=SKV, H=heads, topk=topk)
    if sort:
        idx = idx.sort(dim=-1).values.contiguous()
    flops = sparse_fwd_flops(heads, idx.numel(), 576, D_V)
    ref, rows = None, []
    for label in ("narrow",) + tuple(forms):
        compiled = kernel_fwd_narrow._compiled if label == "narrow" else functools.partial(_compiled, form=label)

        def fn(c=compiled):
            return kernel_fwd.launch(c, q, kv, idx, sm_scale=576**-0.5, d_v=D_V)

        out = fn()
        ref = out if ref is None else ref
        err = [(a.float() - b.float()).abs().max().item() for a, b in zip(out, ref)]
        t = time_fn(lambda _: fn(), [None], q.device, reps=10)
        tag = " sorted" if sort else ""
        print(f"variant S {S}{tag} H {heads} {label}: {t.ms_median:.4f} ms, {flops / t.ms_median / 1e9:.1f} TFLOP/s "
              f"(max |out / lse / max_logits difference| vs narrow {err[0]:.2e} / {err[1]:.2e} / {err[2]:.2e})",
              flush=True)
        rows.append(dict(case=f"S{S}_SKV{SKV}_H{heads}_topk{topk}_d576{tag.replace(' ', '_')}", variant=label,
                         ms=t.ms_median, tflops=flops / t.ms_median / 1e9, max_abs_diff_vs_narrow=err))
    return rows


if __name__ == "__main__":
    import sys

    argv = sys.argv[1:]
    if "--variants" in argv:
        opts = {k: argv[argv.index(k) + 1] for k in ("--json", "--note", "--shapes", "--heads") if k in argv}
        rest = [a for a in argv[argv.index("--variants") + 1:] if not a.startswith("-") and a not in opts.values()]
        _bench_variants(tuple(rest) or ("mma", "mma_g3"), opts.get("--json"), opts.get("--note", ""),
                        tuple(opts.get("--shapes", "prefill").split(",")), int(opts.get("--heads", 16)))
