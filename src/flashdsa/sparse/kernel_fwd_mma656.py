"""Few-head sparse MLA forward over the 656-byte FP8 cache on per-warp ``mma.sync`` chains (H <= 16, sm_90a).

Notes
-----
Contract, signature and numerics as ``kernel_fwd_narrow656`` (q bf16 [T, H, 576], the cache as 16-byte chunks,
``rs16`` / ``n_rows``, Indices [T, topk], topk_length, sink, out bf16 [T, H, 512], lse / max_logits f32); one
CTA of 8 warps per token.  Why another form: the wgmma forms (``kernel_fwd_narrow656`` / ``_dual``) convert every
row into a bf16 / f16 tile in shared memory and run one serial chain per warpgroup (convert, QK, softmax, PV: ~6
us per 64-row block, PERFORMANCE.md session 13).  Here no converted tile exists at all:

  * **Key groups.**  Warps 2g and 2g + 1 form group g (4 groups); group g takes the 16-key chunks g, g + 4, ... of
    the token's top-k and keeps its own online softmax; the four groups are merged at the end (as split-KV).  So
    four independent chains per SM, each step 16 keys, no CTA-wide barrier inside the loop.
  * **Raw rows straight into fragments.**  Each group has ``NST`` raw stages of 16 rows (one ``cp.async.bulk`` of 656
    bytes per row, mbarrier ``expect_tx``; an invalid slot's row is zeroed by its issuing lane and flagged in
    ``Valid``).  The row numbers come in blocks of 4 steps (one load per lane, a block ahead, handed out by shuffles),
    so no index load sits on a step's refill.  The ``mma_par`` build places each warp's 8 rows so that a row's shared
    slot and its source agree in address bit 4 where it can (``fdsa_m656_parity_slot``; a copy shifted 16 bytes modulo
    32 against its source is slower; session 40).  A warp loads the e4m3 bytes it needs into registers and converts
    them with ``cvt.rn.f16x2.e4m3x2`` (exact) straight into ``m16n8k16`` B fragments.  The contraction order inside a
    16-wide k step is free, so lane quad q takes 4 consecutive dims per step (bytes [32 q, +32) of a 128-dim tile over
    its 8 steps: two 16-byte loads per key and tile); Q' is stored in that order as ready A fragments (one 16-byte
    load per lane and k step, no register moves), the bf16 rope likewise.
  * **Producer warps (``mma_ws`` builds, to measure).**  As ``kernel_fwd_mma_ws`` does for bf16 rows: 384 threads,
    warp 8 + g issues group g's 16 copies per step (``fdsa_m656_producer``; ``setmaxnreg`` 24 / 240) and the two
    consumer warps release a stage on an empty mbarrier after its PV, so no consumer spends ~8 x 72 cycles per step
    issuing copies (session 38's per-copy cost); ``mma_ws_par`` adds the PAR placement over the 16 rows.
  * **The pair splits the dims.**  Warp h of a group (h = 0 / 1) owns latent tiles 2h, 2h + 1 (and h = 0 the bf16
    rope): its QK partial over its dims, in true units (each tile's accumulator times the row's tile scale, times
    the head's power of two of Q), goes through shared memory; both warps add the two partials in the same order
    (bitwise the same S), run the same softmax, and each accumulates O for its own 256 output dims (128 fp32
    registers per thread).
  * **PV from raw bytes.**  P (f16) is the A fragment (the S accumulator layout reused); V's B fragment needs two
    consecutive keys of one dim per register: one ``prmt`` per two n-tiles pairs the bytes of two rows, then the
    exact conversion.  The output dims are permuted the same way (lane r of a quad loads dims [16 r, +16) of a
    tile: n-tile i holds dim 16 n + i) and put back in order at the merge.
  * **Scales.**  S = sum over tiles of s_t(row) (Q'_t K8_t) 2^e(head), with Q' = f16(q 2^-e) (each head's largest
    in [2^13, 2^14): bf16 -> f16 exact there) and K8 the e4m3 values (exact in f16).  For PV, each warp keeps a
    running reference sigma_t per tile (the largest row scale seen so far): P is multiplied by s_t(row) / sigma_t
    (<= 1, a power of two for the format's scales, so exact) before the f16 cast, and O_t is rescaled when sigma_t
    grows (exact power-of-two ratio) and multiplied by sigma_t at the merge.  Rows whose tile scale is 2^14 below
    sigma_t lose low bits in f16, as in ``kernel_fwd_narrow656_dual``'s f16 form (module notes there).
Numerics otherwise as the other kernels: fp32 accumulators and softmax state, exp2 with ``sm_scale * log2(e)``
folded, a finite running-max start (-1e30) -- the exp reference moves only when a max grows by more than 2^8 in the
exp2 domain (so P <= 2^8; the true max is kept apart for max_logits) -- invalid rows never read (zeroed, score
-inf), natural-log lse without the sink, empty rows -> out 0, lse +inf, max_logits -inf;
``inv = 1 / (l + 2^(sink log2 e - m c))``.

Measured (H200, H 16, topk 2048, ``python -m flashdsa.sparse.kernel_fwd_narrow656 --variants``; the history and its
JSONs in docs/PERFORMANCE.md "Session 32" to "Session 35").  Against the two-warpgroup form (session 33): decode B 128
over 32768 rows per token 75.1 vs 98.9 us, B 512 268.6 vs 358.4, prefill S 4096 over SKV 8192 2.026 vs 2.550 ms:
``kernel_fwd_fp8cache.FEW_HEAD_FORM`` runs it at every H <= 16 call, as the "mma_ws" build (4 producer warps issue
the copies) since session 43: B 128 71.3 us, B 512 246.8, S 4096 1.674 ms against "mma"'s 73.6 / 269.8 / 1.999.
Since session 34 (95ed1cf; the merge stores
straight to global): B 128 73.3-73.7 us (suite 2.38-2.40 TB/s), B 512 263-264, S 4096 1.984 ms.  Without any QK or
PV product (ABL 48) B 128 takes 65.9 us; the timestamp build (ABL 64, ``scripts/mma656_timestamps.py``) shows ~6.4
us before the first copies go out, then 1.98 us per 16-key step against 1.44 without products; ncu: ~705
instructions per warp and step.  Measured slower (PERFORMANCE.md): one producer warp issuing every copy, rows or half
rows by 16-byte ``cp.async`` pieces, an integer-op e4m3 -> f16 conversion, QK on ``mma.sync.m16n8k32.e4m3``.
Shared memory: stages 4 x ``NST`` x 16 x 656 B (NST 4: 167,936 B; they hold the merge buffer at the end),
Q' 16 KB, rope 2 KB, partial-S exchange 16 KB, flags and barriers.
The per-warp fragment work is an extern device function (``fdsa_m656_kernel``): TileLang's tile operators express
block-wide gemms, not independent per-warp ``mma.sync`` chains with their own softmax state.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import tilelang
import tilelang.language as T

from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from ._tl_common import LOG2E
from ._mma656_parts import M656_HELPERS
from ._warp_mma import WARP_MMA_PRELUDE
from .kernel_fwd_narrow656 import _pass_configs

MAX_HEADS = 16
GROUPS = 4  # key groups (pairs of warps)
NST = 4  # raw stages of 16 rows per group
CHUNK = 16  # keys per step
THREADS = 256
EXPECTS_WGMMA = False  # tests/test_lowering.py: mma.sync by design (m16n8k16 fits 16 heads; no wgmma)

_SRC = tc.FAST_EXP2_PRELUDE + WARP_MMA_PRELUDE + f"""
#define FDSA_M656_G {GROUPS}
#define FDSA_M656_NST {NST}
#define FDSA_M656_ROW {fc.ROW_BYTES}
""" + M656_HELPERS + r"""
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


def form(name: str) -> tuple[int, bool, bool]:
    """(``ablate`` bits, ``parity``, ``producer``) of a form name "mma[_ws][_par][_a<N>]": "_ws" the producer-warp
    build (``fdsa_m656_kernel``'s WS), "_par" rows placed by their source address's bit 4
    (``fdsa_m656_parity_slot``), "_a<N>" a timing build with the ABL bits N."""
    rest = name.removeprefix("mma")
    producer = rest.startswith("_ws")
    rest = rest.removeprefix("_ws")
    parity = rest.startswith("_par")
    rest = rest.removeprefix("_par")
    if not name.startswith("mma") or (rest and not (rest.startswith("_a") and rest[2:].isdigit())):
        raise ValueError(f"narrow: unknown mma form {name!r}")
    return int(rest[2:] or 0), parity, producer


def build_sparse_mla_fwd_mma656(*, heads: int, sm_scale: float, has_sink: bool = False,
                                has_topk_length: bool = False, ablate: int = 0, parity: bool = False,
                                producer: bool = False, out_f32: bool = False):
    """prim_func with ``kernel_fwd_narrow656.build_sparse_mla_fwd_narrow656``'s signature (Q[T,H,576] bf16, KV8 /
    KVf / KVb: 16-byte-chunk views of the cache, rs16, n_rows, Indices[T,topk], TopkLen, Sink, Out, Lse,
    MaxLogits); H <= 16, any topk.  ``ablate``: the kernel's ABL bits (``form``; timing builds); ``parity``: the
    PAR build (rows in slots of their source address's 32-byte phase); ``producer``: the WS build (4 producer
    warps, 384 threads); ``out_f32``: Out float32 (split-KV partials, the OF32 build), and Q [n_q, H, 576] with
    n_q dividing T: rows t read q row t / (T / n_q) (a token's chunks share its q row)."""
    assert 1 <= heads <= MAX_HEADS, heads
    assert not (out_f32 and ablate), "timing builds write bf16"
    assert not ablate & 64 or heads == 16, "the timestamp build writes 4096 words per token"

    assert sm_scale > 0
    c_log2 = float(sm_scale) * LOG2E
    bf16, f32, i32, u8 = "bfloat16", "float32", "int32", "uint8"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    n_q = T.dynamic("n_q") if out_f32 else n_tok  # split-KV: one q row per token, n_tok / n_q chunk rows each
    CH = fc.CHUNK
    stage_bytes = GROUPS * NST * CHUNK * fc.ROW_BYTES
    assert stage_bytes >= GROUPS * 2 * 32 * 32 * 4 * 4  # the merge buffer
    fn = (f"fdsa_m656_kernel<{heads}, {int(has_sink)}, {int(has_topk_length)}, {int(ablate)}, {int(parity)}, "
          f"{int(producer)}" + (", 1>" if out_f32 else ">"))

    @T.prim_func
    def sparse_mla_fwd_mma656(
        Q: T.Tensor([n_q, heads, fc.DQK], bf16),
        KV8: T.Tensor([n_ch, CH], fc.FP8),
        KVf: T.Tensor([n_ch, CH // 4], f32),
        KVb: T.Tensor([n_ch, CH // 2], bf16),
        rs16: T.int32,
        n_rows: T.int32,
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, fc.D_V], f32 if out_f32 else bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(n_tok, threads=THREADS + 128 * producer, prelude=_SRC) as bx:
            Stage = T.alloc_shared([stage_bytes], u8)
            Qs = T.alloc_shared([MAX_HEADS * 1024], u8)
            Xch = T.alloc_shared([GROUPS * 2 * 512], f32)
            Qr = T.alloc_shared([MAX_HEADS * 128], u8)
            Valid = T.alloc_shared([GROUPS * NST * CHUNK], i32)
            Misc = T.alloc_shared([32 + GROUPS * 32 + GROUPS * 4 + GROUPS * 16], f32)
            bars = T.alloc_barrier([CHUNK] * (GROUPS * NST) + [2] * (GROUPS * NST * producer))
            T.call_extern("handle", fn, T.address_of(Q[0, 0, 0]), T.address_of(KV8[0, 0]), rs16, n_rows,
                          T.address_of(Indices[0, 0]), topk_dim, T.address_of(TopkLen[0]), T.address_of(Sink[0]),
                          T.address_of(Out[0, 0, 0]), T.address_of(Lse[0, 0]), T.address_of(MaxLogits[0, 0]),
                          T.address_of(Stage[0]), T.address_of(Qs[0]), T.address_of(Qr[0]), T.address_of(Xch[0]),
                          T.address_of(Valid[0]), T.address_of(Misc[0]), T.address_of(bars[0]), bx, c_log2,
                          *((n_tok // n_q,) if out_f32 else ()))

    return sparse_mla_fwd_mma656


@functools.lru_cache(maxsize=64)
def compiled(heads: int, sm_scale: float, has_sink: bool, has_topk_length: bool, name: str = "mma",
             out_f32: bool = False):
    ablate, parity, producer = form(name)
    func = build_sparse_mla_fwd_mma656(heads=heads, sm_scale=sm_scale, has_sink=has_sink,
                                       has_topk_length=has_topk_length, ablate=ablate, parity=parity,
                                       producer=producer, out_f32=out_f32)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("mma656_h16_sink_tl", build_sparse_mla_fwd_mma656(heads=16, sm_scale=576 ** -0.5, has_sink=True,
                                                           has_topk_length=True)),
        ("mma656_h3", build_sparse_mla_fwd_mma656(heads=3, sm_scale=0.05)),
        ("mma656_h16_par", build_sparse_mla_fwd_mma656(heads=16, sm_scale=576 ** -0.5, parity=True)),
        ("mma656_h16_ws_sink_tl", build_sparse_mla_fwd_mma656(heads=16, sm_scale=576 ** -0.5, has_sink=True,
                                                              has_topk_length=True, producer=True)),
        ("mma656_h5_ws_par", build_sparse_mla_fwd_mma656(heads=5, sm_scale=0.05, parity=True, producer=True)),
        ("mma656_h16_ws_tl_f32", build_sparse_mla_fwd_mma656(heads=16, sm_scale=0.05, has_topk_length=True,
                                                            producer=True, out_f32=True)),
    ]
