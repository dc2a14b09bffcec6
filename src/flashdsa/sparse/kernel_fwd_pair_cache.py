"""Sparse MLA forward over the 656-byte FP8 KV cache on the "pair" schedule (Hopper sm_90a).

Notes
-----
Contract, numerics and host interface as ``kernel_fwd_fp8cache.py`` (q bf16 [T, H, 576], kv the uint8 [Tkv, 656]
cache of :func:`flashdsa.quant.quantize_kv_fp8`, d_v 512, bf16 compute on ``bf16(float(e4m3) * scale)``, exact
for the format's power-of-two scales); schedule, buffers and consumer roles as ``kernel_fwd_pair.py`` (H 64 /
128, 384 threads, WG0 / WG1 consumers, a producer warpgroup), only the producer differs.

In-place conversion.  Shared memory is full (the pair kernel uses 230,912 of 232,448 B), so there is no staging
buffer: dims [16k, 16k + 16) of a row are 16 e4m3 bytes in the cache and 32 bytes of bf16 in the half tile; the
16 raw bytes are copied (cp.async, as if they were 8 bf16) into the bf16 slots of dims [16k, 16k + 8), and after
they landed one thread reads them back, converts (``fdsa_e4m3x64_to_bf16``) and writes dims [16k, 16k + 8) and
[16k + 8, 16k + 16).  Raw bytes of (row, k) only ever sit in slots that the owner of (row, k) rewrites after
reading them, so no thread can clobber another's raw data.  Thread t of the 128 converting threads: row t / 2,
dims [128 (t % 2), +128) of the half (one 128-dim scale tile); part 1 walks its chunks rotated by two so the 8
threads of a quarter warp touch 8 different 16-byte bank groups.

Who converts (``staging``).  "converter_contig" (the default since session 22): a fourth warpgroup (512 threads;
setmaxnreg 216 / 216 / 24 / 56) waits on "landed" barriers, converts each half in place and arrives on the
consumers' ready barrier, so the consumers run the bf16 kernel's protocol unchanged; the producer copies each row's
raw bytes contiguously (``fdsa_gather_raw656<1>``: 8 lanes fill one 128-byte swizzled row, as the bf16 gather
does) and the converter expands them (``fdsa_convert_half_contig``: a thread's eight raw chunks into registers, one
named barrier, then the converted stores).  At 512 threads ptxas checks each instruction against the launch's 128
registers per thread, so ``pair_body`` splits each PV into two m64n128 wgmmas.  "converter" (the default in
session 21): the raw chunks land in the bf16 slots they are converted into (``fdsa_gather_raw656<0>``, every other
16-byte piece of a row: twice the copies' L2 sectors) and are converted in place (``fdsa_convert_half``).
"consumer": the producer is ``_pair_parts.gather_producer`` (the bf16 kernel's non-blocking
    protocol, up to four half tiles in flight) copying raw bytes, plus each row's 16 bytes of scales into the
    slots of dims [8, 16) (free until chunk 0 is converted).  The consumer that reads a half first (WG0: a.L,
    a.R; WG1: b.R, b.L) converts it after its ready barrier: scale read, warpgroup barrier, conversion,
    ``fence.proxy.async``, warpgroup barrier, then its wgmma.
Invalid slots are zero-filled (src-size 0, nothing read) with scale 0.  Outputs are bitwise those of
``kernel_fwd_pair`` on the dequantized cache (tests/sparse_mla/test_kernel_pair_cache_gpu.py).  The CUDA helpers
named here (``fdsa_*``): ``_pair_cache_src``.

Measured (H200, session 9, S 4096, H 128, topk 2048; ``--variants``; docs/PERFORMANCE.md): with one chunk per
conversion call and the f32 conversion (f29d7ee), SKV 8192: bf16 pair 5.39 ms, "consumer" 7.55 (0.71x),
"inplace" 8.22 (0.66x), a register-staged producer (raw bytes in 48 registers before the free-barrier wait, since
removed) 7.65 (0.70x), the pipelined fp8-cache kernel 9.76 (0.55x).  Four chunks per call and the 5-instruction
conversion (519baba): "consumer" 0.73x at SKV 8192 and 131072, "inplace" 0.70x / 0.75x; suite 0.741x / 0.742x.
Session 10 (early free in ``pair_body``, both kernels): SKV 8192 / 131072: bf16 pair 5.163 / 5.371 ms, this kernel
6.692 / 7.113 (0.77x / 0.76x); the since-removed stagings, same builds: "split" (the producer warpgroup converted
dims [128, 256) of each half, signalled on per-half barriers) 7.285 / 7.807, "inplace" (the producer converted
after ``cp.async.wait_group``, two halves in flight) 7.463 / 7.578.
ncu: the conversion adds ~3.9K warp instructions per 64-row block (+49% over the bf16 pair kernel); both kernels
stall most on the mbarrier waits for late half tiles (WG0 waiting for a.R is the largest single one).
Session 14 (``--variants`` at 7a8fbbd): this kernel 6.728 / 7.131 ms (0.763x / 0.774x of the bf16 pair kernel's
5.131 / 5.521); the whole-cache copy + the bf16 pair kernel 5.120 / 5.469 ms (copy alone 18 / 66 us), which
``kernel_fwd_fp8cache.run_sparse_mla_fwd`` now picks where rows are reused (``kernel_dequant656``); this kernel
serves the low-reuse calls (decode over a large paged cache).  f16 products (session 14) were measured slower in
session 15 and removed; see docs/PERFORMANCE.md 'Session 15'.
Session 21 (``--variants``, S 4096 / H 128 / topk 2048; docs/PERFORMANCE.md 'Session 21'): SKV 8192 bf16 pair 3.96
ms, "consumer" 6.56, "converter" 6.62 -- without any conversion (``ablate="no_convert"``) 5.36 / 5.21, so the raw
path itself, not the conversion alone, keeps this kernel from the bf16 kernel's speed; SKV 131072 bf16 4.59,
"consumer" 7.23, "converter" 6.82.  Sparse FP8 decode suite rows: H 128 s_q 2 0.473 -> 0.460 ms, H 64 0.135 ->
0.129 with the converter.
Session 22 (docs/PERFORMANCE.md 'Session 22'): "converter_contig" from registers 5.94 / 6.26 ms at SKV 8192 /
131072 with the f16-form conversion (the phased form before it 6.64 / 6.90, "converter" 6.63 / 6.96, bf16 pair
4.03 / 4.61); then the prmt conversion (one instruction less per pair): decode suite sparse FP8 H 128 s_q 2
0.462 -> 0.386 ms (378 TFLOP/s), H 64 0.120 ms (303).  A producer that loads the next half's raw bytes into
registers before its free wait (no converter warpgroup, 384 threads; at 66f1528, removed) ran 6.54 / 7.67 ms:
one half in flight per CTA.
Session 49 (docs/PERFORMANCE.md 'Session 49'): a timestamp build (``stamps``, ``scripts/pair_timestamps.py``) and
the Q gate (``QGATE_ENV``): at one wave of CTAs the consumers load Q after the first pair's a.L landed, 2-5% faster
in graph replay at B 128 / H 64 (dispatched for such launches).
Session 50 (docs/PERFORMANCE.md 'Session 50'): Q by TMA (q_gate "tma" / "tma_al"): at one wave it arrives no
sooner (the prologue waits on the memory system, not on the load path), so "al" stays; grids of more than one wave
take "tma" (H 128 s_q 2 -1.7% on an H100, -2.1% on an H200, graph replay).
"""

import functools
import os

import torch

import tilelang
import tilelang.language as T

from .. import _dispatch
from .._tilelang import aligned, direct_launcher
from .._validate import check_choice, check_positive_int, check_tensor
from . import _pair_parts as pp
from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from . import kernel_fwd_pair as kp
from ._pair_body import Q_LOADS
from ._pair_cache_src import _CONVERTER_SRC, _DEQUANT_SRC
from ._tl_common import BLOCK_H, BLOCK_I, D_V

SUPPORTED_H = kp.SUPPORTED_H
_ASYNC = tc.ASYNC_GATHER


def convert_share_macro():
    """Macro ``convert_share(Half, sc, rw, part)``: one thread's share of a half tile's in-place conversion: row
    ``rw``, chunks [8 part, 8 part + 8), walked rotated by 2 part (the 8 threads of a quarter warp, rows 4i..4i+3 x
    parts 0 / 1, then touch 8 different 16-byte bank groups), four chunks per call of ``fdsa_e4m3x64_to_bf16``."""

    @T.macro
    def convert_share(Half, sc, rw, part):
        for g in T.unroll(2):
            T.call_extern("handle", "fdsa_e4m3x64_to_bf16",
                          *[T.address_of(Half[rw, (part * 8 + (g * 4 + i + 2 * part) % 8) * 16 + h * 8])
                            for i in range(4) for h in range(2)], sc[0])

    return convert_share


def _raw_gather_macro():
    """Macro ``gather_raw(Half, Kt, Rows, kv_src, chunk0)``: cp.async (no commit, no wait) of one half tile's raw
    bytes, e4m3 chunk k of a row into the bf16 slots of dims [16k, 16k + 8), the row's 16 bytes of scales into the
    slots of dims [8, 16), the rope (``Kt`` not None) into the rope tile; invalid rows zero-filled."""
    BI = BLOCK_I
    DH = D_V // 2
    bf16 = "bfloat16"

    @T.macro
    def latent_raw(Half, KVb, rs16, Rows, chunk0):
        # (the parameter is named KVb: a macro argument takes the parameter's name in the generated code)
        for r, k, v in T.Parallel(BI, DH // 16, 8, annotations=_ASYNC):
            rk = Rows[r]
            Half[r, k * 16 + v] = T.if_then_else(rk >= 0, KVb[rk * rs16 + chunk0 + k, v], T.cast(0, bf16))
        for r, v in T.Parallel(BI, 8, annotations=_ASYNC):
            rk = Rows[r]
            Half[r, 8 + v] = T.if_then_else(rk >= 0, KVb[rk * rs16 + fc.SCALE_CHUNK, v], T.cast(0, bf16))

    @T.macro
    def gather_raw(Half, Kt, Rows, kv_src, chunk0):
        KVb = kv_src[1]
        rs16 = kv_src[2]
        latent_raw(Half, KVb, rs16, Rows, chunk0)
        if Kt is not None:
            for r, c, v in T.Parallel(BI, 8, 8, annotations=_ASYNC):
                rk = Rows[r]
                Kt[r, c * 8 + v] = T.if_then_else(rk >= 0, KVb[rk * rs16 + fc.ROPE_CHUNK0 + c, v], T.cast(0, bf16))

    return gather_raw


ABLATIONS = ("", "no_convert", "contig_no_convert")  # timing builds: conversion skipped (contig: converter only)
STAGINGS = ("consumer", "converter", "converter_contig")
# the default since session 22: S 4096 / H 128 5.94 / 6.26 ms at SKV 8192 / 131072 against "converter" 6.63 / 6.96
# (session 21's default), the sparse FP8 decode rows 10-20% faster
DEFAULT_STAGING = "converter_contig"
STAGING_ENV = "FLASHDSA_CACHE656_STAGING"  # overrides DEFAULT_STAGING when the caller names no staging
# timing switch (session 48; the dispatch never picks it): a positive integer P runs every launch of this kernel,
# dispatched ones included, on P persistent CTAs (pair_body's ``persistent``: the producer gathers the next item's
# rows while the consumers finish an item); measured no faster in decode (docs/PERFORMANCE.md 'Session 48')
PERSISTENT_ENV = "FLASHDSA_CACHE656_PERSISTENT"
# Q after the first rows (session 49): where one launch's CTAs all fit on the SMs at once (a single wave, e.g. the
# decode rows at B 128 / H 64), every CTA loads Q and issues its first gathers at the same moment, and the first
# rows queue behind the Q loads (which also slow the converter while in flight); ``pair_body``'s q_gate "al" lets the
# consumers load Q only once the first pair's a.L landed.  B 128 / H 64 / topk 2048 in graph replay: H100 -2 to -3%
# (three interleaved pairs), H200 -5% (one sample); eager timings within noise; H 128 s_q 2 (four waves) +0.5%, so
# ``auto_gate`` gates one-wave grids only.  Q by TMA ("tma": ``pair_body``'s, session 50): H100, graph replay, six
# interleaved pairs: H 128 s_q 2 (four waves) 0.3745 -> 0.3680 ms mean (-1.7%), where the bf16 pair kernel's prefill
# gained 2-3%; at H 64 (one wave, six-round means) TMA alone 0.1241 ms against the gate's 0.1206 ("tma_al" 0.1198,
# no gate 0.1278 over three); on an H200 (three rounds, one machine) H 128 s_q 2 0.3757 -> 0.3678 (-2.1%), H 64
# "al" 0.1094, "tma" 0.1141, "tma_al" 0.1088, no gate 0.1139 (0.1109 in its last two rounds): "auto" takes "tma"
# for grids of more than one wave.  $FLASHDSA_CACHE656_QGATE: "auto" (unset) those rules, "off" never, "al" / "ar" /
# "tma" / "tma_al" wherever a launch can take them (timing).
QGATE_ENV = "FLASHDSA_CACHE656_QGATE"
# pair_body's Q loads ("off" = ""; "tma*": Q by TMA, session 50); not "next" (persistent grids: the bf16 kernel's)
QGATES = ("auto", "off") + tuple(g for g in Q_LOADS[1:] if g != "next")
# setmaxnreg (WG0, WG1, producer, converter) of the converter staging: 512 threads, a pool of 4 x 128
CONVERTER_REGS = (216, 216, 24, 56)  # session 27: best of four splits (ptxas: 12 bytes spilled in the converter)


def _converter_parts(*, topk_dim, ablate="", contig=False):
    """The converter staging: the producer (``gather_producer``) copies the raw bytes by rows
    (``fdsa_gather_raw656<0>``: the same bytes at the same places as ``_raw_gather_macro``; ``contig``:
    ``fdsa_gather_raw656<1>``, a row's raw bytes in order) with its arrivals on the "landed" barriers; the
    fourth warpgroup waits each half in the producer's order (a.L, b.R, a.R, b.L), converts it in place
    (``fdsa_convert_half``; ``contig``: ``fdsa_convert_half_contig``: its raw chunks into registers, the
    ``__syncwarp``, the stores), fences it for the async proxy and arrives on the consumers'
    ready barrier.
    Returns (producer, converter)."""
    assert ablate in ABLATIONS, ablate
    assert not (contig and ablate == "no_convert"), "contig: its timing build is ablate='contig_no_convert'"
    DH = D_V // 2
    contig = contig or ablate == "contig_no_convert"

    @T.macro
    def gather_rows(Half, Kt, rope, Rows, kv_src, chunk0):
        KVb = kv_src[1]
        T.call_extern("handle", f"fdsa_gather_raw656<{int(contig)}>",
                      T.address_of(Half[0, 0]), T.address_of(Kt[0, 0]), rope,
                      T.address_of(KVb[0, 0]), kv_src[2] * fc.CHUNK, chunk0, T.address_of(Rows[0]),
                      T.get_thread_binding() - 256)

    @T.macro
    def gather_l(KVl, Rows, kv_src):
        gather_rows(KVl, KVl, 0, Rows, kv_src, 0)

    @T.macro
    def gather_r(KVr, Kt, Rows, kv_src):
        gather_rows(KVr, Kt, 1, Rows, kv_src, DH // 16)

    @T.macro
    def convert_one(Half, tile0, ld, rdy, phase, tx, st, half, on):
        T.barrier_wait(ld, phase)
        if st is not None:
            st("conv_landed_" + half, on)
        if not ablate:
            if contig:
                T.call_extern("handle", "fdsa_convert_half_contig", T.address_of(Half[0, 0]), tile0, tx - 384)
            else:
                T.call_extern("handle", "fdsa_convert_half", T.address_of(Half[0, 0]), tile0, tx - 384)
        T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads
        T.barrier_arrive(rdy)
        if st is not None and half != "bl":
            st("conv_done_" + half, on)

    @T.macro
    def converter(npair, tx, KVa_l, KVa_r, KVb_l, KVb_r, ld_al, ld_br, ld_ar, ld_bl, rdy_al, rdy_br, rdy_ar, rdy_bl,
                  pb, st=None):
        # st: ``_pair_parts.stamper``'s macro (timestamp builds): pair 0's halves landed / converted
        for j in T.serial(npair[0]):
            on = None if st is None else (tx == 384) & (j == 0)
            convert_one(KVa_l, 0, ld_al, rdy_al, pp.pair_phase(pb, j), tx, st, "al", on)
            convert_one(KVb_r, 2, ld_br, rdy_br, pp.pair_phase(pb, j), tx, st, "br", on)
            convert_one(KVa_r, 2, ld_ar, rdy_ar, pp.pair_phase(pb, j), tx, st, "ar", on)
            convert_one(KVb_l, 0, ld_bl, rdy_bl, pp.pair_phase(pb, j), tx, st, "bl", on)

    producer = pp.gather_producer(topk_dim=topk_dim, row_ok=lambda row, kv_src: (row >= 0) & (row < kv_src[3]),
                                  gather_l=gather_l, gather_r=gather_r)
    return producer, converter


def _dequant_parts(*, topk_dim, ablate=""):
    """The producer is ``_pair_parts.gather_producer`` (non-blocking, up to four half
    tiles in flight) copying raw bytes: e4m3 chunk k of a row into the bf16 slots of dims [16k, 16k + 8), the
    row's four float32 scales (16 B) into the slots of dims [8, 16) (free until chunk 0 is converted), the rope
    straight into the rope tile.  The consumer that reads a half first converts it in place after its ready
    barrier (thread t: row t / 2, chunks [8 (t % 2), +8)): scale read, warpgroup barrier (the scales sit in slots
    that the conversion overwrites), conversion, ``fence.proxy.async``, warpgroup barrier, then its wgmma.
    ``ablate`` (timing only, wrong results): "no_convert" leaves the raw bytes (barriers and scale read kept).
    Returns (producer, first_use)."""
    assert ablate in ("", "no_convert"), ablate
    DH = D_V // 2
    f32 = "float32"
    gather_raw = _raw_gather_macro()
    convert_share = convert_share_macro()

    @T.macro
    def gather_l(KVl, Rows, kv_src):
        gather_raw(KVl, None, Rows, kv_src, 0)

    @T.macro
    def gather_r(KVr, Kt, Rows, kv_src):
        gather_raw(KVr, Kt, Rows, kv_src, DH // 16)

    @T.macro
    def convert_half(Half, tile0, t, bar):
        # thread t of the 128 converting threads: row t / 2, chunks [8 (t % 2), +8), with its tile's scale (invalid
        # rows are zero bytes with scale 0 -> zeros); ends with the stores fenced for the async proxy (the wgmma
        # reads)
        rw = t // 2
        part = t % 2
        sc = T.alloc_local([1], f32)
        sc[0] = T.call_extern(f32, "fdsa_ld_f32", T.address_of(Half[rw, 8]), tile0 + part)
        T.sync_threads(bar, 128)  # every scale read before the slots of dims [8, 16) are overwritten
        if ablate != "no_convert":
            convert_share(Half, sc, rw, part)
        T.fence_proxy_async()  # generic-proxy stores -> wgmma (async proxy) reads

    @T.macro
    def first_use(Half, tile0, wg_bar, t):
        convert_half(Half, tile0, t, wg_bar)
        T.sync_threads(wg_bar, 128)  # the whole half converted before this warpgroup's wgmma reads it

    producer = pp.gather_producer(topk_dim=topk_dim, row_ok=lambda row, kv_src: (row >= 0) & (row < kv_src[3]),
                                  gather_l=gather_l, gather_r=gather_r)
    return producer, first_use


def build_sparse_mla_fwd_pair_cache(*, heads: int, topk: int, sm_scale: float, has_sink: bool = False,
                                    has_topk_length: bool = False, ablate: str = "", overlap_qk: bool = True,
                                    staging: str = DEFAULT_STAGING, out_f32: bool = False, persistent: int = 0,
                                    stamps: bool = False, q_gate: str = ""):
    """Return the TileLang prim_func: (Q[T,H,576] bf16, KVf[n_ch,4] f32, KVb[n_ch,8] bf16 (two views of the cache
    as 16-byte chunks), rs16 int32 (row stride in chunks), n_rows int32 (Tkv), Indices[T,topk] i32, TopkLen[n_tl]
    i32, Sink[n_sink] f32, Out[T,H,512] bf16, Lse[T,H] f32, MaxLogits[T,H] f32).  ``ablate``: a timing build of
    ``ABLATIONS`` (``_dequant_parts``); ``overlap_qk``: ``kernel_fwd_pair.pair_body``'s (default; WG0 then
    converts a.L while its remote PV runs); ``staging``: who converts, one of ``STAGINGS`` ("consumer":
    ``_dequant_parts``; "converter": a fourth warpgroup, ``_converter_parts``); ``out_f32``: Out float32 (split-KV
    partials) and Q [n_q, H, 576] with n_q dividing T (``pair_body``'s q_rows); ``persistent``: ``pair_body``'s
    (P > 0: P CTAs loop over the items); ``stamps`` (timing build): one more argument, Stamps [T * H / 64,
    ``_pair_parts.STAMP_WORDS``] int32, the CTAs' timestamps (``pair_body``'s); ``q_gate``: one of ``pair_body``'s
    ``Q_LOADS`` but "next" ("" the 16-byte loads at entry; ``launcher`` picks it)."""
    assert staging in STAGINGS, staging
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_ch, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_ch", "n_tl", "n_sink", "topk")
    common = dict(heads=heads, dqk=fc.DQK, topk=topk, sm_scale=sm_scale, has_sink=has_sink,
                  has_topk_length=has_topk_length, n_tok=n_tok, topk_dim=topk_dim, overlap_qk=overlap_qk,
                  out_f32=out_f32, persistent=persistent, stamps=stamps, q_gate=q_gate)
    out_dtype = f32 if out_f32 else bf16
    n_q = n_tok
    if out_f32:  # split-KV: one q row per token, n_tok / n_q chunk rows each (pair_body's q_rows)
        n_q = common["q_rows"] = T.dynamic("n_q")
    if staging.startswith("converter"):
        producer, converter = _converter_parts(topk_dim=topk_dim, ablate=ablate, contig=staging == "converter_contig")
        body = kp.pair_body(**common, producer=producer, converter=converter, regs=CONVERTER_REGS,
                            prelude=_DEQUANT_SRC + tc.ROW_GATHER_PRELUDE + _CONVERTER_SRC)
    else:
        producer, first_use = _dequant_parts(topk_dim=topk_dim, ablate=ablate)
        body = kp.pair_body(**common, producer=producer, prelude=_DEQUANT_SRC, first_use=first_use)

    if stamps:  # (its own signature: TileLang reads a prim_func's parameters from the Python signature)
        n_st = T.dynamic("n_st")

        @T.prim_func
        def sparse_mla_fwd_pair_cache_stamps(
            Q: T.Tensor([n_q, heads, fc.DQK], bf16),
            KVf: T.Tensor([n_ch, 4], f32),
            KVb: T.Tensor([n_ch, 8], bf16),
            rs16: T.int32,
            n_rows: T.int32,
            Indices: T.Tensor([n_tok, topk_dim], i32),
            TopkLen: T.Tensor([n_tl], i32),
            Sink: T.Tensor([n_sink], f32),
            Out: T.Tensor([n_tok, heads, D_V], out_dtype),
            Lse: T.Tensor([n_tok, heads], f32),
            MaxLogits: T.Tensor([n_tok, heads], f32),
            Stamps: T.Tensor([n_st, pp.STAMP_WORDS], i32),
        ):
            body(Q, (KVf, KVb, rs16, n_rows), Indices, TopkLen, Sink, Out, Lse, MaxLogits, None, Stamps)
        return sparse_mla_fwd_pair_cache_stamps

    @T.prim_func
    def sparse_mla_fwd_pair_cache(
        Q: T.Tensor([n_q, heads, fc.DQK], bf16),
        KVf: T.Tensor([n_ch, 4], f32),
        KVb: T.Tensor([n_ch, 8], bf16),
        rs16: T.int32,
        n_rows: T.int32,
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D_V], out_dtype),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        body(Q, (KVf, KVb, rs16, n_rows), Indices, TopkLen, Sink, Out, Lse, MaxLogits, None)

    return sparse_mla_fwd_pair_cache


def _pass_configs():
    return kp._pass_configs()  # explicit named barriers only (the automatic pass reuses ids across roles)


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool, ablate: str = "",
              overlap_qk: bool = True, staging: str = DEFAULT_STAGING, out_f32: bool = False, persistent: int = 0,
              stamps: bool = False, q_gate: str = ""):
    func = build_sparse_mla_fwd_pair_cache(heads=heads, topk=n_blocks * BLOCK_I, sm_scale=sm_scale,
                                           has_sink=has_sink, has_topk_length=has_topk_length, ablate=ablate,
                                           overlap_qk=overlap_qk, staging=staging, out_f32=out_f32,
                                           persistent=persistent, stamps=stamps, q_gate=q_gate)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def kernel_unsupported(q, kv, indices, *, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments: ``kernel_fwd_fp8cache``'s rules and full 64-head tiles."""
    reason = fc.kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is None and q.shape[1] not in SUPPORTED_H:
        reason = f"H={q.shape[1]} not in {SUPPORTED_H} (the pair schedule needs full 64-head tiles)"
    return reason


def launcher(heads: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool, ablate: str = "",
             overlap_qk: bool = True, staging: str | None = None, out_f32: bool = False,
             persistent: int | None = None, stamps: bool = False, q_gate: str | None = None,
             n_tok: int | None = None, device_index: int | None = None):
    """This kernel's launch as ``(q, kv, indices, topk_length or dummy, attn_sink or dummy, out, lse, max_logits)``
    (q and indices contiguous and 16-byte aligned, for Q's 16-byte loads and TMA boxes;
    ``kernel_fwd_fp8cache.launcher``'s form), compiled now.  ``staging``: None reads
    ``$FLASHDSA_CACHE656_STAGING`` (``STAGING_ENV``) now; ``out_f32``: out float32; ``persistent`` (timing only):
    that many persistent CTAs (0: one per item), None reads ``$FLASHDSA_CACHE656_PERSISTENT`` (``PERSISTENT_ENV``);
    ``stamps`` (timing build): the launch takes the Stamps buffer as a ninth argument; ``q_gate``: one of
    ``QGATES`` ("auto": ``auto_gate``'s rule for a launch of ``n_tok`` tokens on device ``device_index``; "off":
    Q's 16-byte loads at entry; "tma": Q by TMA, one item per CTA; "al" / "ar" / "tma_al": gated, with a converter
    staging and one item per CTA), None reads ``$FLASHDSA_CACHE656_QGATE`` (``QGATE_ENV``, default "auto") now,
    whose values other than "auto" / "off" reach only the launches that can take them."""
    staging = staging or os.environ.get(STAGING_ENV, DEFAULT_STAGING)
    if staging not in STAGINGS:
        raise ValueError(f"${STAGING_ENV}={staging!r}: expected one of {STAGINGS}")
    name = "persistent"
    if persistent is None:
        name, env = f"${PERSISTENT_ENV}", os.environ.get(PERSISTENT_ENV, "")
        try:
            persistent = int(env or 0)
        except ValueError:
            raise ValueError(f"{name}={env!r}: expected a non-negative integer (CTAs)") from None
    check_positive_int(name, persistent, minimum=0)
    if stamps and persistent:
        raise ValueError(f"stamps=True: the timestamp build takes one item per CTA, got {name}={persistent}")
    gateable = staging.startswith("converter") and not persistent
    name = "q_gate"
    if q_gate is None:
        name, q_gate = f"${QGATE_ENV}", os.environ.get(QGATE_ENV) or "auto"
    check_choice(name, q_gate, QGATES)
    if q_gate not in ("auto", "off") and not (gateable or (q_gate == "tma" and not persistent)):
        if name == "q_gate":
            need = "one item per CTA" if q_gate == "tma" else "a converter staging and one item per CTA"
            raise ValueError(f"q_gate={q_gate!r}: needs {need} (staging {staging!r}, persistent {persistent})")
        q_gate = "off"  # the environment's gate reaches only the launches that can take it
    if q_gate == "auto":  # (converter stagings only: the consumer staging keeps the loads, not measured)
        q_gate = auto_gate(heads, n_tok, device_index) if gateable and not out_f32 else "off"
    run = direct_launcher(_compiled(heads, n_blocks, float(sm_scale), has_sink, has_topk_length, ablate, overlap_qk,
                                    staging, out_f32, persistent, stamps, "" if q_gate == "off" else q_gate))

    def launch(q, kv, indices, tl_arg, sink_arg, out, lse, max_logits, *stamps_buf):
        chunks = fc.cache_chunks(kv)
        run(q, chunks.view(torch.float32), chunks.view(torch.bfloat16), fc._rs16(kv), kv.shape[0], indices, tl_arg,
            sink_arg, out, lse, max_logits, *stamps_buf)

    return launch


def auto_gate(heads: int, n_tok: int | None, device_index: int | None) -> str:
    """``q_gate`` "auto" for a launch of ``n_tok`` tokens (None: unknown): "al" where its CTAs (one per token and
    64-head group) fill more than half of the device's SMs and fit on them at once (the measured case: 128 CTAs on
    132 SMs), "tma" where they take more than one wave (measured: 512 CTAs), else "off" (smaller grids: not
    measured)."""
    if n_tok is None:
        return "off"
    n_sm = _dispatch.sm_count(0 if device_index is None else device_index)
    ctas = n_tok * (heads // BLOCK_H)
    return "al" if n_sm // 2 < ctas <= n_sm else "tma" if ctas > n_sm else "off"


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
                       checked: bool = False, ablate: str = "", overlap_qk: bool = True, staging: str | None = None,
                       persistent: int | None = None, stamps: torch.Tensor | None = None,
                       q_gate: str | None = None):
    """Returns (out [T,H,512] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32).  Timing builds (``--variants``
    and tests only): ``ablate`` one of ``ABLATIONS`` (wrong results), ``overlap_qk``; ``persistent``: ``launcher``'s
    (None reads ``$FLASHDSA_CACHE656_PERSISTENT``, which also reaches the dispatched calls); ``stamps``: None, or
    an int32 [T * H / 64, ``_pair_parts.STAMP_WORDS``] tensor that the timestamp build fills
    (``scripts/pair_timestamps.py``); ``q_gate``: ``launcher``'s (None reads ``$FLASHDSA_CACHE656_QGATE``)."""
    if not checked:
        reason = kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
        if reason is not None:
            raise ValueError(f"sparse_mla fwd pair fp8-cache kernel: {reason}")
    (out, lse, max_logits), done = tc.fwd_outputs(q, kv, sm_scale=sm_scale, d_v=d_v)
    if done:
        return out, lse, max_logits
    q, indices = aligned(q), aligned(indices)
    has_sink, has_tl, tl_arg, sink_arg, n_blocks = tc.optional_args(indices, topk_length, attn_sink, q.device)
    if stamps is not None:
        check_tensor("stamps", stamps, shape=(q.shape[0] * (q.shape[1] // BLOCK_H), pp.STAMP_WORDS),
                     dtypes=(torch.int32,), device=q.device)
        if not stamps.is_contiguous():
            raise ValueError(f"stamps: expected a contiguous tensor, got strides {tuple(stamps.stride())}")
    launch = launcher(q.shape[1], n_blocks, sm_scale, has_sink, has_tl, ablate, overlap_qk, staging,
                      persistent=persistent, stamps=stamps is not None, q_gate=q_gate, n_tok=q.shape[0],
                      device_index=q.device.index)
    launch(q, kv, indices, tl_arg, sink_arg, out, lse, max_logits, *(() if stamps is None else (stamps,)))
    return out, lse, max_logits


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [("pair_cache_h128_topk2048_sink_tl",
             build_sparse_mla_fwd_pair_cache(heads=128, topk=2048, sm_scale=576**-0.5, has_sink=True,
                                             has_topk_length=True)),
            ("pair_cache_h64_topk128_tl_f32",
             build_sparse_mla_fwd_pair_cache(heads=64, topk=128, sm_scale=576**-0.5, has_topk_length=True,
                                             out_f32=True)),
            ("pair_cache_h64_topk128_tl_f32_persistent5",  # the timing switch with split-KV partials
             build_sparse_mla_fwd_pair_cache(heads=64, topk=128, sm_scale=576**-0.5, has_topk_length=True,
                                             out_f32=True, persistent=5)),
            ("pair_cache_h64_topk2048_qgate_tma_al",  # Q by TMA after the first rows (timing)
             build_sparse_mla_fwd_pair_cache(heads=64, topk=2048, sm_scale=576**-0.5, q_gate="tma_al")),
            ("pair_cache_h128_topk256_tl_qgate_al",  # Q after the first rows (one-wave launches)
             build_sparse_mla_fwd_pair_cache(heads=128, topk=256, sm_scale=576**-0.5, has_topk_length=True,
                                             q_gate="al")),
            ("pair_cache_h64_topk2048_stamps",  # the timestamp build
             build_sparse_mla_fwd_pair_cache(heads=64, topk=2048, sm_scale=576**-0.5, stamps=True)),
            ("pair_cache_h64_topk700_tl_consumer",
             build_sparse_mla_fwd_pair_cache(heads=64, topk=700, sm_scale=576**-0.5, has_topk_length=True,
                                             staging="consumer")),
            ("pair_cache_h128_topk2048_converter",
             build_sparse_mla_fwd_pair_cache(heads=128, topk=2048, sm_scale=576**-0.5, staging="converter"))]


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if "--variants" in args:
        from ._pair_cache_timing import bench_variants

        bench_variants(tuple(int(x) for x in args[args.index("--skv") + 1].split(",")) if "--skv" in args
                       else (8192, 131072), args[args.index("--rows") + 1].split(",") if "--rows" in args else None,
                       "--compile-only" in args, "--zero-latent" in args,
                       int(args[args.index("--row-stride") + 1]) if "--row-stride" in args else None)
