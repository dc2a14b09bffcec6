"""Parts of ``kernel_bwd`` (the sparse MLA backward): the CUDA prelude of its dKV reductions and stage hand-over
(``RED_V4_PRELUDE``), and the deterministic mode's segmented-sum kernel (``build_segment_reduce``)."""

import tilelang.language as T

# fdsa_red_add_v4(ptr, a, b, c, d): one 16-byte fp32 reduction into global memory (sm_90; ptr 16-byte aligned)
RED_V4_PRELUDE = r"""
__device__ __forceinline__ void fdsa_red_add_v4(float *ptr, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

// fdsa_red_acc64<STORE>(acc, rows, dst, ld, col0, prow0): one thread's 16 values of a 64 x 64 fp32 dKV chunk (the
// wgmma fragment: pair i = floats 2i, 2i + 1 at row 16 w + 8 (i & 1) + lane / 4, column 32 wg + 8 (i >> 1) +
// 2 (lane % 4); w the warp of warpgroup wg) as 16-byte accesses in which each 8-lane group covers one row's 32
// contiguous columns (4 rows x 128 bytes per warp instruction): added to dst[rows[r] * ld + col0 + c] (STORE 0:
// the fast path's reductions) or stored to dst[(prow0 + r) * ld + col0 + c] (STORE 1: the deterministic path's
// partial rows); slots with rows[r] < 0 are skipped.  Lanes q, q ^ 1 of a quad swap column pairs (two shuffles
// per float4), so each quad holds one row's 16 contiguous columns per float4; then the two quads of an 8-lane
// group (rows r, r + 1) swap a float4 (four shuffles per row half).  The L2 takes reductions by line: 8 rows x
// 32 bytes per instruction (the fragment's float2) reach 2.3 TB/s, 8 x 64 bytes (the quads alone) 3.2, whole
// 128-byte lines 3.8 (scripts/atomic_ceiling.py, H200).
template <int STORE>
__device__ __forceinline__ void fdsa_dkv_put(float *dst, long long ld, const int *rows, long long prow0, int r,
                                             int col, float4 v) {
  const int kr = rows[r];
  if (kr < 0) return;
  float *p = dst + (STORE ? prow0 + r : static_cast<long long>(kr)) * ld + col;
  if (STORE)
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
  else
    fdsa_red_add_v4(p, v.x, v.y, v.z, v.w);
}
template <int STORE>
__device__ __forceinline__ void fdsa_red_acc64(const float *acc, const int *rows, const float *dst_, long long ld,
                                               int col0, long long prow0) {
  float *dst = const_cast<float *>(dst_);  // TileLang passes the output as a read handle
  const int tx = threadIdx.x, lane = tx & 31, q = lane & 3;
  const bool odd = q & 1, up = (lane >> 2) & 1;
  const int r0 = ((tx & 127) >> 5) * 16 + (lane >> 2);
  const int c4 = col0 + 32 * (tx >> 7) + (odd ? 6 + 2 * q : 2 * q);  // this lane's float4: q 0 1 2 3 -> 0 8 4 12
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float4 v[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // columns 16 k .. 16 k + 15 of row r0 + 8 h: pairs 4 k + h and 4 k + 2 + h
      const int pe = 4 * k + h, po = pe + 2;
      const float s0 = odd ? acc[2 * pe] : acc[2 * po], s1 = odd ? acc[2 * pe + 1] : acc[2 * po + 1];
      const float g0 = __shfl_xor_sync(0xffffffffu, s0, 1), g1 = __shfl_xor_sync(0xffffffffu, s1, 1);
      v[k] = odd ? make_float4(g0, g1, acc[2 * po], acc[2 * po + 1])
                 : make_float4(acc[2 * pe], acc[2 * pe + 1], g0, g1);
    }
    // the even quad keeps columns 0..15 of rows r0, r0 + 1; the odd quad 16..31 of rows r0 - 1, r0
    const float4 s = up ? v[0] : v[1];
    float4 g;
    g.x = __shfl_xor_sync(0xffffffffu, s.x, 4);
    g.y = __shfl_xor_sync(0xffffffffu, s.y, 4);
    g.z = __shfl_xor_sync(0xffffffffu, s.z, 4);
    g.w = __shfl_xor_sync(0xffffffffu, s.w, 4);
    const int ra = (up ? r0 - 1 : r0) + 8 * h, col = c4 + 16 * up;
    fdsa_dkv_put<STORE>(dst, ld, rows, prow0, ra, col, up ? g : v[0]);
    fdsa_dkv_put<STORE>(dst, ld, rows, prow0, ra + 1, col, up ? v[1] : g);
  }
}

// the reducer's stage: two [64][32] fp32 halves (half h = columns 32 h.. of the chunk, written by compute
// warpgroup h); 16-byte piece q of row r lives at piece q ^ (r & 7) (conflict-free writes and reads)
__device__ __forceinline__ void fdsa_stage_put(float *stage, int r, int d, float v) {
  const int c = d & 31;
  stage[(d >> 5) * 2048 + r * 32 + ((((c >> 2) ^ r) & 7) << 2) + (c & 3)] = v;
}

// 64 reducer threads u of one half: rows u / 8 + 8 p, piece u % 8.  Rows 0-31 are read and reduced, rows 32-63
// read, the half freed (mbarrier arrive: every read of the stage and of rows is done), then reduced.
__device__ __forceinline__ void fdsa_reduce_half(const float *half, const int *rows, float *dkv, int ld, int col0,
                                                 int u, void *free_bar, int do_red) {
  const int q = u & 7;
  float4 v[4];
  int rr[4];
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int r = (u >> 3) + 8 * (4 * pass + p);
      rr[p] = rows[r];
      v[p] = *reinterpret_cast<const float4 *>(half + r * 32 + ((q ^ (r & 7)) << 2));
    }
    if (pass == 1) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(
                       static_cast<unsigned>(__cvta_generic_to_shared(free_bar)))
                   : "memory");
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if (do_red && rr[p] >= 0) {
        fdsa_red_add_v4(dkv + static_cast<long long>(rr[p]) * ld + col0 + q * 4, v[p].x, v[p].y, v[p].z, v[p].w);
      }
    }
  }
}
"""


def build_segment_reduce(*, dqk: int, threads: int = 64):
    """Deterministic segmented sum: ``Acc[r] += sum_{k in [Start[r], Start[r+1])} Part[Order[k]]`` in k order.

    One CTA per kv row, thread x owns columns x, x + 64, ...: every output element is a sequential sum.
    """
    assert dqk % threads == 0
    NC = dqk // threads
    f32, i32 = "float32", "int32"
    n_part = T.dynamic("n_part")
    n_ord = T.dynamic("n_ord")
    n_start = T.dynamic("n_start")
    n_kv = T.dynamic("n_kv")

    @T.prim_func
    def segment_reduce(
        Part: T.Tensor([n_part, dqk], f32),
        Order: T.Tensor([n_ord], i32),
        Start: T.Tensor([n_start], i32),
        Acc: T.Tensor([n_kv, dqk], f32),
    ):
        with T.Kernel(n_kv, threads=threads) as bx:
            tx = T.get_thread_binding()
            acc = T.alloc_local([NC], f32)
            lo = T.alloc_local([1], i32)
            cnt = T.alloc_local([1], i32)
            lo[0] = Start[bx]
            cnt[0] = Start[bx + 1] - Start[bx]
            for c in T.serial(NC):
                acc[c] = Acc[bx, c * threads + tx]
            for k in T.serial(cnt[0]):
                src = Order[lo[0] + k]
                for c in T.serial(NC):
                    acc[c] = acc[c] + Part[src, c * threads + tx]
            for c in T.serial(NC):
                Acc[bx, c * threads + tx] = acc[c]

    return segment_reduce
