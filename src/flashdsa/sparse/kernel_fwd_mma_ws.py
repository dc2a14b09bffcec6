"""Few-head sparse MLA forward (bf16, H <= 16) on ``kernel_fwd_mma``'s per-warp ``mma.sync`` chains, with the row
copies issued by a producer warpgroup (sm_90a).

Notes
-----
Contract, host interface (``kernel_fwd.launch``) and numerics as ``kernel_fwd_mma`` (whose module notes describe
the consumers' schedule: a group of two warps per token splitting the dims, 16-key steps, the partial-S exchange,
the lazy softmax, PV on ``ldmatrix.trans``).  Why: in ``mma_c4`` each consumer warp spends ~29% of its step
issuing its share of the next stage's bulk copies (~72 cycles per copy, session 38), on the critical path.

  * **Roles.**  384 threads: warps 0-7 are four groups of two consumer warps (``setmaxnreg`` 240), each group its
    own token; warps 8-11 are producers (``setmaxnreg`` 24): warp 8 + g copies group g's rows (lane l < 16: row l
    of each 16-key step, one ``cp.async.bulk`` counted on the stage's full mbarrier; an invalid slot is zeroed and
    flagged, never read).  A group's two warps arrive on the stage's empty mbarrier after its PV; the producer
    waits on it before refilling.  2 stages of 16 rows per group (1168-byte row stride).
  * **Persistent.**  Grid min(ceil(T / 4), ``N_CTAS``); group g of CTA b takes tokens 4 b + g, 4 b + g + 4 grid, ..;
    its producer warp follows the same sequence.  Stage and parity follow a running step count across tokens.
Q's A fragments come from global memory per token: the 16 latent k steps into registers (as ``mma_c4``), the rope
(Dqk 576) into a per-group shared tile read by ``ldmatrix`` -- 8 registers fewer, so that ptxas can load B
fragments ahead of the products (session 40: with all 18 k steps in registers every B fragment went into the same
four registers, each ``ldmatrix`` waited out before its two products; 1.384 -> 1.369 ms).

Measured (H200, session 39, S 4096 over SKV 8192, H 16, topk 2048, ``--variants``): 1.386 / 1.387 ms (two calls;
sorted indices 1.387-1.390) against ``mma_c4``'s 1.422-1.423 and ``mma_c2q18``'s 1.435, outputs bitwise ``mma_c4``'s;
dispatched from 4 tokens per SM (``kernel_fwd_mma.MANY_TOKEN_FORM``).  128 tokens over SKV 65536: 0.170 ms (32 CTAs
on 132 SMs) against ``mma_c2q18``'s 0.094, so fewer tokens keep the other forms.  Two producer warps per group (512
threads, consumers at 232 registers with 84 B of spills): 1.457 ms; each group's rows spread over the four producer
warps (divergent per-lane token loops): 1.483 ms; three stages per group (flags in the rows' padding, one exchange
buffer with two barriers per step): 1.500 ms; the exchange in each warp's own rope half of the stage rows (so three
stages fit): 1.442 ms (two stages that way 1.435); all removed.
Session 40 (docs/PERFORMANCE.md "Session 40"; ABL 64 counters with the outputs kept): the consumers wait only
~150-200 cycles per 16-key step for their stage; the step is their own QK (~870-1,050 cycles: 18 ``ldmatrix`` + 36
``mma``) and softmax + PV (~800-1,070) on a shared-memory port ~67-79% busy, with the L2 at 86% of its throughput
delivering the rows (ncu; 25% more SM clock buys only 8% less time).  Measured and removed: rows by TMA with the
128B swizzle (128-byte aligned destinations: without products 1.35 -> 1.08 ms, but the swizzled addresses cost
registers: 1.387 vs 1.375 ms), also with three stages (1.46), two full barriers per stage (1.39), the next token's Q
loaded during the last step (no gain).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import tilelang
import tilelang.language as T

from .._tilelang import plain_pass_configs
from . import _tl_common as tc
from . import kernel_fwd_mma as km
from ._tl_common import D_V

MAX_HEADS = 16
THREADS = 384
N_CTAS = 132  # persistent CTAs (one per H200 SM)
EXPECTS_WGMMA = False

_SRC = km._SRC + r"""
// ABL 64: where warp `warp` of CTA bx puts its counters (see fdsa_mma_ws_kernel)
__device__ __forceinline__ unsigned *fdsa_mma_ws_counters(void *Outv, int bx, int warp) {
  return static_cast<unsigned *>(Outv) + 8 * (12 * bx + warp);
}
// The CTA: consumers (warps 0-7, groups of two) and producers (warps 8-11).  stage: [4 groups][2][16 rows][RS];
// valid: [4][2][16]; xch: [4][2 parity][512]; bars: 8 full (16 arrivals) then 8 empty (2 arrivals), group-major.
// ABL (timing builds, wrong results): 16 no PV, 32 no QK products, 64 per-warp clock counters written at the end
// over out's first words (tokens 0-3, which CTA 0 stores first; u32 words 8 (12 bx + warp) + 0..5, summed over the
// warp's tokens; consumers:
// cycles in the full-barrier waits, QK + exchange store, the exchange barrier, the rest of the step (exchange sum,
// softmax, PV, release), the loop, steps; producers: cycles in the empty-barrier waits, in the copies' issue, the
// loop, steps).  The outputs stay written: without them the products are dead code.
// The rope's Q fragments (Dqk 576) come by ldmatrix from qrope ([4 groups][16 heads][64 dims], 128-byte rows, chunk
// c of head h at c ^ (h & 7); written per token by the group), not from 8 registers: with all of Q in registers
// ptxas has no register left to load a B fragment before the products of the one before (SASS, session 40).
template <int H, int DQK, int HAS_SINK, int HAS_TL, int ABL = 0>
__device__ __forceinline__ void fdsa_mma_ws_kernel(const void *Qv, const void *KVv, int n_rows, int n_tok,
                                                   const int *Indices, int topk, const int *TopkLen,
                                                   const float *Sink, void *Outv, float *Lse, float *MaxLogits,
                                                   void *stage_v, int *valid, float *xch, void *qrope_v, void *bars_v,
                                                   int bx, int grid, float c) {
  constexpr int ROW = 2 * DQK, RS = ROW + 16, NROPE = (DQK - 512) / 32, NQ = 16 + NROPE;
  constexpr int NQR = 16;  // k steps whose Q fragments stay in registers (the latent ones)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, r = lane >> 2, q = lane & 3;
  unsigned char *stage = static_cast<unsigned char *>(stage_v);
  const unsigned stage_s = static_cast<unsigned>(__cvta_generic_to_shared(stage));
  const unsigned bars = static_cast<unsigned>(__cvta_generic_to_shared(bars_v));
  const int g = warp < 8 ? warp >> 1 : warp - 8;
  auto token_lim = [&](int tok) -> int {
    int lim = topk;
    if (HAS_TL) {
      lim = TopkLen[tok];
      lim = lim < 0 ? 0 : (lim > topk ? topk : lim);
    }
    return lim;
  };
  if (warp >= 8) {  // ---- producer of group g
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (lane >= 16) return;
    const unsigned char *kv = static_cast<const unsigned char *>(KVv);
    unsigned cw = 0, ci = 0, cl = 0;
    const unsigned cl0 = (ABL & 64) ? clock() : 0u;
    int n = 0;
    for (int tok = 4 * bx + g; tok < n_tok; tok += 4 * grid) {
      const int lim = token_lim(tok), nsteps = (lim + 15) >> 4;
      const int *idx = Indices + static_cast<long long>(tok) * topk;
      int row = lane < lim ? idx[lane] : -1;
      for (int it = 0; it < nsteps; ++it, ++n) {
        const int s = n & 1, slot = 16 * (it + 1) + lane;
        const int nrow = (it + 1 < nsteps && slot < lim) ? idx[slot] : -1;
        unsigned c0 = (ABL & 64) ? clock() : 0u;
        if (n >= 2) fdsa_wait_parity(bars + 8 * (8 + 2 * g + s), ((n >> 1) - 1) & 1);
        if (ABL & 64) fdsa_clock_lap(cw, c0);
        const int ok = row >= 0 && row < n_rows, bi = 2 * g + s;
        valid[bi * 16 + lane] = ok;
        fdsa_bulk_row<ROW>(stage_s + (bi * 16 + lane) * RS, kv + static_cast<long long>(ok ? row : 0) * ROW,
                          bars + 8 * bi, ok, stage + (bi * 16 + lane) * RS);
        if (ABL & 64) ci += clock() - c0;
        row = nrow;
      }
    }
    if (ABL & 64) {
      cl = clock() - cl0;
      if (lane == 0) fdsa_put_counters(fdsa_mma_ws_counters(Outv, bx, warp), cw, ci, 0u, 0u, cl, n);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int hh = warp & 1;
  // per-lane ldmatrix addresses (kernel_fwd_mma's): B of QK (rows as n), B of PV (transposed)
  const unsigned ka = ((lane & 7) + 8 * (lane >> 4)) * RS + 16 * ((lane >> 3) & 1) + 512 * hh;
  const unsigned kr = ((lane & 7) + 8 * (lane >> 4)) * RS + 16 * ((lane >> 3) & 1) + 1024 + 64 * hh;
  const unsigned va = ((lane & 7) + 8 * ((lane >> 3) & 1)) * RS + 16 * (lane >> 4) + 512 * hh;
  // the rope's A fragments: head lane % 16, dims 32 hh + 8 (lane / 16) of k step 16 (17: chunk ^ 2, address ^ 32)
  const unsigned qrope_s = static_cast<unsigned>(__cvta_generic_to_shared(qrope_v)) + g * 2048;
  const unsigned qra = qrope_s + (lane & 15) * 128 + 16 * ((4 * hh + (lane >> 4)) ^ (lane & 7));
  unsigned cw = 0, cq = 0, cb = 0, cr = 0, cl = 0;
  const unsigned cl0 = (ABL & 64) ? clock() : 0u;
  int n = 0;
  for (int tok = 4 * bx + g; tok < n_tok; tok += 4 * grid) {
    const int lim = token_lim(tok), nsteps = (lim + 15) >> 4;
    unsigned qreg[NQR][4];  // {a0, a1, a2, a3} = heads r / r + 8, dims d + 2 q (+1) / d + 8 + 2 q (+1)
    if (NROPE) {  // the group's rope tile: after the last step's exchange barrier nobody reads the old one
      for (int i = 32 * hh + lane; i < 128; i += 64) {
        const int h = i >> 3, ch = i & 7;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (h < H)
          w = reinterpret_cast<const uint4 *>(static_cast<const unsigned short *>(Qv) +
                                              (static_cast<long long>(tok) * H + h) * DQK + 512)[ch];
        *reinterpret_cast<uint4 *>(static_cast<unsigned char *>(qrope_v) + g * 2048 + h * 128 + 16 * (ch ^ (h & 7))) =
            w;
      }
      asm volatile("bar.sync %0, 64;" :: "r"(1 + g) : "memory");
    }
    {
      const unsigned *q0 = static_cast<const unsigned *>(Qv) + (static_cast<long long>(tok) * H + r) * (DQK / 2);
      const unsigned *q1 = q0 + 4 * DQK;  // 8 heads on
#pragma unroll
      for (int s = 0; s < NQR; ++s) {
        const int d = (s < 16 ? 256 * hh + 16 * s : 512 + 32 * hh + 16 * (s - 16)) / 2 + q;
        qreg[s][0] = r < H ? q0[d] : 0u;
        qreg[s][1] = r + 8 < H ? q1[d] : 0u;
        qreg[s][2] = r < H ? q0[d + 4] : 0u;
        qreg[s][3] = r + 8 < H ? q1[d + 4] : 0u;
      }
    }
    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
    float m0 = -1e30f, m1 = -1e30f, t0 = -1e30f, t1 = -1e30f, l0 = 0.f, l1 = 0.f;
    for (int it = 0; it < nsteps; ++it, ++n) {
      const int bi = 2 * g + (n & 1);
      unsigned c0 = (ABL & 64) ? clock() : 0u;
      fdsa_wait_parity(bars + 8 * bi, (n >> 1) & 1);
      if (ABL & 64) fdsa_clock_lap(cw, c0);
      const unsigned sb = stage_s + bi * 16 * RS;
      float acc[2][2][4];
#pragma unroll
      for (int e = 0; e < 16; ++e) acc[e >> 3][(e >> 2) & 1][e & 3] = 0.f;
      if (!(ABL & 32)) {
#pragma unroll
        for (int s = 0; s < NQ; ++s) {
          unsigned b[4], qa[4];
          fdsa_mma_ldm(sb + (s < 16 ? ka + 32 * s : kr + 32 * (s - 16)), b);
          if (s >= NQR) fdsa_mma_ldm(qra ^ (32u * (s - 16)), qa);
          const unsigned *af = s < NQR ? qreg[s < NQR ? s : 0] : qa;
          fdsa_mma_bf16_16816(acc[s & 1][0], af, b[0], b[1]);
          fdsa_mma_bf16_16816(acc[s & 1][1], af, b[2], b[3]);
        }
      }
      int vd[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int b = 0; b < 2; ++b) vd[j][b] = valid[bi * 16 + 8 * j + 2 * q + b];
      float part[2][4], S[2][4];
      float *xb = xch + (2 * g + (n & 1)) * 512;  // [hh][j][lane][4]
      fdsa_mma_xch_put(acc, xb, hh, lane, part);
      if (ABL & 64) fdsa_clock_lap(cq, c0);
      asm volatile("bar.sync %0, 64;" :: "r"(1 + g) : "memory");
      if (ABL & 64) fdsa_clock_lap(cb, c0);
      fdsa_mma_xch_sum(part, vd, xb, hh, lane, S);
      fdsa_mma_softmax_pv<!(ABL & 16)>(S, c, m0, m1, t0, t1, l0, l1, o, sb + va);
      __syncwarp();  // every lane's ldmatrix of the stage is done before the release
      if (lane == 0)
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bars + 8 * (8 + bi)) : "memory");
      if (ABL & 64) cr += clock() - c0;
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    fdsa_mma_store_group<H, HAS_SINK>(o, m0, m1, t0, t1, l0, l1, c, Sink, Outv, Lse, MaxLogits, tok, r, q, hh);
  }
  if (ABL & 64) {
    cl = clock() - cl0;
    if (lane == 0) fdsa_put_counters(fdsa_mma_ws_counters(Outv, bx, warp), cw, cq, cb, cr, cl, n);
  }
}
"""


def build_sparse_mla_fwd_mma_ws(*, heads: int, dqk: int, sm_scale: float, has_sink: bool = False,
                                has_topk_length: bool = False, n_ctas: int = N_CTAS, ablate: int = 0):
    """prim_func as ``kernel_fwd_mma.build_sparse_mla_fwd_mma`` (H <= 16, Dqk 512 / 576, any topk); ``ablate``:
    the ABL bits of a timing build (``fdsa_mma_ws_kernel``)."""
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"sparse mma_ws forward: H={heads} not in 1..{MAX_HEADS}")
    if dqk not in (512, 576):
        raise ValueError(f"sparse mma_ws forward: Dqk={dqk} not in (512, 576)")
    assert sm_scale > 0
    c_log2 = float(sm_scale) * tc.LOG2E
    bf16, f32, i32, u8 = "bfloat16", "float32", "int32", "uint8"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    rs = 2 * dqk + 16
    fn = f"fdsa_mma_ws_kernel<{heads}, {dqk}, {int(has_sink)}, {int(has_topk_length)}, {int(ablate)}>"

    @T.prim_func
    def sparse_mla_fwd_mma_ws(
        Q: T.Tensor([n_tok, heads, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D_V], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        with T.Kernel(T.min((n_tok + 3) // 4, n_ctas), threads=THREADS, prelude=_SRC) as bx:
            Stage = T.alloc_shared([4 * 2 * 16 * rs], u8)
            Valid = T.alloc_shared([4 * 2 * 16], i32)
            Xch = T.alloc_shared([4 * 2 * 512], f32)
            Qrope = T.alloc_shared([4 * 2048 if dqk == 576 else 16], u8)
            bars = T.alloc_barrier([16] * 8 + [2] * 8)
            T.call_extern("handle", fn, T.address_of(Q[0, 0, 0]), T.address_of(KV[0, 0]), n_kv, n_tok,
                          T.address_of(Indices[0, 0]), topk_dim, T.address_of(TopkLen[0]), T.address_of(Sink[0]),
                          T.address_of(Out[0, 0, 0]), T.address_of(Lse[0, 0]), T.address_of(MaxLogits[0, 0]),
                          T.address_of(Stage[0]), T.address_of(Valid[0]), T.address_of(Xch[0]),
                          T.address_of(Qrope[0]), T.address_of(bars[0]), bx, T.min((n_tok + 3) // 4, n_ctas), c_log2)

    return sparse_mla_fwd_mma_ws


@functools.lru_cache(maxsize=32)
def _build(heads, dqk, sm_scale, has_sink, has_topk_length, ablate=0):
    func = build_sparse_mla_fwd_mma_ws(heads=heads, dqk=dqk, sm_scale=sm_scale, has_sink=has_sink,
                                       has_topk_length=has_topk_length, ablate=ablate)
    return tilelang.compile(func, target="cuda", pass_configs=plain_pass_configs())


def _compiled(heads: int, dqk: int, d_v: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool):
    """``kernel_fwd.launch``'s compiled-kernel signature (n_blocks unused: dynamic trip count)."""
    assert d_v == D_V, d_v
    return _build(heads, dqk, sm_scale, has_sink, has_topk_length)


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [("mma_ws_h16_d576_sink_tl", build_sparse_mla_fwd_mma_ws(heads=16, dqk=576, sm_scale=576 ** -0.5,
                                                                     has_sink=True, has_topk_length=True)),
            ("mma_ws_h5_d512", build_sparse_mla_fwd_mma_ws(heads=5, dqk=512, sm_scale=0.05))]


def _bench_variants(shapes=("prefill", "sorted", "decode")):
    """Kernel times against ``kernel_fwd_mma``'s dispatched forms (``python -m flashdsa.sparse.kernel_fwd_mma_ws
    --variants [--shapes a,b]``; the same shapes as ``kernel_fwd_mma --variants``), outputs compared."""
    import torch

    from ..bench.flops import sparse_fwd_flops
    from ..bench.harness import time_fn
    from . import kernel_fwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in shapes:
        S, SKV = {"prefill": (4096, 8192), "sorted": (4096, 8192), "decode": (128, 65536)}[shape]
        q, kv, idx = kernel_fwd._prefill_inputs(gen, S=S, SKV=SKV, H=16, topk=2048)
        if shape == "sorted":
            idx = idx.sort(dim=-1).values.contiguous()
        flops = sparse_fwd_flops(16, idx.numel(), 576, D_V)
        ref = None
        for label, compiled in (("mma_c4", functools.partial(km._compiled, form="mma_c4")),
                                ("mma_c2q18", functools.partial(km._compiled, form="mma_c2q18")),
                                ("mma_ws", _compiled)):
            def fn(c=compiled):
                return kernel_fwd.launch(c, q, kv, idx, sm_scale=576**-0.5, d_v=D_V)

            out = fn()
            ref = out if ref is None else ref
            err = [(a.float() - b.float()).abs().max().item() for a, b in zip(out, ref)]
            t = time_fn(lambda _: fn(), [None], q.device, reps=10)
            print(f"variant {shape} S {S} {label}: {t.ms_median:.4f} ms, {flops / t.ms_median / 1e9:.1f} TFLOP/s "
                  f"(max |diff| vs mma_c4 {err[0]:.2e} / {err[1]:.2e} / {err[2]:.2e})", flush=True)


if __name__ == "__main__":
    import sys

    argv = sys.argv[1:]
    if "--variants" in argv:
        _bench_variants(tuple(argv[argv.index("--shapes") + 1].split(",")) if "--shapes" in argv
                        else ("prefill", "sorted", "decode"))
