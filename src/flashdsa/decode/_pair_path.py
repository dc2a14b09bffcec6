"""Dense decode at H 64 / 128 as one sparse MLA forward on the pair schedule (``sparse.kernel_fwd_pair``).

Each of the B * s_q query tokens becomes one forward row whose slot list is its sequence's cache positions in
order (slot = block_table[b, p // bs] * bs + p % bs, -1 for an out-of-range block id) and whose ``topk_length``
is its causal length, so the kernel walks exactly the attended positions (and skips the blocks past them); the
cache viewed as ``num_blocks * block_size`` rows is the forward's kv; the CTAs take the sequences longest first,
a sequence's tokens together (``token_order``).  The forward's 64-head CTAs run at the pair schedule's rate
(~500-550 TFLOP/s at H 128, session 25) when there are enough of them, where the split-KV decode kernels reach
~250; ``pair_efficiency`` decides.  Block sizes that are multiples of 64 skip the slot lists: the kernel of
``kernel_pair_paged`` reads the pages through the block table (TMA for full blocks), same outputs bit for bit
(``$FLASHDSA_DECODE_PAIR_PAGED=0``: the slot lists everywhere, for timing).
"""

from __future__ import annotations

import os

import torch

from ._tl_common import D_V, DQK

PAIR_HEADS = (64, 128)
PAIR_MIN_EFFICIENCY = 0.6  # the pair path when its CTAs fill the waves at least this well (else split-KV)
MAX_SLOT_BYTES = 1 << 28  # the B * s_q * L int32 slot lists it materializes (L = max_blocks * block_size)


PAGED_ENV = "FLASHDSA_DECODE_PAIR_PAGED"


def paged(block_size: int) -> bool:
    """Whether the pair path reads the pages through the block table (``kernel_pair_paged``) instead of slot
    lists: block sizes that are multiples of 64, unless ``$FLASHDSA_DECODE_PAIR_PAGED`` is "0"."""
    from . import kernel_pair_paged

    return kernel_pair_paged.supports(block_size) and os.environ.get(PAGED_ENV, "1") != "0"


def pair_fits(batch: int, s_q: int, length: int, block_size: int) -> bool:
    """The int32 slot arithmetic holds (L < 2^30) and, where slot lists are built (not ``paged``), they stay
    within ``MAX_SLOT_BYTES``."""
    return length < 2**30 and (paged(block_size) or batch * s_q * length * 4 <= MAX_SLOT_BYTES)


def pair_efficiency(batch: int, s_q: int, heads: int, num_sms: int) -> float:
    """Fraction of the SM-waves the forward's B * s_q * H / 64 CTAs fill (0 where the pair path cannot run)."""
    if heads not in PAIR_HEADS or batch * s_q == 0:
        return 0.0
    n = batch * s_q * (heads // 64)
    waves = -(-n // num_sms)
    return n / (waves * num_sms)


def slot_rows(block_table, cache_seqlens, num_blocks: int, block_size: int, s_q: int, causal: bool):
    """(slots [B * s_q, L] int32, lengths [B * s_q] int32) with L = max_blocks * block_size: the cache slot of every
    position (-1 for a block id outside [0, num_blocks)) and each query's attended length clamped to [0, L]."""
    B, max_blocks = block_table.shape
    dev = block_table.device
    L = max_blocks * block_size
    # per page, then broadcast over its offsets: the large tensors are written twice (a few launches of host time)
    ok = (block_table >= 0) & (block_table < num_blocks)  # [B, max_blocks]; bad ids may overflow below: masked
    offs = torch.arange(block_size, device=dev, dtype=torch.int32)
    slots = torch.where(ok.unsqueeze(-1), block_table.unsqueeze(-1) * block_size + offs, -1).view(B, L)
    slots = slots.view(B, 1, L).expand(B, s_q, L).reshape(B * s_q, L)
    return slots, query_lengths(cache_seqlens, L, s_q, causal)


def query_lengths(cache_seqlens, L: int, s_q: int, causal: bool):
    """[B * s_q] int32: each query's attended length (causal: bottom-right, query i of s_q sees cache_seqlens -
    s_q + 1 + i positions) clamped to [0, L]."""
    dev = cache_seqlens.device
    shift = torch.arange(s_q, device=dev, dtype=torch.int32) - (s_q - 1) if causal else \
        torch.zeros(s_q, device=dev, dtype=torch.int32)
    # clamped first: int32 sums must not wrap (cache_seqlens values are never checked; INT_MIN - 1 would be INT_MAX)
    lens = cache_seqlens.view(-1, 1).clamp(-s_q, L + s_q)
    return (lens + shift.view(1, s_q)).clamp(0, L).reshape(-1)  # int32


def token_order(lengths, s_q: int):
    """[B * s_q] int32: the forward's CTA order, sequences longest first (a stable descending sort of each sequence's
    longest query length), the s_q tokens of a sequence adjacent and in order.  The tokens of a sequence read the
    same cache rows, so while their CTAs run together the rows come from DRAM once (a sort of the tokens' own
    lengths put every sequence's last token first and its other tokens a wave or more later: at s_q 2 causal each
    cache row came from DRAM twice)."""
    per_seq = lengths.view(-1, s_q).amax(dim=1)
    seqs = torch.argsort(per_seq, descending=True, stable=True)
    return (seqs.view(-1, 1) * s_q + torch.arange(s_q, device=lengths.device)).view(-1).to(torch.int32)


def prepare(block_table, cache_seqlens, num_blocks: int, block_size: int, s_q: int, causal: bool):
    """(slots, lengths, order) of a step: ``slot_rows`` (slots None where ``paged``: ``query_lengths`` only) and
    ``token_order`` (GPU ops, no host sync; where paged, on CUDA, both in one launch: ``kernel_order``); what ``run``
    needs besides q and the cache, the same for every layer of a decode step."""
    if paged(block_size):
        L = block_table.shape[1] * block_size
        if cache_seqlens.is_cuda:
            from . import kernel_order

            if kernel_order.enabled():  # one launch instead of ~11 small ones
                return (None,) + kernel_order.lengths_and_order(cache_seqlens, L, s_q, causal)
        slots, lengths = None, query_lengths(cache_seqlens, L, s_q, causal)
    else:
        slots, lengths = slot_rows(block_table, cache_seqlens, num_blocks, block_size, s_q, causal)
    return slots, lengths, token_order(lengths, s_q)


def run(q, kv_cache, block_table, cache_seqlens, *, sm_scale: float, causal: bool, attn_sink=None, prepared=None):
    """q [B, s_q, H, 576] bf16 (H 64 / 128), kv_cache [num_blocks, block_size, 576] bf16 -> (out [B, s_q, H, 512]
    bf16, lse [B, s_q, H] f32).  The CTAs take the sequences longest first (the kernel's ``Order`` input:
    ``token_order``), so that mixed lengths do not leave a long sequence for the last wave.  The
    caller checked the arguments (``kernel_dense.kernel_unsupported``; H 64 / 128 and ``pair_fits`` by the
    dispatch), which covers the forward's rules for the slot lists built here.  ``prepared``: ``prepare``'s result
    for these block_table / cache_seqlens (computed here when None)."""
    from ..sparse import kernel_fwd_pair

    B, s_q, H, _ = q.shape
    nb, bs, _ = kv_cache.shape
    slots, lengths, order = prepared if prepared is not None else prepare(block_table, cache_seqlens, nb, bs, s_q,
                                                                          causal)
    if slots is None:
        from . import kernel_pair_paged

        out, lse = kernel_pair_paged.run(q, kv_cache, block_table, lengths, order, sm_scale=sm_scale,
                                         attn_sink=attn_sink)
        return out.view(B, s_q, H, D_V), lse.view(B, s_q, H)
    out, lse, _ = kernel_fwd_pair.run_sparse_mla_fwd(q.reshape(B * s_q, H, DQK), kv_cache.reshape(nb * bs, DQK),
                                                     slots, sm_scale=sm_scale, d_v=D_V, topk_length=lengths,
                                                     attn_sink=attn_sink, order=order, checked=True)
    return out.view(B, s_q, H, D_V), lse.view(B, s_q, H)
