"""CUDA preludes of ``kernel_fwd_pair_cache`` (the pair schedule over the 656-byte FP8 cache):
``_DEQUANT_SRC``, the exact e4m3 -> bf16 conversion (also ``kernel_fwd_narrow656``'s prelude), and
``_CONVERTER_SRC``, the converter stagings' raw-row gather and in-place half-tile conversion (concatenated
after ``_tl_common.ROW_GATHER_PRELUDE``).  Layouts, stagings and measurements: the module notes of
``kernel_fwd_pair_cache``."""

_DEQUANT_SRC = r"""
// 16 e4m3 (4 words) -> bf16(float(e4m3) * s) (8 words), exact for the format's power-of-two scales: each byte
// (s eeee mmm) goes straight to the bf16 bits s 0000 eeee mmm 0000 -- one prmt sign-replicating each byte into its
// 16-bit lane, a shift and a mask -- which read value * 2^-120 (e4m3 subnormals become bf16 subnormals, exact),
// then one exact bf16x2 multiply by 2^120 * s (two, 2^120 then s, for s > 2^7 where 2^120 * s is no bf16).
// (Session 22; before: cvt.rn.f16x2.e4m3x2 and the f16 bits moved to bf16 positions, one instruction more per
// pair.  A NaN e4m3 would come out finite: the format's writer never stores one in a row.)
// ONE: the caller knows s <= 2^7 (one multiply; "converter_contig" takes this path for a warp none of whose rows has
// a larger scale, so the second multiply is neither issued nor predicated).
template <int ONE = 0>
__device__ __forceinline__ void fdsa_cvt_e4m3x16(const unsigned in[4], unsigned o[8], float s) {
  const bool one = ONE || s <= 128.0f;
  unsigned m1, m2;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(m1) : "f"(one ? s * 1.329227995784916e36f : 1.329227995784916e36f));
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(m2) : "f"(s));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      unsigned x, b;
      asm("prmt.b32 %0, %1, 0, %2;" : "=r"(x) : "r"(in[i]), "r"(k ? 0xB3A2u : 0x9180u));
      const unsigned y = (x << 4) & 0x87f087f0u;
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


# The converter staging (``staging="converter"``, session 21): a fourth warpgroup converts each landed half tile
# in place while the consumers run the bf16 pair kernel's protocol unchanged, and the producer copies the raw
# bytes by rows (8 threads per row, as the bf16 kernel's ``row_gather``).
_CONVERTER_SRC = r"""
// The raw half tile (128 producer threads).  In place (CONTIG 0, staging "converter"): e4m3 chunk k of a row (16
// bytes, dims 16k .. 16k + 15 of the half) into the slots of dims [16k, 16k + 8) (chunk k / 4, piece 2 (k % 4) of
// the 128B-swizzled bf16 half), the row's 16 bytes of scales (byte 512) into dims [8, 16) (piece 1 of chunk 0).
// Contiguous (CONTIG 1, staging "converter_contig", timing build "contig_no_convert"): a row's 256 raw bytes in order
// in the row's first 256 bytes (raw chunk k: chunk k / 8, piece k % 8; 8 lanes fill one 128-byte swizzled row as the
// bf16 gather does), the scales at bytes [256, 272) (chunk 2, piece 0).  Session 21: the in-place layout's
// every-other-slot destinations cost the raw copies 32 L2 sectors per instruction against 16 ideal; landing
// contiguously, the kernel without conversion ran 4.04 ms against 5.24 (S 4096 / SKV 8192 / H 128).  Both: the bf16
// rope (bytes 528 .. 655) into the rope tile; thread t: rows t / 8 + 16 j (-1 invalid: zero fill, nothing read),
// chunks t % 8 and t % 8 + 8 from chunk0, rope piece t % 8, the scales on t % 8 == 0.
template <int CONTIG>
__device__ __forceinline__ void fdsa_gather_raw656(void *tile, void *rope, int has_rope, const void *kv,
                                                   int row_bytes, int chunk0, const int *rows, int t) {
  const int g = t >> 3, q = t & 7;
  const unsigned tile_s = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  const unsigned rope_s = static_cast<unsigned>(__cvta_generic_to_shared(rope));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = g + 16 * j, row = rows[r], sz = row >= 0 ? 16 : 0;
    const char *base = fdsa_row_ptr(kv, row, row_bytes);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = q + 8 * h;
      const unsigned dst = CONTIG ? h * 8192 + fdsa_swz128(r, q) : (k >> 2) * 8192 + fdsa_swz128(r, 2 * (k & 3));
      fdsa_cp16(tile_s + dst, base + (chunk0 + k) * 16, sz);
    }
    if (q == 0) fdsa_cp16(tile_s + (CONTIG ? 2 * 8192 + fdsa_swz128(r, 0) : fdsa_swz128(r, 1)), base + 512, sz);
    if (has_rope) fdsa_cp16(rope_s + fdsa_swz128(r, q), base + 528 + q * 16, sz);
  }
}
// x, opaque to the compiler: a per-call value, so what a helper derives from its thread index is recomputed at
// each call instead of hoisted out of the pair loop (the hoisted per-store addresses stayed live and spilled)
__device__ __forceinline__ unsigned fdsa_opaque(unsigned x) {
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
  return x;
}
// byte address of 16-byte piece q of chunk c of row r (row_s = tile + r * 128) in a 128B-swizzled half tile
__device__ __forceinline__ unsigned fdsa_piece(unsigned row_s, int r, int c, int q) {
  return row_s + c * 8192 + ((q ^ (r & 7)) << 4);
}
__device__ __forceinline__ void fdsa_ld16(unsigned a, unsigned w[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(a)
               : "memory");
}
// raw chunk (16 e4m3, loaded) -> its 32 bf16 bytes at piece address lo (dims 16k .. 16k + 7) and lo ^ 16 (the
// piece after it: the swizzle XOR keeps the pair of pieces 2m, 2m + 1 together)
template <int ONE = 0>
__device__ __forceinline__ void fdsa_st_cvt(unsigned lo, const unsigned w[4], float s) {
  unsigned o[8];
  fdsa_cvt_e4m3x16<ONE>(w, o, s);
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(lo), "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3])
               : "memory");
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(lo ^ 16u), "r"(o[4]), "r"(o[5]), "r"(o[6]), "r"(o[7])
               : "memory");
}
// The converter's share of one contiguous raw half tile, expanded in place (128 converter threads): thread t takes
// row r = t / 2 and, p = t % 2, the raw chunks 8 c + 4 p + m (c = 0, 1: swizzle chunk c and scale tile tile0 + c;
// m = 0..3), loads all eight into registers, then -- once every raw byte its outputs overwrite was read --
// converts and stores them (output chunk k at pieces 2 (k & 3), 2 (k & 3) + 1 of 64-dim chunk k >> 2, i.e. chunk
// 2 c + p, piece 2 m).  Step j (c = j >> 2) takes m = (j + 2 p) & 3, so the 8 threads of a quarter warp (4 rows x
// both parts) load from and store to 8 different 16-byte bank groups.  A row's outputs overwrite only that row's
// raw bytes and scales; the thread index goes through fdsa_opaque (the addresses stay in the pair loop).
// "converter_contig" (the default): all loads, a __syncwarp (a row's two threads are lanes of one warp, and a row's
// outputs overwrite only that row's raw bytes; a named barrier of the 128 threads before session 27), all stores; a
// warp none of whose rows has a scale above 2^7 (a vote) converts with one multiply per pair
// (``fdsa_cvt_e4m3x16<1>``): session 27, S 4096 / H 128 5.62 -> 5.46 ms at SKV 8192, sparse FP8 decode H 64 0.1226 ->
// 0.1119 ms (the vote did it: the __syncwarp alone measured 5.60 / 0.1223).  (Session 21's phased form, three named
// barriers per half, ran 6.64 ms at S 4096 / SKV 8192 / H 128.)
template <int ONE>
__device__ __forceinline__ void fdsa_store_half_contig(unsigned row_s, int r, int p, const unsigned w[8][4],
                                                       const float s[2]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
    fdsa_st_cvt<ONE>(fdsa_piece(row_s, r, 2 * (j >> 2) + p, 2 * ((j + 2 * p) & 3)), w[j], s[j >> 2]);
}
__device__ __forceinline__ void fdsa_convert_half_contig(void *half, int tile0, int t_in) {
  const int t = static_cast<int>(fdsa_opaque(static_cast<unsigned>(t_in)));
  const int r = t >> 1, p = t & 1;
  const unsigned row_s = static_cast<unsigned>(__cvta_generic_to_shared(half)) + r * 128;
  float s[2];
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(s[0]), "=f"(s[1]) : "r"(fdsa_piece(row_s, r, 2, 0) + 4 * tile0)
               : "memory");
  unsigned w[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) fdsa_ld16(fdsa_piece(row_s, r, j >> 2, 4 * p + ((j + 2 * p) & 3)), w[j]);
  __syncwarp();
  if (!__any_sync(0xffffffffu, !(s[0] <= 128.0f && s[1] <= 128.0f)))
    fdsa_store_half_contig<1>(row_s, r, p, w, s);
  else
    fdsa_store_half_contig<0>(row_s, r, p, w, s);
}
// The converter's share of one landed raw half tile, in place (128 converter threads): thread t takes row t / 2,
// chunks [8 p, 8 p + 8) (p = t % 2: the row's 128-dim scale tile tile0 + p), two chunks per step with both loads
// before the stores (four spill at the converter's 56 registers); part 1 walks its chunks rotated by two, so the
// 8 threads of a quarter warp (rows 4i .. 4i + 3 x both parts) touch 8 different 16-byte bank groups.  Both threads
// of a row read their scale before the warp barrier: part 0's chunk 0 overwrites the scale slots.
__device__ __forceinline__ void fdsa_convert_half(void *half, int tile0, int t) {
  const int r = t >> 1, p = t & 1;
  const unsigned row_s = static_cast<unsigned>(__cvta_generic_to_shared(half)) + r * 128;
  float s;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(s) : "r"(fdsa_piece(row_s, r, 0, 1) + 4 * (tile0 + p)) : "memory");
  __syncwarp();
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    unsigned lo[2], w[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int k = 8 * p + ((2 * g + i + 2 * p) & 7);
      lo[i] = fdsa_piece(row_s, r, k >> 2, 2 * (k & 3));
      fdsa_ld16(lo[i], w[i]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) fdsa_st_cvt(lo[i], w[i], s);
  }
}
"""
