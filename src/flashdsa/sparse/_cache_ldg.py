"""The "converter_ldg" staging of ``kernel_fwd_pair_cache``: the converter warpgroup loads each half tile's raw
e4m3 bytes and scales from global memory into registers itself, so no raw byte lands in shared memory.

Why (docs/PERFORMANCE.md "Session 39"): the pair kernels are bound by the shared-memory port (~63% busy in the
bf16 pair kernel); per 64-key block the converter staging adds the raw landing (42 KB), the converter's raw reads
(42 KB) and its bf16 stores (74 KB) to the bf16 kernel's ~286 KB.  Loading the raw bytes straight into registers
removes the first two.

Protocol: unchanged from "converter_contig" except who reads what.  The producer publishes each block's rows
and copies only the bf16 rope (R halves) into the rope tile; its arrivals on the "landed" barriers (rows
published, the half free, the rope landed) keep their counts (``cp.async.mbarrier.arrive.noinc`` arrives at once
when the thread has no copy in flight).  The converter (128 threads; thread t: row t / 2, part t % 2, the chunks
``fdsa_convert_half_contig`` takes) walks the halves in the producer's order (a.L, b.R, a.R, b.L per pair),
loads each half's raw chunks and scales from the row the Indices name (zeros where the slot is past topk_eff
or the row is out of range) ahead of its landed barrier, then converts and stores half h
(``fdsa_store_half_contig``, with its one-multiply vote), fences it for the async proxy and arrives on its ready
barrier.  DEPTH 1 keeps one half's raw bytes in registers (34) and loads them after the previous half's stores,
DEPTH 2 keeps two (half h + 2's loads are issued right after half h's stores, so they also overlap half h + 1's
conversion).
"""

LDG_SRC = r"""
// the bf16 rope of a block's rows into the rope tile (thread t of the 128 producer threads: rows t / 8 + 16 j, piece
// t % 8; an invalid row is zero-filled, nothing read)
__device__ __forceinline__ void fdsa_gather_rope656(void *rope, const void *kv, int row_bytes, const int *rows, int t) {
  const int g = t >> 3, q = t & 7;
  const unsigned rope_s = static_cast<unsigned>(__cvta_generic_to_shared(rope));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = g + 16 * j, row = rows[r];
    fdsa_cp16(rope_s + fdsa_swz128(r, q), fdsa_row_ptr(kv, row, row_bytes) + 528 + q * 16, row >= 0 ? 16 : 0);
  }
}
__device__ __forceinline__ void fdsa_ldg16(const unsigned char *p, unsigned (&w)[4]) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}
// half h of the item (h = 4 j + i, i: a.L, b.R, a.R, b.L): its block and first scale tile
__device__ __forceinline__ int fdsa_ldg_block(int h) { return 2 * (h >> 2) + ((h & 3) == 1 || (h & 3) == 3); }
__device__ __forceinline__ int fdsa_ldg_tile0(int h) { return ((h & 3) == 1 || (h & 3) == 2) ? 2 : 0; }
// this thread's raw chunks of half h (fdsa_convert_half_contig's w[j]: raw chunk 8 (j >> 2) + 4 p + ((j + 2 p) & 3)
// of the half's 256 bytes) and its two scales; zeros for an invalid slot
__device__ __forceinline__ void fdsa_ldg_half(int h, int r, int p, const unsigned char *kv, long long row_bytes,
                                              int n_rows, const int *idx, int lim, unsigned (&w)[8][4],
                                              float (&s)[2]) {
  const int slot = 64 * fdsa_ldg_block(h) + r, tile0 = fdsa_ldg_tile0(h);
  const int row = slot < lim ? idx[slot] : -1;
  if (row >= 0 && row < n_rows) {
    const unsigned char *base = kv + row * row_bytes;
    const float2 sc = *reinterpret_cast<const float2 *>(base + 512 + 4 * tile0);
    s[0] = sc.x;
    s[1] = sc.y;
#pragma unroll
    for (int j = 0; j < 8; ++j) fdsa_ldg16(base + 128 * tile0 + 16 * (8 * (j >> 2) + 4 * p + ((j + 2 * p) & 3)), w[j]);
  } else {
    s[0] = s[1] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j][0] = w[j][1] = w[j][2] = w[j][3] = 0u;
  }
}
__device__ __forceinline__ void fdsa_ldg_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n\t.reg .pred p;\n\tWAIT:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra WAIT;\n\t}\n"
               :: "r"(bar), "r"(parity) : "memory");
}
// half h converted into its tile once its landed barrier completed, then fenced and announced on its ready barrier
__device__ __forceinline__ void fdsa_ldg_store(int h, int r, int p, int pb, unsigned half, unsigned ld, unsigned rdy,
                                               const unsigned (&w)[8][4], const float (&s)[2]) {
  fdsa_ldg_wait(ld, (pb + (h >> 2)) & 1);
  const unsigned row_s = half + r * 128;
  if (!__any_sync(0xffffffffu, !(s[0] <= 128.0f && s[1] <= 128.0f)))
    fdsa_store_half_contig<1>(row_s, r, p, w, s);
  else
    fdsa_store_half_contig<0>(row_s, r, p, w, s);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(rdy) : "memory");
}
// The converter warpgroup's item (thread t < 128): every half of npair pairs, loads DEPTH halves ahead
template <int DEPTH>
__device__ __forceinline__ void fdsa_converter_ldg(int npair, int t, void *al, void *br, void *ar, void *bl,
                                                   void *ld_al, void *ld_br, void *ld_ar, void *ld_bl, void *rdy_al,
                                                   void *rdy_br, void *rdy_ar, void *rdy_bl, int pb, const void *kv_,
                                                   long long row_bytes, int n_rows, const int *idx, int lim) {
  const int r = t >> 1, p = t & 1, nh = 4 * npair;
  const unsigned char *kv = static_cast<const unsigned char *>(kv_);
  const unsigned half[4] = {static_cast<unsigned>(__cvta_generic_to_shared(al)),
                            static_cast<unsigned>(__cvta_generic_to_shared(br)),
                            static_cast<unsigned>(__cvta_generic_to_shared(ar)),
                            static_cast<unsigned>(__cvta_generic_to_shared(bl))};
  const unsigned ld[4] = {static_cast<unsigned>(__cvta_generic_to_shared(ld_al)),
                          static_cast<unsigned>(__cvta_generic_to_shared(ld_br)),
                          static_cast<unsigned>(__cvta_generic_to_shared(ld_ar)),
                          static_cast<unsigned>(__cvta_generic_to_shared(ld_bl))};
  const unsigned rdy[4] = {static_cast<unsigned>(__cvta_generic_to_shared(rdy_al)),
                           static_cast<unsigned>(__cvta_generic_to_shared(rdy_br)),
                           static_cast<unsigned>(__cvta_generic_to_shared(rdy_ar)),
                           static_cast<unsigned>(__cvta_generic_to_shared(rdy_bl))};
  unsigned wa[8][4], wb[8][4];
  float sa[2], sb[2];
  if (DEPTH == 2) {
    if (nh > 0) {
      fdsa_ldg_half(0, r, p, kv, row_bytes, n_rows, idx, lim, wa, sa);
      fdsa_ldg_half(1, r, p, kv, row_bytes, n_rows, idx, lim, wb, sb);
    }
  }
  for (int j = 0; j < npair; ++j) {  // the pair's halves unrolled: constant barrier / tile / buffer picks
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = 4 * j + i;
      if (DEPTH == 1) {  // one buffer: half h's loads overlap only its landed wait
        fdsa_ldg_half(h, r, p, kv, row_bytes, n_rows, idx, lim, wa, sa);
        fdsa_ldg_store(h, r, p, pb, half[i], ld[i], rdy[i], wa, sa);
      } else if (i % 2 == 0) {  // two buffers: half h + 2's loads also overlap half h + 1's conversion
        fdsa_ldg_store(h, r, p, pb, half[i], ld[i], rdy[i], wa, sa);
        if (h + 2 < nh) fdsa_ldg_half(h + 2, r, p, kv, row_bytes, n_rows, idx, lim, wa, sa);
      } else {
        fdsa_ldg_store(h, r, p, pb, half[i], ld[i], rdy[i], wb, sb);
        if (h + 2 < nh) fdsa_ldg_half(h + 2, r, p, kv, row_bytes, n_rows, idx, lim, wb, sb);
      }
    }
  }
}
"""


def ldg_parts(*, topk_dim, depth):
    """(producer, converter) of the "converter_ldg" stagings: ``_pair_parts.gather_producer`` copying only the rope
    of R halves (its landed arrivals unchanged), and the converter warpgroup's ``fdsa_converter_ldg<depth>``."""
    import tilelang.language as T

    from . import _pair_parts as pp
    from . import kernel_fwd_fp8cache as fc

    assert depth in (1, 2), depth

    @T.macro
    def gather_l(KVl, Rows, kv_src):
        T.evaluate(0)  # the converter loads the latent bytes itself

    @T.macro
    def gather_r(KVr, Kt, Rows, kv_src):
        T.call_extern("handle", "fdsa_gather_rope656", T.address_of(Kt[0, 0]), T.address_of(kv_src[1][0, 0]),
                      kv_src[2] * fc.CHUNK, T.address_of(Rows[0]), T.get_thread_binding() - 256)

    @T.macro
    def converter(npair, tx, KVa_l, KVa_r, KVb_l, KVb_r, ld_al, ld_br, ld_ar, ld_bl, rdy_al, rdy_br, rdy_ar, rdy_bl,
                  pb, ctx):
        kv_src, Indices, tok, lim = ctx
        T.call_extern("handle", f"fdsa_converter_ldg<{depth}>", npair[0], tx - 384, T.address_of(KVa_l[0, 0]),
                      T.address_of(KVb_r[0, 0]), T.address_of(KVa_r[0, 0]), T.address_of(KVb_l[0, 0]),
                      T.address_of(ld_al[0]), T.address_of(ld_br[0]), T.address_of(ld_ar[0]), T.address_of(ld_bl[0]),
                      T.address_of(rdy_al[0]), T.address_of(rdy_br[0]), T.address_of(rdy_ar[0]),
                      T.address_of(rdy_bl[0]), pb[0] if pb is not None else 0, T.address_of(kv_src[1][0, 0]),
                      T.cast(kv_src[2], "int64") * fc.CHUNK, kv_src[3], T.address_of(Indices[tok, 0]), lim[0])

    producer = pp.gather_producer(topk_dim=topk_dim, row_ok=lambda row, kv_src: (row >= 0) & (row < kv_src[3]),
                                  gather_l=gather_l, gather_r=gather_r)
    return producer, converter
