"""Sparse MLA forward over the 656-byte FP8 cache for few heads (H <= 32): bulk row copies, keys on wgmma M.

Notes
-----
Contract, signature and numerics as ``kernel_fwd_fp8cache.build_sparse_mla_fwd_fp8cache`` (q bf16 [T, H, 576], the
cache as 16-byte chunks, bf16 compute on ``bf16(float(e4m3) * scale)``, exact); tile shape as
``kernel_fwd_narrow`` (one CTA of 128 threads per token, each block of 64 top-k rows on the wgmma M side, the
heads zero-padded to ``BR`` = 16 / 32 on N: ``S^T = K Q^T``, ``O^T += V^T P^T``; ``_tl_common.narrow_macros``).
``kernel_fwd_fp8cache.run_sparse_mla_fwd`` runs it for H 17..32 (H <= 16: ``kernel_fwd_narrow656_dual``'s default form;
``$FLASHDSA_NARROW_CACHE656``: "1" this kernel up to H 32, "0" the 64-head kernel).

  * **Gather**: one ``cp.async.bulk`` of the whole 656-byte row per top-k slot into a raw stage ``[64, 656]``
    bytes, completing on the stage's mbarrier (``arrive.expect_tx`` of 656 bytes per valid row).  An invalid slot
    (-1, out of range, past topk_length) is never read: its thread zeroes the stale raw row and only arrives, so
    the row converts to zeros (V stays finite under ``P V``) and its score is -inf.  Thread ``2 r`` handles row
    ``r``: a warp issues its lanes' bulk copies one after another (the instruction takes uniform registers, ncu
    shows an ELECT / R2UR / UBLKCP loop), so the 64 copies are spread over all four warps.  ``NS`` stages: blocks
    ``it + 1 .. it + NS - 1`` are in flight while block ``it`` is converted and attended.
  * **Conversion** (all 128 threads; thread t: row ``t % 64``, dims ``[256 (t / 64), +256)`` = two scale tiles,
    then 4 of the row's 8 rope chunks): 16-byte shared loads of the raw row, ``fdsa_cvt_e4m3x16`` (the
    exact conversion of ``kernel_fwd_pair_cache``), 16-byte stores into the swizzled bf16 tile.  A
    quarter warp touches 8 consecutive rows: 8 different 16-byte bank groups for the loads (656-byte row stride)
    and for the swizzled stores.
  * Then ``fence.proxy.async`` + ``__syncthreads``, QK, the mask (recomputed from ``Indices``), softmax, PV
    (``narrow_macros``), ``__syncthreads`` (the tile is rewritten by the next block).
Shared memory (BR 16, NS 3): raw 3 x 41,984 + bf16 tile 65,536 + rope 8,192 + Q 18,432 + S^T 4,096 + P 2,048 B
(225,280 B); BR 32 uses NS 2.  168 registers, no spills.

Measured (H200, session 11, ``--variants``; docs/PERFORMANCE.md): 128 decode tokens, H 16, topk 2048 over 32768
rows each (172 MB of cache rows): the 64-head kernel 171.6 us (1.00 TB/s), this kernel 132.2 us (1.30 TB/s); a
first version with the copies on warps 0-1 only, 146 us; per-thread cp.async of half rows instead of bulk copies,
164 us.  Prefill S 4096, SKV 8192, H 16: 4.97 -> 3.91 ms.  ncu of the first version (decode shape): one warp per
scheduler, IPC 0.89, 4.5 cycles per issued instruction; samples: bulk-copy issue 21%, the barrier before QK 13%
(warps 2-3 waiting for warps 0-1's copies), conversion 25%, QK 4%, softmax 10%, PV 9%.  What is left is a
serial per-block chain (conversion, then QK / softmax / PV) in one warpgroup: overlapping the conversion of
block i + 1 with the products of block i needs a second bf16 tile, which does not fit next to the raw stages.
GPU tests: tests/sparse_mla/test_kernel_narrow656_gpu.py, test_kernel_fp8cache_gpu.py, tests/decode/test_sparse_gpu.py.

The two-warpgroup forms (H <= 16) are ``kernel_fwd_narrow656_dual``; ``--variants`` times them against this kernel.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import tilelang
import tilelang.language as T

from .._tilelang import plain_pass_configs
from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from . import kernel_fwd_narrow as _kn
from ._pair_cache_src import _DEQUANT_SRC
from ._tl_common import BLOCK_I, D_V, LOG2E

MAX_HEADS = _kn.MAX_HEADS
ROW = fc.ROW_BYTES  # 656
ROPE_BYTE = fc.ROPE_CHUNK0 * fc.CHUNK  # 528
SCALE_BYTE = fc.SCALE_CHUNK * fc.CHUNK  # 512

_SRC = _DEQUANT_SRC + r"""
// one 656-byte cache row -> shared memory, completing on an mbarrier; an invalid row is zeroed, then arrives
__device__ __forceinline__ void fdsa_bulk_row(void *dst, const void *src, void *bar, int ok) {
  const unsigned b = (unsigned)__cvta_generic_to_shared(bar);
  if (ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads of the old stage -> async write
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(656) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 656, [%2];"
                 :: "r"(d), "l"(src), "r"(b) : "memory");
  } else {  // nothing is read; the row's stale bytes become zeros (they convert to zeros: V stays finite)
#pragma unroll
    for (int k = 0; k < 41; ++k) reinterpret_cast<uint4 *>(dst)[k] = make_uint4(0u, 0u, 0u, 0u);
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(b) : "memory");
  }
}
// 64 e4m3 bytes in w[0..15] -> bf16 dims at l_i (first 8) / h_i (last 8) of chunk i, scale = the bits of s
__device__ __forceinline__ void fdsa_regs_dequant64(const unsigned *w, void *l0, void *h0, void *l1, void *h1,
                                                    void *l2, void *h2, void *l3, void *h3, unsigned s) {
  void *lo[4] = {l0, l1, l2, l3}, *hi[4] = {h0, h1, h2, h3};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const unsigned in[4] = {w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]};
    unsigned o[8];
    fdsa_cvt_e4m3x16(in, o, __uint_as_float(s));
    *reinterpret_cast<uint4 *>(lo[c]) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4 *>(hi[c]) = make_uint4(o[4], o[5], o[6], o[7]);
  }
}
// 4 x 16 bytes in w[0..15] -> d_i
__device__ __forceinline__ void fdsa_regs_store4x16(const unsigned *w, void *d0, void *d1, void *d2, void *d3) {
  void *d[4] = {d0, d1, d2, d3};
#pragma unroll
  for (int c = 0; c < 4; ++c)
    *reinterpret_cast<uint4 *>(d[c]) = make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]);
}
// 64 bytes at src (shared memory, 16-byte aligned) -> w[0..15], four 16-byte loads
__device__ __forceinline__ void fdsa_ld64(const void *src, unsigned *w) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint4 v = reinterpret_cast<const uint4 *>(src)[c];
    w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
  }
}
// 64 raw e4m3 bytes at src (shared memory) -> as fdsa_regs_dequant64 (all four loads first)
__device__ __forceinline__ void fdsa_dequant64(const void *src, void *l0, void *h0, void *l1, void *h1, void *l2,
                                               void *h2, void *l3, void *h3, float s) {
  unsigned w[16];
  fdsa_ld64(src, w);
  fdsa_regs_dequant64(w, l0, h0, l1, h1, l2, h2, l3, h3, __float_as_uint(s));
}
// 4 rope chunks (16 bytes each) from src (shared memory) -> d_i
__device__ __forceinline__ void fdsa_copy4x16(const void *src, void *d0, void *d1, void *d2, void *d3) {
  void *d[4] = {d0, d1, d2, d3};
#pragma unroll
  for (int c = 0; c < 4; ++c) *reinterpret_cast<uint4 *>(d[c]) = reinterpret_cast<const uint4 *>(src)[c];
}
"""


def stages_for(heads: int) -> int:
    """Raw stages that fit next to the rest of shared memory (BR 16: 3, BR 32: 2)."""
    return 3 if _kn.rows_tile(heads) == 16 else 2


def build_sparse_mla_fwd_narrow656(*, heads: int, sm_scale: float, has_sink: bool = False,
                                   has_topk_length: bool = False, stages: int | None = None):
    """prim_func with ``kernel_fwd_fp8cache.build_sparse_mla_fwd_fp8cache``'s signature (Q[T,H,576] bf16, KV8 /
    KVf / KVb: 16-byte-chunk views of the cache, rs16, n_rows, Indices[T,topk], TopkLen, Sink, Out, Lse,
    MaxLogits); any topk (dynamic trip count), H <= 32."""
    BR = _kn.rows_tile(heads)
    NS = stages_for(heads) if stages is None else stages
    BI, D, DT, CH = BLOCK_I, D_V, fc.D_TAIL, fc.CHUNK
    assert sm_scale > 0 and NS >= 2, NS
    c_log2 = float(sm_scale) * LOG2E
    bf16, f32, i32, u8 = "bfloat16", "float32", "int32", "uint8"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    _row = tc.make_slot_row(topk_dim)
    load_q, normaliser, _, store_lse = tc.padded_head_macros(
        BH=BR, D=D, D_tail=DT, dqk=fc.DQK, heads=heads, c_log2=c_log2, has_sink=has_sink, dtype=bf16)
    qk_t, softmax_pv, _ = tc.narrow_macros(BR=BR, BI=BI, D=D, has_tail=True, c_log2=c_log2)
    epilogue = _kn._epilogue_macro(BR=BR, D=D, heads=heads, normaliser=normaliser, store_lse=store_lse)
    start = _kn._prologue_macro(BI=BI, topk_dim=topk_dim, has_topk_length=has_topk_length, load_q=load_q)

    @T.macro
    def issue(Indices, KV8, rs16, n_rows, tok, lim, blk, Raw, bars, tx):
        # block blk's rows into stage blk % NS: thread 2 r issues one cp.async.bulk of row r (or zeroes it).  The
        # copies are spread over the four warps because a warp issues its lanes' bulk copies one after another
        # (the instruction takes uniform registers)
        st = blk % NS
        if tx % 2 == 0:
            row = _row(Indices, tok, lim, blk * BI + tx // 2)
            ok = (row >= 0) & (row < n_rows)
            T.call_extern("handle", "fdsa_bulk_row", T.address_of(Raw[st, tx // 2, 0]),
                          T.address_of(KV8[T.if_then_else(ok, row, 0) * rs16, 0]),
                          T.address_of(bars[st]), T.if_then_else(ok, 1, 0))

    @T.macro
    def convert(Raw, st, KV_s, Kt_s, sc, tx):
        # thread tx: row tx % 64, dims [256 * (tx / 64), +256) (scale tiles 2 (tx / 64) and + 1), rope chunks
        # [4 (tx / 64), +4)
        r = tx % BI
        part = tx // BI
        # (an invalid row's raw bytes were zeroed by its gathering thread: they convert to zeros)
        for g in T.unroll(4):
            sc[0] = T.call_extern(f32, "fdsa_ld_f32", T.address_of(Raw[st, r, SCALE_BYTE]), part * 2 + g // 2)
            T.call_extern("handle", "fdsa_dequant64", T.address_of(Raw[st, r, part * 256 + g * 64]),
                          *[T.address_of(KV_s[r, part * 256 + g * 64 + i * 16 + h * 8])
                            for i in range(4) for h in range(2)], sc[0])
        T.call_extern("handle", "fdsa_copy4x16", T.address_of(Raw[st, r, ROPE_BYTE + part * 64]),
                      *[T.address_of(Kt_s[r, part * 32 + i * 8]) for i in range(4)])

    @T.prim_func
    def sparse_mla_fwd_narrow656(
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
        with T.Kernel(n_tok, threads=_kn.THREADS, prelude=_SRC) as bx:
            tx = T.get_thread_binding()
            Raw = T.alloc_shared([NS, BI, ROW], u8)
            Q_s = T.alloc_shared([BR, D], bf16)
            Qt_s = T.alloc_shared([BR, DT], bf16)
            KV_s = T.alloc_shared([BI, D], bf16)
            Kt_s = T.alloc_shared([BI, DT], bf16)
            ST_s = T.alloc_shared([BI, BR], f32)
            P_s = T.alloc_shared([BR, BI], bf16)
            Alpha_s = T.alloc_shared([BR], f32)
            bars = T.alloc_barrier([BI] * NS)

            acc_t = T.alloc_fragment([BI, BR], f32)
            acc_ot = T.alloc_fragment([D, BR], f32)
            s_f = T.alloc_fragment([BR, BI], f32)
            m_i = T.alloc_fragment([BR], f32)
            m_prev = T.alloc_fragment([BR], f32)
            alpha = T.alloc_fragment([BR], f32)
            l_i = T.alloc_fragment([BR], f32)
            l_blk = T.alloc_fragment([BR], f32)
            inv = T.alloc_fragment([BR], f32)
            lim = T.alloc_local([1], i32)
            nblk = T.alloc_local([1], i32)
            sc = T.alloc_local([1], f32)

            start(TopkLen, Q, Q_s, Qt_s, lim, nblk, acc_ot, l_i, m_i, bx)
            for s in T.serial(NS - 1):
                if s < nblk[0]:
                    issue(Indices, KV8, rs16, n_rows, bx, lim[0], s, Raw, bars, tx)
            for it in T.serial(nblk[0]):
                st = it % NS
                # stage (it - 1) % NS was converted in the last iteration (all threads past its barrier)
                if it + NS - 1 < nblk[0]:
                    issue(Indices, KV8, rs16, n_rows, bx, lim[0], it + NS - 1, Raw, bars, tx)
                T.barrier_wait(bars[st], (it // NS) % 2)
                convert(Raw, st, KV_s, Kt_s, sc, tx)
                T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
                T.sync_threads()
                qk_t(KV_s, Kt_s, Q_s, Qt_s, acc_t, ST_s)
                for n, r in T.Parallel(BR, BI):
                    row = _row(Indices, bx, lim[0], it * BI + r)
                    s_f[n, r] = T.if_then_else((row >= 0) & (row < n_rows), ST_s[r, n], -T.infinity(f32))
                softmax_pv(KV_s, s_f, P_s, Alpha_s, acc_ot, m_i, m_prev, alpha, l_i, l_blk)
                T.sync_threads()  # KV_s and Kt_s are rewritten by the next block

            epilogue(acc_ot, inv, l_i, m_i, Sink, Alpha_s, Q_s, Out, Lse, MaxLogits, bx)

    return sparse_mla_fwd_narrow656


def _pass_configs():
    return plain_pass_configs()


@functools.lru_cache(maxsize=64)
def compiled(heads: int, sm_scale: float, has_sink: bool, has_topk_length: bool, stages: int | None = None):
    func = build_sparse_mla_fwd_narrow656(heads=heads, sm_scale=sm_scale, has_sink=has_sink,
                                          has_topk_length=has_topk_length, stages=stages)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("narrow656_h16_sink_tl", build_sparse_mla_fwd_narrow656(heads=16, sm_scale=576 ** -0.5, has_sink=True,
                                                                 has_topk_length=True)),
        ("narrow656_h32", build_sparse_mla_fwd_narrow656(heads=32, sm_scale=576 ** -0.5)),
    ]


VARIANTS = ("narrow656", "regs", "ring", "ring16", "ring64", "ring_er", "ring16_er", "ringx",
            "ring_er_f16", "mma")  # this kernel, kernel_fwd_narrow656_dual's forms, kernel_fwd_mma656


def _variant_kernel(name: str, sm: float):
    from . import kernel_fwd_mma656, kernel_fwd_narrow656_dual

    if name == "narrow656":
        return compiled(16, sm, False, False)
    if name.startswith("mma"):
        return kernel_fwd_mma656.compiled(16, sm, False, False, name)
    return kernel_fwd_narrow656_dual.compiled(16, sm, False, False, name)


def variant_inputs(n_tok: int, tkv: int, per_token: bool, gen, *, heads: int = 16, topk: int = 2048):
    """(q [n_tok, heads, 576] bf16, cache [rows, 656] uint8, indices [n_tok, topk] int32) of the ``--variants``
    shapes on ``gen``'s device: random rows quantized in 1M-row pieces, each token's ``topk`` sorted unique indices
    into its own ``tkv`` rows (``per_token``, decode: rows = n_tok * tkv) or into ``tkv`` shared rows (prefill)."""
    import torch

    from ..quant import quantize_kv_fp8

    dev = gen.device
    rows = n_tok * tkv if per_token else tkv
    kv8 = torch.empty(rows, ROW, dtype=torch.uint8, device=dev)
    for a in range(0, rows, 1 << 20):
        b = min(rows, a + (1 << 20))
        kv8[a:b] = quantize_kv_fp8(torch.randn(b - a, fc.DQK, generator=gen, device=dev).to(torch.bfloat16))
    q = torch.randn(n_tok, heads, fc.DQK, generator=gen, device=dev).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(n_tok, tkv, generator=gen, device=dev), dim=1)[:, :topk]
    if per_token:
        idx = idx + torch.arange(n_tok, device=dev).unsqueeze(1) * tkv
    return q, kv8, idx.sort(dim=1).values.to(torch.int32)


def _bench_variants(names, compile_only: bool = False):
    """Kernel times (``python -m flashdsa.sparse.kernel_fwd_narrow656 --variants [NAME ...]``; ``--compile-only``
    fills the TileLang cache, one process per name runs them in parallel): three shapes at H 16, topk 2048 --
    decode with 128 and 512 tokens, each token its own 32768 / 8192 rows (2.75 GB of cache, rows from DRAM), and
    prefill S 4096 / 256 over SKV 8192 shared rows (L2-resident) -- for this kernel and the two-warpgroup forms; max
    |out - out(narrow656)| and TB/s of unique cache rows touched.  Rows also go to ``$OUT/variants_narrow656.json``
    when ``$OUT`` is set."""
    import json
    import os

    import torch

    from ..bench.harness import time_fn

    sm = fc.DQK ** -0.5
    for name in names:
        _variant_kernel(name, sm)
    if compile_only:
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for label, n_tok, tkv, per_token in (("decode_B128", 128, 32768, True), ("decode_B512", 512, 8192, True),
                                         ("prefill_S4096", 4096, 8192, False),
                                         ("prefill_S256", 256, 8192, False)):
        heads, topk = 16, 2048
        q, kv8, idx = variant_inputs(n_tok, tkv, per_token, gen, heads=heads, topk=topk)
        touched = int(torch.unique(idx).numel()) * ROW
        ref = None
        for name in names:
            narrow = True if name == "narrow656" else name
            fn = lambda n=narrow: fc.run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm, d_v=D_V, narrow=n)  # noqa: E731
            out = fn()
            ref = out if ref is None else ref
            diff = (out[0].float() - ref[0].float()).abs().max().item()
            t = time_fn(lambda _, f=fn: f(), [None], q.device, reps=30)
            rows_out.append({"case": label, "variant": name, "tokens": n_tok, "heads": heads, "topk": topk,
                             "bytes_touched": touched, "ms": t.ms_median, "ms_p10": t.ms_p10,
                             "tbps": touched / t.ms_median / 1e9, "max_abs_diff_vs_first": diff})
            print(f"variant {label} {name}: {t.ms_median * 1e3:.1f} us (p10 {t.ms_p10 * 1e3:.1f}), "
                  f"{touched / t.ms_median / 1e9:.3f} TB/s of cache rows, max |diff| vs {names[0]}: {diff:.2e}",
                  flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "variants_narrow656.json"), "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if "--variants" in args:
        _bench_variants([a for a in args if not a.startswith("--")] or list(VARIANTS), "--compile-only" in args)
