"""``mla_decode_plan``: a decode step's checks, dispatch and schedule done once, then one launch per layer.

Every layer of a decode step attends the same block table and cache lengths with its own q and KV cache. FlashMLA
computes its scheduler metadata once per step (``get_mla_metadata``) and FlashInfer separates ``plan`` from
``run`` for the same reason: what depends on the batch -- argument checks, the kernel choice, the split plan, the
pair path's slot lists, the partial buffers -- need not be redone ~60 times per generated token. ``plan.run(q,
kv_cache)`` then checks only that its tensors match the plan and launches the kernels.

Semantics: the plan copies ``block_table`` and ``cache_seqlens`` when it is made (a GPU copy, no host sync), so
``run`` attends what they held then, whatever the caller writes into them afterwards: make one plan per step.
Making a plan and running it are both capturable in a CUDA graph (capture them together to replay a whole step
with new lengths). Paths: the dense bf16 cache on the GPU kernels launches straight from the plan; so does the FP8
cache where ``mla_decode`` would run split-KV (few query tokens: ``_fp8_step``, the chunk rows made once per step,
two launches per layer; ``_fp8_step.STEP_ENV`` "0" turns it off). The reference backend and the other FP8 steps
(through the sparse forward) run ``mla_decode``'s op per call with the plan's copies.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _dispatch
from .._validate import check_positive_int, check_tensor
from . import api


class MLADecodePlan:
    """What ``mla_decode_plan`` returns; ``run(q, kv_cache, attn_sink=None)`` per layer (see its docstring)."""

    def __init__(self, *, shape, q_dtype, kv_shape, kv_dtype, device, has_sink, block_table, cache_seqlens, sm_scale,
                 d_v, causal, backend, step):
        self.shape, self.q_dtype, self.kv_shape, self.kv_dtype, self.device = shape, q_dtype, kv_shape, kv_dtype, device
        self.has_sink, self.block_table, self.cache_seqlens = has_sink, block_table, cache_seqlens
        self.sm_scale, self.d_v, self.causal, self.backend, self._step = sm_scale, d_v, causal, backend, step

    @property
    def path(self) -> str:
        """"kernel" where ``run`` launches the decode kernels straight from the plan (the dense bf16 cache; the FP8
        cache where the step splits), else "op"."""
        return "kernel" if self._step is not None else "op"

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, attn_sink: Optional[torch.Tensor] = None):
        """One layer of the step: ``mla_decode(q, kv_cache, block_table, cache_seqlens, ...)`` with the plan's
        block_table / cache_seqlens copies and settings.

        Args:
            q: `[B, s_q, H, Dqk]` with the plan's shape and dtype, last dim contiguous.
            kv_cache: this layer's cache, with the shape, dtype and device the plan was made for.
            attn_sink: `[H]` float32 (float64 too where ``plan.path`` is "op") when the plan was made with
                ``has_sink=True``, else None.

        Returns:
            out `[B, s_q, H, d_v]` in q's dtype, lse `[B, s_q, H]` float32 (natural log), as ``mla_decode``.
        """
        # the plan's shapes compared directly (a few attribute reads per layer); check_tensor words any mismatch
        if not isinstance(q, torch.Tensor) or q.shape != self.shape or q.dtype != self.q_dtype \
                or q.device != self.device or q.stride(-1) != 1:
            check_tensor("q", q, shape=self.shape, dtypes=(self.q_dtype,), device=self.device)
        if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4:
            kv_cache = kv_cache.squeeze(2)
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.shape != self.kv_shape \
                or kv_cache.dtype != self.kv_dtype or kv_cache.device != self.device or kv_cache.stride(-1) != 1:
            check_tensor("kv_cache", kv_cache, shape=self.kv_shape, dtypes=(self.kv_dtype,), device=self.device)
        if (attn_sink is not None) != self.has_sink:
            raise ValueError(f"attn_sink: the plan was made with has_sink={self.has_sink}, got "
                             f"{'a tensor' if attn_sink is not None else 'None'}")
        if attn_sink is not None:  # the kernels take float32 (mla_decode sends a float64 sink to the reference)
            check_tensor("attn_sink", attn_sink, shape=(self.shape[2],), device=self.device,
                         dtypes=(torch.float32,) if self._step is not None else (torch.float32, torch.float64))
        if self._step is not None:
            result = self._step(q, kv_cache, attn_sink)
            if result is not None:  # None: the FP8 step's kernel does not take this layer's cache layout
                return result
        return api._decode_op(q, kv_cache, self.block_table, self.cache_seqlens, self.sm_scale, self.d_v, self.causal,
                              None, None, attn_sink, self.backend)


def mla_decode_plan(block_table, cache_seqlens, kv_cache, *, num_heads, s_q=1, q_dtype=torch.bfloat16, sm_scale=None,
                    d_v=512, causal=True, has_sink=False, backend="auto") -> MLADecodePlan:
    """Plan a dense MLA decode step once for all layers (see the module notes); ``plan.run(q, kv_cache)`` per layer.

    Math:
        ``plan.run(q, kv_cache, attn_sink)`` equals ``mla_decode(q, kv_cache, block_table, cache_seqlens,
        sm_scale=sm_scale, d_v=d_v, causal=causal, attn_sink=attn_sink, backend=backend)`` with the values
        ``block_table`` and ``cache_seqlens`` held when the plan was made.

    Args:
        block_table: `[B, max_blocks]` int32 (docs/conventions.md#paged-cache).
        cache_seqlens: `[B]` int32 tokens cached per sequence.
        kv_cache: one layer's cache, `[num_blocks, block_size, Dqk]` (or `[..., 1, Dqk]`) with q's dtype, or uint8
            `[num_blocks, block_size, 656]` (FP8 format, Dqk 576); every layer's cache must have this shape.
        num_heads: int, H.
        s_q: int, query tokens per sequence (default 1).
        q_dtype: q's dtype (default bfloat16, the kernels' dtype).
        sm_scale: float, default ``Dqk ** -0.5``.
        d_v: int, V is the first d_v dims of a row (default 512).
        causal: bool (default True): bottom-right aligned, as ``mla_decode``.
        has_sink: bool (default False): whether ``run`` is given an ``attn_sink`` `[H]` float32.
        backend: "auto" | "kernel" | "reference".

    Returns:
        An ``MLADecodePlan``; ``plan.path`` is "kernel" where ``run`` launches straight from the plan.

    Raises:
        TypeError / ValueError naming the argument (``mla_decode``'s checks, on a q of the planned shape).

    Example:
        >>> cache = torch.randn(4, 16, 576, dtype=torch.bfloat16)
        >>> plan = mla_decode_plan(torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        ...                        torch.tensor([20, 0], dtype=torch.int32), cache, num_heads=4)
        >>> out, lse = plan.run(torch.randn(2, 1, 4, 576, dtype=torch.bfloat16), cache)
        >>> out.shape, float(lse[1, 0, 0])
        (torch.Size([2, 1, 4, 512]), inf)
    """
    check_positive_int("num_heads", num_heads)
    check_positive_int("s_q", s_q)
    if not isinstance(has_sink, bool):
        raise TypeError(f"has_sink: expected a bool, got {type(has_sink).__name__}")
    if not isinstance(q_dtype, torch.dtype) or q_dtype not in api._Q:
        raise TypeError(f"q_dtype: expected one of {', '.join(str(d) for d in api._Q)}, got {q_dtype!r}")
    check_tensor("block_table", block_table, ndim=2, dtypes=api._I32)
    check_tensor("kv_cache", kv_cache, ndim=(3, 4))
    dev = kv_cache.device
    dqk = api.KV_DIM if kv_cache.dtype == torch.uint8 else kv_cache.shape[-1]
    if dqk not in (512, 576):  # checked here: mla_decode's check below would name q, which is not an argument here
        raise ValueError(f"kv_cache: expected a last dim (Dqk) in [512, 576] (or uint8 656-byte rows), "
                         f"got shape {list(kv_cache.shape)}")
    B = block_table.shape[0]
    shape = torch.Size((B, s_q, num_heads, dqk))
    # the checks of mla_decode, on a q of the planned shape (all rows alias one row: nothing of size B * H is made)
    q_like = torch.empty(dqk, dtype=q_dtype, device=dev).as_strided(tuple(shape), (0, 0, 0, 1))
    sink_like = torch.empty(num_heads, dtype=torch.float32, device=dev) if has_sink else None
    kv_cache, scale = api._check_args(q_like, kv_cache, block_table, cache_seqlens, sm_scale, d_v, causal, None, None,
                                      sink_like, backend)
    block_table = block_table.clone(memory_format=torch.contiguous_format)
    cache_seqlens = cache_seqlens.clone(memory_format=torch.contiguous_format)
    step = None
    if kv_cache.dtype != torch.uint8:
        def check():
            return _dispatch.kernel_module("mla_decode").kernel_unsupported(
                q_like, kv_cache, block_table, cache_seqlens, d_v=d_v, causal=causal, attn_sink=sink_like)

        if _dispatch.resolve_backend("mla_decode", backend, dev, check) == "kernel":
            from ._dense_step import prepare_dense

            step = prepare_dense(
                B, s_q, num_heads, kv_cache.shape, block_table, cache_seqlens, sm_scale=scale, causal=causal,
                has_sink=has_sink, device=dev)
    else:  # the FP8 cache: its split step where the op splits on the kernels (fp8_split_launch decides), else the op
        from ._fp8_step import Fp8SplitStep, fp8_split_launch

        launch = fp8_split_launch(q_like, kv_cache, block_table.shape[1], sm_scale=scale, d_v=d_v, causal=causal,
                                  backend=backend)
        step = Fp8SplitStep(launch, block_table, cache_seqlens) if launch is not None else None
    return MLADecodePlan(shape=shape, q_dtype=q_dtype, kv_shape=kv_cache.shape, kv_dtype=kv_cache.dtype, device=dev,
                         has_sink=has_sink, block_table=block_table, cache_seqlens=cache_seqlens, sm_scale=scale,
                         d_v=d_v, causal=causal, backend=backend, step=step)
