"""The 656-byte cache kernel's register staging (``kernel_fwd_pair_cache`` ``staging="regs"``, session 22).

The producer warpgroup loads the next half tile's raw bytes (e4m3 latent, the row's two scales of the half, the
bf16 rope for R halves) from global memory into registers before it waits for that half's free barrier, so the
chain free -> ready holds only the conversion and the shared-memory stores, not the gather's L2 latency (which
binds the bf16 pair kernel with its one K set).  384 threads (the bf16 kernel's roles and registers, 216 / 216 /
72; each PV one m64n256 wgmma), no converter warpgroup, no raw bytes in shared memory.

Producer thread pt (0..127): g = pt / 8, q = pt % 8; rows g + 16 i (i = 0..3) of the block, 16-byte chunks q and
q + 8 of the half's 256 latent bytes (dims 16 q .. 16 q + 15 and 16 (q + 8) .. of the half: scale tiles tile0 and
tile0 + 1), rope piece q.  The 8 lanes of a row read one contiguous 128-byte span per load (16 L2 sectors per warp
instruction, as the bf16 row gather); each 16-byte store of a warp instruction (4 rows x 8 lanes) spreads over
the 8 bank groups 4 times (the minimum for 512 bytes).  Invalid rows (-1) load nothing: zeros, scale 1.
Per pair, halves in the consumers' free order a.L, b.R, a.R, b.L; for each: [registers already loaded] wait its
free barrier, publish the block's rows (a.L / b.R, ordinary arrival), convert + store + fence, arrive; then load
the next half and, after a.R / b.L, the next pair's rows of that block (so their Indices latency has two halves).
Ready counts as the bf16 kernel's: rdy_al / rdy_br 256 (rows + data), rdy_ar / rdy_bl 128."""

import tilelang.language as T

from . import _pair_parts as pp
from ._tl_common import BLOCK_I, D_V

READY_COUNTS = (128, 256, 256, 128)  # al, br, ar, bl: data (+ rope cp.async noinc on the R halves)
N_STAGE = 34  # registers per producer thread: 32 latent words, 8 scale exponents

# requires ROW_GATHER_PRELUDE (fdsa_row_ptr, fdsa_swz128) and the cache module's _DEQUANT_SRC / converter helpers
# (fdsa_piece, fdsa_st_cvt_at, fdsa_opaque)
REGS_SRC = r"""
// Registers (the producer has 72): stage[0, 32) the latent chunks (chunk q + 8 h of row g + 16 i at 8 i + 4 h),
// stage[32, 34) the 8 scales as exponent bytes (the format's scales are powers of two: 2^(e - 127), byte 2 i + h of
// the pair; invalid rows 127), and one row register per lane: lane q < 4 of row group g holds block a's row g + 16 q,
// lane 4 + q block b's (read with shuffles inside the 8-lane group).  Every shared address is one per-thread base +
// an immediate (rows g + 16 i are 2 KiB apart and keep r & 7 = g & 7, so the swizzled piece does not change with
// i).  Each helper takes the thread index through fdsa_opaque, so what it derives from it is recomputed per call
// (a few integer ops) instead of hoisted out of the pair loop: the compiler kept one register per store address
// (16 per half tile) and per half-tile base live across the loop and spilled.
// the row of row group g's slot i of block b (0: a, 1: b) from the lanes' row registers
__device__ __forceinline__ int fdsa_row_of(int rowreg, int b, int i) {
  return __shfl_sync(0xffffffffu, rowreg, ((threadIdx.x & 31) & ~7) + 4 * b + i);
}
// lanes of block b (q / 4 == b): rowreg = KV row of top-k slot slot0 + g + 16 (q % 4) of this token (idx: its
// Indices row), -1 at or past lim (topk_eff <= the Indices row length) or outside [0, n_rows)
__device__ __forceinline__ void fdsa_regs_rows(int *rowreg, const int *idx, int lim, int slot0, int n_rows, int b,
                                               int pt_in) {
  const int pt = static_cast<int>(fdsa_opaque(static_cast<unsigned>(pt_in)));
  const int q = pt & 7;
  if ((q >> 2) == b) {
    const int slot = slot0 + (pt >> 3) + 16 * (q & 3);
    int row = -1;
    if (slot < lim) row = __ldg(idx + slot);
    rowreg[0] = (row >= 0 && row < n_rows) ? row : -1;
  }
}
// the block's rows -> Rows (each lane of block b writes its one row)
__device__ __forceinline__ void fdsa_regs_publish(int *Rows, const int *rowreg, int b, int pt_in) {
  const int pt = static_cast<int>(fdsa_opaque(static_cast<unsigned>(pt_in)));
  const int q = pt & 7;
  if ((q >> 2) == b) Rows[(pt >> 3) + 16 * (q & 3)] = rowreg[0];
}
__device__ __forceinline__ void fdsa_regs_load(unsigned *st, const void *kv, int row_bytes, int chunk0, int tile0,
                                               const int *rowreg, int b, int pt_in) {
  const int pt = static_cast<int>(fdsa_opaque(static_cast<unsigned>(pt_in)));
  const unsigned off = (chunk0 + (pt & 7)) * 16;
  unsigned e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = fdsa_row_of(rowreg[0], b, i);
    const char *base = fdsa_row_ptr(kv, row, row_bytes);
    uint4 w0 = make_uint4(0u, 0u, 0u, 0u), w1 = w0;
    uint2 sc = make_uint2(127u << 23, 127u << 23);
    if (row >= 0) {
      w0 = __ldg(reinterpret_cast<const uint4 *>(base + off));
      w1 = __ldg(reinterpret_cast<const uint4 *>(base + off + 128));
      sc = __ldg(reinterpret_cast<const uint2 *>(base + 512 + 4 * tile0));
    }
    st[8 * i + 0] = w0.x; st[8 * i + 1] = w0.y; st[8 * i + 2] = w0.z; st[8 * i + 3] = w0.w;
    st[8 * i + 4] = w1.x; st[8 * i + 5] = w1.y; st[8 * i + 6] = w1.z; st[8 * i + 7] = w1.w;
    e[i] = ((sc.x >> 23) & 0xffu) | (((sc.y >> 23) & 0xffu) << 8);
  }
  st[32] = e[0] | (e[1] << 16);
  st[33] = e[2] | (e[3] << 16);
}
__device__ __forceinline__ float fdsa_scale_of(const unsigned *st, int i, int h) {
  return __uint_as_float(((st[32 + (i >> 1)] >> (16 * (i & 1) + 8 * h)) & 0xffu) << 23);
}
// the bf16 rope of the block's rows (piece q) straight into the rope tile (cp.async)
__device__ __forceinline__ void fdsa_regs_rope(void *rope_tile, const void *kv, int row_bytes, const int *rowreg,
                                               int b, int pt_in) {
  const int pt = static_cast<int>(fdsa_opaque(static_cast<unsigned>(pt_in)));
  const int g = pt >> 3, q = pt & 7;
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(rope_tile)) + fdsa_swz128(g, q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = fdsa_row_of(rowreg[0], b, i);
    fdsa_cp16(dst + 2048 * i, fdsa_row_ptr(kv, row, row_bytes) + 528 + q * 16, row >= 0 ? 16 : 0);
  }
}
// CVT 0: a timing build (raw words stored twice, no conversion; wrong results).  Chunk q + 8 h of row g + 16 i:
// 32 bytes at pieces 2 (q & 3), 2 (q & 3) + 1 of 64-dim chunk (q >> 2) + 2 h.
template <int CVT>
__device__ __forceinline__ void fdsa_regs_store(const unsigned *st, void *half, int pt_in) {
  const int pt = static_cast<int>(fdsa_opaque(static_cast<unsigned>(pt_in)));
  const int g = pt >> 3, q = pt & 7;
  const unsigned lo = static_cast<unsigned>(__cvta_generic_to_shared(half)) + (q >> 2) * 8192 + fdsa_swz128(g, 2 * (q & 3));
  const unsigned hi = lo ^ 16u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned off = 2048 * i + 16384 * h;
      const unsigned *w = st + 8 * i + 4 * h;
      if (CVT) {
        fdsa_st_cvt_at(lo + off, hi + off, w, fdsa_scale_of(st, i, h));
      } else {
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(lo + off), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                     "r"(w[3]) : "memory");
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(hi + off), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                     "r"(w[3]) : "memory");
      }
    }
  }
}
"""


def regs_producer(*, topk_dim, ablate=""):
    """The producer macro for ``kernel_fwd_pair.pair_body`` (module notes).  ``ablate`` "no_convert": a timing
    build (the raw words stored without conversion; wrong results)."""
    assert ablate in ("", "no_convert"), ablate
    BI = BLOCK_I
    DH = D_V // 2
    cvt = int(ablate != "no_convert")

    @T.macro
    def block_rows(rowreg, Indices, tok, lim, blk, kv_src, pt):
        # the row lanes of block blk % 2: KV row of slot blk * 64 + g + 16 (q % 4), or -1
        T.call_extern("handle", "fdsa_regs_rows", T.address_of(rowreg[0]), T.address_of(Indices[tok, 0]), lim[0],
                      blk * BI, kv_src[3], blk % 2, pt)

    @T.macro
    def load(stage, rowreg, b, kv_src, right, pt):
        KVb = kv_src[1]
        T.call_extern("handle", "fdsa_regs_load", T.address_of(stage[0]), T.address_of(KVb[0, 0]),
                      kv_src[2] * 16, right * (DH // 16), right * 2, T.address_of(rowreg[0]), b, pt)

    @T.macro
    def rope(Kt, rowreg, b, kv_src, rdy, pt):
        # issued right after the free wait, so its latency overlaps the conversion; lands noinc on rdy
        KVb = kv_src[1]
        T.call_extern("handle", "fdsa_regs_rope", T.address_of(Kt[0, 0]), T.address_of(KVb[0, 0]),
                      kv_src[2] * 16, T.address_of(rowreg[0]), b, pt)
        T.cp_async_barrier_noinc(rdy)

    @T.macro
    def store(stage, Half, rdy, pt):
        T.call_extern("handle", f"fdsa_regs_store<{cvt}>", T.address_of(stage[0]), T.address_of(Half[0, 0]), pt)
        T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
        T.barrier_arrive(rdy)

    @T.macro
    def publish(Rows, rowreg, b, pt):
        # the block's rows for the consumers' masks; ordered before them by the data arrival that follows
        T.call_extern("handle", "fdsa_regs_publish", T.address_of(Rows[0]), T.address_of(rowreg[0]), b, pt)

    @T.macro
    def producer(kv_src, Indices, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
                 row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar, pb):
        pt = tx - 256
        stage = T.alloc_local([N_STAGE], "uint32")
        rowreg = T.alloc_local([1], "int32")
        block_rows(rowreg, Indices, tok, lim, 0, kv_src, pt)
        block_rows(rowreg, Indices, tok, lim, 1, kv_src, pt)
        load(stage, rowreg, 0, kv_src, 0, pt)
        for j in T.serial(npair[0]):
            T.barrier_wait(fr_al, pp.pair_phase(pb, j) ^ 1)
            publish(Rows0, rowreg, 0, pt)
            store(stage, KVa_l, rdy_al, pt)
            load(stage, rowreg, 1, kv_src, 1, pt)
            T.barrier_wait(fr_br, pp.pair_phase(pb, j) ^ 1)
            publish(Rows1, rowreg, 1, pt)
            rope(Kb_t, rowreg, 1, kv_src, rdy_br, pt)
            store(stage, KVb_r, rdy_br, pt)
            load(stage, rowreg, 0, kv_src, 1, pt)
            T.barrier_wait(fr_ar, pp.pair_phase(pb, j) ^ 1)
            rope(Ka_t, rowreg, 0, kv_src, rdy_ar, pt)
            block_rows(rowreg, Indices, tok, lim, 2 * j + 2, kv_src, pt)  # block a done with its rows
            store(stage, KVa_r, rdy_ar, pt)
            load(stage, rowreg, 1, kv_src, 0, pt)
            block_rows(rowreg, Indices, tok, lim, 2 * j + 3, kv_src, pt)
            T.barrier_wait(fr_bl, pp.pair_phase(pb, j) ^ 1)
            store(stage, KVb_l, rdy_bl, pt)
            load(stage, rowreg, 0, kv_src, 0, pt)  # the next pair's a.L (rows -1 past the last pair: nothing read)
        pp.drain()

    return producer
