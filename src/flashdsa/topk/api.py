"""Public top-k API: ``topk_indices`` (exact per-row top-k over ranges) and ``dsa_topk`` (indexer + top-k, chunked)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _dispatch
from .._library import custom_op
from .._validate import check_choice, check_positive_int, check_same_device, check_tensor
from ..indexer.api import indexer_logits
from . import reference

ORDERS = ("index", "score", "any")
_I32 = (torch.int32,)


@custom_op("topk_indices")
def _topk_op(scores: torch.Tensor, k: int, starts: Optional[torch.Tensor], ends: Optional[torch.Tensor], order: str,
             backend: str) -> torch.Tensor:
    def check():
        return _dispatch.kernel_module("topk_indices").kernel_unsupported(scores, k, starts, ends, order)

    if _dispatch.resolve_backend("topk_indices", backend, scores.device, check) == "kernel":
        return _dispatch.kernel_module("topk_indices").run_topk_indices(scores, k, starts, ends, order)
    return reference.topk_indices_reference(scores, k, starts, ends, order)


@_topk_op.register_fake
def _(scores, k, starts, ends, order, backend):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int32)


def topk_indices(scores, k, *, starts=None, ends=None, order="index", backend="auto"):
    """Exact top-k positions of each row of scores over a per-row range.

    Math:
        row m selects the k largest ``scores[m, n]`` with ``starts[m] <= n < ends[m]``; -inf and NaN are never
        selected; ties go to the lower position (deterministic); slots left over are -1.

    Args:
        scores: `[M, N]` float32; last dim contiguous.
        k: int >= 1, slots per row (may exceed N; the extra slots are -1).
        starts: `[M]` int32 or None (0). See docs/conventions.md#ranges.
        ends: `[M]` int32 or None (N).
        order: "index" (ascending position, -1s last: what sparse attention gathers best), "score" (descending
            score, ties by ascending position) or "any" (whatever is fastest; currently "index").
        backend: "auto" | "kernel" | "reference".

    Returns:
        `[M, k]` int32 positions.

    Raises:
        TypeError / ValueError naming the argument.

    Supported:
        Kernel: Hopper sm_90a radix select (exact, deterministic); ``order="score"`` up to k = 4096.
        Elsewhere: the reference.

    Example:
        >>> topk_indices(torch.tensor([[0.5, 2.0, -1.0, 2.0]]), 3)
        tensor([[0, 1, 3]], dtype=torch.int32)
    """
    check_tensor("scores", scores, ndim=2, dtypes=(torch.float32, torch.float64))
    M = scores.shape[0]
    check_positive_int("k", k)
    check_tensor("starts", starts, shape=(M,), dtypes=_I32, optional=True, last_dim_contiguous=False)
    check_tensor("ends", ends, shape=(M,), dtypes=_I32, optional=True, last_dim_contiguous=False)
    check_choice("order", order, ORDERS)
    check_same_device(scores=scores, starts=starts, ends=ends)
    _dispatch.requested_backend(backend)
    return _topk_op(scores, k, starts, ends, order, backend)


def dsa_topk(q, k, weights, topk, k_scale=None, *, k_start=None, k_end=None, max_chunk_bytes=2**31,
             backend="auto"):
    """DSA key selection: the lightning indexer followed by top-k, streamed over query chunks.

    Math:
        ``topk_indices(indexer_logits(q, k, weights, k_scale, k_start, k_end), topk, starts=k_start, ends=k_end)``
        with ``order="index"``, computed ``rows`` query rows at a time so that at most ``max_chunk_bytes`` of
        float32 logits exist at once (``rows = max(1, max_chunk_bytes // (4 * N))``).

    Args:
        q: `[M, H, D]` float8_e4m3fn or bfloat16.
        k: `[N, D]`, same dtype as q.
        weights: `[M, H]` float32.
        topk: int >= 1, keys selected per row.
        k_scale: `[N]` float32; required for fp8 k.
        k_start: `[M]` int32 or None.
        k_end: `[M]` int32 or None.
        max_chunk_bytes: int, bound on the logits buffer (default 2 GiB).
        backend: "auto" | "kernel" | "reference" (for both stages).

    Returns:
        `[M, topk]` int32 key positions, ascending, -1 padded.

    Raises:
        TypeError / ValueError naming the argument.

    Supported:
        As :func:`indexer_logits` and :func:`topk_indices`.

    Example:
        >>> q = torch.randn(4, 2, 32, dtype=torch.bfloat16)
        >>> k = torch.randn(9, 32, dtype=torch.bfloat16)
        >>> dsa_topk(q, k, torch.rand(4, 2), 3, k_end=torch.tensor([1, 2, 9, 9], dtype=torch.int32))[0]
        tensor([ 0, -1, -1], dtype=torch.int32)
    """
    check_positive_int("topk", topk)
    check_positive_int("max_chunk_bytes", max_chunk_bytes)
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=2)
    M, N = q.shape[0], k.shape[0]
    # checked whole here: the chunked path below passes slices, which would hide a wrong row count
    check_tensor("weights", weights, shape=(M, q.shape[1]))
    check_tensor("k_start", k_start, shape=(M,), optional=True, last_dim_contiguous=False)
    check_tensor("k_end", k_end, shape=(M,), optional=True, last_dim_contiguous=False)
    rows = max(1, max_chunk_bytes // max(1, 4 * N))
    if rows >= M:
        logits = indexer_logits(q, k, weights, k_scale, k_start=k_start, k_end=k_end, backend=backend)
        return topk_indices(logits, topk, starts=k_start, ends=k_end, order="index", backend=backend)
    out = torch.empty(M, topk, dtype=torch.int32, device=q.device)
    for a in range(0, M, rows):
        b = min(M, a + rows)
        ks = k_start[a:b] if k_start is not None else None
        ke = k_end[a:b] if k_end is not None else None
        logits = indexer_logits(q[a:b], k, weights[a:b], k_scale, k_start=ks, k_end=ke, backend=backend)
        out[a:b] = topk_indices(logits, topk, starts=ks, ends=ke, order="index", backend=backend)
        del logits
    return out
