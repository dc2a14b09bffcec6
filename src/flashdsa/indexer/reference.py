"""PyTorch reference of the lightning indexer (prefill ranges and paged decode).

Math:
    ``out[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n])`` for n in ``[k_start[m], k_end[m])``,
    ``-inf`` elsewhere. Inputs are dequantized to float32 (fp8 e4m3 -> float32 is exact) and all math is float32
    (float64 for float64 inputs). Rows are processed in chunks so that at most about ``2**26`` logits exist at once.
"""

from __future__ import annotations

import math
import torch

_CHUNK_ELEMS = 1 << 26


def _cd(*xs) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def indexer_logits_reference(q, k, weights, k_scale=None, k_start=None, k_end=None):
    """q `[M, H, D]`, k `[N, D]`, weights `[M, H]`, k_scale `[N]` or None, k_start/k_end `[M]` or None -> `[M, N]`."""
    cd = _cd(q, weights)
    M, H, _ = q.shape
    N = k.shape[0]
    dev = q.device
    out = torch.full((M, N), -math.inf, dtype=cd, device=dev)
    kf = k.to(cd)
    pos = torch.arange(N, device=dev)
    step = max(1, _CHUNK_ELEMS // max(1, H * N))
    for a in range(0, M, step):
        b = min(M, a + step)
        logits = torch.einsum("mhd,nd->mhn", q[a:b].to(cd), kf).clamp_min_(0)
        s = torch.einsum("mhn,mh->mn", logits, weights[a:b].to(cd))
        if k_scale is not None:
            s = s * k_scale.to(cd).unsqueeze(0)
        lo = k_start[a:b].long().clamp(0, N).unsqueeze(-1) if k_start is not None else 0
        hi = k_end[a:b].long().clamp(0, N).unsqueeze(-1) if k_end is not None else N
        inside = (pos.unsqueeze(0) >= lo) & (pos.unsqueeze(0) < hi)
        out[a:b] = torch.where(inside, s, torch.full((), -math.inf, dtype=cd, device=dev))
    return out


def paged_positions(block_table: torch.Tensor, num_blocks: int, block_size: int, length: int):
    """Cache slot of every logical position ``p < length`` of each sequence: `[B, length]` int64, -1 where the
    position lies past the table or its block id is out of ``[0, num_blocks)``. See docs/conventions.md#paged-cache."""
    dev = block_table.device
    pos = torch.arange(length, device=dev)
    max_blocks = block_table.shape[1]
    col = (pos // block_size).clamp_max(max(max_blocks - 1, 0))
    if max_blocks == 0:
        return torch.full((block_table.shape[0], length), -1, dtype=torch.long, device=dev)
    blk = block_table.long()[:, col]  # [B, length]
    ok = (blk >= 0) & (blk < num_blocks) & (pos // block_size < max_blocks).unsqueeze(0)
    return torch.where(ok, blk * block_size + (pos % block_size).unsqueeze(0), torch.full_like(blk, -1))


def indexer_logits_paged_reference(q, k_cache, weights, context_lens, block_table, k_scale_cache=None,
                                   max_context: int = 0):
    """q `[B, next_n, H, D]`, k_cache `[num_blocks, block_size, D]`, weights `[B*next_n, H]`, context_lens `[B]`,
    block_table `[B, max_blocks]`, k_scale_cache `[num_blocks, block_size]` or None -> `[B*next_n, max_context]`.

    Row ``b*next_n + j`` scores positions ``p < context_lens[b] - next_n + 1 + j``; -inf elsewhere and at positions
    whose block id is invalid."""
    cd = _cd(q, weights)
    B, next_n, H, D = q.shape
    nb, bs = k_cache.shape[:2]
    dev = q.device
    L = int(max_context)
    out = torch.full((B * next_n, L), -math.inf, dtype=cd, device=dev)
    if L == 0 or B == 0 or nb == 0:  # no blocks: no block id is valid
        return out
    flat_k = k_cache.reshape(nb * bs, D)
    flat_s = k_scale_cache.reshape(nb * bs) if k_scale_cache is not None else None
    step = max(1, _CHUNK_ELEMS // max(1, L * max(D, next_n * H)))
    pos = torch.arange(L, device=dev)
    for a in range(0, B, step):
        b = min(B, a + step)
        slots = paged_positions(block_table[a:b], nb, bs, L)  # [bc, L]
        ok = slots >= 0
        safe = torch.where(ok, slots, torch.zeros_like(slots))
        keys = torch.where(ok.unsqueeze(-1), flat_k[safe].to(cd), torch.zeros((), dtype=cd, device=dev))
        logits = torch.einsum("bjhd,bld->bjhl", q[a:b].to(cd), keys).clamp_min_(0)
        s = torch.einsum("bjhl,bjh->bjl", logits, weights[a * next_n:b * next_n].to(cd).view(b - a, next_n, H))
        if flat_s is not None:
            s = s * torch.where(ok, flat_s[safe].to(cd), torch.zeros((), dtype=cd, device=dev)).unsqueeze(1)
        limit = context_lens[a:b].long().view(-1, 1) - next_n + 1 + torch.arange(next_n, device=dev).view(1, -1)
        inside = (pos.view(1, 1, L) < limit.unsqueeze(-1)) & ok.unsqueeze(1)
        s = torch.where(inside, s, torch.full((), -math.inf, dtype=cd, device=dev))
        out[a * next_n:b * next_n] = s.reshape((b - a) * next_n, L)
    return out
