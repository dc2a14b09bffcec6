"""Dense decode over the FP8 cache, split-KV: the chunk rows' slot lists and lengths in one launch.

Split dense decode over the 656-byte cache runs the sparse forward over (token, chunk) rows (``kernel_split``).
Their inputs, as PyTorch ops, are ``_pair_path.slot_rows`` (each query's cache slot per position, its causal
length) then ``kernel_split.split_inputs`` (the lists cut into ``n_split`` chunks of ``chunk`` slots): ~14 small
launches, most of an eager call's host time at B 1-2. This kernel writes the same two tensors directly: row
``r = (b * s_q + i) * n_split + k``, column c holds position ``p = k * chunk + c`` of sequence b,

    slot = block_table[b, p // bs] * bs + p % bs   where p < L = max_blocks * bs and the block id is in
                                                   [0, num_blocks), else -1,
    length[r] = clamp(len_i - k * chunk, 0, chunk),  len_i = clamp(clamp(seqlens[b], -s_q, L + s_q) + shift_i, 0, L)

with shift_i = i - (s_q - 1) if causal else 0 (``_pair_path.query_lengths``: the first clamp keeps the int32 sum
from wrapping for any seqlens value). Block ids are compared before the product, so bad ids never overflow into a
valid slot; valid slots are < num_blocks * bs, which the forward's int32 addressing already bounds.
"""

import functools

import torch

from .._tilelang import direct_launcher

THREADS = 128
EXPECTS_WGMMA = False


def build_split_slots_kernel(*, threads: int = THREADS):
    """prim_func ``(BlockTable [B, max_blocks] i32, Seqlens [B] i32, Slots [rows, chunk] i32, Lengths [rows] i32,
    num_blocks i32, block_size i32, s_q i32, causal i32, n_split i32)``; grid (rows, ceil(chunk / threads))
    (module notes)."""
    import tilelang.language as T

    i32 = "int32"
    B, mb, rows, chunk = T.dynamic("B"), T.dynamic("max_blocks"), T.dynamic("rows"), T.dynamic("chunk")

    @T.prim_func
    def mla_decode_split_slots(
        BlockTable: T.Tensor((B, mb), i32),
        Seqlens: T.Tensor((B,), i32),
        Slots: T.Tensor((rows, chunk), i32),
        Lengths: T.Tensor((rows,), i32),
        num_blocks: T.int32,
        block_size: T.int32,
        s_q: T.int32,
        causal: T.int32,
        n_split: T.int32,
    ):
        with T.Kernel(rows, T.ceildiv(chunk, threads), threads=threads) as (r, cx):
            tx = T.get_thread_binding()
            tok = r // n_split
            k = r % n_split
            b = tok // s_q
            c = cx * threads + tx
            p = k * chunk + c
            L = mb * block_size
            blk = T.alloc_var(i32)
            if c < chunk:
                Slots[r, c] = -1
                if p < L:
                    blk = BlockTable[b, p // block_size]
                    if blk >= 0 and blk < num_blocks:
                        Slots[r, c] = blk * block_size + p % block_size
            if cx == 0 and tx == 0:
                i = tok % s_q
                shift = T.if_then_else(causal != 0, i - (s_q - 1), 0)
                lc = T.max(T.min(Seqlens[b], L + s_q), -s_q)
                ln = T.max(T.min(lc + shift, L), 0)
                Lengths[r] = T.max(T.min(ln - k * chunk, chunk), 0)

    return mla_decode_split_slots


@functools.lru_cache(maxsize=1)
def _compiled():
    import tilelang

    return direct_launcher(tilelang.compile(build_split_slots_kernel(), target="cuda"))


def split_slots(block_table, cache_seqlens, num_blocks: int, block_size: int, s_q: int, causal: bool, n_split: int,
                chunk: int, out=None):
    """(slots [B * s_q * n_split, chunk] int32, lengths [B * s_q * n_split] int32) for CUDA ``block_table`` [B,
    max_blocks] and ``cache_seqlens`` [B] int32 (any values): equal to ``kernel_split.split_inputs`` of
    ``_pair_path.slot_rows`` where ``n_split * chunk >= max_blocks * block_size`` (module notes).  ``out``: the
    two tensors to write (contiguous, those shapes), else new ones."""
    B = block_table.shape[0]
    rows = B * s_q * n_split
    dev = block_table.device
    if out is None:
        out = (torch.empty((rows, chunk), dtype=torch.int32, device=dev),
               torch.empty(rows, dtype=torch.int32, device=dev))
    slots, lengths = out
    if rows > 0:
        _compiled()(block_table.contiguous(), cache_seqlens.contiguous(), slots, lengths, num_blocks, block_size,
                    s_q, 1 if causal else 0, n_split)
    return slots, lengths


def lowering_cases():
    """(name, prim_func) for the CPU lowering test (no matrix products: ``EXPECTS_WGMMA``)."""
    return [("split_slots", build_split_slots_kernel())]
