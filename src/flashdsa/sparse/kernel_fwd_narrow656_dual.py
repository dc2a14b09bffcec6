"""Two-warpgroup form of the few-head forward over the 656-byte FP8 cache (H <= 16): each warpgroup runs the whole
chain (conversion, QK, softmax, PV) on alternate 64-row blocks of the token with its own bf16 tile, so one
warpgroup's conversion overlaps the other's products; merged at the end.

Notes
-----
Contract, signature and numerics as ``kernel_fwd_narrow656`` (whose conversion helpers and tile shapes it reuses:
keys on the wgmma M side, the heads zero-padded to 16 on N).  Two ways to bring the raw rows in:

  * ``prefetch="regs"``: each thread loads its share of the warpgroup's next block (82 words: ``fdsa_row_to_regs``;
    invalid rows as zeros, nothing read) right after converting the current one.  A warp's load touches 32
    different rows (one per lane).
  * ``prefetch="ring"`` (``"ring16"`` / ``"ring64"``: 16- / 64-row stages; the ``"_er"`` forms: each issuing
    thread loads its row numbers of the next block before converting, so the refill after a stage's barrier does
    not wait for the ``Indices`` load): one shared ring of ``64 / QR`` stages of ``QR`` raw
    rows (41,984 B: one block), filled by
    one ``cp.async.bulk`` per row as in ``kernel_fwd_narrow656`` (mbarrier ``expect_tx``; an invalid slot is zeroed
    by its thread and only arrives).  The warpgroup that converts stage s of block b issues stage s of block b + 1
    right after its own named barrier, so block b + 1's rows are in flight while warpgroup b % 2 runs its products
    and the other warpgroup waits for them.  Each warpgroup has its own mbarrier per stage (block b completes
    barrier (b % 2, s)): its j-th block is phase j of its barriers (parity j % 2), never more than one phase ahead
    of the waiter.  (One barrier per stage for both warpgroups is wrong: a warpgroup reaching its wait for block
    b while block b - 1 is still in flight sees parity b % 2 as the completed previous phase and passes.)
  * ``prefetch="ringx"``: ``RINGX_STAGES`` = 5 stages of 16 rows (52,480 B, all that shared memory leaves), not tied
    to blocks: chunk c (rows [16 c, +16) of the token's top-k; block c / 4, converted by warpgroup (c / 4) % 2) lives
    in stage c % 5; whoever converts chunk c issues chunk c + 5 (row numbers loaded at the start of the block), so
    1.25 blocks of rows can be in flight.  Each warpgroup has its own barrier per stage and tracks its phase parities
    in a 5-bit mask (its chunks on a stage come in order, each issued only after the previous one on that stage was
    converted, so a wait is never more than one phase ahead).
  * ``"ring_er_f16"`` (the default at H <= 16): "ring_er" with f16 products.  A pass over the token's valid rows
    (block 0's rows already in flight) takes each 128-dim tile's largest scale sigma_t; a row converts as
    ``f16(e4m3) * (s_t / sigma_t)`` (two instructions a pair instead of five: ``cvt.rn.f16x2.e4m3x2`` is exact, the
    ratio <= 1 is a power of two for the format's scales, so the product is exact while it stays a normal f16);
    Q's latent dims are stored as ``f16(q * sigma_t * 2^-e_n)`` with a per-head power of two putting each head's
    largest into [2^13, 2^14) (bf16 -> f16 is exact in that range); S^T = 2^e_n (K' Q'^T) (f16 wgmma) + the rope's
    K Q^T (bf16 wgmma, own accumulator); P is f16 (<= 1: 11-bit mantissa); O^T of tile t is multiplied by sigma_t
    at the merge.  Range: a row whose tile scale is below 2^-14 sigma_t keeps fewer mantissa bits in its small
    elements (absolute error <= 2^-25 sigma_t, i.e. ~2^-34 of the largest representable value of that tile); the
    format's writer clamps scales at 1e-4 / 448, so this needs tiles of the same token ~2^14 apart in magnitude
    (tests/sparse_mla/test_kernel_narrow656_gpu.py: rows spread 2^+-10 match the bf16 form's error;
    tests/sparse_mla/test_f16_numerics.py emulates the operands on the CPU: exact, and the bound).  Invalid
    rows carry a -1 in their first scale slot in the ring (written by the issuing thread), which the converting
    warp turns into a -inf row mask in shared memory (no ``Indices`` reload per block).
  The ring's bytes hold warpgroup 1's O^T for the final merge (``T.view`` as [ring bytes / 64, 16] fp32, rows
  0..511 used) once both warpgroups are past their last block.

At the end warpgroup 1 publishes (O^T, m, l) through shared memory and warpgroup 0 merges (``m = max``, both sides
rescaled by ``2^((m_w - m) c)``) and writes the output.  Shared memory: Q 18 KB + 2 x (tile 64 KB + rope 8 KB + S^T
4 KB + P 2 KB) = 174 KB, + merge 32 KB ("regs"), ring 41 KB ("ring") or 51 KB ("ringx").

Measured (H200, session 12, ``python -m flashdsa.sparse.kernel_fwd_narrow656 --variants``; docs/PERFORMANCE.md):
H 16, topk 2048; decode shape (128 tokens, each its own 32768 rows) / prefill S 4096 over SKV 8192:
``kernel_fwd_narrow656`` 132.3 us / 3.92 ms, "regs" 162.6 us / 3.27 ms, "ring" 116.0 us / 3.12 ms, "ring16"
141.3 us / 3.85 ms, "ring64" 132.4 us / 3.56 ms.  Session 13 (one call): "ring" 117.9 us / 412.8 us (decode B 512)
/ 3.12 ms, "ring_er" 110.4 / 360.9 us / 2.71 ms, "ring16_er" 105.3 / 387.9 us / 2.89 ms, "ringx" 109.7 /
410.3 us / 3.08 ms; then "ring_er" 110.6 / 360.0 us / 2.71 ms against **"ring_er_f16" 99.5 / 361.4 us / 2.57 ms**
(the default at H <= 16: ``DEFAULT``).  ncu (B 128): stalls spread over shared-memory dependencies, fixed
latencies, waits and barriers, 2 warps per scheduler; the mbarrier waits for rows are ~3% of the samples, so the
bound is each warpgroup's serial chain per block (~6 us), not the copies.
GPU tests: tests/sparse_mla/test_kernel_narrow656_gpu.py (every form), test_kernel_fp8cache_gpu.py,
tests/decode/test_sparse_gpu.py (through the default).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import tilelang
import tilelang.language as T

from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from . import kernel_fwd_narrow as _kn
from ._tl_common import BLOCK_I, D_V, LOG2E, Q_F16_TOP
from .kernel_fwd_narrow656 import _SRC, ROPE_BYTE, ROW, SCALE_BYTE, _pass_configs

_DUAL_SRC = r"""
// a thread's share of a 656-byte row into 82 registers: latent bytes [256 part, +256) (w[0..63]), its two scales
// (w[64], w[65]), rope bytes [528 + 64 part, +64) (w[66..81]); zeros for an invalid row (nothing is read)
__device__ __forceinline__ void fdsa_row_to_regs(unsigned *w, const void *row, int part, int ok) {
  const char *p = reinterpret_cast<const char *>(row);
  const uint4 *lat = reinterpret_cast<const uint4 *>(p + 256 * part);
  const uint4 *rope = reinterpret_cast<const uint4 *>(p + 528 + 64 * part);
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const uint4 v = ok ? __ldg(lat + c) : z;
    w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
  }
  const uint2 sc = ok ? __ldg(reinterpret_cast<const uint2 *>(p + 512 + 8 * part)) : make_uint2(0u, 0u);
  w[64] = sc.x; w[65] = sc.y;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint4 v = ok ? __ldg(rope + c) : z;
    w[66 + 4 * c] = v.x; w[67 + 4 * c] = v.y; w[68 + 4 * c] = v.z; w[69 + 4 * c] = v.w;
  }
}
// one 16-byte chunk in shared memory
__device__ __forceinline__ void fdsa_copy16(const void *src, void *dst) {
  *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
}
// "_f16": 64 raw e4m3 bytes at src (shared memory) -> f16(e4m3) * r at l_i (dims 16i..16i+7) / h_i (16i+8..+15);
// two instructions a pair (cvt.rn.f16x2.e4m3x2 is exact, the multiply by r = row scale / token scale <= 1 is exact
// for power-of-two scales while the product stays a normal f16)
__device__ __forceinline__ void fdsa_dequant64_f16(const void *src, void *l0, void *h0, void *l1, void *h1,
                                                   void *l2, void *h2, void *l3, void *h3, float r) {
  void *lo[4] = {l0, l1, l2, l3}, *hi[4] = {h0, h1, h2, h3};
  unsigned w[16], r2;
  fdsa_ld64(src, w);
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(r2) : "f"(r));
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    unsigned o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        unsigned h2x;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2x) : "h"((unsigned short)(w[4 * c + i] >> (16 * k))));
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(o[2 * i + k]) : "r"(h2x), "r"(r2));
      }
    }
    *reinterpret_cast<uint4 *>(lo[c]) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4 *>(hi[c]) = make_uint4(o[4], o[5], o[6], o[7]);
  }
}
// "_f16": this thread's largest scale of each 128-dim tile over the token's valid rows j = tx + 256 i (j < lim,
// 0 <= row < n_rows), eight rows at a time so the index and scale loads overlap; the warp's maxima -> out4
__device__ __forceinline__ void fdsa_scale_max(const int *idx, int lim, int n_rows, const float *kvf, int rs16,
                                               int tx, float *out4) {
  float m[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j0 = tx; j0 < lim; j0 += 8 * 256) {
    int rows[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) rows[i] = j0 + 256 * i < lim ? __ldg(idx + j0 + 256 * i) : -1;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (rows[i] >= 0 && rows[i] < n_rows) {
        const float4 v = __ldg(reinterpret_cast<const float4 *>(kvf + ((long long)rows[i] * rs16 + 32) * 4));
        m[0] = fmaxf(m[0], v.x); m[1] = fmaxf(m[1], v.y); m[2] = fmaxf(m[2], v.z); m[3] = fmaxf(m[3], v.w);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m[k] = fmaxf(m[k], __shfl_xor_sync(0xffffffffu, m[k], o));
  }
  if ((tx & 31) == 0) { out4[0] = m[0]; out4[1] = m[1]; out4[2] = m[2]; out4[3] = m[3]; }
}
// "_f16": fdsa_bulk_row, with an invalid row's first scale -1 (the converting warp's validity mark)
__device__ __forceinline__ void fdsa_bulk_row_mark(void *dst, const void *src, void *bar, int ok) {
  if (ok) {
    fdsa_bulk_row(dst, src, bar, 1);
  } else {
#pragma unroll
    for (int k = 0; k < 41; ++k) reinterpret_cast<uint4 *>(dst)[k] = make_uint4(0u, 0u, 0u, 0u);
    reinterpret_cast<float *>(reinterpret_cast<char *>(dst) + 512)[0] = -1.0f;
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
  }
}
// the largest power of two <= x (x a positive normal float)
__device__ __forceinline__ float fdsa_pow2_floor(float x) { return __int_as_float(__float_as_int(x) & 0x7f800000); }
"""

THREADS = 256
BAR_WG = (1, 2)  # named barriers of warpgroups 0 / 1 (0 is __syncthreads)
# all 256 threads, reached from both warpgroups' branches: through _tl_common.role_barrier, the unaligned
# barrier.sync (TileLang numbers its own barriers from 3 up)
BAR_ALL = 15
# "ring16" / "ring64": the ring in 16- / 64-row stages (default 32); "_er": the next block's row numbers loaded early;
# "ringx": RINGX_STAGES stages of 16 rows, not tied to blocks (more than one block's worth of raw rows in flight);
# "_f16": f16 products (module notes)
PREFETCH = ("regs", "ring", "ring16", "ring64", "ring_er", "ring16_er", "ringx", "ring_er_f16")
RINGX_STAGES = 5  # 5 x 16 rows x 656 B = 52,480 B: what shared memory leaves next to the two tiles


def ringx_barrier(c, chunks_per_block, n_stages):
    """"ringx": the mbarrier chunk c completes: its warpgroup's ((c / chunks_per_block) % 2) barrier of its stage
    (c % n_stages).  Works on ints and TIR expressions (tests/sparse_mla/test_ring_schedule.py models the
    protocol with it)."""
    return ((c // chunks_per_block) % 2) * n_stages + c % n_stages
DEFAULT = "ring_er_f16"  # what kernel_fwd_fp8cache.run_sparse_mla_fwd runs at H <= MAX_HEADS
MAX_HEADS = 16
RING_ROWS = 32  # rows per ring stage (QR); 64 / QR stages = one block


def f16_prologue_macros(*, BR, heads):
    """The f16 form's prologue (all 256 threads):

    * ``token_scales(Indices, KVf, rs16, n_rows, lim, Pmx_s, Sg_s, sc, bx, tx)``: Sg_s[t] = the largest scale of
      128-dim tile t over the token's valid rows (at least 1e-30; ``fdsa_scale_max``, per-warp maxima in Pmx_s).
    * ``load_q_f16(Q, Q_s, Qt_s, Qf, qmax, Sg_s, Qsc_s, bx)``: Q_s = f16(q * Sg_s[d / 128] * 2^-e_n), each head's
      largest in [2^13, 2^14); Qsc_s[n] = 2^e_n; the rope part (Qt_s) stays bf16."""
    D, DT, f32, bf16 = D_V, fc.D_TAIL, "float32", "bfloat16"

    @T.macro
    def token_scales(Indices, KVf, rs16, n_rows, lim, Pmx_s, Sg_s, sc, bx, tx):
        T.call_extern("handle", "fdsa_scale_max", T.address_of(Indices[bx, 0]), lim, n_rows, T.address_of(KVf[0, 0]),
                      rs16, tx, T.address_of(Pmx_s[tx // 32, 0]))  # strides over 256 threads
        T.sync_threads()
        if tx < 4:
            sc[0] = T.float32(1e-30)
            for w in T.unroll(8):
                sc[0] = T.max(sc[0], Pmx_s[w, tx])
            Sg_s[tx] = sc[0]
        T.sync_threads()

    @T.macro
    def load_q_f16(Q, Q_s, Qt_s, Qf, qmax, Sg_s, Qsc_s, bx):
        for n, d in T.Parallel(BR, D):
            Qf[n, d] = T.if_then_else(n < heads, T.cast(Q[bx, T.min(n, heads - 1), d], f32), T.float32(0)) * \
                Sg_s[d // 128]
        T.reduce_absmax(Qf, qmax, dim=1)
        for n in T.Parallel(BR):
            qmax[n] = T.call_extern(f32, "fdsa_pow2_floor", T.max(qmax[n], T.float32(1e-30)))
        for n, d in T.Parallel(BR, D):
            Q_s[n, d] = T.cast(Qf[n, d] * (Q_F16_TOP / qmax[n]), "float16")
        for n in T.Parallel(BR):
            Qsc_s[n] = qmax[n] * (1.0 / Q_F16_TOP)
        for n, d in T.Parallel(BR, DT):
            Qt_s[n, d] = T.if_then_else(n < heads, Q[bx, T.min(n, heads - 1), D + d], T.cast(0, bf16))

    return token_scales, load_q_f16


def build_sparse_mla_fwd_narrow656_dual(*, heads: int, sm_scale: float, has_sink: bool = False,
                                        has_topk_length: bool = False, prefetch: str = "ring"):
    """prim_func with ``kernel_fwd_narrow656.build_sparse_mla_fwd_narrow656``'s signature; H <= 16, any topk.
    ``prefetch``: a name in ``PREFETCH`` (module notes; ``DEFAULT`` is what the dispatcher runs)."""
    BR = _kn.rows_tile(heads)
    assert BR == 16, "the dual form is for H <= 16 (two O^T accumulators + the merge buffer)"
    assert prefetch in PREFETCH, prefetch
    BI, D, DT, CH = BLOCK_I, D_V, fc.D_TAIL, fc.CHUNK
    f16 = prefetch.endswith("_f16")
    prefetch = prefetch.removesuffix("_f16")
    QR = {"ring16": 16, "ring64": 64, "ring16_er": 16, "ringx": 16}.get(prefetch, RING_ROWS)
    early = prefetch.endswith("_er")
    ringx = prefetch == "ringx"
    # f16: a thread converts one 128-dim scale tile (its warp's) of its stage rows, which needs 32-row stages
    assert not f16 or prefetch in ("ring", "ring_er"), prefetch
    kdt = "float16" if f16 else "bfloat16"  # the latent tile, Q's latent part and P
    NQ = BI // QR  # ring stages per block ("ringx": chunks per block)
    NSX = RINGX_STAGES if ringx else NQ  # ring stages
    PARTS = 128 // QR  # threads per row in a stage's conversion
    GROUPS = 8 // PARTS  # 64-dim groups per thread (each inside one 128-dim scale tile)
    ROPES = 8 // PARTS  # 16-byte rope chunks per thread
    ISSUE = 128 // QR  # one issuing thread per ISSUE threads (spread over the four warps)
    assert sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E
    bf16, f32, i32, u32, u8 = "bfloat16", "float32", "int32", "uint32", "uint8"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    _row = tc.make_slot_row(topk_dim)
    set_lim = tc.make_set_lim(has_topk_length, topk_dim)
    load_q, normaliser, _, store_lse = tc.padded_head_macros(
        BH=BR, D=D, D_tail=DT, dqk=fc.DQK, heads=heads, c_log2=c_log2, has_sink=has_sink, dtype=bf16)
    _, _, softmax_stage = tc.narrow_macros(BR=BR, BI=BI, D=D, has_tail=True, c_log2=c_log2)
    epilogue = _kn._epilogue_macro(BR=BR, D=D, heads=heads, normaliser=normaliser, store_lse=store_lse,
                                   bar=BAR_WG[0])
    ring = prefetch != "regs"

    def wg_state():
        # one warpgroup's buffers: (KV, Kt, S^T, P, alpha) in shared memory, then its fragments (acc_t, acc_ot,
        # s_f, m_i, m_prev, alpha, l_i, l_blk)
        # ("_f16": + the rope's S^T accumulator, each row's validity as -inf / 0)
        return (T.alloc_shared([BI, D], kdt), T.alloc_shared([BI, DT], bf16), T.alloc_shared([BI, BR], f32),
                T.alloc_shared([BR, BI], kdt), T.alloc_shared([BR], f32),
                T.alloc_fragment([BI, BR], f32), T.alloc_fragment([D, BR], f32), T.alloc_fragment([BR, BI], f32),
                *[T.alloc_fragment([BR], f32) for _ in range(5)],
                *([T.alloc_fragment([BI, BR], f32), T.alloc_shared([BI], f32)] if f16 else []))

    @T.macro
    def load_regs(Indices, KV8, rs16, n_rows, tok, lim, blk, raw, t):
        row = _row(Indices, tok, lim, blk * BI + t % BI)
        ok = (row >= 0) & (row < n_rows)
        T.call_extern("handle", "fdsa_row_to_regs", T.address_of(raw[0]),
                      T.address_of(KV8[T.if_then_else(ok, row, 0) * rs16, 0]), t // BI, T.if_then_else(ok, 1, 0))

    @T.macro
    def convert_regs(raw, KV_w, Kt_w, t):
        r = t % BI
        part = t // BI
        for g in T.unroll(4):
            T.call_extern("handle", "fdsa_regs_dequant64", T.address_of(raw[16 * g]),
                          *[T.address_of(KV_w[r, part * 256 + g * 64 + i * 16 + h * 8])
                            for i in range(4) for h in range(2)], raw[64 + g // 2])
        T.call_extern("handle", "fdsa_regs_store4x16", T.address_of(raw[66]),
                      *[T.address_of(Kt_w[r, part * 32 + i * 8]) for i in range(4)])

    @T.macro
    def issue_stage(Indices, KV8, rs16, n_rows, tok, lim, blk, s, Raw, bars, t, rows):
        # stage s of block blk: thread ISSUE * r (of the warpgroup that issues) copies row r or zeroes it;
        # rows: None, or the thread's row numbers of block blk loaded earlier (rows[s])
        if t % ISSUE == 0:
            row = _row(Indices, tok, lim, blk * BI + s * QR + t // ISSUE) if rows is None else rows[s]
            ok = (row >= 0) & (row < n_rows)
            T.call_extern("handle", "fdsa_bulk_row_mark" if f16 else "fdsa_bulk_row",
                          T.address_of(Raw[s, t // ISSUE, 0]),
                          T.address_of(KV8[T.if_then_else(ok, row, 0) * rs16, 0]),
                          T.address_of(bars[(blk % 2) * NQ + s]), T.if_then_else(ok, 1, 0))

    @T.macro
    def issue_chunk(KV8, rs16, n_rows, c, row, Raw, bars, t):
        # "ringx": chunk c (rows [QR c, +QR) of the token's top-k) into stage c % NSX, completing on the barrier
        # of its warpgroup ((c / NQ) % 2) for that stage; thread ISSUE * r copies row r (``row``) or zeroes it
        if t % ISSUE == 0:
            ok = (row >= 0) & (row < n_rows)
            T.call_extern("handle", "fdsa_bulk_row", T.address_of(Raw[c % NSX, t // ISSUE, 0]),
                          T.address_of(KV8[T.if_then_else(ok, row, 0) * rs16, 0]),
                          T.address_of(bars[ringx_barrier(c, NQ, NSX)]), T.if_then_else(ok, 1, 0))

    @T.macro
    def convert_stage(Raw, s, row0, KV_w, Kt_w, sc, t, Vld_w):
        # thread t: stage row t % QR (tile row row0 + t % QR), latent dims [512 / PARTS * part, +512 / PARTS)
        # (inside one scale tile for PARTS >= 4), rope chunks [ROPES * part, +ROPES); "_f16": sc[1] = 1 / the
        # token scale of the thread's tile (part), and part 0 records the row's validity (-inf / 0) in Vld_w
        r = t % QR
        part = t // QR
        if f16 and part == 0:
            Vld_w[row0 + r] = T.if_then_else(
                T.call_extern(f32, "fdsa_ld_f32", T.address_of(Raw[s, r, SCALE_BYTE]), 0) < 0, -T.infinity(f32), 0.0)
        for g in T.unroll(GROUPS):
            dim0 = part * (512 // PARTS) + g * 64
            sc[0] = T.call_extern(f32, "fdsa_ld_f32", T.address_of(Raw[s, r, SCALE_BYTE]), dim0 // 128)
            T.call_extern("handle", "fdsa_dequant64_f16" if f16 else "fdsa_dequant64",
                          T.address_of(Raw[s, r, dim0]),
                          *[T.address_of(KV_w[row0 + r, dim0 + i * 16 + h * 8])
                            for i in range(4) for h in range(2)],
                          T.max(sc[0], T.float32(0)) * sc[1] if f16 else sc[0])  # f16: an invalid row's -1 -> 0
        for c in T.unroll(ROPES):
            T.call_extern("handle", "fdsa_copy16", T.address_of(Raw[s, r, ROPE_BYTE + (part * ROPES + c) * 16]),
                          T.address_of(Kt_w[row0 + r, (part * ROPES + c) * 8]))

    def make_chain(w):
        bar = BAR_WG[w]

        @T.macro
        def chain(Q_s, Qt_s, KV8, rs16, n_rows, Indices, tok, lim, nblk, state, raw, Raw, bars, sc, nb, ph, tx,
                  Qsc_s):
            # warpgroup w: blocks w, w + 2, ... of the token, one whole chain per block
            KV_w, Kt_w, ST_w, P_w, Al_w, acc_t, acc_ot, s_f, m_i, m_prev, alpha, l_i, l_blk = state[:13]
            t = tx - 128 * w
            nb[0] = (nblk - w + 1) // 2
            T.fill(acc_ot, 0)
            T.fill(l_i, 0)
            T.fill(m_i, tc.NEG_BIG)
            if not ring:
                if nb[0] > 0:
                    load_regs(Indices, KV8, rs16, n_rows, tok, lim, w, raw, t)
            if ringx:
                ph[0] = 0  # bit s: parity of this warpgroup's next phase of its stage-s barrier
            for j in T.serial(nb[0]):
                b = 2 * j + w
                if ringx:
                    # the row numbers of the chunks this warpgroup issues during block b (c + NSX for its chunks c)
                    if t % ISSUE == 0:
                        for k in T.unroll(NQ):
                            raw[k] = _row(Indices, tok, lim, (b * NQ + k + NSX) * QR + t // ISSUE)
                    for k in T.unroll(NQ):
                        c = b * NQ + k
                        T.barrier_wait(bars[w * NSX + c % NSX], (ph[0] >> (c % NSX)) & 1)
                        ph[0] = ph[0] ^ (1 << (c % NSX))
                        convert_stage(Raw, c % NSX, k * QR, KV_w, Kt_w, sc, t, None)
                        T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
                        T.sync_threads(bar, 128)  # the whole warpgroup is past stage c % NSX: refill it
                        if c + NSX < nblk * NQ:
                            issue_chunk(KV8, rs16, n_rows, c + NSX, raw[k], Raw, bars, t)
                elif ring:
                    if early:  # the next block's row numbers now: their load latency is off the issue's path
                        if (b + 1 < nblk) & (t % ISSUE == 0):
                            for s in T.unroll(NQ):
                                raw[s] = _row(Indices, tok, lim, (b + 1) * BI + s * QR + t // ISSUE)
                    for s in T.unroll(NQ):
                        T.barrier_wait(bars[w * NQ + s], j % 2)
                        convert_stage(Raw, s, s * QR, KV_w, Kt_w, sc, t, state[14] if f16 else None)
                        T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
                        T.sync_threads(bar, 128)  # the whole warpgroup is past stage s: refill it
                        if b + 1 < nblk:
                            issue_stage(Indices, KV8, rs16, n_rows, tok, lim, b + 1, s, Raw, bars, t,
                                        raw if early else None)
                else:
                    convert_regs(raw, KV_w, Kt_w, t)
                    if j + 1 < nb[0]:
                        load_regs(Indices, KV8, rs16, n_rows, tok, lim, b + 2, raw, t)
                    T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
                    T.sync_threads(bar, 128)
                if f16:  # S^T = 2^e_n (K' Q'^T) (f16) + the rope's K Q^T (bf16)
                    T.wgmma_gemm(KV_w, Q_s, acc_t, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(Kt_w, Qt_s, state[13], transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    for r, n in T.Parallel(BI, BR):
                        ST_w[r, n] = acc_t[r, n] * Qsc_s[n] + state[13][r, n] + state[14][r]
                else:
                    T.wgmma_gemm(KV_w, Q_s, acc_t, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(Kt_w, Qt_s, acc_t, transpose_B=True)
                    T.wait_wgmma(0)
                    T.copy(acc_t, ST_w)
                T.sync_threads(bar, 128)
                for n, r in T.Parallel(BR, BI):
                    if f16:  # masked already
                        s_f[n, r] = ST_w[r, n]
                    else:
                        row = _row(Indices, tok, lim, b * BI + r)
                        s_f[n, r] = T.if_then_else((row >= 0) & (row < n_rows), ST_w[r, n], -T.infinity(f32))
                softmax_stage(s_f, P_w, Al_w, m_i, m_prev, alpha, l_i, l_blk)
                T.fence_proxy_async()
                T.sync_threads(bar, 128)
                for d, n in T.Parallel(D, BR):
                    acc_ot[d, n] = acc_ot[d, n] * Al_w[n]
                T.wgmma_gemm(KV_w, P_w, acc_ot, transpose_A=True, transpose_B=True)
                T.wait_wgmma(0)
                T.sync_threads(bar, 128)  # the tile, S^T and P are rewritten by the next block

        return chain

    chain0, chain1 = make_chain(0), make_chain(1)

    token_scales, load_q_f16 = f16_prologue_macros(BR=BR, heads=heads)

    @T.prim_func
    def sparse_mla_fwd_narrow656_dual(
        Q: T.Tensor([n_tok, heads, fc.DQK], bf16),
        KV8: T.Tensor([n_ch, CH], fc.FP8),
        KVf: T.Tensor([n_ch, CH // 4], f32),
        KVb: T.Tensor([n_ch, CH // 2], bf16),
        rs16: T.int32,
        n_rows: T.int32,
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, threads=THREADS, prelude=_SRC + _DUAL_SRC + tc.ROLE_BARRIER_PRELUDE) as bx:
            tx = T.get_thread_binding()
            Q_s = T.alloc_shared([BR, D], kdt)
            Qt_s = T.alloc_shared([BR, DT], bf16)
            st0, st1 = wg_state(), wg_state()
            _, _, _, _, Al_0, _, acc_ot0, _, m_i0, m_prev0, alpha0, l_i0, l_blk0 = st0[:13]
            Al_1, acc_ot1, m_i1, l_i1 = st1[4], st1[6], st1[8], st1[11]
            if ring:
                Raw = T.alloc_shared([NSX, QR, ROW], u8)
                Mrg_s = T.view(Raw, [NSX * QR * ROW // (4 * BR), BR], f32)  # >= 64 rows of 656 B: >= 656 x 16 fp32
                bars = T.alloc_barrier([QR] * (2 * NSX))  # stage s of warpgroup w's blocks: w * NSX + s
                raw = T.alloc_local([NQ], i32)  # "_er" / "ringx": row numbers of the next chunks of an issuing thread
            else:
                Raw = None
                bars = None
                Mrg_s = T.alloc_shared([D, BR], f32)
                raw = T.alloc_local([82], u32)
            Ml_s = T.alloc_shared([2, BR], f32)
            inv = T.alloc_fragment([BR], f32)
            lim = T.alloc_local([1], i32)
            nb = T.alloc_local([1], i32)
            sc = T.alloc_local([2], f32)
            ph = T.alloc_local([1], i32)
            Qsc_s = None
            if f16:
                Pmx_s = T.alloc_shared([THREADS // 32, 4], f32)
                Sg_s = T.alloc_shared([4], f32)
                Qsc_s = T.alloc_shared([BR], f32)
                Qf = T.alloc_fragment([BR, D], f32)
                qmax = T.alloc_fragment([BR], f32)

            set_lim(lim, TopkLen, bx)
            nblk = T.ceildiv(lim[0], BI)
            if f16:  # block 0's rows in flight while the token scales and Q are prepared
                if (tx < 128) & (nblk > 0):
                    for s in T.unroll(NQ):
                        issue_stage(Indices, KV8, rs16, n_rows, bx, lim[0], 0, s, Raw, bars, tx, None)
                token_scales(Indices, KVf, rs16, n_rows, lim[0], Pmx_s, Sg_s, sc, bx, tx)
                sc[1] = 1.0 / Sg_s[(tx % 128) // QR]  # the tile this thread converts (its warp's)
                load_q_f16(Q, Q_s, Qt_s, Qf, qmax, Sg_s, Qsc_s, bx)
            else:
                load_q(Q, Q_s, Qt_s, bx, 0)
            T.fence_proxy_async()
            T.sync_threads()
            if ring and not f16:
                if tx < 128:
                    if ringx:
                        for c in T.unroll(NSX):
                            if c < nblk * NQ:
                                issue_chunk(KV8, rs16, n_rows, c, _row(Indices, bx, lim[0], c * QR + tx // ISSUE),
                                            Raw, bars, tx)
                    elif nblk > 0:
                        for s in T.unroll(NQ):
                            issue_stage(Indices, KV8, rs16, n_rows, bx, lim[0], 0, s, Raw, bars, tx, None)
            if tx < 128:
                chain0(Q_s, Qt_s, KV8, rs16, n_rows, Indices, bx, lim[0], nblk, st0, raw, Raw, bars, sc, nb, ph, tx,
                       Qsc_s)
                if ring:
                    tc.role_barrier(BAR_ALL, 256)  # warpgroup 1 may overwrite the ring only after our last block
            else:
                chain1(Q_s, Qt_s, KV8, rs16, n_rows, Indices, bx, lim[0], nblk, st1, raw, Raw, bars, sc, nb, ph, tx,
                       Qsc_s)
                if ring:
                    tc.role_barrier(BAR_ALL, 256)
                T.copy(acc_ot1, Mrg_s[0:D, :])
                for n in T.Parallel(BR):
                    Ml_s[0, n] = m_i1[n]
                    Ml_s[1, n] = l_i1[n]
            T.sync_threads()  # warpgroup 1's state published; both past every wgmma (Q_s is dead)
            if tx < 128:
                for n in T.Parallel(BR):
                    m_prev0[n] = T.max(m_i0[n], Ml_s[0, n])
                    alpha0[n] = T.exp2((m_i0[n] - m_prev0[n]) * c_log2)
                    l_blk0[n] = T.exp2((Ml_s[0, n] - m_prev0[n]) * c_log2)
                    l_i0[n] = l_i0[n] * alpha0[n] + Ml_s[1, n] * l_blk0[n]
                    m_i0[n] = m_prev0[n]
                T.copy(alpha0, Al_0)
                T.copy(l_blk0, Al_1)
                T.sync_threads(BAR_WG[0], 128)
                if f16:  # O^T of tile t carries 1 / its token scale
                    for d, n in T.Parallel(D, BR):
                        acc_ot0[d, n] = (acc_ot0[d, n] * Al_0[n] + Mrg_s[d, n] * Al_1[n]) * Sg_s[d // 128]
                else:
                    for d, n in T.Parallel(D, BR):
                        acc_ot0[d, n] = acc_ot0[d, n] * Al_0[n] + Mrg_s[d, n] * Al_1[n]
                T.sync_threads(BAR_WG[0], 128)  # every thread has read Al_0 before the epilogue rewrites it
                epilogue(acc_ot0, inv, l_i0, m_i0, Sink, Al_0, T.view(Q_s, dtype=bf16) if f16 else Q_s, Out, Lse,
                         MaxLogits, bx)

    return sparse_mla_fwd_narrow656_dual


@functools.lru_cache(maxsize=64)
def compiled(heads: int, sm_scale: float, has_sink: bool, has_topk_length: bool, prefetch: str = "ring"):
    func = build_sparse_mla_fwd_narrow656_dual(heads=heads, sm_scale=sm_scale, has_sink=has_sink,
                                               has_topk_length=has_topk_length, prefetch=prefetch)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [(f"narrow656_dual_{p}_h16_sink_tl",
             build_sparse_mla_fwd_narrow656_dual(heads=16, sm_scale=576 ** -0.5, has_sink=True, has_topk_length=True,
                                                 prefetch=p))
            for p in ("regs", "ring", "ring_er", "ringx", "ring_er_f16")]
