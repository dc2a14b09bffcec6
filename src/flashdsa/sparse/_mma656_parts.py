"""CUDA device code of ``kernel_fwd_mma656`` (the few-head forward over the 656-byte FP8 cache): the helpers
(``M656_HELPERS``: the exact e4m3 -> f16 conversions and f16 ``mma.sync``, the PAR builds' row placement and the
WS builds' producer warp) and the per-CTA device function ``fdsa_m656_kernel`` (``M656_KERNEL_SRC``; its notes:
that module's docstring).  Concatenated into that kernel's prelude after its ``FDSA_M656_*`` defines (groups,
stages, row bytes).  ``PARITY_SLOT_SRC`` alone is also the row placement of ``scripts/row_gather_probe.py`` and
``scripts/bulk_issue_probe.py``."""

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

M656_KERNEL_SRC = r"""
// The whole CTA (256 threads; 384 in WS builds) for token tok: see the module notes of kernel_fwd_mma656.py.
// ABL (timing builds, wrong results): 1 no conversion in QK, 2 none in PV, 4 no Q loads per step, 8 no S exchange,
// 16 no PV at all, 32 no QK products at all, 64 timestamps instead of out (H 16; u32 words per token: 0 / 1 the
// globaltimer at entry, 2 after the prologue (6 / 7: warp 0's copies issued / Q' stored), 3 merge start (8 / 9 / 10:
// O stored, synced, weights), 4 end, 5 the globaltimer at the end, 64 + 32 w + it warp w's wait of step it done,
// 320 + .. its exchange barrier passed, 832 + w its loop end; clock64 deltas from entry in cycles)
// PAR 1: rows placed by fdsa_m656_parity_slot (the keys of a half-chunk permuted; the softmax does not care).
// WS 1 (384 threads): warps 8 + g copy group g's rows (lane l < 16: row l of each step, the row numbers one step
// ahead; setmaxnreg 24), the consumers (setmaxnreg 240) release a stage on its empty mbarrier (bars + 8 (G NST + bi),
// 2 arrivals) after its PV instead of issuing copies themselves
// OF32 1: Out is float32 (split-KV partials), stored as 16-byte pieces of 4 dims; qdiv: rows per q row
template <int H, int HAS_SINK, int HAS_TL, int ABL = 0, int PAR = 0, int WS = 0, int OF32 = 0>
__device__ __forceinline__ void fdsa_m656_kernel(
    const void *Qv, const void *KVv, int rs16, int n_rows, const int *Indices, int topk, const int *TopkLen,
    const float *Sink, void *Outv, float *Lse, float *MaxLogits, void *stage_v, void *qs_v, void *qr_v,
    float *xch, int *valid, float *misc, void *bars_v, int tok, float c, int qdiv = 1) {
  constexpr int G = FDSA_M656_G, NST = FDSA_M656_NST, ROW = FDSA_M656_ROW;
  auto token_lim = [&]() -> int {
    int lim = topk;
    if (HAS_TL) {
      lim = TopkLen[tok];
      lim = lim < 0 ? 0 : (lim > topk ? topk : lim);
    }
    return lim;
  };
  if (WS && static_cast<int>(threadIdx.x) >= 64 * G) {  // the producers first: no consumer value lives across
    fdsa_m656_producer<PAR>(static_cast<const unsigned char *>(KVv), static_cast<long long>(rs16) * 16, n_rows,
                            Indices + static_cast<long long>(tok) * topk, token_lim(), (threadIdx.x >> 5) - 2 * G,
                            threadIdx.x & 31, static_cast<unsigned char *>(stage_v), valid,
                            static_cast<unsigned>(__cvta_generic_to_shared(bars_v)));
    return;
  }
  int tid = threadIdx.x;
  if (WS) {  // (tid read again after setmaxnreg: ptxas kept the earlier read's warp and lane on the stack)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  }
  const int warp = tid >> 5, lane = tid & 31;
  const int g = warp >> 1, hh = warp & 1, r = lane >> 2, q = lane & 3;
  const long long t_entry = (ABL & 64) ? clock64() : 0;
  unsigned *dbg = static_cast<unsigned *>(Outv) + static_cast<long long>(tok) * 4096;
  auto stamp = [&](int at) {
    if ((ABL & 64) && lane == 0) dbg[at] = static_cast<unsigned>(clock64() - t_entry);
  };
  auto gtime = [&](int at) {
    unsigned long long gt;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
    dbg[at] = static_cast<unsigned>(gt);
    if (at == 0) dbg[1] = static_cast<unsigned>(gt >> 32);
  };
  if ((ABL & 64) && tid == 0) gtime(0);
  unsigned char *stage = static_cast<unsigned char *>(stage_v);
  const unsigned char *kv = static_cast<const unsigned char *>(KVv);
  unsigned char *qs = static_cast<unsigned char *>(qs_v);
  unsigned char *qr = static_cast<unsigned char *>(qr_v);
  const long long rs = static_cast<long long>(rs16) * 16;
  const unsigned bars = static_cast<unsigned>(__cvta_generic_to_shared(bars_v));
  float *qf = misc;                 // [2][16]: 2^e per (dim half, head)
  float *mlx = misc + 32;           // [G][2][16]: each group's m and l per head
  float *smx = misc + 32 + G * 32;  // [G][4]: each group's final scale reference per tile
  float *mtx = smx + G * 4;         // [G][16]: each group's true max score per head (max_logits)
  const int lim = token_lim();
  const int nc = (lim + 15) >> 4;
  const int nsteps = nc > g ? (nc - g + G - 1) / G : 0;
  const unsigned stage_s = static_cast<unsigned>(__cvta_generic_to_shared(stage));
  const int dpar = (stage_s >> 4) & 1;  // bit 4 of slot 0's shared address (the slots of a stage alternate)

  // step s of this group: chunk g + G s into stage s % NST; lanes 0-7 of each warp copy 8 of its 16 rows, one
  // cp.async.bulk each (an invalid slot's row is zeroed instead: nothing read), after writing the row's flag.
  // The row numbers come in blocks of 4 steps, one load per lane (lane l: step 4 k + l / 8, row l % 8 of the
  // warp's half), a block ahead of their use and handed to lanes 0-7 by a shuffle: a load per step issued one step
  // ahead put an L2 / DRAM round trip on every step's refill (session 33: 82.9 -> 79.2 us at B 128)
  auto slot_row = [&](int step) -> int {
    const int slot = (g + G * step) * 16 + hh * 8 + (lane & 7);
    return slot < lim ? Indices[static_cast<long long>(tok) * topk + slot] : -1;
  };
  auto block_rows = [&](int k) -> int { return slot_row(4 * k + (lane >> 3)); };
  auto issue = [&](int step, int row) {
    int j = lane;
    if (PAR) {  // the whole warp takes part in the ballot
      const size_t src = reinterpret_cast<size_t>(kv + (row >= 0 && row < n_rows ? row : 0) * rs);
      j = fdsa_m656_parity_slot<8>(static_cast<int>(src >> 4) & 1, lane, dpar);
    }
    if (lane < 8) {
      const int k = hh * 8 + j, bi = g * NST + step % NST;
      const int ok = row >= 0 && row < n_rows;
      valid[bi * 16 + k] = ok;
      fdsa_bulk_row<FDSA_M656_ROW>(stage_s + (bi * 16 + k) * ROW, kv + (ok ? row : 0) * rs, bars + bi * 8, ok,
                    stage + (bi * 16 + k) * ROW);
    }
  };
  static_assert(NST == 4, "the row blocks hold 4 steps: the prologue issues block 0");
  int rows_cur = WS ? 0 : block_rows(0), rows_next = WS ? 0 : block_rows(1);

  {  // Q' (f16, per-(half, head) power of two) and the bf16 rope into shared memory: 16 threads per head
    const int h = tid >> 4, p = tid & 15;
    uint4 w[4] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u),
                  make_uint4(0u, 0u, 0u, 0u)};
    uint2 rw = make_uint2(0u, 0u);
    if (h < H) {
      // qdiv > 1 (split-KV): qdiv consecutive rows (one token's chunks) share one q row
      const unsigned short *row =
          static_cast<const unsigned short *>(Qv) + (static_cast<long long>(tok / qdiv) * H + h) * 576;
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const uint4 *>(row + 32 * p)[i];
      rw = *reinterpret_cast<const uint2 *>(row + 512 + 4 * p);
    }
    // block 0's copies go out while Q's loads are in flight
    for (int s = 0; !WS && s < NST && s < nsteps; ++s)
      issue(s, __shfl_sync(0xffffffffu, rows_cur, 8 * s + (lane & 7)));
    if (warp == 0) stamp(6);
    const unsigned *wu = reinterpret_cast<const unsigned *>(w);
    float mx = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      mx = fmaxf(mx, fmaxf(fabsf(__uint_as_float(wu[i] << 16)), fabsf(__uint_as_float(wu[i] & 0xffff0000u))));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    const int ex = mx > 0.f ? static_cast<int>((__float_as_uint(mx) >> 23) & 255u) - 127 : 0;
    const int sh = max(-120, min(120, 13 - ex));  // the head's largest * 2^sh in [2^13, 2^14)
    const float up = __uint_as_float(static_cast<unsigned>(sh + 127) << 23);
    if ((p & 7) == 0) qf[(p >> 3) * 16 + h] = __uint_as_float(static_cast<unsigned>(127 - sh) << 23);
    // fragment-native layouts (one 16-byte load per lane and k step gives the m16n8k16 A fragment {a0, a1, a2, a3}
    // in order: no register moves before the mma): Q' unit (t, s, lane) holds, for lane (r, q), heads r / r + 8,
    // dims d, d + 1 (a0 / a1) and d + 2, d + 3 (a2 / a3) of d = 128 t + 32 q + 4 s -- the order the K fragments
    // take from the raw rows; this thread holds dims [32 p, +32) of head h (t = p / 4, q = p % 4)
    const int top = h >> 3;
    unsigned *qw = reinterpret_cast<unsigned *>(qs + (((p >> 2) * 8) * 32 + 4 * (h & 7) + (p & 3)) * 16) + top;
#pragma unroll
    for (int i = 0; i < 16; ++i) {  // f16 word i: dims 32 p + 2 i, + 1 (k step i / 2, low / high pair)
      const unsigned x = wu[i];
      qw[(i >> 1) * 128 + 2 * (i & 1)] =
          fdsa_m656_pack(__uint_as_float(x << 16) * up, __uint_as_float(x & 0xffff0000u) * up);
    }
    // the bf16 rope the same way: unit (s, lane) holds dims 16 q + 4 s (+1, +2, +3); this thread has dims [4 p, +4)
    unsigned *rp = reinterpret_cast<unsigned *>(qr + ((p & 3) * 32 + 4 * (h & 7) + (p >> 2)) * 16) + top;
    rp[0] = rw.x;
    rp[2] = rw.y;
    if (warp == 0) stamp(7);
  }
  fdsa_m656_sync<WS>();
  if (tid == 0) stamp(2);

  float o[2][16][4];
#pragma unroll
  for (int tt = 0; tt < 2; ++tt)
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[tt][i][e] = 0.f;
  float m0 = -1e30f, m1 = -1e30f, t0 = -1e30f, t1 = -1e30f, l0 = 0.f, l1 = 0.f, sref0 = 0.f, sref1 = 0.f;
  float sinv0 = 0.f, sinv1 = 0.f;
  const float qf0 = qf[hh * 16 + r], qf1 = qf[hh * 16 + r + 8];
  // per-thread byte offsets (the loads below add compile-time displacements only; session 32's ncu counted ~280 of
  // ~1,090 instructions per warp and step in recomputed index arithmetic): K / rope rows 8 j + r from byte 32 q of
  // the warp's tiles, V rows 2 q (+1, +8, +9) from byte 16 r, scales of rows 2 q (+1, +8, +9); the Q' fragment of
  // tile 2 hh + tt and k step s at qoff + (8 tt + s) 512, the rope's of k step s at roff + 512 s
  const int koff = r * ROW + 32 * q + 256 * hh, voff = 2 * q * ROW + 16 * r + 256 * hh;
  const int soff = 2 * q * ROW + 512 + 8 * hh;
  const int qoff = hh * 8192 + lane * 16, roff = lane * 16;

  for (int it = 0; it < nsteps; ++it) {
    const int bi = g * NST + it % NST;
    fdsa_wait_parity(bars + bi * 8, (it / NST) & 1);
    if (it < 32) stamp(64 + 32 * warp + it);
    const unsigned char *sb = stage + bi * 16 * ROW;
    // ---- QK partial over this warp's tiles 2 hh, 2 hh + 1 (+ the rope for hh 0)
    float acc[2][2][4];
#pragma unroll
    for (int tt = 0; tt < 2; ++tt) {  // tile 2 hh + tt
      if (ABL & 32) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[tt][e >> 2][e & 3] = 0.f;
        continue;
      }
      uint4 kw[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4 *kp = reinterpret_cast<const uint4 *>(sb + koff + 8 * j * ROW + 128 * tt);
        kw[j][0] = kp[0];
        kw[j][1] = kp[1];
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[tt][j][e] = 0.f;
      }
      const unsigned *kwu = reinterpret_cast<const unsigned *>(kw);
#pragma unroll
      for (int s = 0; s < 8; ++s) {  // k step s: the A fragment is one 16-byte load
        const uint4 qa = (ABL & 4) ? kw[s & 1][(s >> 1) & 1]
                                   : *reinterpret_cast<const uint4 *>(qs + qoff + (8 * tt + s) * 512);
        const unsigned a[4] = {qa.x, qa.y, qa.z, qa.w};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const unsigned x = kwu[j * 8 + s];
          const unsigned b0 = (ABL & 1) ? x : fdsa_m656_cvt(x);
          const unsigned b1 = (ABL & 1) ? x >> 16 : fdsa_m656_cvt_hi(x);
          fdsa_m656_mma_f16(acc[tt][j], a, b0, b1);
        }
      }
    }
    float accr[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if (hh == 0) {
      uint4 kr[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4 *kp = reinterpret_cast<const uint4 *>(sb + koff + 8 * j * ROW + 528);  // hh 0: koff has no 256
        kr[j][0] = kp[0];
        kr[j][1] = kp[1];
      }
      const unsigned *kru = reinterpret_cast<const unsigned *>(kr);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint4 qa = *reinterpret_cast<const uint4 *>(qr + roff + s * 512);
        const unsigned a[4] = {qa.x, qa.y, qa.z, qa.w};
#pragma unroll
        for (int j = 0; j < 2; ++j) fdsa_mma_bf16_16816(accr[j], a, kru[j * 8 + 2 * s], kru[j * 8 + 2 * s + 1]);
      }
    }
    // the lane's S columns: keys 8 j + 2 q + b (j, b in {0, 1}); their tile scales and flags
    float2 sc[2][2];
    int vd[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int key = 8 * j + 2 * q + b;
        sc[j][b] = *reinterpret_cast<const float2 *>(sb + soff + (8 * j + b) * ROW);
        vd[j][b] = valid[bi * 16 + key];
      }
    float part[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 s2 = sc[j][e & 1];
        float x = (acc[0][j][e] * s2.x + acc[1][j][e] * s2.y) * (e < 2 ? qf0 : qf1);
        if (hh == 0) x += accr[j][e];
        part[j][e] = x;
      }
    // exchange the partials: both warps add them in the same order
    float *xb = xch + (g * 2 + (it & 1)) * 512;  // [hh][j][lane][4]
#pragma unroll
    for (int j = 0; j < 2; ++j)
      *reinterpret_cast<float4 *>(xb + hh * 256 + (j * 32 + lane) * 4) =
          make_float4(part[j][0], part[j][1], part[j][2], part[j][3]);
    if (!(ABL & 8)) asm volatile("bar.sync %0, 64;" :: "r"(8 + g) : "memory");
    if (it < 32) stamp(320 + 32 * warp + it);
    // the stage of step it - 1 is free (both warps are past its PV): refill it with step it + NST - 1
    // (issuing it after the PV instead measured slower: 95.5 vs 94.0 us, session 32)
    if (!WS && it >= 1 && it + NST - 1 < nsteps) {
      const int st = it + NST - 1;
      if ((st & 3) == 0) {  // the first step of block st / 4: load block st / 4 + 1
        rows_cur = rows_next;
        rows_next = block_rows((st >> 2) + 1);
      }
      issue(st, __shfl_sync(0xffffffffu, rows_cur, 8 * (st & 3) + (lane & 7)));
    }
    float S[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float4 own = make_float4(part[j][0], part[j][1], part[j][2], part[j][3]);
      const float4 pa = (ABL & 8) ? own : *reinterpret_cast<const float4 *>(xb + (j * 32 + lane) * 4);
      const float4 pb = (ABL & 8) ? own : *reinterpret_cast<const float4 *>(xb + 256 + (j * 32 + lane) * 4);
      S[j][0] = vd[j][0] ? pa.x + pb.x : -FDSA_INF;
      S[j][1] = vd[j][1] ? pa.y + pb.y : -FDSA_INF;
      S[j][2] = vd[j][0] ? pa.z + pb.z : -FDSA_INF;
      S[j][3] = vd[j][1] ? pa.w + pb.w : -FDSA_INF;
    }
    // ---- online softmax (rows r, r + 8), identical in both warps.  The exp reference m moves only when a chunk's
    // max exceeds it by more than 2^8 in the exp2 domain (P <= 2^8: exact enough in f16 and fp32), so O is rescaled
    // on few steps (every max change rescaled on most steps at H 16: 14% of the instructions, session 32's ncu)
    float P[2][4];
    fdsa_lazy_softmax_step(S, c, m0, m1, t0, t1, l0, l1, P, [&](float al0, float al1) {
#pragma unroll
      for (int tt = 0; tt < 2; ++tt)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          o[tt][i][0] *= al0;
          o[tt][i][1] *= al0;
          o[tt][i][2] *= al1;
          o[tt][i][3] *= al1;
        }
    });
    // ---- PV for each of the warp's tiles
#pragma unroll
    for (int tt = 0; tt < ((ABL & 16) ? 0 : 2); ++tt) {  // tile t = 2 hh + tt
      float cm = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int b = 0; b < 2; ++b) cm = fmaxf(cm, vd[j][b] ? (tt ? sc[j][b].y : sc[j][b].x) : 0.f);
      cm = fdsa_quad_max(cm);  // the chunk's largest scale of tile t (the same in every lane)
      float &sref = tt ? sref1 : sref0, &inv = tt ? sinv1 : sinv0;  // inv = 1 / sref (0 while sref is 0)
      if (cm > sref) {
        if (sref > 0.f) {
          const float ratio = sref / cm;
#pragma unroll
          for (int i = 0; i < 16; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[tt][i][e] *= ratio;
        }
        sref = cm;
        inv = 1.f / cm;
      }
      float pv[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 s2 = sc[j][e & 1];
          pv[j][e] = P[j][e] * ((tt ? s2.y : s2.x) * inv);
        }
      const unsigned a[4] = {fdsa_m656_pack(pv[0][0], pv[0][1]), fdsa_m656_pack(pv[0][2], pv[0][3]),
                             fdsa_m656_pack(pv[1][0], pv[1][1]), fdsa_m656_pack(pv[1][2], pv[1][3])};
      // V: keys 2q, 2q + 1, 8 + 2q, 9 + 2q (the A fragment's k positions), dims [16 r, +16) of tile t
      uint4 vw[4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        vw[kk] = *reinterpret_cast<const uint4 *>(sb + voff + ((kk >> 1) * 8 + (kk & 1)) * ROW + 128 * tt);
      const unsigned *v0 = reinterpret_cast<const unsigned *>(&vw[0]), *v1 = reinterpret_cast<const unsigned *>(&vw[1]);
      const unsigned *v2 = reinterpret_cast<const unsigned *>(&vw[2]), *v3 = reinterpret_cast<const unsigned *>(&vw[3]);
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
        for (int hb = 0; hb < 2; ++hb) {  // bytes 2 hb, 2 hb + 1 of each word: n-tiles 4 wi + 2 hb, + 1
          const unsigned sel = hb ? 0x7362u : 0x5140u;
          const unsigned x = fdsa_m656_prmt(v0[wi], v1[wi], sel), y = fdsa_m656_prmt(v2[wi], v3[wi], sel);
          if (ABL & 2) {
            fdsa_m656_mma_f16(o[tt][4 * wi + 2 * hb], a, x, y);
            fdsa_m656_mma_f16(o[tt][4 * wi + 2 * hb + 1], a, x >> 16, y >> 16);
          } else {
            fdsa_m656_mma_f16(o[tt][4 * wi + 2 * hb], a, fdsa_m656_cvt(x), fdsa_m656_cvt(y));
            fdsa_m656_mma_f16(o[tt][4 * wi + 2 * hb + 1], a, fdsa_m656_cvt_hi(x), fdsa_m656_cvt_hi(y));
          }
        }
      }
    }
    if (WS) {  // both warps release the stage to the producer once every lane's reads of it are done
      __syncwarp();
      if (lane == 0)
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bars + (G * NST + bi) * 8) : "memory");
    }
  }

  stamp(832 + warp);
  // ---- merge the four groups
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  if (hh == 0 && q == 0) {
    mlx[g * 32 + r] = m0;
    mlx[g * 32 + r + 8] = m1;
    mlx[g * 32 + 16 + r] = l0;
    mlx[g * 32 + 16 + r + 8] = l1;
    mtx[g * 16 + r] = t0;
    mtx[g * 16 + r + 8] = t1;
  }
  if (lane == 0) {
    smx[g * 4 + 2 * hh] = sref0;
    smx[g * 4 + 2 * hh + 1] = sref1;
  }
  fdsa_m656_sync<WS>();  // every group is done: no copy in flight, the stages hold the merge buffer now
  if (tid == 0) stamp(3);
  float *mrg = reinterpret_cast<float *>(stage);  // [g][hh][fragment 0..31][lane][4]
#pragma unroll
  for (int tt = 0; tt < 2; ++tt)
#pragma unroll
    for (int i = 0; i < 16; ++i)
      *reinterpret_cast<float4 *>(mrg + (((g * 2 + hh) * 32 + tt * 16 + i) * 32 + lane) * 4) =
          make_float4(o[tt][i][0], o[tt][i][1], o[tt][i][2], o[tt][i][3]);
  if (tid == 0) stamp(8);
  fdsa_m656_sync<WS>();
  if (tid == 0) stamp(9);
  float wgt[G][2], inv0, inv1;
  fdsa_groups_weights<G, H, HAS_SINK>(mlx, Sink, r, c, wgt, inv0, inv1);
  // warp (g, hh) merges fragments [4 g, 4 g + 4) of tiles 2 hh and 2 hh + 1: for tile t, dims 128 t + 32 q + 4 g
  // (+ 0..3, and + 16) of heads r and r + 8, stored straight to global as 8-byte pieces (session 34: a bf16 staging
  // tile in shared memory with 2-byte stores took 2.8 us per CTA, 16-way bank conflicts; the output is 16 KB)
  unsigned short *out = static_cast<unsigned short *>(Outv) + static_cast<long long>(tok) * H * 512;
  if (tid == 0) stamp(10);
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const int t = 2 * hh + tt;
    float sum[4][4];  // [f][x, y, z, w]
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const int fr = tt * 16 + 4 * g + f;
#pragma unroll
      for (int e = 0; e < 4; ++e) sum[f][e] = 0.f;
#pragma unroll
      for (int gg = 0; gg < G; ++gg) {
        const float4 v = *reinterpret_cast<const float4 *>(mrg + (((gg * 2 + hh) * 32 + fr) * 32 + lane) * 4);
        const float s = smx[gg * 4 + t], f0 = s * wgt[gg][0], f1 = s * wgt[gg][1];
        sum[f][0] += v.x * f0;
        sum[f][1] += v.y * f0;
        sum[f][2] += v.z * f1;
        sum[f][3] += v.w * f1;
      }
    }
    unsigned pk[4][2];  // bf16 pairs (dims f = 2 p, 2 p + 1) of x, y, z, w
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float sinv = e < 2 ? inv0 : inv1;
#pragma unroll
      for (int p2 = 0; p2 < 2; ++p2) {
        const float hi = sum[2 * p2 + 1][e] * sinv, lo = sum[2 * p2][e] * sinv;
        pk[e][p2] = fdsa_pack_bf16x2(lo, hi);
      }
    }
    const int d0 = 128 * t + 32 * q + 4 * g;
    if (OF32) {
      float *outf = static_cast<float *>(Outv) + static_cast<long long>(tok) * H * 512;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = r + (e < 2 ? 0 : 8), d = d0 + (e & 1) * 16;
        const float sinv = e < 2 ? inv0 : inv1;
        if (hr < H)
          *reinterpret_cast<float4 *>(outf + hr * 512 + d) =
              make_float4(sum[0][e] * sinv, sum[1][e] * sinv, sum[2][e] * sinv, sum[3][e] * sinv);
      }
    } else if (!(ABL & 64)) {
      if (r < H) {
        *reinterpret_cast<uint2 *>(out + r * 512 + d0) = make_uint2(pk[0][0], pk[0][1]);
        *reinterpret_cast<uint2 *>(out + r * 512 + d0 + 16) = make_uint2(pk[1][0], pk[1][1]);
      }
      if (r + 8 < H) {
        *reinterpret_cast<uint2 *>(out + (r + 8) * 512 + d0) = make_uint2(pk[2][0], pk[2][1]);
        *reinterpret_cast<uint2 *>(out + (r + 8) * 512 + d0 + 16) = make_uint2(pk[3][0], pk[3][1]);
      }
    }
  }
  if ((ABL & 64) && tid == 0) {
    stamp(4);
    gtime(5);
  }
  fdsa_groups_lse<G, H>(mlx, mtx, tid, tok, c, Lse, MaxLogits);
}
"""
