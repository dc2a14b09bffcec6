"""PyTorch reference of MLA decode over a paged KV cache (dense and sparse; bf16 or the 656-byte FP8 cache).

Math:
    The cache is viewed flat as ``num_blocks * block_size`` rows (slot = block_id * block_size + offset).
    Dense: query i of sequence b attends the slots of positions ``p < cache_seqlens[b] - s_q + 1 + i`` (causal) or
    ``p < cache_seqlens[b]``, position p living in block ``block_table[b, p // block_size]`` at offset
    ``p % block_size``; positions past the table or in an out-of-range block id are skipped.
    Sparse: query i of sequence b attends slots ``indices[b, i, :topk_length[b]]`` (invalid ones skipped).
    Both reduce to the sparse MLA reference (``flashdsa.sparse.reference``) over those slot lists; FP8 rows are
    dequantized after the gather, so the result equals attention over the dequantized cache.
"""

from __future__ import annotations

import torch

from ..indexer.reference import paged_positions
from ..sparse.reference import sparse_mla_fwd_reference


def dense_slots(block_table, cache_seqlens, num_blocks: int, block_size: int, s_q: int, causal: bool):
    """`[B, s_q, L]` int32 slot lists for the dense case (-1 where masked); L = max_blocks * block_size."""
    B, max_blocks = block_table.shape
    L = max_blocks * block_size
    slots = paged_positions(block_table, num_blocks, block_size, L)  # [B, L]
    pos = torch.arange(L, device=block_table.device)
    lens = cache_seqlens.long().view(B, 1)
    shift = (torch.arange(s_q, device=block_table.device).view(1, s_q) - s_q + 1 if causal
             else torch.zeros(1, s_q, dtype=torch.long, device=block_table.device))
    limit = lens + shift  # [B, s_q]
    keep = pos.view(1, 1, L) < limit.unsqueeze(-1)
    return torch.where(keep, slots.unsqueeze(1),
                       torch.full((), -1, dtype=torch.long, device=block_table.device)).to(torch.int32)


def mla_decode_reference(q, kv_cache, block_table, cache_seqlens, *, sm_scale: float, d_v: int, causal: bool,
                         indices=None, topk_length=None, attn_sink=None):
    """q `[B, s_q, H, Dqk]`; kv_cache `[num_blocks, block_size, Dqk]` (or uint8 `[..., 656]`) -> (out, lse) with
    out `[B, s_q, H, d_v]` and lse `[B, s_q, H]` in the compute dtype (float32)."""
    B, s_q, H, dqk = q.shape
    nb, bs = kv_cache.shape[:2]
    flat = kv_cache.reshape(nb * bs, kv_cache.shape[-1])
    if indices is None:
        slots = dense_slots(block_table, cache_seqlens, nb, bs, s_q, causal)
        tl = None
    else:
        slots = indices
        tl = topk_length.view(B, 1).expand(B, s_q).reshape(B * s_q) if topk_length is not None else None
    if slots.shape[-1] == 0:  # no cache at all: one invalid slot keeps the shapes non-empty
        slots = torch.full((B, s_q, 1), -1, dtype=torch.int32, device=q.device)
    slots = slots.reshape(B * s_q, slots.shape[-1])  # not -1: B = 0 leaves the width ambiguous
    out, lse, _ = sparse_mla_fwd_reference(q.reshape(B * s_q, H, dqk), flat, slots,
                                           sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink, topk_length=tl)
    return out.reshape(B, s_q, H, d_v), lse.reshape(B, s_q, H)
