"""CUDA pieces of the FP8 pair forward's transposed PV (``kernel_fwd_pair_fp8``).

The SM90 e4m3 wgmma takes only K-major operands, and the PV contracts over the gathered keys while a gathered
tile is [keys, dims].  Computing O^T = V^T P^T instead of O = P V moves V^T to the A side, and A may come from
registers: ``ldmatrix.trans`` on 16-bit pairs of a [keys, dims] tile gives each thread 2 keys x 2 dims, and one
byte permute of two such registers gives the 4 consecutive keys of one dim that an e4m3 A register holds.  No
V^T tile in shared memory, no transpose pass, and the tile is read once for both halves of the split P
(P' = hi + lo, kernel_fwd_pair_fp8's notes).  P^T is the B operand: P [64 heads, 64 keys] e4m3 with its keys
contiguous is K-major as it is (64-byte rows, 64B swizzle).

Accumulators: a consumer warpgroup owns 256 output dims = four m64n64 tiles (32 fp32 per thread each, 128 in
all, ``float acc[128]``).  Tile i, thread (warp w, lane = 4 c + q), register j (wgmma's m64nN f32 layout):
row m = 16 w + c + 8 ((j >> 1) & 1), column (head) h = 8 (j >> 2) + 2 q + (j & 1).  The A fragment's rows are
dims in the order the byte permute leaves them: row 16 w + c <-> dim 64 i + 16 w + 2 c and row 16 w + c + 8 <->
dim 64 i + 16 w + 2 c + 1, so registers j and j + 2 (j & 2 == 0) hold dims d, d + 1 of head h: one bf16x2
store each.  Per-head factors (the softmax rescale, 1 / l) are columns here: they come through shared memory.

A fragment (m64 x k32 e4m3, per thread 4 registers: a0 = (row c, keys 4q..4q+3), a1 = (row c + 8, same keys),
a2 / a3 = the same for keys 16 + 4q..): ``ldmatrix.x4.trans`` of four 8 x 16-byte matrices of the K half tile
(e4m3 [64 keys, 256 dims] as 2 chunks of [64, 128 B] with the 128B swizzle, as the gather writes it).  Matrix
rows (keys) L0 = {0,1,4,5,10,11,14,15}, L1 = {2,3,6,7,8,9,12,13} (+16 for matrices 2, 3): thread q receives
keys L0[2q], L0[2q+1] from matrix 0 and L1[2q], L1[2q+1] from matrix 1, i.e. keys 4q..4q+3 (matrix 1 first for
q >= 2), and each matrix's 8 keys have distinct key % 8, so the 8 addresses hit 8 different 16-byte bank groups.
"""

OT_PRELUDE = r"""
__device__ __forceinline__ void fdsa_ot_frag(unsigned kh, int i, int s, int warp, int lane, unsigned (&a)[4]) {
  // A fragment of m-tile i (dims 64 i + 16 warp ..), k-step s (keys 32 s ..) from the K half tile at smem kh
  const int mi = lane >> 3, j = lane & 7, q = lane & 3;
  int rr = ((j >> 1) << 2) + (j & 1) + ((mi & 1) << 1);
  if (j >= 4) rr += (mi & 1) ? -2 : 2;
  const int r = 32 * s + 16 * (mi >> 1) + rr, d = 64 * i + 16 * warp;
  const unsigned addr = kh + (d >> 7) * 8192 + r * 128 + ((((d >> 4) & 7) ^ (r & 7)) << 4);
  unsigned x0, x1, x2, x3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3) : "r"(addr));
  // even dim: bytes 0, 2 of the first matrix's register then of the second (matrix 1 first for q >= 2); odd: 1, 3
  const unsigned se = q < 2 ? 0x6420u : 0x2064u, so = q < 2 ? 0x7531u : 0x3175u;
  a[0] = __byte_perm(x0, x1, se);
  a[1] = __byte_perm(x0, x1, so);
  a[2] = __byte_perm(x2, x3, se);
  a[3] = __byte_perm(x2, x3, so);
}

__device__ __forceinline__ unsigned long long fdsa_desc_sw64(unsigned addr) {
  // K-major B operand, 64-byte rows, 64B swizzle: start address, LBO 16 (unused), SBO 512 (8 rows), mode 2
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(512 >> 4) << 32) |
         (2ull << 62);
}

__device__ __forceinline__ void fdsa_ot_mma(float *c, const unsigned (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7]),
        "+f"(c[8]), "+f"(c[9]), "+f"(c[10]), "+f"(c[11]), "+f"(c[12]), "+f"(c[13]), "+f"(c[14]), "+f"(c[15]),
        "+f"(c[16]), "+f"(c[17]), "+f"(c[18]), "+f"(c[19]), "+f"(c[20]), "+f"(c[21]), "+f"(c[22]), "+f"(c[23]),
        "+f"(c[24]), "+f"(c[25]), "+f"(c[26]), "+f"(c[27]), "+f"(c[28]), "+f"(c[29]), "+f"(c[30]), "+f"(c[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void fdsa_ot_keep(unsigned (&a)[2][4]) {
  // the A registers stay allocated until the wgmma reading them retired (the caller's wait comes first)
#pragma unroll
  for (int s = 0; s < 2; ++s)
    asm volatile("" : "+r"(a[s][0]), "+r"(a[s][1]), "+r"(a[s][2]), "+r"(a[s][3]));
}

// m-tile i of O^T += V^T P^T (hi, then lo when LO): the two k-steps of the 64 keys, one commit group
template <int LO>
__device__ __forceinline__ void fdsa_ot_tile(float *acc, unsigned kh, int i, unsigned long long dh,
                                             unsigned long long dl, int warp, int lane, unsigned (&a)[2][4]) {
  fdsa_ot_frag(kh, i, 0, warp, lane, a[0]);
  fdsa_ot_frag(kh, i, 1, warp, lane, a[1]);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  fdsa_ot_mma(acc + 32 * i, a[0], dh);
  fdsa_ot_mma(acc + 32 * i, a[1], dh + 2);  // + 32 bytes: the second k-step inside the 64-byte row
  if (LO) {
    fdsa_ot_mma(acc + 32 * i, a[0], dl);
    fdsa_ot_mma(acc + 32 * i, a[1], dl + 2);
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// O^T [256 dims of the half, 64 heads] += V^T P^T over one 64-key block; retired on return (with any wgmma in
// flight).  The K half tile: kh0 (set 0) or kh1 (set 1) by ``set``; ph / pl: P' hi / lo [64 heads, 64 keys] (64B
// swizzle); wt: thread index in the warpgroup
template <int LO>
__device__ __forceinline__ void fdsa_ot_pv(float *acc, const void *kh0, const void *kh1, int set, const void *ph,
                                           const void *pl, int wt) {
  const unsigned kh = static_cast<unsigned>(__cvta_generic_to_shared(set ? kh1 : kh0));
  const unsigned long long dh = fdsa_desc_sw64(static_cast<unsigned>(__cvta_generic_to_shared(ph)));
  const unsigned long long dl = fdsa_desc_sw64(static_cast<unsigned>(__cvta_generic_to_shared(pl)));
  const int warp = wt >> 5, lane = wt & 31;
  unsigned a0[2][4], a1[2][4];
  fdsa_ot_tile<LO>(acc, kh, 0, dh, dl, warp, lane, a0);
  fdsa_ot_tile<LO>(acc, kh, 1, dh, dl, warp, lane, a1);
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  fdsa_ot_keep(a0);
  fdsa_ot_tile<LO>(acc, kh, 2, dh, dl, warp, lane, a0);
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  fdsa_ot_keep(a1);
  fdsa_ot_tile<LO>(acc, kh, 3, dh, dl, warp, lane, a1);
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fdsa_ot_keep(a0);
  fdsa_ot_keep(a1);
}

// the producer's fdsa_gather_half<1> (ROW_GATHER_PRELUDE) into K set ``set``: one call site for both sets
__device__ __forceinline__ void fdsa_gather_set(void *tile0, void *tile1, void *rope0, void *rope1, int set,
                                                int has_rope, const void *kv, int ld, int col0, const int *rows,
                                                int t) {
  fdsa_gather_half<1>(set ? tile1 : tile0, set ? rope1 : rope0, has_rope, kv, ld, col0, rows, t);
}

__device__ __forceinline__ void fdsa_ot_zero(float *acc) {
#pragma unroll
  for (int k = 0; k < 128; ++k) acc[k] = 0.f;
}

// acc *= f[head] (f: 64 floats in shared memory)
__device__ __forceinline__ void fdsa_ot_scale(float *acc, const float *f, int wt) {
  const int q = wt & 3;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const float2 v = *reinterpret_cast<const float2 *>(f + 8 * jj + 2 * q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[32 * i + 4 * jj + 0] *= v.x;
      acc[32 * i + 4 * jj + 1] *= v.y;
      acc[32 * i + 4 * jj + 2] *= v.x;
      acc[32 * i + 4 * jj + 3] *= v.y;
    }
  }
}

// out[h * ld + d] = bf16(acc * f[h]) for the warpgroup's 64 heads x 256 dims (out: this half's first element)
__device__ __forceinline__ void fdsa_ot_store(const float *acc, const float *f, void *out_, int ld, int wt) {
  unsigned short *out = reinterpret_cast<unsigned short *>(out_);
  const int warp = wt >> 5, lane = wt & 31, c = lane >> 2, q = lane & 3;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = 8 * jj + 2 * q + e;
      const float fh = f[h];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        unsigned v;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(v) : "f"(acc[32 * i + 4 * jj + 2 + e] * fh),
            "f"(acc[32 * i + 4 * jj + e] * fh));
        *reinterpret_cast<unsigned *>(out + h * ld + 64 * i + 16 * warp + 2 * c) = v;
      }
    }
  }
}
"""
