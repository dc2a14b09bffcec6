"""PyTorch reference of the exact top-k selector.

Math:
    Row m keeps the k largest ``scores[m, n]`` over ``starts[m] <= n < ends[m]``; -inf and NaN are never selected;
    ties go to the lower position (a stable descending sort); leftover slots are -1.
    ``order="score"``: descending score (ties: ascending position); ``"index"`` and ``"any"``: ascending position,
    -1s last. Rows are processed in chunks of about ``2**25`` elements.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMS = 1 << 25


def topk_indices_reference(scores: torch.Tensor, k: int, starts=None, ends=None, order: str = "index"):
    """scores `[M, N]`, starts/ends `[M]` int32 or None -> `[M, k]` int32."""
    M, N = scores.shape
    dev = scores.device
    out = torch.full((M, k), -1, dtype=torch.int32, device=dev)
    kk = min(k, N)
    if kk == 0 or M == 0:
        return out
    pos = torch.arange(N, device=dev)
    neg_inf = torch.full((), -float("inf"), dtype=scores.dtype, device=dev)
    step = max(1, _CHUNK_ELEMS // max(1, N))
    for a in range(0, M, step):
        b = min(M, a + step)
        s = scores[a:b]
        keep = ~torch.isnan(s)
        if starts is not None:
            keep &= pos.unsqueeze(0) >= starts[a:b].long().unsqueeze(-1)
        if ends is not None:
            keep &= pos.unsqueeze(0) < ends[a:b].long().unsqueeze(-1)
        s = torch.where(keep, s, neg_inf)
        vals, idx = torch.sort(s, dim=-1, descending=True, stable=True)
        vals, idx = vals[:, :kk], idx[:, :kk]
        idx = torch.where(vals == -float("inf"), torch.full_like(idx, -1), idx)
        if order != "score":
            key = torch.where(idx < 0, torch.full_like(idx, N), idx).sort(dim=-1).values
            idx = torch.where(key == N, torch.full_like(key, -1), key)
        out[a:b, :kk] = idx.to(torch.int32)
    return out
