"""Dense decode at H 64 / 128 on the pair schedule, reading the paged cache through the block table (sm_90a).

Notes
-----
The same schedule, consumers and numerics as the sparse forward's pair kernel (``sparse._pair_body.pair_body``; its
module notes in ``sparse/kernel_fwd_pair.py``), with a producer that reads the KV cache as pages instead of a slot
list: query token ``tok`` (= b * s_q + i) attends positions [0, TopkLen[tok]) of sequence b = tok // s_q, and its
64-position block blk lies in page BlockTable[b, blk * 64 // block_size] at offset blk * 64 % block_size (block
sizes that are multiples of 64: a block never spans two pages).  So:
  * no slot lists: the rows come from the block table (one broadcast load per block and producer thread), which
    removes the ``B * s_q * L`` int32 lists the slot-list path builds on the GPU at every call (~8% of a single
    dense B 128 H 128 call, session 28);
  * a full block (every position < TopkLen, page id in [0, num_blocks)) is one contiguous 64 x 1152-byte page
    segment, loaded by TMA: one elected producer thread issues the half tile's 64-column boxes (tensor map over
    the cache [num_blocks, block_size, 576], 128-byte swizzle = the layout the row gather writes) after
    ``expect_tx`` on the half's ready barrier, and every producer thread arrives on it (the 128 arrivals the row
    gather's ``cp.async.mbarrier.arrive.noinc`` would give).  The row gather (``fdsa_gather_half``) keeps the
    tail block and blocks with a bad page id: rows past the length or in a bad page are zero-filled, never read
    (unused cache slots may hold NaN), and masked to -inf by the consumers as before.
Same products in the same order as the slot-list path over the same rows, so outputs are bitwise equal to it.
The TMA path was built to cut the producer's issue work per half tile (128 threads x 16 cp.async with their
addresses -> 4-5 TMA instructions from one thread): without any gather the pair kernel runs ~20% faster
(PERFORMANCE.md, sessions 18-19).
"""

import functools
import os

import torch

import tilelang
import tilelang.language as T

from .._tilelang import aligned, direct_launcher, dummy, plain_pass_configs
from .._validate import check_choice
from ..sparse import _tl_common as tc
from ..sparse._pair_body import pair_body
from ..sparse._pair_parts import BAR_PROD, drain, pair_phase
from ..sparse.kernel_fwd_pair import row_gather_macros
from ._tl_common import D_V, DQK

BI = tc.BLOCK_I
DH = D_V // 2
TOPK_BOUND = 1 << 30  # the kernel's static block bound; the real bound is TopkLen <= max_blocks * block_size
# "1": at H 128 the token's two head-group CTAs run as a 2-CTA cluster sharing each full page's TMA load (one L2
# read per page instead of two; session 45, not yet measured: timing and tests read it, the default is off)
CLUSTER_ENV = "FLASHDSA_DECODE_PAIR_CLUSTER"
# "1": Q loaded by TMA (one elected thread, 9 boxes) instead of every consumer thread's 16-byte loads (session 50:
# slower, H100 graph replay B 128 H 128 s_q 1 0.5277 -> 0.5392 ms, s_q 2 causal 0.928 -> 0.963; Q's boxes queue in
# the TMA unit ahead of the page loads; timing and tests read it, the default is off)
QTMA_ENV = "FLASHDSA_DECODE_PAIR_QTMA"


def paged_producer(*, s_q, block_size, cluster=False):
    """The producer (``pair_body``'s ``producer`` slot) of the paged bf16 cache: ``kv_src`` = (KV [num_blocks *
    block_size, 576] (the row gather's flat view), KVP [num_blocks, block_size, 576] (the TMA's paged view)),
    ``Indices`` = BlockTable [B, max_blocks] int32.  ``cluster`` (``pair_body``'s): a full block's TMA loads are
    multicast by rank 0 of the token's 2-CTA cluster into both CTAs (each CTA still expects the bytes on its own
    ready barrier), so each page is read from L2 once for both head groups; partial blocks keep a row gather per
    CTA."""
    bs = int(block_size)
    mc = 0b11 if cluster else None  # T.tma_copy's cluster_mask: None = a unicast load
    assert bs % BI == 0, bs
    gather_l, gather_r = row_gather_macros(DQK)
    i32 = "int32"

    @T.macro
    def block_rows(BlockTable, KVP, b, lim, blk, pt, pg, k, row):
        # pg[k] = page of block blk or -1 (id out of range), in every producer thread (one broadcast load);
        # row[0] (thread pt < 64) = flat cache row of position blk * 64 + pt, -1 past the length or in a bad page;
        # pg[k + 2] = 1 where the block is full (TMA), else 0
        pg[k] = BlockTable[b, T.min(blk * BI // bs, BlockTable.shape[1] - 1)]
        pg[k] = T.if_then_else((pg[k] >= 0) & (pg[k] < KVP.shape[0]), pg[k], -1)
        pg[k + 2] = T.if_then_else((pg[k] >= 0) & (blk * BI + BI <= lim), 1, 0)
        if pt < BI:
            row[0] = T.if_then_else((pg[k] >= 0) & (blk * BI + pt < lim), pg[k] * bs + blk * BI % bs + pt, -1)

    @T.macro
    def publish(Rows, row, pt, rdy):
        if pt < BI:
            Rows[pt] = row[0]
        T.sync_threads(BAR_PROD, 128)
        T.barrier_arrive(rdy)

    @T.macro
    def load_l(kv_src, KVh, Rows, pg, k, blk, rdy):
        KVP = kv_src[1]
        if pg[k + 2] == 1:
            T.tma_copy(KVP[pg[k], blk * BI % bs:blk * BI % bs + BI, 0:DH], KVh, barrier=rdy,
                       leader_scope_threads=128, cluster_mask=mc)
            T.barrier_arrive(rdy)
        else:
            gather_l(KVh, Rows, kv_src)
            T.cp_async_barrier_noinc(rdy)

    @T.macro
    def load_r(kv_src, KVh, Kt, Rows, pg, k, blk, rdy):
        KVP = kv_src[1]
        if pg[k + 2] == 1:
            T.tma_copy(KVP[pg[k], blk * BI % bs:blk * BI % bs + BI, DH:D_V], KVh, barrier=rdy,
                       leader_scope_threads=128, cluster_mask=mc)
            T.tma_copy(KVP[pg[k], blk * BI % bs:blk * BI % bs + BI, D_V:DQK], Kt, barrier=rdy,
                       leader_scope_threads=128, cluster_mask=mc)
            T.barrier_arrive(rdy)
        else:
            gather_r(KVh, Kt, Rows, kv_src)
            T.cp_async_barrier_noinc(rdy)

    @T.macro
    def producer(kv_src, BlockTable, tok, lim, npair, tx, Rows0, Rows1, KVa_l, KVa_r, KVb_l, KVb_r, Ka_t, Kb_t,
                 row_a, row_b, rdy_al, rdy_br, rdy_ar, rdy_bl, fr_al, fr_bl, fr_br, fr_ar, pb):
        pg = T.alloc_local([4], i32)  # pages of blocks a / b, then their "full" flags
        pt = tx - 256
        b = tok // s_q
        for j in T.serial(npair[0]):
            # the pair's pages and rows before the waits (their loads overlap them)
            block_rows(BlockTable, kv_src[1], b, lim[0], j * 2, pt, pg, 0, row_a)
            block_rows(BlockTable, kv_src[1], b, lim[0], j * 2 + 1, pt, pg, 1, row_b)
            T.barrier_wait(fr_al, pair_phase(pb, j) ^ 1)
            publish(Rows0, row_a, pt, rdy_al)
            load_l(kv_src, KVa_l, Rows0, pg, 0, j * 2, rdy_al)
            T.barrier_wait(fr_br, pair_phase(pb, j) ^ 1)
            publish(Rows1, row_b, pt, rdy_br)
            load_r(kv_src, KVb_r, Kb_t, Rows1, pg, 1, j * 2 + 1, rdy_br)
            T.barrier_wait(fr_ar, pair_phase(pb, j) ^ 1)
            load_r(kv_src, KVa_r, Ka_t, Rows0, pg, 0, j * 2, rdy_ar)
            T.barrier_wait(fr_bl, pair_phase(pb, j) ^ 1)
            load_l(kv_src, KVb_l, Rows1, pg, 1, j * 2 + 1, rdy_bl)
        if pb is None:
            drain()

    return producer


def build_pair_paged(*, heads: int, s_q: int, block_size: int, sm_scale: float, has_sink: bool,
                     cluster: bool = False, q_tma: bool = False):
    """The TileLang prim_func: Q [B * s_q, H, 576] bf16, KV [num_blocks * block_size, 576] bf16 (flat view), KVP
    [num_blocks, block_size, 576] bf16 (the same cache, paged view), BlockTable [B, max_blocks] int32, TopkLen
    [B * s_q] int32 (attended length per token, in [0, max_blocks * block_size]), Sink [n_sink] f32, Order
    [B * s_q] int32 (CTA row -> token; ``pair_body``), Out [B * s_q, H, 512] bf16, Lse [B * s_q, H] f32,
    MaxLogits [B * s_q, H] f32.  H 64 / 128, block_size a multiple of 64; ``cluster`` (H 128): the token's two
    head-group CTAs as a cluster sharing each full page's TMA load (``paged_producer``); ``q_tma``: Q loaded by TMA
    (``pair_body``'s q_gate "tma")."""
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv, n_pages, n_seq, maxb, n_sink = tc.dynamic_dims("n_tok", "n_kv", "n_pages", "n_seq", "max_blocks",
                                                                "n_sink")
    bs = int(block_size)
    body = pair_body(heads=heads, dqk=DQK, topk=TOPK_BOUND, sm_scale=sm_scale, has_sink=has_sink,
                     has_topk_length=True, n_tok=n_tok, topk_dim=maxb * bs,
                     producer=paged_producer(s_q=s_q, block_size=bs, cluster=cluster),
                     prelude=tc.ROW_GATHER_PRELUDE, **({"cluster": True} if cluster else {}),
                     **({"q_gate": "tma"} if q_tma else {}))

    @T.prim_func
    def mla_decode_pair_paged(
        Q: T.Tensor([n_tok, heads, DQK], bf16),
        KV: T.Tensor([n_kv, DQK], bf16),
        KVP: T.Tensor([n_pages, bs, DQK], bf16),
        BlockTable: T.Tensor([n_seq, maxb], i32),
        TopkLen: T.Tensor([n_tok], i32),
        Sink: T.Tensor([n_sink], f32),
        Order: T.Tensor([n_tok], i32),
        Out: T.Tensor([n_tok, heads, D_V], bf16),
        Lse: T.Tensor([n_tok, heads], f32),
        MaxLogits: T.Tensor([n_tok, heads], f32),
    ):
        body(Q, (KV, KVP), BlockTable, TopkLen, Sink, Out, Lse, MaxLogits, Order)

    return mla_decode_pair_paged


def _pass_configs():
    # the pair kernel's (explicit named barriers only; ``T.tma_copy`` is explicit, not a lowered ``T.copy``)
    return plain_pass_configs({tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})


@functools.lru_cache(maxsize=32)
def _compiled(heads: int, s_q: int, block_size: int, sm_scale: float, has_sink: bool, cluster: bool = False,
              q_tma: bool = False):
    func = build_pair_paged(heads=heads, s_q=s_q, block_size=block_size, sm_scale=sm_scale, has_sink=has_sink,
                            cluster=cluster, q_tma=q_tma)
    return tilelang.compile(func, target="cuda", pass_configs=_pass_configs())


def use_cluster(heads: int) -> bool:
    """Whether ``run`` launches the cluster build: H 128 and ``$FLASHDSA_DECODE_PAIR_CLUSTER`` = "1"."""
    return heads == 128 and os.environ.get(CLUSTER_ENV, "") == "1"


def use_q_tma(heads: int) -> bool:
    """Whether ``run`` launches the build loading Q by TMA: ``$FLASHDSA_DECODE_PAIR_QTMA`` = "1" and not the
    cluster build (timing, session 50)."""
    on = check_choice(f"${QTMA_ENV}", os.environ.get(QTMA_ENV, ""), ("", "0", "1")) == "1"
    return on and not use_cluster(heads)


def supports(block_size: int) -> bool:
    """Whether this kernel reads caches of ``block_size`` (a multiple of 64: no 64-position block spans pages)."""
    return block_size % BI == 0


def run(q, kv_cache, block_table, lengths, order, *, sm_scale: float, attn_sink=None):
    """q [B, s_q, H, 576] bf16 (H 64 / 128), kv_cache [num_blocks, block_size, 576] bf16 (``supports``),
    block_table [B, max_blocks] int32, lengths / order [B * s_q] int32 (``_pair_path.prepare``) -> (out [B * s_q,
    H, 512] bf16, lse [B * s_q, H] f32).  Arguments already checked."""
    B, s_q, H, _ = q.shape
    nb, bs, _ = kv_cache.shape
    q = aligned(q.reshape(B * s_q, H, DQK))  # Q's 16-byte loads and TMA boxes need a 16-byte aligned base
    kv_cache = aligned(kv_cache)
    flat = kv_cache.view(nb * bs, DQK)
    (out, lse, max_logits), done = tc.fwd_outputs(q, flat, sm_scale=sm_scale, d_v=D_V)
    if done:
        return out, lse
    kernel = _compiled(H, s_q, bs, float(sm_scale), attn_sink is not None, use_cluster(H), use_q_tma(H))
    sink = aligned(attn_sink) if attn_sink is not None else dummy(torch.float32, q.device)
    direct_launcher(kernel)(q, flat, kv_cache, block_table.contiguous(), lengths, sink, order, out, lse, max_logits)
    return out, lse


def lowering_cases():
    """Representative (name, prim_func) configurations for the CPU lowering test."""
    return [
        ("pair_paged_h128_sq1_bs64", build_pair_paged(heads=128, s_q=1, block_size=64, sm_scale=DQK ** -0.5,
                                                      has_sink=False)),
        ("pair_paged_h64_sq2_bs256_sink", build_pair_paged(heads=64, s_q=2, block_size=256, sm_scale=0.04,
                                                           has_sink=True)),
        ("pair_paged_h64_sq1_bs64_qtma", build_pair_paged(heads=64, s_q=1, block_size=64, sm_scale=0.04,
                                                          has_sink=False, q_tma=True)),
        ("pair_paged_h128_sq2_bs64_sink_cluster", build_pair_paged(heads=128, s_q=2, block_size=64, sm_scale=0.04,
                                                                   has_sink=True, cluster=True)),
    ]
