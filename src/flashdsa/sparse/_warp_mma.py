"""CUDA shared by the per-warp ``mma.sync`` forwards (``kernel_fwd_mma``: bf16 rows; ``kernel_fwd_mma656``: the
656-byte FP8 cache).

Both run ``G`` key groups per CTA (two warps each, its own online softmax over the rows of heads ``r`` and ``r + 8``
of an ``m16n8k16`` fragment) and merge the groups at the end, as split-KV.  The merge state per group lives in shared
memory: ``mlx[g * 32 + h]`` the exp reference m and ``mlx[g * 32 + 16 + h]`` the sum l of head h (exp2 domain, scores
times ``c = sm_scale * log2(e)``), ``mtx[g * 16 + h]`` the true running max score (max_logits).
"""

WARP_MMA_PRELUDE = r"""
#define FDSA_INF __int_as_float(0x7f800000)
__device__ __forceinline__ void fdsa_wait_parity(unsigned bar, unsigned parity) {  // spin on an mbarrier phase
  asm volatile("{\n\t.reg .pred p;\n\tWAIT:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra WAIT;\n\t}\n"
               :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ float fdsa_quad_max(float x) {  // over the 4 lanes of a quad
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ unsigned fdsa_pack_bf16x2(float lo, float hi) {  // bf16x2 {lo, hi}, round to nearest
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ void fdsa_mma_bf16_16816(float *c, const unsigned *a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// One 16-key step of the lazy online softmax of rows r / r + 8.  S: the scores in the m16n8k16 accumulator layout of
// two key n-tiles (-inf where invalid), identical in the pair's two warps.  The exp reference m moves only when the
// chunk's max exceeds it by more than 2^8 in the exp2 domain (so P <= 2^8), and then rescale(al0, al1) rescales the
// caller's O; t keeps the true running max (max_logits), l the row sums; P = 2^(S c - m c).
template <typename Rescale>
__device__ __forceinline__ void fdsa_lazy_softmax_step(const float (&S)[2][4], float c, float &m0, float &m1,
                                                       float &t0, float &t1, float &l0, float &l1, float (&P)[2][4],
                                                       Rescale rescale) {
  const float mx0 = fdsa_quad_max(fmaxf(fmaxf(S[0][0], S[0][1]), fmaxf(S[1][0], S[1][1])));
  const float mx1 = fdsa_quad_max(fmaxf(fmaxf(S[0][2], S[0][3]), fmaxf(S[1][2], S[1][3])));
  t0 = fmaxf(t0, mx0);
  t1 = fmaxf(t1, mx1);
  const bool up0 = (mx0 - m0) * c > 8.f, up1 = (mx1 - m1) * c > 8.f;
  if (__any_sync(0xffffffffu, up0 || up1)) {
    const float n0 = up0 ? mx0 : m0, n1 = up1 ? mx1 : m1;
    const float al0 = fdsa_ex2((m0 - n0) * c), al1 = fdsa_ex2((m1 - n1) * c);
    m0 = n0;
    m1 = n1;
    l0 *= al0;
    l1 *= al1;
    rescale(al0, al1);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) P[j][e] = fdsa_ex2(fmaf(S[j][e], c, -(e < 2 ? m0 : m1) * c));
  l0 += (P[0][0] + P[0][1]) + (P[1][0] + P[1][1]);
  l1 += (P[0][2] + P[0][3]) + (P[1][2] + P[1][3]);
}
// One row of ROW bytes into a stage row at shared address dst, counted on the mbarrier at shared address bar; an
// invalid row (ok 0) is zeroed instead (nothing read).  No proxy fence before a copy: the stage's earlier generic
// reads are ordered before it by the group's barrier (WAR, as CUTLASS's TMA pipelines); only the zero fill's generic
// writes need one before a later copy into the same row (always by the same thread).
template <int ROW>
__device__ __forceinline__ void fdsa_bulk_row(unsigned dst, const void *src, unsigned bar, int ok, void *dst_g) {
  if (ok) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(ROW) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(ROW), "r"(bar) : "memory");
  } else {
#pragma unroll
    for (int k = 0; k < ROW / 16; ++k) reinterpret_cast<uint4 *>(dst_g)[k] = make_uint4(0u, 0u, 0u, 0u);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
  }
}
// The merge weights of the G groups for heads r and r + 8 (wgt[g][0 / 1] = 2^(m_g - M) per head) and the output
// normalisers inv = 1 / (L + 2^(sink log2 e - M c)) (0 for a head without any valid key)
template <int G, int H, int HAS_SINK>
__device__ __forceinline__ void fdsa_groups_weights(const float *mlx, const float *Sink, int r, float c,
                                                    float (*wgt)[2], float &inv0, float &inv1) {
  float M0 = -1e30f, M1 = -1e30f;
#pragma unroll
  for (int gg = 0; gg < G; ++gg) {
    M0 = fmaxf(M0, mlx[gg * 32 + r]);
    M1 = fmaxf(M1, mlx[gg * 32 + r + 8]);
  }
  float L0 = 0.f, L1 = 0.f;
#pragma unroll
  for (int gg = 0; gg < G; ++gg) {
    wgt[gg][0] = fdsa_ex2((mlx[gg * 32 + r] - M0) * c);
    wgt[gg][1] = fdsa_ex2((mlx[gg * 32 + r + 8] - M1) * c);
    L0 += mlx[gg * 32 + 16 + r] * wgt[gg][0];
    L1 += mlx[gg * 32 + 16 + r + 8] * wgt[gg][1];
  }
  float sk0 = 0.f, sk1 = 0.f;
  if (HAS_SINK) {
    sk0 = exp2f(__fsub_rn(__fmul_rn(Sink[min(r, H - 1)], 1.4426950408889634f), __fmul_rn(M0, c)));
    sk1 = exp2f(__fsub_rn(__fmul_rn(Sink[min(r + 8, H - 1)], 1.4426950408889634f), __fmul_rn(M1, c)));
  }
  inv0 = L0 > 0.f ? 1.f / (L0 + sk0) : 0.f;
  inv1 = L1 > 0.f ? 1.f / (L1 + sk1) : 0.f;
}
// Thread tid < H writes head tid's natural-log lse (without the sink; +inf if empty) and max_logits (-inf if empty);
// T head tiles of 16: tile t's state at mlx + 32 G t, mtx + 16 G t
template <int G, int H, int T = 1>
__device__ __forceinline__ void fdsa_groups_lse(const float *mlx, const float *mtx, int tid, int tok, float c,
                                                float *Lse, float *MaxLogits) {
  if (tid < H) {
    const int hl = T == 1 ? tid : tid & 15;
    if (T > 1) {
      mlx += (tid >> 4) * G * 32;
      mtx += (tid >> 4) * G * 16;
    }
    float M = -1e30f, L = 0.f, Mt = -1e30f;
    for (int gg = 0; gg < G; ++gg) {
      M = fmaxf(M, mlx[gg * 32 + hl]);
      Mt = fmaxf(Mt, mtx[gg * 16 + hl]);
    }
    for (int gg = 0; gg < G; ++gg) L += mlx[gg * 32 + 16 + hl] * exp2f((mlx[gg * 32 + hl] - M) * c);
    Lse[static_cast<long long>(tok) * H + tid] = L > 0.f ? (log2f(L) + M * c) * 0.6931471805599453f : FDSA_INF;
    MaxLogits[static_cast<long long>(tok) * H + tid] = L > 0.f ? Mt * c * 0.6931471805599453f : -FDSA_INF;
  }
}
"""
