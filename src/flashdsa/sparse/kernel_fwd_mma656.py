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
The per-warp fragment work is an extern device function (``fdsa_m656_kernel``, ``_mma656_parts.M656_KERNEL_SRC``):
TileLang's tile operators express block-wide gemms, not independent per-warp ``mma.sync`` chains with their own
softmax state.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations at definition time

import functools

import tilelang
import tilelang.language as T

from . import _tl_common as tc
from . import kernel_fwd_fp8cache as fc
from ._tl_common import LOG2E
from ._mma656_parts import M656_HELPERS, M656_KERNEL_SRC
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
""" + M656_HELPERS + M656_KERNEL_SRC


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
