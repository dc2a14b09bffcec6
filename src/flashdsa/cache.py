"""Writers for the paged caches (docs/conventions.md#paged-cache): the MLA KV cache and the indexer key cache.

Both write token rows in place at their *slots* (``block_id * block_size + offset``); a slot outside
``[0, num_blocks * block_size)`` (e.g. -1 padding) is skipped. Pure PyTorch for now.
"""

from __future__ import annotations

import torch

from ._validate import check_same_device, check_tensor
from .quant import KV_DIM, KV_FP8_BYTES, quantize_fp8, quantize_kv_fp8

_SLOTS = (torch.int32, torch.int64)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _check_contiguous(name: str, x: torch.Tensor):
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous cache (it is written in place), "
                         f"got strides {tuple(x.stride())}")


def _valid_slots(slot_mapping: torch.Tensor, num_slots: int):
    s = slot_mapping.long()
    return s, (s >= 0) & (s < num_slots)


def write_kv_cache(kv, kv_cache, slot_mapping):
    """Write MLA KV rows into a paged cache in place, quantizing for the FP8 656-byte format.

    Math:
        ``kv_cache.view(-1, row)[slot_mapping[t]] = row(kv[t])`` where row is the bf16 row itself or
        ``quantize_kv_fp8(kv[t])`` for a uint8 cache; slots outside the cache are skipped.

    Args:
        kv: `[T, Dqk]` or `[T, 1, Dqk]` bfloat16 (float16/float32 accepted).
        kv_cache: `[num_blocks, block_size, Dqk]` (`[..., 1, Dqk]`) with kv's dtype, or uint8
            `[num_blocks, block_size, 656]` (Dqk must then be 576); contiguous.
        slot_mapping: `[T]` int32 or int64 slots.

    Returns:
        kv_cache (the same tensor, written).

    Raises:
        TypeError / ValueError naming the argument.

    Example:
        >>> cache = torch.zeros(2, 4, 656, dtype=torch.uint8)
        >>> _ = write_kv_cache(torch.randn(3, 576, dtype=torch.bfloat16), cache, torch.tensor([5, -1, 0]))
        >>> bool(cache.view(8, 656)[5].any()), bool(cache.view(8, 656)[1].any())
        (True, False)
    """
    check_tensor("kv", kv, ndim=(2, 3), dtypes=_FLOATS, last_dim_contiguous=False)
    if kv.dim() == 3:
        check_tensor("kv", kv, shape=(None, 1, None))
        kv = kv.squeeze(1)
    T, d = kv.shape
    if d == 0:
        raise ValueError(f"kv: expected rows of at least one element, got shape {list(kv.shape)}")
    check_tensor("kv_cache", kv_cache, ndim=(3, 4), dtypes=(kv.dtype, torch.uint8))
    fp8 = kv_cache.dtype == torch.uint8
    width = KV_FP8_BYTES if fp8 else d
    cache3 = kv_cache.squeeze(2) if kv_cache.dim() == 4 else kv_cache
    check_tensor("kv_cache", cache3, shape=(None, None, width))
    if fp8 and d != KV_DIM:
        raise ValueError(f"kv: the FP8 cache stores {KV_DIM}-dim rows, got rows of {d}")
    _check_contiguous("kv_cache", kv_cache)
    check_tensor("slot_mapping", slot_mapping, shape=(T,), dtypes=_SLOTS, last_dim_contiguous=False)
    check_same_device(kv=kv, kv_cache=kv_cache, slot_mapping=slot_mapping)
    flat = kv_cache.view(-1, width)
    slots, ok = _valid_slots(slot_mapping, flat.shape[0])
    rows = quantize_kv_fp8(kv) if fp8 else kv
    flat.index_copy_(0, slots[ok], rows[ok].to(flat.dtype))
    return kv_cache


def write_indexer_cache(k, k_cache, k_scale_cache, slot_mapping):
    """Quantize indexer keys to e4m3 (one power-of-two scale per key) and write them into a paged key cache.

    Math:
        ``k_fp8, scale = quantize_fp8(k, block=D)``; ``k_cache.view(-1, D)[slot] = k_fp8[t]`` and
        ``k_scale_cache.view(-1)[slot] = scale[t]``; slots outside the cache are skipped.

    Args:
        k: `[T, D]` bfloat16 or float32 keys.
        k_cache: `[num_blocks, block_size, D]` float8_e4m3fn, contiguous.
        k_scale_cache: `[num_blocks, block_size]` float32, contiguous.
        slot_mapping: `[T]` int32 or int64 slots.

    Returns:
        (k_cache, k_scale_cache), written in place.

    Raises:
        TypeError / ValueError naming the argument.

    Example:
        >>> kc = torch.zeros(2, 4, 128, dtype=torch.float8_e4m3fn); sc = torch.zeros(2, 4)
        >>> _ = write_indexer_cache(torch.randn(2, 128), kc, sc, torch.tensor([1, 6]))
        >>> bool(sc[0, 1] > 0), bool(sc[1, 2] > 0), bool(sc[0, 0] == 0)
        (True, True, True)
    """
    check_tensor("k", k, ndim=2, dtypes=_FLOATS)
    T, D = k.shape
    if D == 0:
        raise ValueError(f"k: expected keys of at least one element, got shape {list(k.shape)}")
    check_tensor("k_cache", k_cache, shape=(None, None, D), dtypes=(torch.float8_e4m3fn,))
    nb, bs = k_cache.shape[:2]
    check_tensor("k_scale_cache", k_scale_cache, shape=(nb, bs), dtypes=(torch.float32,))
    _check_contiguous("k_cache", k_cache)
    _check_contiguous("k_scale_cache", k_scale_cache)
    check_tensor("slot_mapping", slot_mapping, shape=(T,), dtypes=_SLOTS, last_dim_contiguous=False)
    check_same_device(k=k, k_cache=k_cache, k_scale_cache=k_scale_cache, slot_mapping=slot_mapping)
    k_fp8, scale = quantize_fp8(k, block=D)
    slots, ok = _valid_slots(slot_mapping, nb * bs)
    k_cache.view(nb * bs, D).view(torch.uint8).index_copy_(0, slots[ok], k_fp8[ok].view(torch.uint8))
    k_scale_cache.view(nb * bs).index_copy_(0, slots[ok], scale[ok, 0])
    return k_cache, k_scale_cache
