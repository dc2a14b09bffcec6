"""Public lightning-indexer API: ``indexer_logits`` (prefill, per-row key ranges) and ``indexer_logits_paged``."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _dispatch
from .._library import custom_op
from .._validate import check_positive_int, check_same_device, check_tensor
from . import reference

_QK = (torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64)  # kernels: fp8, bf16
_F32 = (torch.float32, torch.float64)
_I32 = (torch.int32,)


def _out_dtype(q, weights):
    return torch.float64 if torch.float64 in (q.dtype, weights.dtype) else torch.float32


@custom_op("indexer_logits")
def _logits_op(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, k_scale: Optional[torch.Tensor],
               k_start: Optional[torch.Tensor], k_end: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    op = "indexer_logits"
    check = lambda: _dispatch.kernel_module(op).kernel_unsupported(q, k, weights, k_scale, k_start, k_end)  # noqa: E731
    if _dispatch.resolve_backend(op, backend, q.device, check) == "kernel":
        return _dispatch.kernel_module(op).run_indexer_logits(q, k, weights, k_scale, k_start, k_end)
    return reference.indexer_logits_reference(q, k, weights, k_scale, k_start, k_end).to(_out_dtype(q, weights))


@_logits_op.register_fake
def _(q, k, weights, k_scale, k_start, k_end, backend):
    return q.new_empty(q.shape[0], k.shape[0], dtype=_out_dtype(q, weights))


@custom_op("indexer_logits_paged")
def _paged_op(q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
              block_table: torch.Tensor, k_scale_cache: Optional[torch.Tensor], max_context: int,
              backend: str) -> torch.Tensor:
    op = "indexer_logits_paged"
    def check():
        return _dispatch.kernel_module(op).kernel_unsupported(q, k_cache, weights, context_lens, block_table,
                                                              k_scale_cache)

    if _dispatch.resolve_backend(op, backend, q.device, check) == "kernel":
        return _dispatch.kernel_module(op).run_indexer_logits_paged(q, k_cache, weights, context_lens, block_table,
                                                                    k_scale_cache, max_context)
    out = reference.indexer_logits_paged_reference(q, k_cache, weights, context_lens, block_table, k_scale_cache,
                                                   max_context)
    return out.to(_out_dtype(q, weights))


@_paged_op.register_fake
def _(q, k_cache, weights, context_lens, block_table, k_scale_cache, max_context, backend):
    return q.new_empty(q.shape[0] * q.shape[1], max_context, dtype=_out_dtype(q, weights))


def indexer_logits(q, k, weights, k_scale=None, *, k_start=None, k_end=None, backend="auto"):
    """Lightning-indexer logits of every query row against a range of keys.

    Math:
        ``out[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n])`` (fp32 accumulation) for
        ``k_start[m] <= n < k_end[m]``; ``-inf`` everywhere else (always written).

    Args:
        q: `[M, H, D]` float8_e4m3fn or bfloat16 (float32 runs on the reference); last dim contiguous.
        k: `[N, D]`, same dtype as q.
        weights: `[M, H]` float32 (head weights, any softmax scale folded in).
        k_scale: `[N]` float32, per-key dequantization scale; required for fp8 k, optional otherwise.
        k_start: `[M]` int32 or None (0); clamped to [0, N].
        k_end: `[M]` int32 or None (N); clamped to [0, N]. See docs/conventions.md#ranges.
        backend: "auto" | "kernel" | "reference".

    Returns:
        `[M, N]` float32 logits (float64 where q or weights is float64: the reference's oracle precision); -inf
        outside each row's range (empty rows are all -inf).

    Raises:
        TypeError / ValueError naming the argument for wrong dtypes, shapes or devices, or fp8 k without k_scale.

    Supported:
        Kernel: Hopper sm_90a, fp8 or bf16, H in {8, 16, 32, 64}, D in {64, 128}. Elsewhere: the reference.

    Example:
        >>> q = torch.randn(3, 4, 64, dtype=torch.bfloat16)
        >>> k = torch.randn(10, 64, dtype=torch.bfloat16)
        >>> w = torch.rand(3, 4)
        >>> out = indexer_logits(q, k, w, k_end=torch.tensor([1, 5, 10], dtype=torch.int32))
        >>> out.shape, bool(torch.isinf(out[0, 1:]).all())
        (torch.Size([3, 10]), True)
    """
    check_tensor("q", q, ndim=3, dtypes=_QK)
    M, H, D = q.shape
    check_tensor("k", k, shape=(None, D), dtypes=(q.dtype,))
    N = k.shape[0]
    check_tensor("weights", weights, shape=(M, H), dtypes=_F32)
    check_tensor("k_scale", k_scale, shape=(N,), dtypes=_F32, optional=True, last_dim_contiguous=False)
    if k_scale is None and k.dtype == torch.float8_e4m3fn:
        raise ValueError("k_scale: required when k is float8_e4m3fn (per-key dequantization scale [N] float32), "
                         "got None")
    check_tensor("k_start", k_start, shape=(M,), dtypes=_I32, optional=True, last_dim_contiguous=False)
    check_tensor("k_end", k_end, shape=(M,), dtypes=_I32, optional=True, last_dim_contiguous=False)
    check_same_device(q=q, k=k, weights=weights, k_scale=k_scale, k_start=k_start, k_end=k_end)
    _dispatch.requested_backend(backend)
    return _logits_op(q, k, weights, k_scale, k_start, k_end, backend)


def indexer_logits_paged(q, k_cache, weights, context_lens, block_table, *, k_scale_cache=None, max_context=None,
                         backend="auto"):
    """Lightning-indexer logits for decode over a paged key cache (next_n new tokens per sequence).

    Math:
        row ``r = b*next_n + j``: ``out[r, p] = k_scale(p) * sum_h weights[r, h] * relu(q[b, j, h] . k(p))`` for
        ``p < context_lens[b] - next_n + 1 + j``, where ``k(p)`` is slot ``p % block_size`` of block
        ``block_table[b, p // block_size]``; ``-inf`` elsewhere (also where that block id is out of range).

    Args:
        q: `[B, next_n, H, D]` float8_e4m3fn or bfloat16.
        k_cache: `[num_blocks, block_size, D]`, same dtype as q (docs/conventions.md#paged-cache).
        weights: `[B*next_n, H]` float32.
        context_lens: `[B]` int32, cached tokens per sequence including the next_n new ones.
        block_table: `[B, max_blocks]` int32 physical block ids.
        k_scale_cache: `[num_blocks, block_size]` float32; required for an fp8 cache.
        max_context: int, columns of the output; default ``max(context_lens)`` (reads the tensor: a host sync —
            pass it explicitly under CUDA graphs / torch.compile).
        backend: "auto" | "kernel" | "reference".

    Returns:
        `[B*next_n, max_context]` float32 (float64 where q or weights is float64).

    Raises:
        TypeError / ValueError naming the argument.

    Supported:
        Kernel: Hopper sm_90a (first draft, see docs/PERFORMANCE.md). Elsewhere: the reference.

    Example:
        >>> q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
        >>> cache = torch.randn(6, 16, 64, dtype=torch.bfloat16)
        >>> bt = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
        >>> lens = torch.tensor([20, 7], dtype=torch.int32)
        >>> indexer_logits_paged(q, cache, torch.rand(2, 4), lens, bt).shape
        torch.Size([2, 20])
    """
    check_tensor("q", q, ndim=4, dtypes=_QK)
    B, next_n, H, D = q.shape
    check_tensor("k_cache", k_cache, shape=(None, None, D), dtypes=(q.dtype,))
    nb, bs = k_cache.shape[:2]
    if bs == 0:  # (no blocks at all is legal: every position is then outside the cache, -inf)
        raise ValueError(f"k_cache: expected block_size >= 1, got shape {list(k_cache.shape)}")
    check_tensor("weights", weights, shape=(B * next_n, H), dtypes=_F32)
    check_tensor("context_lens", context_lens, shape=(B,), dtypes=_I32, last_dim_contiguous=False)
    check_tensor("block_table", block_table, shape=(B, None), dtypes=_I32)
    check_tensor("k_scale_cache", k_scale_cache, shape=(nb, bs), dtypes=_F32, optional=True)
    if k_scale_cache is None and k_cache.dtype == torch.float8_e4m3fn:
        raise ValueError("k_scale_cache: required for a float8_e4m3fn k_cache ([num_blocks, block_size] float32), "
                         "got None")
    check_same_device(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, block_table=block_table,
                      k_scale_cache=k_scale_cache)
    if max_context is None:
        max_context = max(0, int(context_lens.max().item())) if B > 0 else 0
    check_positive_int("max_context", max_context, minimum=0)
    _dispatch.requested_backend(backend)
    return _paged_op(q, k_cache, weights, context_lens, block_table, k_scale_cache, max_context, backend)
