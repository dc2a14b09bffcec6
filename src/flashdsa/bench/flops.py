"""Every FLOP and byte formula the benchmarks report, in one place (each quoted from its kernel issue).

Dims legend (docs/conventions.md): ``S`` queries, ``S_kv`` keys, ``H`` heads, ``H_i`` indexer heads, ``D_i``
indexer head dim, ``D_qk = 576``, ``D_v = 512``, ``K`` top-k, ``P`` page (block) size.

Rates: ``tflops = flops / (ms * 1e9)`` and ``tbps = bytes / (ms * 1e9)`` (``ms`` the median time).
Counts that depend on tensor values (valid indices, causal ranges) are computed from the actual inputs, once,
outside the timed region.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "indexer_flops", "indexer_paged_flops", "indexer_paged_bytes", "topk_bytes",
    "sparse_fwd_flops", "sparse_bwd_flops", "sparse_fwd_bytes", "decode_flops", "decode_bytes",
    "valid_count", "causal_decode_keys", "rate",
    "INDEXER_FP8_KEY_BYTES", "KV_BF16_ROW_BYTES", "KV_FP8_ROW_BYTES",
]

KV_BF16_ROW_BYTES = 576 * 2  # one bf16 MLA KV row
KV_FP8_ROW_BYTES = 656  # one row of the DeepSeek-V3.2 FP8 cache (quant.KV_FP8_BYTES)
INDEXER_FP8_KEY_BYTES = 128 + 4  # D_i = 128 e4m3 bytes + one float32 scale: "keys x 132" (issue 4)


def rate(amount: Optional[float], ms: Optional[float]) -> Optional[float]:
    """``amount / ms`` in units of 1e12 per second (TFLOP/s or TB/s); None when either is missing."""
    if amount is None or ms is None or ms <= 0:
        return None
    return amount / (ms * 1e9)


def _range_lengths(k_start: Optional[torch.Tensor], k_end: Optional[torch.Tensor], M: int, N: int) -> int:
    """sum over rows of (k_end - k_start) after clamping both to [0, N] (empty when end <= start)."""
    if k_start is None and k_end is None:
        return M * N
    start = torch.zeros(M, dtype=torch.int64) if k_start is None else k_start.long().clamp(0, N).cpu()
    end = torch.full((M,), N, dtype=torch.int64) if k_end is None else k_end.long().clamp(0, N).cpu()
    return int((end - start).clamp_min(0).sum())


def indexer_flops(H: int, D: int, k_start: Optional[torch.Tensor], k_end: Optional[torch.Tensor],
                  M: int, N: int) -> float:
    """Issue 4: ``2 * H * D * sum over rows of (k_end - k_start)`` (the q.k products; relu/weights not counted).

    k_start/k_end: `[M]` int32 or None (None = the whole ``[0, N)``).
    """
    return 2.0 * H * D * _range_lengths(k_start, k_end, M, N)


def indexer_paged_flops(H: int, D: int, context_lens: torch.Tensor, next_n: int) -> float:
    """Paged decode indexer: row ``b*next_n + j`` scores ``context_lens[b] - next_n + 1 + j`` keys.

    context_lens: `[B]` int32.
    """
    cl = context_lens.long().cpu()
    total = 0
    for j in range(next_n):
        total += int((cl - next_n + 1 + j).clamp_min(0).clamp_max(cl).sum())
    return 2.0 * H * D * total


def indexer_paged_bytes(context_lens: torch.Tensor, D: int = 128, key_bytes: Optional[int] = None) -> float:
    """Issue 4: ``bytes = keys x 132`` for D=128 fp8 (D bytes of e4m3 + a 4-byte float32 scale per key).

    Every cached key of every request is read once (next_n > 1 reuses the same keys). context_lens: `[B]`.
    """
    per_key = key_bytes if key_bytes is not None else D + 4
    return float(int(context_lens.long().clamp_min(0).sum())) * per_key


def topk_bytes(M: int, N: int) -> float:
    """Top-k: bytes read, the float32 scores ``M x N x 4`` (the `[M, K]` int32 output is not counted)."""
    return 4.0 * M * N


def valid_count(indices: torch.Tensor, num_kv: int, topk_length: Optional[torch.Tensor] = None) -> int:
    """Number of valid index entries (``0 <= i < num_kv`` and ``j < topk_length``): ``indices`` `[..., K]`."""
    ok = (indices >= 0) & (indices < num_kv)
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1], device=indices.device)
        ok &= pos < topk_length.unsqueeze(-1)
    return int(ok.sum())


def sparse_fwd_flops(H: int, n_valid: int, Dqk: int = 576, d_v: int = 512) -> float:
    """Issue 8: ``2 * S * H * topk * (Dqk + d_v)`` over valid indices, i.e. ``2 * H * n_valid * (Dqk + d_v)``.

    n_valid: valid entries of the `[S, K]` index tensor (``S * K`` with unique random in-range indices).
    """
    return 2.0 * H * n_valid * (Dqk + d_v)


def sparse_bwd_flops(H: int, n_valid: int, Dqk: int = 576, d_v: int = 512) -> float:
    """Issue 3: ``2 * S * H * topk * (3 * Dqk + 2 * d_v)`` over valid indices (QK recompute, dP, dq, dK, dV)."""
    return 2.0 * H * n_valid * (3 * Dqk + 2 * d_v)


def sparse_fwd_bytes(S: int, H: int, Dqk: int, d_v: int, K: int, kv_rows_touched: int,
                     kv_row_bytes: int, q_elem_bytes: int = 2) -> float:
    """Minimum traffic of a sparse forward: q + indices + each touched KV row once + out (bf16) + lse (fp32)."""
    return float(S * H * Dqk * q_elem_bytes + S * K * 4 + kv_rows_touched * kv_row_bytes
                 + S * H * d_v * 2 + S * H * 4)


def causal_decode_keys(cache_seqlens: torch.Tensor, s_q: int, causal: bool) -> int:
    """Attended (query, key) pairs of a dense decode: query i of request b sees
    ``cache_seqlens[b] - s_q + 1 + i`` keys when causal, else ``cache_seqlens[b]`` (clamped to [0, len])."""
    cl = cache_seqlens.long().cpu()
    if not causal:
        return int(cl.clamp_min(0).sum()) * s_q
    return sum(int((cl - s_q + 1 + i).clamp_min(0).clamp_max(cl).sum()) for i in range(s_q))


def decode_flops(H: int, attended: int, Dqk: int = 576, d_v: int = 512) -> float:
    """Issue 6: ``2 * H * s_q * (Dqk + d_v)`` per attended key; ``attended`` sums keys over every (request,
    query) pair (dense: :func:`causal_decode_keys`; sparse: valid index entries)."""
    return 2.0 * H * attended * (Dqk + d_v)


def decode_bytes(cache_rows_read: int, row_bytes: int, B: int, s_q: int, H: int, Dqk: int = 576,
                 d_v: int = 512) -> float:
    """Issue 6: every cache byte read once + q + out (+ lse): ``rows x row_bytes + B*s_q*H*(2*Dqk + 2*d_v + 4)``.

    Dense: rows = sum of cache_seqlens; sparse: distinct slots touched per request (summed over requests);
    row_bytes 1152 for the bf16 cache, 656 for the FP8 cache.
    """
    return float(cache_rows_read) * row_bytes + B * s_q * H * (2 * Dqk + 2 * d_v + 4)
