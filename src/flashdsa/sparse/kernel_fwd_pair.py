"""Sparse MLA forward, "pair" warp-specialised schedule with a non-blocking half-tile gather (Hopper sm_90a).

Notes
-----
Same contract, host interface and numerics as ``kernel_fwd.py``, for H in {64, 128}, Dqk in {512, 576},
d_v = 512; ``kernel_fwd.run_sparse_mla_fwd`` dispatches it for those head counts (since session 8).
Measured (H200, session 8, suite at 5942212; docs/PERFORMANCE.md): S 4096 / SKV 8192 / topk 2048: H 128 5.42 ms
(431 TFLOP/s, pipelined kernel 8.40), H 64 2.77 ms (422); SKV 128K 380; DeepSeek-V4 m 4096 / topk 640 / sink
0.96 ms (358, was 1.29).  GPU tests: tests/sparse_mla/test_kernel_pair_gpu.py + the dispatched forward's tests;
compute-sanitizer memcheck clean (scripts/memcheck_small.py sparse_bf16).  Since session 9 the kernel is
``_pair_body.pair_body`` (buffers, barriers, both consumer roles) + a producer per KV format (``gather_producer``;
the 656-byte cache: kernel_fwd_pair_cache.py).  Session 10: each consumer retires its remote PV and frees that half
before it waits for its next tile ("early free"; H 128 5.43 -> 5.16 ms, SKV 128K 5.97 -> 5.37, outputs bitwise
equal).
One CTA per (token, 64-head group), 384 threads: consumer warpgroups WG0 (threads 0-127) and WG1 (128-255),
producer warpgroup (256-383); ``setmaxnreg`` 216 / 216 / 72.

Roles.  Top-k blocks of 64 slots go in pairs (block a = 2j in buffer 0, block b = 2j+1 in buffer 1).  Each
KV buffer is two independently tracked halves: L = columns [0, 256), R = columns [256, 512) (+ the 64-dim rope
tail for Dqk 576).  WG0 computes S_a = Q K_a^T, WG1 S_b (full 64 x 64 x Dqk each, SS wgmma); WG0 owns
O[:, :256], WG1 O[:, 256:].  Per pair j:
  WG0: m_a = max(m, rowmax S_a); rescale O_l, l_0; P_a = 2^(S_a c - m_a c); publish m_a (Ma, bar_ma);
       O_l += P_a V_a[:, :256] (RS wgmma: P in registers); retire; free a.L;  wait m_b (Mb, bar_mb); move O_l,
       l_0, P_a to m_b; P_a -> smem P0 (bar_p0);  wait P1; O_l += P_b V_b[:, :256] (SS); QK of block 2j+2 on
       a.L issued; retire the PV (free b.L); QK on a.R, retire (``overlap_qk``, default since session 15).
  WG1: wait m_a; m_b = max(m_a, rowmax S_b); rescale O_r, l_1; P_b; publish m_b; O_r += P_b V_b[:, 256:] (RS);
       P_b -> smem P1 (bar_p1); wait P0; O_r += P_a V_a[:, 256:] (SS); retire the local PV (free b.R), the
       remote PV (free a.R);  QK of block 2j+3 on b.R, b.L, retire.
  After each pair both consumers hold O and l at the same running max m_b; at the end l = l_0 + l_1.
  The two consumers are staggered: while one runs its softmax the other keeps the tensor pipe busy.
Producer (what makes this schedule differ from the one measured in session 2): per pair it issues the four
half tiles a.L, b.R, a.R, b.L, each right after ITS consumer freed it, as zero-filling predicated cp.async
(src-size 0 for invalid slots: nothing is read) whose completion arrives on the half's ``ready`` mbarrier
(``cp.async.mbarrier.arrive.noinc``): no wait per tile, up to four half tiles (144 KiB) in flight.  Before
a.L / b.R it writes the block's rows (``Rows0`` / ``Rows1``: KV row or -1, loaded into registers before the pair's
first wait: ``prefetch_rows``) and publishes them with an ordinary arrival on the same barrier (count 256 = 128
deferred + 128 ordinary); the consumers build their -inf masks from them.  The dispatched builds issue each half
tile's copies by rows (``row_gather``, sessions 18-19: 8 threads per 128-byte row segment, one row lookup per row
instead of one per copy): the producer had been the bottleneck (ncu: its time on row lookups; the consumers
waiting on ready barriers 45% of theirs); S 4096 / SKV 8192 / topk 2048 H 128 5.21 -> 4.16 ms (561 TFLOP/s), H 64
2.66 -> 2.17 (539), V4 0.875 -> 0.733, outputs bitwise equal.
Q is loaded by the consumers, each warpgroup its own half (+ WG0 the rope tail): copied by all 384 threads the
64 x 256 tile lowered to 2-byte loads (not a multiple of 384 x 8 elements), ~45 us per CTA.
Barriers (mbarriers, one phase per pair, waiters use parity j & 1; the producer waits ``free`` with parity
(j & 1) ^ 1, so a fresh barrier passes):
  rdy_al (256), rdy_br (256), rdy_ar (128), rdy_bl (128): half tile landed (+ rows for al / br).
  fr_al (128, WG0 after its local PV), fr_bl (128, WG0 after its remote PV), fr_br (128, WG1 after its local
  PV), fr_ar (128, WG1 after its remote PV; P0 lives in a.R's rope tile at Dqk 576).
  bar_ma, bar_mb, bar_p0, bar_p1 (128): the max / P exchange.  Named barriers: 8 (WG0), 10 (WG0 + WG1).
Why each buffer is free when rewritten: Rows0 (Rows1) is rewritten after fr_al (fr_br), which its consumer
arrives only after waiting both halves of that block, i.e. after every producer thread issued (so read the
rows of) both nests.  P1 (its own 8 KiB) is rewritten by WG1 after waiting rdy_bl of the next pair, which
the producer arrives after fr_bl, i.e. after WG0's remote PV read P1.  P0 (a.R's rope tile at Dqk 576) is
written after WG0's QK on a.R (WG0 named barrier: every WG0 warp is past it) and freed with fr_ar after WG1's
remote PV.
Counted blocks past ceil(topk_eff / 64) are skipped by every role (uniform trip count npair); an odd count
makes block b of the last pair all-invalid (zero-filled, scores -inf, P = 0).  Running max starts at the
finite -1e30, so all-invalid blocks give exp2(-inf) = 0, never inf - inf; empty rows (l = 0) write 0, lse +inf.
Shared memory, Dqk 576: Q 72 KiB + 2 x 72 KiB KV + P1 8 KiB + rows / max / l 1.5 KiB = 230,912 B (+ barriers)
of 232,448.  Dqk 512: Q 64 + KV 128 + P0 + P1 16 KiB.
ptxas serialises every wgmma of the kernel (C7515) if a wgmma is in flight at the loop back edge or if its
issue and wait_group sit in different ``if`` blocks, hence the dynamic trip count and each iteration retiring
what it issued.
"""

import functools
import os

import torch

import tilelang
import tilelang.language as T

from .. import _dispatch
from .._tilelang import direct_launcher, plain_pass_configs
from .._validate import check_choice
from . import _tl_common as tc
from . import kernel_fwd
from ._pair_body import SUPPORTED_H, pair_body
from ._pair_parts import gather_producer, hop_converter
from ._tl_common import BLOCK_H, BLOCK_I, D_V

HOP_REGS = (216, 216, 56, 24)  # the ``hop`` timing build: 512 threads, the producer's 72 cut to 56
_ASYNC = tc.ASYNC_GATHER


def row_gather_macros(dqk):
    """(``gather_l(KVl, Rows, kv_src)``, ``gather_r(KVr, Kt, Rows, kv_src)``): one half tile's rows by
    ``fdsa_gather_half`` (``_tl_common.ROW_GATHER_PRELUDE``; producer threads 256-383, 8 per 128-byte row segment;
    Rows[r] = KV row or -1: zero fill, nothing read), completion left to the caller (``cp_async_barrier_noinc``).
    ``kv_src[0]``: KV [n_kv, dqk] bf16.  L = columns [0, 256); R = [256, 512) + the rope tail into ``Kt``."""

    @T.macro
    def gather_rows(KVh, Kt, rope, Rows, kv_src, col0):
        KV = kv_src[0]
        T.call_extern("handle", "fdsa_gather_half<2>", T.address_of(KVh[0, 0]), T.address_of(Kt[0, 0]),
                      1 if rope else 0, T.address_of(KV[0, 0]), dqk, col0, T.address_of(Rows[0]),
                      T.get_thread_binding() - 256)

    @T.macro
    def gather_l(KVl, Rows, kv_src):
        gather_rows(KVl, KVl, False, Rows, kv_src, 0)

    @T.macro
    def gather_r(KVr, Kt, Rows, kv_src):
        gather_rows(KVr, Kt, dqk > D_V, Rows, kv_src, D_V // 2)

    return gather_l, gather_r


def _bf16_producer(*, dqk, n_kv, topk_dim, prefetch_rows, ablate, row_gather=False, batched=False):
    """The producer of the bf16 KV format (see the module notes); ``kv_src`` = (KV,), or with ``batched``
    (KV, S, S_kv): entry i of token t names row i + (t // S) * S_kv where 0 <= i < S_kv (-1 otherwise)."""
    D = D_V
    DH = D // 2
    D_tail = dqk - D
    BI = BLOCK_I
    bf16 = "bfloat16"
    _ok = tc.make_row_ok(n_kv)

    def gathers():
        # False for "no_gather"; "half_gather": only even CTAs (head group 0 at H 128); a Python True otherwise
        return ablate != "no_gather" and (ablate != "half_gather" or T.get_block_binding(0) % 2 == 0)

    rows_l, rows_r = row_gather_macros(dqk)

    @T.macro
    def gather_l(KVl, Rows, kv_src):
        if row_gather:
            rows_l(KVl, Rows, kv_src)
        elif gathers():
            KV = kv_src[0]
            for r, c, d in T.Parallel(BI, 4, 64, annotations=_ASYNC):
                rk = Rows[r]
                KVl[r, c * 64 + d] = T.if_then_else(rk >= 0, KV[rk, c * 64 + d], T.cast(0, bf16))

    @T.macro
    def gather_r(KVr, Kt, Rows, kv_src):
        if row_gather:
            rows_r(KVr, Kt, Rows, kv_src)
        elif gathers():
            KV = kv_src[0]
            for r, c, d in T.Parallel(BI, 4, 64, annotations=_ASYNC):
                rk = Rows[r]
                KVr[r, c * 64 + d] = T.if_then_else(rk >= 0, KV[rk, DH + c * 64 + d], T.cast(0, bf16))
                if D_tail > 0:
                    if c == 0:
                        Kt[r, d] = T.if_then_else(rk >= 0, KV[rk, D + d], T.cast(0, bf16))

    if batched:
        return gather_producer(topk_dim=topk_dim, row_ok=lambda row, kv_src: (row >= 0) & (row < kv_src[2]),
                               gather_l=gather_l, gather_r=gather_r, prefetch_rows=prefetch_rows,
                               row_base=lambda tok, kv_src: (tok // kv_src[1]) * kv_src[2])
    return gather_producer(topk_dim=topk_dim, row_ok=lambda row, kv_src: _ok(row), gather_l=gather_l,
                           gather_r=gather_r, prefetch_rows=prefetch_rows)


def build_sparse_mla_fwd(
    *,
    heads: int,
    dqk: int,
    d_v: int = D_V,
    topk: int,
    sm_scale: float,
    has_sink: bool = False,
    has_topk_length: bool = False,
    ablate: str = "",
    prefetch_rows: bool = True,
    has_order: bool = False,
    overlap_qk: bool = True,
    l2_prefetch: bool = False,
    persistent: int = 0,
    row_gather: bool = False,
    hop: bool = False,
    batched: bool = False,
    evict_first: bool = False,
    out_f32: bool = False,
    q_gate: str = "",
):
    """Return the TileLang prim_func; signature as ``kernel_fwd.build_sparse_mla_fwd`` (Q[T,H,Dqk] bf16,
    KV[Tkv,Dqk] bf16, Indices[T,topk] i32, TopkLen[n_tl] i32, Sink[n_sink] f32, Out[T,H,d_v] bf16, Lse[T,H] f32,
    MaxLogits[T,H] f32).  See the module notes for the schedule.

    ``prefetch_rows`` (default; session 8: 3.02 -> 2.75 ms at S 4096, H 64): the producer loads a pair's KV rows
    into registers before its free-barrier waits; False: after them.  ``ablate="no_gather"`` (timing only, wrong
    results; ``python -m flashdsa.sparse.kernel_fwd_pair --variants``) keeps the protocol but issues no cp.async
    (the tiles keep what shared memory holds); ``"half_gather"``: only even CTAs gather (at H 128, the bound of a
    cluster that gathers each row once for both head groups).  ``has_order``: one more input Order[T] int32 after
    Sink, the token of each CTA row (``pair_body``).  ``overlap_qk``: ``pair_body``'s (False: the session-10
    order).  ``l2_prefetch`` (timing build): the gather's cp.async carry the ``.L2::128B`` hint
    (``_tl_common.L2_PREFETCH_PRELUDE``); ``persistent``: ``pair_body``'s (``dispatched`` picks it); ``row_gather``: the
    producer gathers by rows (``_tl_common.ROW_GATHER_PRELUDE``; dispatched for both grids, session 19).  ``hop``
    (timing build, with ``row_gather``): the 656-byte cache kernel's converter warpgroup with nothing to convert
    (``_pair_parts.hop_converter``; 512 threads, each PV two m64n128 wgmmas): what the converter staging's
    structure costs on bf16 tiles (outputs bitwise equal; session 21: 3.917 -> 4.110 ms at S 4096 / SKV 8192 /
    H 128).  ``batched``: the batched forms' index map inside the producer (``sparse_attn``'s
    ``topk_idxs [B, S, topk]`` as positions within each batch's ``kv [B, S_kv, D]``): two more arguments
    ``rows_per_batch`` (S) and ``kv_per_batch`` (S_kv) after MaxLogits, Indices the flat view ``[B * S, topk]``,
    KV ``[B * S_kv, D]``; the rows are those of ``kernel_index.offset_batched_indices`` (one launch less).
    ``evict_first`` (with ``row_gather``): the gather's copies carry an L2 evict_first policy
    (``_tl_common.EVICT_FIRST_PRELUDE``), for calls that read each KV row about once (``_persistent_kw``).
    ``out_f32`` (split-KV partials, ``decode/kernel_split.py``; the plain form): Out float32 and Q [n_q, H, Dqk]
    with n_q dividing T, row t reading q row t / (T / n_q) (``pair_body``'s q_rows: a token's chunks share its q
    row).  ``q_gate``: "tma" (one item per CTA) loads Q by TMA, "next" (``persistent``) has the producer load each
    item's Q by TMA ahead (``pair_body``'s)."""
    assert ablate in ("", "no_gather", "half_gather"), ablate
    assert not (batched and has_order), "batched: no ordered build"
    assert dqk in tc.SUPPORTED_DQK and d_v == D_V, (dqk, d_v)
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv, n_tl, n_sink, topk_dim = tc.dynamic_dims("n_tok", "n_kv", "n_tl", "n_sink", "topk")
    assert not (row_gather and (ablate or l2_prefetch)), "row_gather: no ablate / l2_prefetch build"
    assert row_gather or not evict_first, "evict_first: a row_gather build"
    assert dqk == D_V or not evict_first, "evict_first: Dqk 512 only (illegal instruction at 576, session 31)"
    assert not (out_f32 and (has_order or batched or ablate or hop)), "out_f32: the plain form"
    n_q = T.dynamic("n_q") if out_f32 else n_tok  # split-KV: one q row per token, n_tok / n_q chunk rows each
    producer = _bf16_producer(dqk=dqk, n_kv=n_kv, topk_dim=topk_dim, prefetch_rows=prefetch_rows, ablate=ablate,
                              row_gather=row_gather, batched=batched)
    body = pair_body(heads=heads, dqk=dqk, topk=topk, sm_scale=sm_scale, has_sink=has_sink,
                     has_topk_length=has_topk_length, n_tok=n_tok, topk_dim=topk_dim, producer=producer,
                     overlap_qk=overlap_qk, persistent=persistent,
                     **(dict(out_f32=True, q_rows=n_q) if out_f32 else {}),
                     **(dict(q_gate=q_gate) if q_gate else {}),
                     **(dict(converter=hop_converter(), regs=HOP_REGS) if hop else {}),
                     prelude=(tc.L2_PREFETCH_PRELUDE if l2_prefetch else tc.EVICT_FIRST_PRELUDE if evict_first
                              else tc.ROW_GATHER_PRELUDE if row_gather else None))

    if has_order:
        @T.prim_func
        def sparse_mla_fwd_pair_ordered(
            Q: T.Tensor([n_tok, heads, dqk], bf16),
            KV: T.Tensor([n_kv, dqk], bf16),
            Indices: T.Tensor([n_tok, topk_dim], i32),
            TopkLen: T.Tensor([n_tl], i32),
            Sink: T.Tensor([n_sink], f32),
            Order: T.Tensor([n_tok], i32),
            Out: T.Tensor([n_tok, heads, D_V], bf16),
            Lse: T.Tensor([n_tok, heads], f32),
            MaxLogits: T.Tensor([n_tok, heads], f32),
        ):
            body(Q, (KV,), Indices, TopkLen, Sink, Out, Lse, MaxLogits, Order)

        return sparse_mla_fwd_pair_ordered

    if batched:
        @T.prim_func
        def sparse_mla_fwd_pair_batched(
            Q: T.Tensor([n_tok, heads, dqk], bf16),
            KV: T.Tensor([n_kv, dqk], bf16),
            Indices: T.Tensor([n_tok, topk_dim], i32),
            TopkLen: T.Tensor([n_tl], i32),
            Sink: T.Tensor([n_sink], f32),
            Out: T.Tensor([n_tok, heads, D_V], bf16),
            Lse: T.Tensor([n_tok, heads], f32),
            MaxLogits: T.Tensor([n_tok, heads], f32),
            rows_per_batch: T.int32,
            kv_per_batch: T.int32,
        ):
            body(Q, (KV, rows_per_batch, kv_per_batch), Indices, TopkLen, Sink, Out, Lse, MaxLogits, None)

        return sparse_mla_fwd_pair_batched

    @T.prim_func
    def sparse_mla_fwd_pair(
        Q: T.Tensor([n_q, heads, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Indices: T.Tensor([n_tok, topk_dim], i32),
        TopkLen: T.Tensor([n_tl], i32),
        Sink: T.Tensor([n_sink], f32),
        Out: T.Tensor([n_tok, heads, D_V], f32 if out_f32 else bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        body(Q, (KV,), Indices, TopkLen, Sink, Out, Lse, MaxLogits, None)

    return sparse_mla_fwd_pair


def _pass_configs():
    # every intra-role sync is an explicit named barrier (the automatic pass reuses ids across roles)
    return plain_pass_configs({tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})


@functools.lru_cache(maxsize=64)
def _compiled(heads: int, dqk: int, d_v: int, n_blocks: int, sm_scale: float, has_sink: bool, has_topk_length: bool,
              build_kw: tuple = ()):
    """The compiled kernel; ``build_kw``: extra build keywords as sorted (name, value) pairs (timing builds)."""
    func = build_sparse_mla_fwd(heads=heads, dqk=dqk, d_v=d_v, topk=n_blocks * BLOCK_I, sm_scale=sm_scale,
                                has_sink=has_sink, has_topk_length=has_topk_length, **dict(build_kw))
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


# topk <= 640 (V4's): one CTA per SM looping over the items beats one CTA per item (session 16, V4 prefill 0.880
# -> 0.854 ms; topk 1024 equal, 2048 3-4% slower).  $FLASHDSA_PAIR_PERSISTENT_MAX (blocks, default 10) moves the
# bound for A / B runs (session 53, H100, with "next": topk 2048 H 128 4.102 / 4.102 ms at 10 -> 4.236 / 4.212 at 32,
# H 64 2.175 / 2.151 -> 2.235 / 2.214: one CTA per item at 32 blocks; the bound stays 10).
PERSISTENT_MAX_BLOCKS = 10
PERSISTENT_MAX_ENV = "FLASHDSA_PAIR_PERSISTENT_MAX"


# every dispatched grid gathers by rows (``row_gather``; outputs bitwise equal to the T.Parallel gather).  Session 19
# kernel times at S 4096 / SKV 8192 (T.Parallel gather -> rows): topk 2048 H 64 2.656 -> 2.165 ms, H 128 5.210 ->
# 4.163 (one CTA per item; persistent + rows 2.155 / 4.242); V4 topk 640 0.875 (persistent) -> 0.733 (persistent +
# rows; one CTA per item + rows 0.740)
ROW_GATHER_KW = (("row_gather", True),)
# The dispatched one-item-per-CTA grid (prefill: above ``PERSISTENT_MAX_BLOCKS`` blocks, rows read more than once)
# loads Q by TMA (``pair_body``'s q_gate "tma": one elected thread, eight or nine 64 x 64 boxes, instead of 16-byte
# loads by every consumer thread).  Session 50, S 4096 / topk 2048, the suite's eager timing, two interleaved
# rounds: H100 H 128 4.285 / 4.287 -> 4.148 / 4.192 ms, H 64 2.259 / 2.235 -> 2.194 / 2.189, SKV 131072 4.764 /
# 4.815 -> 4.737 / 4.642; H200 (one machine) H 128 4.196 / 4.199 -> 4.127 / 4.136, H 64 2.150 / 2.150 -> 2.114 /
# 2.114, SKV 131072 4.746 / 4.711 -> 4.680 / 4.686; outputs bitwise equal.  The ordered build (decode) and the
# split-KV partials keep the loads, and so does the grid that reads each row about once (decode shapes, the
# evict_first gather): not measured, and the dense paged decode kernel ran 2-4% slower with Q by TMA.
# $FLASHDSA_PAIR_QTMA = "0" turns it off, "1" (unset) on (read when a call is dispatched; part of ``sparse.api``'s
# plan key).
QTMA_ENV = "FLASHDSA_PAIR_QTMA"
# The persistent grid (up to ``PERSISTENT_MAX_BLOCKS``) with $FLASHDSA_PAIR_QNEXT = "1": the producer loads each
# item's Q by TMA once the previous item's last QK retired (``pair_body``'s q_gate "next"), instead of the consumers
# loading it after the previous item's epilogue.  "0" (unset): off.  Session 51 built it; session 53 measured it
# slower (H100, suite timing, two interleaved rounds, outputs bitwise equal): V4 (topk 640) 0.7645 / 0.7713 ->
# 0.8312 / 0.8341 ms; H 64 topk 2048 on the persistent grid 2.237 / 2.236 -> 2.253 / 2.186.
# It reaches every persistent grid this module dispatches except the single-use evict_first one (``reads_per_row``
# <= 1), the batched forms' and the dense decode pair path's included.
QNEXT_ENV = "FLASHDSA_PAIR_QNEXT"


def _q_tma_kw() -> tuple:
    on = check_choice(f"${QTMA_ENV}", os.environ.get(QTMA_ENV) or "1", ("0", "1")) == "1"
    return (("q_gate", "tma"),) if on else ()


def _q_next_kw() -> tuple:
    on = check_choice(f"${QNEXT_ENV}", os.environ.get(QNEXT_ENV) or "0", ("0", "1")) == "1"
    return (("q_gate", "next"),) if on else ()


def persistent_max_blocks() -> int:
    """``PERSISTENT_MAX_BLOCKS``, or ``$FLASHDSA_PAIR_PERSISTENT_MAX`` (a non-negative int) where set."""
    env = os.environ.get(PERSISTENT_MAX_ENV) or ""
    if not env:
        return PERSISTENT_MAX_BLOCKS
    if not (env.isascii() and env.isdecimal()):
        raise ValueError(f"${PERSISTENT_MAX_ENV}: expected a non-negative int, got {env!r}")
    return int(env)


def _persistent_kw(n_blocks: int, n_sm: int, single_use: bool = False) -> tuple:
    """The build keywords of the dispatched grid: ``persistent = n_sm`` up to ``persistent_max_blocks()`` blocks
    (Q loaded ahead where ``QNEXT_ENV`` says so), else one CTA per item (``n_sm`` 0: not on a GPU, one CTA per item)
    loading Q by TMA (``QTMA_ENV``); neither Q form where ``single_use``; both gather by rows (``ROW_GATHER_KW``);
    ``single_use`` (``reads_per_row`` <= 1): the gather with the evict_first policy."""
    persistent = 0 < n_blocks <= persistent_max_blocks() and n_sm > 0
    q_kw = (_q_next_kw() if persistent else _q_tma_kw()) if not single_use else ()
    return (((("persistent", n_sm),) if persistent else ()) + ROW_GATHER_KW
            + ((("evict_first", True),) if single_use else ()) + q_kw)


def reads_per_row(n_tok: int, heads: int, n_blocks: int, kv_rows: int) -> float:
    """How often the call reads an average KV row: ``T * G * topk / Tkv`` (G = H / 64 head-group CTAs per token).
    At most 1 (decode: a few tokens over a large cache, e.g. DeepSeek-V4's ``sparse_attn`` at m 1) the rows are
    streamed once and gathered with the L2 evict_first policy: session 31, V4 decode shape (b 128, h 64, topk 640,
    n 8192) 40.7 -> 37.5 us after the suite's write flush; prefill (hundreds of reads per row) keeps L2 reuse.
    Dispatched at H 64 and Dqk 512 only: one CTA per token (at H 128 the two head-group CTAs read each row
    together: not measured with the policy; session 26 found the policy 5% slower on the dense decode's TMA
    loads); the Dqk 576 build (its rope-tile copies) raised "illegal instruction" on the H200 in session 31, as the
    constant-policy form did at Dqk 576 in session 26, while every Dqk 512 build ran correct (GPU tests).  Session
    32's SASS (cuobjdump on the GPU host) shows why, and it is not registers (the producer uses at most R35 under its
    setmaxnreg 72): in the Dqk 576 build every hinted copy is ``LDGSTS ... [R+UR0+0x18000], desc[UR1]`` with UR0 /
    UR1 never written in the kernel, where the Dqk 512 build has ``[R+imm], desc[UR6]`` with UR6:UR7 the policy
    built by ``createpolicy``.  So ptxas 13.0 emits a descriptor register nothing sets; the visible difference is
    the immediate offsets (up to 0x30000 at Dqk 576, below 0x10000 at Dqk 512), a likely trigger not yet tested."""
    return n_tok * (heads // BLOCK_H) * n_blocks * BLOCK_I / max(kv_rows, 1)


def dispatched(q, kv_rows: int, order=None):
    """``compiled(heads, dqk, d_v, n_blocks, sm_scale, has_sink, has_topk_length)`` of the build this module runs
    for ``q``'s device and a KV of ``kv_rows`` rows: with ``order``, the ordered one-item-per-CTA build; else the
    persistent grid up to ``persistent_max_blocks()`` blocks (``_persistent_kw``; Q loaded ahead with ``QNEXT_ENV``),
    one CTA per item above (Q by TMA where rows are read more than once: ``QTMA_ENV``); all gather by rows (the
    ordered build since session 23: dense decode B 128 H 128 s_q 2 causal 425 -> 520 TFLOP/s)."""
    if order is not None:
        return lambda *a: _compiled(*a, (("has_order", True),) + ROW_GATHER_KW)
    return lambda *a: _compiled(*a, dispatched_kw(q, a[3], kv_rows))


def dispatched_kw(q, n_blocks: int, kv_rows: int) -> tuple:
    """``_persistent_kw`` for ``q``'s device (0 SMs off the GPU) and ``reads_per_row``."""
    n_sm = 0 if not q.is_cuda else _dispatch.sm_count(q.device.index if q.device.index is not None
                                                      else torch.cuda.current_device())
    single_use = (q.shape[1] == BLOCK_H and q.shape[2] == D_V
                  and reads_per_row(q.shape[0], q.shape[1], n_blocks, kv_rows) <= 1)
    return _persistent_kw(n_blocks, n_sm, single_use)


def batched_launcher(q, kv_rows: int, n_blocks: int, *, sm_scale: float, d_v: int, has_sink: bool,
                     has_topk_length: bool):
    """The launch of the dispatched grid's ``batched`` build for flat ``q`` [B * S, H, Dqk] (H 64 / 128):
    ``(q, kv [B * S_kv, Dqk], indices [B * S, topk], topk_length or dummy, attn_sink or dummy, out, lse,
    max_logits, S, S_kv)`` with the batched forms' per-batch positions as indices (the eager plans of
    ``sparse.api``)."""
    kw = dispatched_kw(q, n_blocks, kv_rows) + (("batched", True),)
    return direct_launcher(_compiled(q.shape[1], q.shape[2], d_v, n_blocks, float(sm_scale), has_sink,
                                     has_topk_length, kw))


def kernel_unsupported(q, kv, indices, *, d_v, topk_length=None, attn_sink=None) -> str | None:
    """None if this kernel handles the arguments, else a short reason: the pipelined kernel's rules, and full
    64-head tiles."""
    reason = kernel_fwd.kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
    if reason is None and q.shape[1] not in SUPPORTED_H:
        reason = f"H={q.shape[1]} not in {SUPPORTED_H} (the pair schedule needs full 64-head tiles)"
    return reason


# the split-KV partials' build (``decode/kernel_split.py``): one CTA per (token, chunk) item, rows gathered by rows
OUT_F32_KW = ROW_GATHER_KW + (("out_f32", True),)


def run_sparse_mla_fwd(q, kv, indices, *, sm_scale: float, d_v: int, topk_length=None, attn_sink=None,
                       order=None, checked: bool = False, out_f32: bool = False):
    """Returns (out [T,H,d_v] bf16, lse [T,H] f32 (natural log), max_logits [T,H] f32).  ``order``: None, or
    [T] int32 on the device, the token each CTA row takes (a permutation of 0..T-1; ``pair_body``'s Order).
    ``out_f32`` (split-KV partials; ``OUT_F32_KW``'s build, no ``order``): out float32, and q may hold one row per
    token for T = indices' rows = a multiple of q's (row t reads q row t / (T / q rows)); such a q passes only with
    ``checked=True`` (the caller checked the split rows: ``kernel_unsupported`` asks q rows = indices rows)."""
    if not checked:
        reason = kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)
        if reason is not None:
            raise ValueError(f"sparse_mla fwd pair kernel: {reason}")
    if out_f32:
        if order is not None:
            raise ValueError("out_f32: no ordered build")
        return kernel_fwd.launch(lambda *a: _compiled(*a, OUT_F32_KW), q, kv, indices, sm_scale=sm_scale, d_v=d_v,
                                 topk_length=topk_length, attn_sink=attn_sink, out_f32=True)
    return kernel_fwd.launch(dispatched(q, kv.shape[0], order), q, kv, indices, sm_scale=sm_scale, d_v=d_v,
                             topk_length=topk_length, attn_sink=attn_sink, extra=() if order is None else (order,))


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("pair_h128_d576_topk2048", build_sparse_mla_fwd(heads=128, dqk=576, topk=2048, sm_scale=576**-0.5)),
        ("pair_h64_d512_topk640_sink_tl", build_sparse_mla_fwd(heads=64, dqk=512, topk=640, sm_scale=512**-0.5,
                                                               has_sink=True, has_topk_length=True)),
        ("pair_h128_d576_topk8192_tl_ordered_row_gather",  # the decode pair path's build
         build_sparse_mla_fwd(heads=128, dqk=576, topk=8192, sm_scale=0.04, has_topk_length=True, has_order=True,
                              row_gather=True)),
        ("pair_h64_d576_topk2048_no_overlap_qk", build_sparse_mla_fwd(heads=64, dqk=576, topk=2048, sm_scale=0.04,
                                                                      overlap_qk=False)),  # timing build
        ("pair_h128_d576_topk2048_row_gather", build_sparse_mla_fwd(heads=128, dqk=576, topk=2048, sm_scale=0.04,
                                                                    row_gather=True)),  # with QTMA_ENV=0
        ("pair_h64_d512_topk2048_row_gather_qtma",  # dispatched above 10 blocks (prefill)
         build_sparse_mla_fwd(heads=64, dqk=512, topk=2048, sm_scale=0.04, row_gather=True, q_gate="tma")),
        ("pair_h64_d512_topk640_sink_tl_persistent132_row_gather",  # the dispatched grid at V4's topk
         build_sparse_mla_fwd(heads=64, dqk=512, topk=640, sm_scale=512**-0.5, has_sink=True, has_topk_length=True,
                              persistent=132, row_gather=True)),
        ("pair_h128_d576_topk640_tl_persistent132_row_gather_qnext",  # $FLASHDSA_PAIR_QNEXT=1: Q loaded ahead
         build_sparse_mla_fwd(heads=128, dqk=576, topk=640, sm_scale=0.04, has_topk_length=True, persistent=132,
                              row_gather=True, q_gate="next")),
        ("pair_h64_d512_topk640_sink_persistent132_row_gather_batched_evict_first",  # sparse_attn's decode plan
         build_sparse_mla_fwd(heads=64, dqk=512, topk=640, sm_scale=512**-0.5, has_sink=True, persistent=132,
                              row_gather=True, batched=True, evict_first=True)),
        ("pair_h128_d576_topk256_tl_row_gather_out_f32",  # split-KV partials of bf16-cache decode
         build_sparse_mla_fwd(heads=128, dqk=576, topk=256, sm_scale=0.04, has_topk_length=True, row_gather=True,
                              out_f32=True)),
    ]


if __name__ == "__main__":
    from ._pair_timing import main

    main()
