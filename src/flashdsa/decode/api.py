"""Public MLA decode API: ``mla_decode`` over a paged cache (dense or sparse, bf16 or FP8 656-byte rows)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import _dispatch
from .._library import _needs_dispatcher, custom_op
from .._validate import check_float, check_same_device, check_tensor
from ..quant import KV_DIM, KV_FP8_BYTES
from . import _fp8_step, _pair_path, kernel_split, reference

_Q = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # kernels: bf16
_I32 = (torch.int32,)


def _token_lengths(topk_length, B: int, s_q: int):
    """topk_length `[B]` (one per request) as `[B * s_q]`, the same length for each of a request's query tokens."""
    return topk_length if s_q == 1 else topk_length.view(B, 1).expand(B, s_q).reshape(B * s_q)


def _via_sparse_fwd(q, kv_cache, block_table, cache_seqlens, sm_scale, d_v, causal, indices, topk_length, attn_sink,
                    backend):
    """Sparse decode, and dense decode over the FP8 cache, as one sparse MLA forward over the flat cache.

    The cache viewed as ``num_blocks * block_size`` rows is exactly the forward's kv (slot = row), each of the
    B * s_q query tokens is one forward row with its slot list (dense: the sequence's slots in position order from
    the block table, -1 for a bad block id, and the causal length as ``topk_length``, so nothing past it is read
    or computed; built on the GPU without a host sync). The forward's kernels (bf16 rows, or the 656-byte FP8 rows
    dequantized in shared memory) and its reference give the same contract as ``mla_decode``.
    """
    from ..sparse import api as sparse_api, fp8 as sparse_fp8

    B, s_q, H, dqk = q.shape
    nb, bs, width = kv_cache.shape
    flat = kv_cache.reshape(nb * bs, width)
    if indices is None:  # each query's cache positions in order, its causal length as topk_length
        slots, tl = _pair_path.slot_rows(block_table, cache_seqlens, nb, bs, s_q, causal)
    else:
        slots = indices
        tl = None if topk_length is None else _token_lengths(topk_length, B, s_q).contiguous()
    if slots.shape[-1] == 0:  # no cache at all: one invalid slot keeps the shapes non-empty
        slots, tl = torch.full((B, s_q, 1), -1, dtype=torch.int32, device=q.device), None
    slots = slots.reshape(B * s_q, slots.shape[-1])
    qf = q.reshape(B * s_q, H, dqk)
    fp8 = width == KV_FP8_BYTES
    op = "sparse_mla_fwd_cache656" if fp8 else "sparse_mla_fwd"
    n_split, chunk, heads_s = _split_plan(qf, flat, slots, d_v, tl, backend)
    if n_split > 1:  # few query tokens: chunks of each slot list, fp32 partials, merged (kernel_split)
        from ..sparse import kernel_fwd_fp8cache, kernel_fwd_pair

        run = kernel_fwd_fp8cache.run_sparse_mla_fwd if fp8 else kernel_fwd_pair.run_sparse_mla_fwd
        q_s, slots_s, tl_s = kernel_split.split_rows(qf, slots, tl, n_split, chunk, heads_s)
        out_p, lse_p, _ = run(q_s, flat, slots_s, sm_scale=sm_scale, d_v=d_v, topk_length=tl_s, checked=True,
                              out_f32=True)
        out, lse = kernel_split.combine(out_p, lse_p, attn_sink, n_split, heads=H)
        _dispatch.record_choice(op, "kernel")
    elif fp8:
        out, lse, _ = sparse_fp8._cache656_op(qf, flat, slots, sm_scale, d_v, attn_sink, tl, backend)
    else:
        out, lse, _ = sparse_api._fwd_op(qf, flat, slots, sm_scale, d_v, attn_sink, tl, False, backend)
    _dispatch.record_choice("mla_decode", _dispatch.last_choice(op))
    ld = torch.float64 if q.dtype == torch.float64 else torch.float32  # the dtypes of the reference branch below
    return out.reshape(B, s_q, H, d_v).to(q.dtype), lse.reshape(B, s_q, H).to(ld)


def _split_plan(qf, flat, slots, d_v, tl, backend) -> tuple[int, int, int]:
    """(n_split, chunk, heads of the split forward): ``kernel_split.split_plan``'s split and
    ``kernel_split.forward_heads`` where the forward over this cache (bf16 rows or 656-byte FP8 rows) runs its
    kernel on these arguments (the split rows have the same shapes but for T, H and topk), else (1, topk, H)."""
    from ..sparse import kernel_fwd, kernel_fwd_fp8cache

    fp8 = flat.shape[1] == KV_FP8_BYTES
    op, check = (("sparse_mla_fwd_cache656", kernel_fwd_fp8cache.kernel_unsupported) if fp8
                 else ("sparse_mla_fwd", kernel_fwd.kernel_unsupported))
    no_split = 1, slots.shape[-1], qf.shape[1]
    if _dispatch.requested_backend(backend) == "reference" or qf.device.type != "cuda":
        return no_split
    n_split, chunk = kernel_split.split_plan(qf.shape[0], qf.shape[1], slots.shape[1],
                                             _dispatch.sm_count(qf.device.index or 0),
                                             kernel_split.split_fill(qf.shape[1], fp8))
    if n_split == 1:
        return no_split
    if _dispatch.kernel_unavailable_reason(op, qf.device, lambda: check(qf, flat, slots, d_v=d_v,
                                                                       topk_length=tl)) is not None:
        return no_split
    return n_split, chunk, kernel_split.forward_heads(qf.shape[1], fp8)


@custom_op("mla_decode")
def _decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: Optional[torch.Tensor],
               cache_seqlens: Optional[torch.Tensor], sm_scale: float, d_v: int, causal: bool,
               indices: Optional[torch.Tensor], topk_length: Optional[torch.Tensor],
               attn_sink: Optional[torch.Tensor], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if _dispatch.requested_backend(backend) != "reference" and (indices is not None or kv_cache.dtype == torch.uint8):
        return _via_sparse_fwd(q, kv_cache, block_table, cache_seqlens, sm_scale, d_v, causal, indices, topk_length,
                               attn_sink, backend)

    def check():
        return _dispatch.kernel_module("mla_decode").kernel_unsupported(
            q, kv_cache, block_table, cache_seqlens, d_v=d_v, causal=causal, indices=indices, attn_sink=attn_sink)

    if _dispatch.resolve_backend("mla_decode", backend, q.device, check) == "kernel":
        return _dispatch.kernel_module("mla_decode").run_mla_decode_dense(
            q, kv_cache, block_table, cache_seqlens, sm_scale=sm_scale, d_v=d_v, causal=causal, attn_sink=attn_sink,
            checked=True)
    out, lse = reference.mla_decode_reference(q, kv_cache, block_table, cache_seqlens, sm_scale=sm_scale, d_v=d_v,
                                              causal=causal, indices=indices, topk_length=topk_length,
                                              attn_sink=attn_sink)
    ld = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(ld)


@_decode_op.register_fake
def _(q, kv_cache, block_table, cache_seqlens, sm_scale, d_v, causal, indices, topk_length, attn_sink, backend):
    B, s_q, H, _ = q.shape
    ld = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(B, s_q, H, d_v), q.new_empty(B, s_q, H, dtype=ld)


def _check_args(q, kv_cache, block_table, cache_seqlens, sm_scale, d_v, causal, indices, topk_length, attn_sink,
                backend):
    """``mla_decode``'s argument checks (shapes, dtypes, devices; no values read); returns (kv_cache without its
    singleton head dim, sm_scale with its default)."""
    check_tensor("q", q, ndim=4, dtypes=_Q)
    B, s_q, H, dqk = q.shape
    if dqk not in (512, 576):
        raise ValueError(f"q: expected a last dim (Dqk) in [512, 576], got {dqk}")
    fp8 = isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.uint8
    width = KV_FP8_BYTES if fp8 else dqk
    check_tensor("kv_cache", kv_cache, ndim=(3, 4), dtypes=(q.dtype, torch.uint8))
    if kv_cache.dim() == 4:
        check_tensor("kv_cache", kv_cache, shape=(None, None, 1, width))
        kv_cache = kv_cache.squeeze(2)
    check_tensor("kv_cache", kv_cache, shape=(None, None, width))
    if fp8 and dqk != KV_DIM:
        raise ValueError(f"q: the FP8 656-byte cache holds {KV_DIM}-dim rows, but q has Dqk={dqk}")
    if not isinstance(d_v, int) or isinstance(d_v, bool):
        raise TypeError(f"d_v: expected an int, got {type(d_v).__name__}")
    if not 0 < d_v <= dqk:
        raise ValueError(f"d_v: expected 0 < d_v <= Dqk={dqk}, got {d_v}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    sparse = indices is not None
    check_tensor("indices", indices, shape=(B, s_q, None), dtypes=_I32, optional=True)
    if sparse and indices.shape[-1] < 1:
        raise ValueError(f"indices: expected topk >= 1, got shape {list(indices.shape)}")
    check_tensor("block_table", block_table, shape=(B, None), dtypes=_I32, optional=sparse)
    check_tensor("cache_seqlens", cache_seqlens, shape=(B,), dtypes=_I32, optional=sparse, last_dim_contiguous=False)
    if topk_length is not None and not sparse:
        raise ValueError("topk_length: only meaningful for sparse decode (indices given), "
                         "got a tensor with indices=None")
    check_tensor("topk_length", topk_length, shape=(B,), dtypes=_I32, optional=True, last_dim_contiguous=False)
    check_tensor("attn_sink", attn_sink, shape=(H,), dtypes=(torch.float32, torch.float64), optional=True)
    check_same_device(q=q, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens, indices=indices,
                      topk_length=topk_length, attn_sink=attn_sink)
    scale = check_float("sm_scale", sm_scale)
    scale = dqk ** -0.5 if scale is None else scale
    _dispatch.requested_backend(backend)
    return kv_cache, scale


# ------------------------------------------------------------------------------------------- eager fast path
_PLANS = _dispatch.PlanCache()


class _Cache656Plan:
    """The kernel launch one sparse-decode call signature over the 656-byte cache was validated and dispatched to
    (``_dispatch.PlanCache``, as ``sparse_mla_fwd``'s plans): views, three outputs, one launch; with split-KV
    (``n_split`` > 1, ``kernel_split``) the split slot lists, the forward's launch over them and the combine."""

    __slots__ = ("launch", "B", "s_q", "H", "rows", "topk", "d_v", "tl_dummy", "sink_dummy", "n_split", "chunk",
                 "heads_s")

    def __call__(self, q, kv_cache, block_table, cache_seqlens, indices, topk_length, attn_sink):
        _dispatch.record_choice("mla_decode", "kernel")
        B, s_q, H, n, S = self.B, self.s_q, self.H, self.B * self.s_q, self.n_split
        tl = self.tl_dummy if topk_length is None else _token_lengths(topk_length, B, s_q)
        qf, idx, flat = q.view(n, H, KV_DIM), indices.view(n, self.topk), kv_cache.view(self.rows, KV_FP8_BYTES)
        if S > 1:
            q_s, idx_s, tl_s = kernel_split.split_rows(qf, idx, None if topk_length is None else tl, S, self.chunk,
                                                       self.heads_s)
            out, lse = kernel_split.launch_and_combine(self.launch, q_s, flat, idx_s,
                                                       self.tl_dummy if tl_s is None else tl_s, self.sink_dummy,
                                                       attn_sink, S, H, self.d_v)
        else:
            out = torch.empty((n, H, self.d_v), dtype=torch.bfloat16, device=q.device)
            lse = torch.empty((n, H), dtype=torch.float32, device=q.device)
            mx = torch.empty((n, H), dtype=torch.float32, device=q.device)
            self.launch(qf, flat, idx, tl, self.sink_dummy if attn_sink is None else attn_sink, out, lse, mx)
        return out.view(B, s_q, H, self.d_v), lse.view(B, s_q, H)


class _DenseCache656Plan:
    """Dense decode over the 656-byte cache where it splits (few query tokens): the call's decisions
    (``_fp8_step.Fp8SplitLaunch``) kept per call signature; each call makes its chunk rows (one launch) and runs
    the forward and the combine, bitwise the plain path."""

    __slots__ = ("launch",)

    def __init__(self, launch):
        self.launch = launch

    def __call__(self, q, kv_cache, block_table, cache_seqlens, indices, topk_length, attn_sink):
        return self.launch(q, kv_cache, *self.launch.rows(block_table, cache_seqlens), attn_sink)


_PLAIN_PATH = object()  # stored for a dense signature that does not split: its calls take the plain path


def _plan_key(q, kv_cache, block_table, cache_seqlens, sm_scale, d_v, causal, indices, topk_length, attn_sink,
              backend):
    """The call signature of a decode over the 656-byte cache (sparse, or dense with a block table: the forms with
    plans), else None (also where the PyTorch dispatcher must run).  The environment switches the kernel choice
    reads are part of it."""
    if not (isinstance(q, torch.Tensor) and isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.uint8
            and q.device.type == "cuda"):
        return None
    if not (isinstance(indices, torch.Tensor) or (indices is None and isinstance(block_table, torch.Tensor)
                                                  and isinstance(cache_seqlens, torch.Tensor))):
        return None
    if _needs_dispatcher((q, kv_cache, block_table, cache_seqlens, indices, topk_length, attn_sink)):
        return None
    from ..sparse import kernel_dequant656, kernel_fwd_fp8cache, kernel_fwd_pair_cache

    env = tuple(os.environ.get(v) for v in (kernel_fwd_fp8cache.NARROW_ENV, kernel_fwd_pair_cache.STAGING_ENV,
                                            kernel_fwd_pair_cache.PERSISTENT_ENV, kernel_fwd_pair_cache.QGATE_ENV,
                                            kernel_dequant656.DEQUANT_ONCE_ENV,
                                            kernel_split.SPLIT_ENV, _fp8_step.STEP_ENV))
    return _dispatch.call_signature("mla_decode_cache656", q, kv_cache, block_table, cache_seqlens, indices,
                                    topk_length, attn_sink, sm_scale, d_v, causal, backend, env)


def _store_plan(key, q, kv_cache, block_table, indices, topk_length, attn_sink, sm_scale, d_v, causal) -> None:
    """After the plain path ran a call on the kernel: store its launch under ``key`` where the call can be replayed
    as views of its inputs (all contiguous, a non-empty cache) and is one forward launch (not the whole-cache copy;
    with split-KV, the forward over the split rows and the combine); dense decode only where it splits."""
    if key is None or _dispatch.last_choice("mla_decode") != "kernel" or kv_cache.numel() == 0:
        return
    if not all(t is None or t.is_contiguous() for t in (q, kv_cache, indices, topk_length, attn_sink)):
        return
    from .._tilelang import any_misaligned, dummy

    if any_misaligned(q, kv_cache, indices, topk_length, attn_sink):
        return

    if indices is None:  # dense: the split form only (an unsplit call's host time is small against its kernel)
        from ._fp8_step import fp8_split_launch

        launch = fp8_split_launch(q, kv_cache, block_table.shape[1], sm_scale=sm_scale, d_v=d_v, causal=causal,
                                  backend="kernel")
        _PLANS.put(key, _PLAIN_PATH if launch is None else _DenseCache656Plan(launch))
        return
    B, s_q, H, _ = q.shape
    n, topk, rows = B * s_q, indices.shape[-1], kv_cache.shape[0] * kv_cache.shape[1]
    tl = None if topk_length is None else _token_lengths(topk_length, B, s_q)  # as a replay derives it
    qf, idx = q.view(n, H, KV_DIM), indices.view(n, topk)
    n_split, chunk, heads_s = _split_plan(qf, kv_cache.view(rows, KV_FP8_BYTES), idx, d_v, tl, "kernel")
    if n_split > 1:  # the launch the split rows take (as in _via_sparse_fwd)
        qf, idx, tl = kernel_split.split_rows(qf, idx, tl, n_split, chunk, heads_s)
    launch = _dispatch.kernel_module("sparse_mla_fwd_cache656").launcher(
        qf, kv_cache.view(rows, KV_FP8_BYTES), idx, sm_scale=sm_scale, d_v=d_v, topk_length=tl,
        attn_sink=attn_sink if n_split == 1 else None, out_f32=n_split > 1)
    if launch is None:
        return
    plan = _Cache656Plan()
    plan.launch, plan.B, plan.s_q, plan.H, plan.rows, plan.topk, plan.d_v = launch, B, s_q, H, rows, topk, d_v
    plan.n_split, plan.chunk, plan.heads_s = n_split, chunk, heads_s
    plan.tl_dummy, plan.sink_dummy = dummy(torch.int32, q.device), dummy(torch.float32, q.device)
    _PLANS.put(key, plan)


def mla_decode(q, kv_cache, block_table, cache_seqlens, *, sm_scale=None, d_v=512, causal=True, indices=None,
               topk_length=None, attn_sink=None, backend="auto"):
    """MLA decode: a few new query tokens per sequence attend a paged latent KV cache (MQA), dense or sparse.

    Math:
        Dense (``indices`` None): query i of sequence b attends cache positions ``p < cache_seqlens[b] - s_q + 1 + i``
        (causal, bottom-right aligned) or ``p < cache_seqlens[b]``; position p is slot ``p % block_size`` of block
        ``block_table[b, p // block_size]``. Sparse: it attends the slots ``indices[b, i, :topk_length[b]]``
        (slot = block_id * block_size + offset; invalid slots skipped). Softmax as in :func:`sparse_mla_fwd`.

    Args:
        q: `[B, s_q, H, Dqk]` bfloat16, Dqk in {576, 512}.
        kv_cache: `[num_blocks, block_size, Dqk]` or `[num_blocks, block_size, 1, Dqk]` with q's dtype, or uint8
            `[num_blocks, block_size, 656]` (`[..., 1, 656]`) in the FP8 format (Dqk 576); see
            docs/conventions.md#fp8-kv-cache and #paged-cache.
        block_table: `[B, max_blocks]` int32; required for dense, may be None for sparse.
        cache_seqlens: `[B]` int32 tokens cached per sequence; required for dense, may be None for sparse.
        sm_scale: float, default ``Dqk ** -0.5``.
        d_v: int, V is the first d_v dims of a row (default 512).
        causal: bool, dense only (default True).
        indices: `[B, s_q, topk]` int32 slots for sparse decode, or None for dense.
        topk_length: `[B]` int32 or None (sparse only): slots used per sequence.
        attn_sink: `[H]` float32 or None.
        backend: "auto" | "kernel" | "reference".

    Returns:
        out `[B, s_q, H, d_v]` bfloat16, lse `[B, s_q, H]` float32 (natural log, +inf and out 0 for empty rows).

    Raises:
        TypeError / ValueError naming the argument.

    Supported:
        Kernel: Hopper sm_90a. Dense decode over a bf16 cache (Dqk 576, d_v 512, H 1..128, block sizes 16..256):
        the split-KV decode kernel, or at H 64 / 128 with enough query tokens to fill the SMs one sparse forward on
        the pair schedule (sequences longest first). Sparse decode, and dense decode over the FP8 cache: one sparse
        MLA forward over the flat cache (see :func:`sparse_mla_fwd`; FP8 rows through the 656-byte-cache forward);
        where its CTAs would fill at most half of the SMs (few query tokens), split-KV: each token's slot list in
        chunks, one forward over the chunks writing fp32 partials (H 64 / 128, and H <= 16 over the FP8 cache;
        other H with zero-padded heads on the 64 / 128-head form) and a combine kernel
        (``decode/kernel_split.py``).

    Example:
        >>> q = torch.randn(2, 1, 4, 576, dtype=torch.bfloat16)
        >>> cache = torch.randn(4, 16, 576, dtype=torch.bfloat16)
        >>> bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        >>> out, lse = mla_decode(q, cache, bt, torch.tensor([20, 0], dtype=torch.int32))
        >>> out.shape, float(lse[1, 0, 0])
        (torch.Size([2, 1, 4, 512]), inf)
    """
    key = _plan_key(q, kv_cache, block_table, cache_seqlens, sm_scale, d_v, causal, indices, topk_length, attn_sink,
                    backend)
    plan = None if key is None else _PLANS.get(key)
    if plan is not None and plan is not _PLAIN_PATH:
        result = plan(q, kv_cache, block_table, cache_seqlens, indices, topk_length, attn_sink)
        if result is not None:  # None: the dense plan's kernel does not take this cache's layout (the plain path)
            return result
    kv_cache, scale = _check_args(q, kv_cache, block_table, cache_seqlens, sm_scale, d_v, causal, indices,
                                  topk_length, attn_sink, backend)
    sparse = indices is not None
    result = _decode_op(q, kv_cache, block_table if not sparse else None, cache_seqlens if not sparse else None,
                        scale, d_v, causal, indices, topk_length, attn_sink, backend)
    if plan is None:
        _store_plan(key, q, kv_cache, block_table, indices, topk_length, attn_sink, scale, d_v, causal)
    return result
