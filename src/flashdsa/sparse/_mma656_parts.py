"""CUDA device helpers of ``kernel_fwd_mma656`` (the few-head forward over the 656-byte FP8 cache): the exact e4m3 ->
f16 conversions and f16 ``mma.sync``, the PAR builds' row placement and the WS builds' producer warp.  Concatenated
into that kernel's prelude after its ``FDSA_M656_*`` defines (groups, stages, row bytes).  ``PARITY_SLOT_SRC`` alone
is also the row placement of ``scripts/row_gather_probe.py`` and ``scripts/bulk_issue_probe.py``."""

PARITY_SLOT_SRC = r"""
// PAR builds: the slot (0..N-1) among the N its warp copies for lane l's row (lanes 0..N-1; cls: bit 4 of the
// row's source address; dpar: that bit of slot 0's shared address).  A bulk copy whose shared destination is 16
// bytes off its source modulo 32 moves ~14% slower (session 40, scripts/bulk_issue_probe.py); the slots alternate in
// that bit (656 = 41 x 16), so each row takes a slot of its own class by rank, and only the rows beyond N / 2 of one
// class take the other class's free slots.  The whole warp calls it (ballot)
template <int N>
__device__ __forceinline__ int fdsa_m656_parity_slot(int cls, int lane, int dpar) {
  constexpr unsigned ALL = (1u << N) - 1u;
  const unsigned odd = __ballot_sync(0xffffffffu, cls) & ALL;
  const unsigned mine = cls ? odd : ~odd & ALL;
  const int rank = __popc(mine & ((1u << (lane & (N - 1))) - 1u));
  if (rank < N / 2) return 2 * rank + (cls ^ dpar);
  return 2 * (rank - N / 2 + N - __popc(mine)) + (cls ^ 1 ^ dpar);  // after the other class's own rows
}
"""

M656_HELPERS = PARITY_SLOT_SRC + r"""
__device__ __forceinline__ unsigned fdsa_m656_cvt(unsigned v) {  // the low two e4m3 bytes of v -> f16x2 (exact)
  unsigned r;
  const unsigned short h = (unsigned short)(v & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
  return r;
}
// the high two e4m3 bytes of v -> f16x2, the half taken by the PTX unpack (ptxas may read it as a register half
// instead of shifting first)
__device__ __forceinline__ unsigned fdsa_m656_cvt_hi(unsigned v) {
  unsigned r;
  asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;\n\t}" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ unsigned fdsa_m656_pack(float lo, float hi) {  // f16x2 {lo, hi}
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned fdsa_m656_prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ void fdsa_m656_mma_f16(float *c, const unsigned *a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// the consumers' CTA-wide barrier: all threads, or the 256 consumer threads of a WS build (its producers return early)
template <int WS>
__device__ __forceinline__ void fdsa_m656_sync() {
  if (WS)
    asm volatile("bar.sync 1, 256;" ::: "memory");
  else
    __syncthreads();
}
// WS builds: the producer warp of group gp (see fdsa_m656_kernel's WS); lim: the token's valid top-k slots
template <int PAR>
__device__ __forceinline__ void fdsa_m656_producer(const unsigned char *kv, long long rs, int n_rows,
                                                   const int *idx, int lim, int gp, int lane, unsigned char *stage,
                                                   int *valid, unsigned bars) {
  constexpr int G = FDSA_M656_G, NST = FDSA_M656_NST, ROW = FDSA_M656_ROW;
  asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
  const unsigned stage_s = static_cast<unsigned>(__cvta_generic_to_shared(stage));
  const int dpar = (stage_s >> 4) & 1, nc = (lim + 15) >> 4, np = nc > gp ? (nc - gp + G - 1) / G : 0;
  auto prow = [&](int step) -> int {
    const int slot = (gp + G * step) * 16 + (lane & 15);
    return step < np && slot < lim ? idx[slot] : -1;
  };
  int row = prow(0);
  for (int it = 0; it < np; ++it) {
    const int nrow = prow(it + 1), bi = gp * NST + it % NST;
    if (it >= NST) fdsa_wait_parity(bars + (G * NST + bi) * 8, ((it / NST) - 1) & 1);
    const int ok = row >= 0 && row < n_rows;
    const unsigned char *src = kv + (ok ? row : 0) * rs;
    const int k =
        PAR ? fdsa_m656_parity_slot<16>(static_cast<int>(reinterpret_cast<size_t>(src) >> 4) & 1, lane, dpar) : lane;
    if (lane < 16) {
      valid[bi * 16 + k] = ok;
      fdsa_bulk_row<ROW>(stage_s + (bi * 16 + k) * ROW, src, bars + bi * 8, ok, stage + (bi * 16 + k) * ROW);
    }
    row = nrow;
  }
}
"""
