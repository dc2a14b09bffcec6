"""Dense decode over the FP8 656-byte cache with few query tokens, split once per step for ``mla_decode_plan``.

``mla_decode`` runs such a call as one sparse forward over the flat cache (``api._via_sparse_fwd``): each query
token's slots in position order, cut into chunks (``kernel_split``), a forward over the (token, chunk) rows that
writes fp32 partials, and a combine. All of that but the forward and the combine depends only on the block table
and the lengths, so ``prepare_fp8_split`` makes it once per step (slot lists, chunk rows, the compiled launch) and
``Fp8SplitStep`` runs each layer as two launches -- bitwise the op's outputs, since the launches and their
inputs are the op's. Where the op would not split (enough tokens to fill the SMs), the plan keeps running the op.
"""

import torch

from .. import _dispatch
from .._tilelang import aligned, dummy, pad_heads
from ..quant import KV_DIM, KV_FP8_BYTES
from . import _pair_path, kernel_split


class Fp8SplitStep:
    """One step's split-KV inputs over the 656-byte cache; ``step(q [B, s_q, H, 576] bf16, kv_cache [num_blocks,
    block_size, 656] uint8, attn_sink [H] f32 or None)`` -> (out [B, s_q, H, 512] bf16, lse [B, s_q, H] f32), or
    None where this layer's cache has a layout the kernel does not take (``cache_layout_unsupported``): the caller
    then runs the op."""

    path = "split"

    def __init__(self, *, B, s_q, H, heads_s, n_split, slots_s, tl_s, launch, d_v):
        self.B, self.s_q, self.H, self.heads_s, self.n_split = B, s_q, H, heads_s, n_split
        self.slots_s, self.tl_s, self.launch, self.d_v = slots_s, tl_s, launch, d_v

    def __call__(self, q, kv_cache, attn_sink=None):
        from ..sparse import kernel_fwd_fp8cache

        nb, bs = kv_cache.shape[0], kv_cache.shape[1]
        flat = kv_cache.reshape(nb * bs, KV_FP8_BYTES)  # a view where the rows allow it (as the op)
        if kernel_fwd_fp8cache.cache_layout_unsupported(flat) is not None:
            return None
        B, s_q, H, S = self.B, self.s_q, self.H, self.n_split
        n = B * s_q
        q_s = aligned(pad_heads(q.reshape(n, H, KV_DIM), self.heads_s))
        rows, dev = n * S, q.device
        out = torch.empty((rows, self.heads_s, self.d_v), dtype=torch.float32, device=dev)
        lse = torch.empty((rows, self.heads_s), dtype=torch.float32, device=dev)
        max_logits = torch.empty((rows, self.heads_s), dtype=torch.float32, device=dev)
        self.launch(q_s, flat, self.slots_s, self.tl_s, dummy(torch.float32, dev), out, lse, max_logits)
        out, lse = kernel_split.combine(out, lse, attn_sink, S, heads=H)
        _dispatch.record_choice("mla_decode", "kernel")
        return out.view(B, s_q, H, self.d_v), lse.view(B, s_q, H)


def prepare_fp8_split(q_like, kv_cache, block_table, cache_seqlens, *, sm_scale: float, d_v: int, causal: bool,
                      backend: str):
    """An ``Fp8SplitStep`` where ``mla_decode`` would run this step (q of ``q_like``'s shape, `[B, s_q, H, 576]`;
    kv_cache `[num_blocks, block_size, 656]` uint8; block_table / cache_seqlens the plan's copies) as split-KV on
    the kernels, else None (the op per layer).  GPU ops only: no host sync, capturable."""
    from ..sparse import kernel_fwd_fp8cache
    from . import api

    B, s_q, H, _ = q_like.shape
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    if B == 0 or nb * bs == 0 or block_table.shape[1] == 0 or q_like.dtype != torch.bfloat16:
        return None
    flat = kv_cache.reshape(nb * bs, KV_FP8_BYTES)
    slots, lengths = _pair_path.slot_rows(block_table, cache_seqlens, nb, bs, s_q, causal)
    qf = q_like.reshape(B * s_q, H, KV_DIM)
    n_split, chunk, heads_s = api._split_plan(qf, flat, slots, d_v, lengths, backend)
    if n_split == 1:
        return None
    slots_s, tl_s = kernel_split.split_inputs(slots, lengths, n_split, chunk)
    slots_s, tl_s = aligned(slots_s), aligned(tl_s)
    # the launch the op's run_sparse_mla_fwd makes for these rows (q padded to heads_s; no sink: the combine's)
    q_rows = q_like.new_empty(KV_DIM).as_strided((B * s_q, heads_s, KV_DIM), (0, 0, 1))
    launch = kernel_fwd_fp8cache.launcher(q_rows, flat, slots_s, sm_scale=sm_scale, d_v=d_v, topk_length=tl_s,
                                          attn_sink=None, dequant_once=False, out_f32=True)
    if launch is None:
        return None
    return Fp8SplitStep(B=B, s_q=s_q, H=H, heads_s=heads_s, n_split=n_split, slots_s=slots_s, tl_s=tl_s,
                        launch=launch, d_v=d_v)
