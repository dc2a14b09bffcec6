"""Dense decode over the FP8 656-byte cache with few query tokens, split-KV, decided once and launched per call.

``mla_decode`` runs such a call as one sparse forward over the flat cache (``api._via_sparse_fwd``): each query
token's slots in position order, cut into chunks (``kernel_split``), a forward over the (token, chunk) rows that
writes fp32 partials, and a combine. The decisions depend on shapes only (``fp8_split_launch`` ->
``Fp8SplitLaunch``); the chunk rows on the block table and the lengths (``Fp8SplitLaunch.rows``: one launch,
``kernel_split_slots``); the rest on q and the cache (``Fp8SplitLaunch.__call__``: the forward and the combine,
the op's kernels on the op's inputs, so bitwise its outputs). ``mla_decode_plan`` makes the rows once per step
(``Fp8SplitStep``); ``mla_decode``'s eager plans (``api._DenseCache656Plan``) once per call. Where the op would not
split (enough tokens to fill the SMs), both keep running the op.

``$FLASHDSA_DECODE_FP8_STEP`` (``STEP_ENV``, default "1"): "1" takes these paths, anything else runs the op as
before (for A / B timing and as a switch-off).
"""

import os

import torch

from .. import _dispatch
from .._tilelang import aligned, dummy, pad_heads
from ..quant import KV_DIM, KV_FP8_BYTES
from . import kernel_split


STEP_ENV = "FLASHDSA_DECODE_FP8_STEP"
_STEP_DEFAULT = "1"  # "0" turns the paths off (the op as before)


def enabled() -> bool:
    """Whether ``fp8_split_launch`` may return a launch (``$FLASHDSA_DECODE_FP8_STEP``, module notes)."""
    return os.environ.get(STEP_ENV, _STEP_DEFAULT) == "1"


class Fp8SplitLaunch:
    """The shape-only part of one split dense decode over the 656-byte cache (``fp8_split_launch``)."""

    def __init__(self, *, B, s_q, H, heads_s, n_split, chunk, num_blocks, block_size, causal, launch, d_v):
        self.B, self.s_q, self.H, self.heads_s, self.n_split, self.chunk = B, s_q, H, heads_s, n_split, chunk
        self.num_blocks, self.block_size, self.causal, self.launch, self.d_v = (num_blocks, block_size, causal,
                                                                                launch, d_v)

    def rows(self, block_table, cache_seqlens):
        """(slots [B * s_q * n_split, chunk] int32, topk_length [B * s_q * n_split] int32) of the (token, chunk)
        rows: ``kernel_split_slots.split_slots`` (one launch, no host sync)."""
        from .kernel_split_slots import split_slots

        return split_slots(block_table, cache_seqlens, self.num_blocks, self.block_size, self.s_q, self.causal,
                           self.n_split, self.chunk)

    def __call__(self, q, kv_cache, slots_s, tl_s, attn_sink=None):
        """q [B, s_q, H, 576] bf16, kv_cache [num_blocks, block_size(, 1), 656] uint8, ``rows``' tensors, attn_sink
        [H] float32 (or float64, as the op: the combine takes it as float32) or None -> (out [B, s_q, H, 512] bf16,
        lse [B, s_q, H] f32); None where this cache has a layout the kernel does not take
        (``kernel_fwd_fp8cache.cache_layout_unsupported``: the caller runs the op)."""
        from ..sparse import kernel_fwd_fp8cache

        flat = kv_cache.reshape(self.num_blocks * self.block_size, KV_FP8_BYTES)  # a view where it can be (as the op)
        if kernel_fwd_fp8cache.cache_layout_unsupported(flat) is not None:
            return None
        B, s_q, H = self.B, self.s_q, self.H
        q_s = aligned(pad_heads(q.reshape(B * s_q, H, KV_DIM), self.heads_s))
        out, lse = kernel_split.launch_and_combine(self.launch, q_s, flat, slots_s, tl_s,
                                                   dummy(torch.float32, q.device), attn_sink, self.n_split, H,
                                                   self.d_v)
        _dispatch.record_choice("mla_decode", "kernel")
        return out.view(B, s_q, H, self.d_v), lse.view(B, s_q, H)


class Fp8SplitStep:
    """``mla_decode_plan``'s step over the 656-byte cache: an ``Fp8SplitLaunch`` and the step's chunk rows;
    ``step(q, kv_cache, attn_sink)`` as ``Fp8SplitLaunch.__call__``."""

    path = "split"

    def __init__(self, launch: Fp8SplitLaunch, block_table, cache_seqlens):
        self.launch = launch
        self.slots_s, self.tl_s = launch.rows(block_table, cache_seqlens)

    def __call__(self, q, kv_cache, attn_sink=None):
        return self.launch(q, kv_cache, self.slots_s, self.tl_s, attn_sink)


def fp8_split_launch(q, kv_cache, max_blocks: int, *, sm_scale: float, d_v: int, causal: bool, backend: str):
    """An ``Fp8SplitLaunch`` where ``mla_decode`` runs a dense decode of q's shape over this cache (`[num_blocks,
    block_size(, 1), 656]` uint8, a block table of ``max_blocks`` columns) as split-KV on the kernels, else None.
    Reads shapes, strides and dtypes only (q may be a stride-0 stand-in), so it is the same for every call of
    one signature."""
    from ..sparse import kernel_fwd_fp8cache
    from . import api

    B, s_q, H, _ = q.shape
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    L, n, dev = max_blocks * bs, B * s_q, q.device
    if n == 0 or nb * bs == 0 or L == 0 or q.dtype != torch.bfloat16 or dev.type != "cuda" or not enabled():
        return None
    try:
        flat = kv_cache.view(nb * bs, KV_FP8_BYTES)
    except RuntimeError:  # rows that are not one flat view: the op copies the cache per call; so do its callers
        return None
    stand_in = torch.empty(L, dtype=torch.int32, device=dev)  # shapes only: the checks read no values
    qf = q.reshape(n, H, KV_DIM)
    slots_like, tl_like = stand_in.as_strided((n, L), (0, 1)), stand_in[:1].expand(n)
    n_split, chunk, heads_s = api._split_plan(qf, flat, slots_like, d_v, tl_like, backend)
    if n_split == 1:
        return None
    q_rows = q.new_empty(KV_DIM).as_strided((n, heads_s, KV_DIM), (0, 0, 1))
    slot_rows = torch.empty(chunk, dtype=torch.int32, device=dev).as_strided((n * n_split, chunk), (0, 1))
    # the launch the op's run_sparse_mla_fwd makes for these rows (q padded to heads_s; no sink: the combine's)
    launch = kernel_fwd_fp8cache.launcher(q_rows, flat, slot_rows, sm_scale=sm_scale, d_v=d_v,
                                          topk_length=slot_rows[:, 0], attn_sink=None, dequant_once=False,
                                          out_f32=True)
    if launch is None:
        return None
    return Fp8SplitLaunch(B=B, s_q=s_q, H=H, heads_s=heads_s, n_split=n_split, chunk=chunk, num_blocks=nb,
                          block_size=bs, causal=causal, launch=launch, d_v=d_v)
