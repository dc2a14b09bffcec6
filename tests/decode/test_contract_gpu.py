"""MLA decode contract cases (issue #6) the other decode tests leave out, through the public ``flashdsa.mla_decode``.

On CUDA every case calls ``backend="kernel"`` (a silent fall-back to the reference cannot pass: the call raises if the
kernel refuses, and the recorded path is checked) and compares against ``backend="reference"`` on the same (for FP8:
dequantized) cache. On CPU the identical input construction runs, with sizes past 4096 cache tokens scaled down,
and ``backend="reference"`` is compared against the float64 oracle of tests/oracles.py, so every line but the
kernel call is exercised without a GPU.

Inputs as tests/decode/test_kernel_gpu.py: N(0, 0.01) q and cache rows, shuffled block tables, NaN in every unused
cache slot (FP8: the quantized NaN rows), table entries past each sequence set to -1 / num_blocks / INT_MAX /
INT_MIN. Tolerances (issue #6, as ``test_kernel_gpu._check``): out elementwise within abs 1e-3 or rel 2/128, cosine
distance <= 5e-6, lse rel (or abs) 8/65536 on finite rows; empty rows give lse = +inf and out = 0 on both sides.

Cases: (1) sparse FP8 and bf16 at H 1 and 63 with s_q 1 and 2, sparse FP8 at s_q 4 with H 16 and 64;
(2) sparse indices mixing INT_MIN, INT_MAX, -123456, num_slots and -1 with valid slots, one request whose indices
are all invalid, and valid slots of NaN rows past topk_length; (3) topk 32768 (B 2, H 16, FP8 and bf16);
(4) dense decode over the FP8 cache, s_q 4, block size 256, one 32768-token request, with sink, H 16 and 128.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashdsa
from flashdsa import _dispatch
from oracles import INT32_MAX, INT32_MIN, decode_slots, mla_decode_oracle

from devices import DEVICES, backend_for as _backend

from .checks import check_close as _check, make_paged as _make

I32 = torch.int32
BF16 = torch.bfloat16
CPU_MAX_CACHE = 4096  # cache lengths / topk above this are scaled to it on CPU (the float64 oracle is slow)
BAD = (INT32_MIN, INT32_MAX, -123456, None, -1)  # None: num_slots, the first out-of-range slot


def _size(n: int, device: str) -> int:
    """``n`` on CUDA; on CPU at most ``CPU_MAX_CACHE`` (sizes up to it unchanged)."""
    return n if device == "cuda" else min(n, CPU_MAX_CACHE)


def _sparse_indices(table, lens, block_size, s_q, topk, *, seed, n_slots, sprinkle=True):
    """`[B, s_q, topk]` int32 slots of random cached positions (no repeats), -1 past them; with ``sprinkle`` a -1
    and an out-of-range slot inside each list of more than 4."""
    g = torch.Generator().manual_seed(seed)
    B = table.shape[0]
    idx = torch.full((B, s_q, topk), -1, dtype=I32)
    for b in range(B):
        n = int(lens[b])
        for i in range(s_q):
            pos = torch.randperm(n, generator=g)[:topk]
            slots = table[b, pos // block_size].long() * block_size + pos % block_size
            idx[b, i, :len(slots)] = slots.to(I32)
            if sprinkle and len(slots) > 4:
                idx[b, i, 1] = -1
                idx[b, i, 3] = n_slots + 1000
    return idx


def _sink(H, seed):
    """`[H]` float32 sink values, with +inf (output 0) and -inf (no effect) entries where H >= 3."""
    s = torch.randn(H, generator=torch.Generator().manual_seed(seed))
    if H >= 3:
        s[0], s[-1] = math.inf, -math.inf
    return s


def _to(device, *xs):
    return [None if x is None else x.to(device) for x in xs]


def _run_and_check(q, cache, table, seqlens, *, indices=None, topk_length=None, attn_sink=None, backend):
    """``mla_decode`` on ``backend``, checked against the reference on the dequantized cache (CUDA) or the float64
    oracle (CPU). ``table``/``seqlens`` are ignored by sparse decode (passed as None)."""
    fp8 = cache.dtype == torch.uint8
    sparse = indices is not None
    bt, cl = (None, None) if sparse else (table, seqlens)
    out, lse = flashdsa.mla_decode(q, cache, bt, cl, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                                   backend=backend)
    assert _dispatch.last_choice("mla_decode") == backend
    rows = flashdsa.dequantize_kv_fp8(cache) if fp8 else cache
    if backend == "kernel":
        ref_out, ref_lse = flashdsa.mla_decode(q, rows, bt, cl, indices=indices, topk_length=topk_length,
                                               attn_sink=attn_sink, backend="reference")
        torch.cuda.synchronize()
        _check(out, lse, ref_out.to(BF16), ref_lse.float())
        return
    B, s_q, H, dqk = q.shape
    nb, bs = cache.shape[:2]
    if sparse:
        topk = indices.shape[-1]
        tl = [topk if topk_length is None else min(max(int(topk_length[b]), 0), topk) for b in range(B)]
        slots = [[indices[b, i, :tl[b]].tolist() for i in range(s_q)] for b in range(B)]
    else:
        slots = decode_slots(table, seqlens, nb, bs, s_q, True)
    ref_out, ref_lse = mla_decode_oracle(q, rows.reshape(nb * bs, dqk), slots, sm_scale=dqk ** -0.5,
                                         attn_sink=attn_sink)
    _check(out, lse, ref_out, ref_lse)


# ------------------------------------------------------------------------------------ (1) sparse: H 1 / 63, s_q 4
# (B, s_q, H, block_size, lens (cycled over the batch), topk, fp8, sink)
SPARSE = [
    (2, 1, 1, 64, (4096, 140), 512, True, False),
    (3, 2, 1, 16, (140, 0, 20), 256, True, True),
    (2, 1, 63, 256, (4096, 20), 1024, True, True),
    (6, 2, 63, 64, (0, 20, 140, 4096, 1, 300), 512, True, False),
    (3, 1, 1, 32, (20, 4096, 0), 384, False, True),
    (2, 2, 1, 256, (4096, 140), 2048, False, False),
    (2, 1, 63, 16, (140, 4096), 512, False, False),
    (6, 2, 63, 128, (4096, 0, 140, 20, 300, 1), 256, False, True),
    (2, 4, 16, 64, (4096, 140), 2048, True, True),
    (6, 4, 64, 16, (140, 4096, 0, 20, 1, 1000), 512, True, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,s_q,H,bs,lens,topk,fp8,sink", SPARSE,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-bs{c[3]}-k{c[5]}-{'fp8' if c[6] else 'bf16'}"
                              + ("-sink" if c[7] else "") for c in SPARSE])
def test_sparse_decode_heads_and_sq(B, s_q, H, bs, lens, topk, fp8, sink, device):
    backend = _backend(device)
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, bs, lens, seed=B * 7 + H * 3 + s_q)
    idx = _sparse_indices(table, seqlens, bs, s_q, topk, seed=B + H + s_q, n_slots=kv.shape[0] * bs)
    g = torch.Generator().manual_seed(H + topk)
    tl = torch.randint(0, topk + 1, (B,), generator=g, dtype=I32)
    tl[0] = topk
    attn_sink = _sink(H, seed=H) if sink else None
    q, kv, idx, tl, attn_sink = _to(device, q, kv, idx, tl, attn_sink)
    cache = flashdsa.quantize_kv_fp8(kv) if fp8 else kv
    _run_and_check(q, cache, None, None, indices=idx, topk_length=tl, attn_sink=attn_sink, backend=backend)


# ------------------------------------------------------------------------------------ (2) extreme invalid indices
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8,H,s_q,sink", [(True, 16, 2, False), (True, 64, 1, True), (False, 3, 2, True),
                                            (False, 128, 1, False)],
                         ids=["fp8-H16-sq2", "fp8-H64-sq1-sink", "bf16-H3-sq2-sink", "bf16-H128-sq1"])
def test_sparse_decode_extreme_invalid_indices(fp8, H, s_q, sink, device):
    """INT_MIN, INT_MAX, -123456, num_slots and -1 every third entry (never dereferenced: every unused slot holds
    NaN); request 1 has cached tokens but only invalid indices; requests 2 and 3 carry valid slots of NaN rows
    past their topk_length (request 3 has no cached token: only invalid entries inside its length)."""
    backend = _backend(device)
    B, bs, topk = 4, 64, 256
    q, kv, table, seqlens = _make(B, s_q, H, bs, [4096, 140, 300, 0], seed=H * 5 + s_q)
    n_slots = kv.shape[0] * bs
    idx = _sparse_indices(table, seqlens, bs, s_q, topk, seed=H, n_slots=n_slots, sprinkle=False)
    bad = torch.tensor([n_slots if v is None else v for v in BAD], dtype=I32)
    j = torch.arange(topk)
    sel = j % 3 == 1
    for b in range(B):
        for i in range(s_q):
            idx[b, i, sel] = bad[(j[sel] // 3 + b + i) % len(BAD)]
    idx[1] = bad[(j + 2) % len(BAD)].expand(s_q, topk)  # all invalid
    tl = torch.tensor([topk, topk, topk - 37, 5], dtype=I32)
    nan_slots = torch.isnan(kv.view(n_slots, 576)[:, 0]).nonzero().flatten().to(I32)
    assert len(nan_slots) >= topk
    for b in (2, 3):
        idx[b, :, int(tl[b]):] = nan_slots[: topk - int(tl[b])]  # past topk_length: must not be read
    valid = (idx >= 0) & (idx < n_slots) & (j < tl.view(B, 1, 1))
    assert valid[0].any() and not valid[1].any() and not valid[3].any()
    attn_sink = _sink(H, seed=H + 1) if sink else None
    q, kv, idx, tl, attn_sink = _to(device, q, kv, idx, tl, attn_sink)
    cache = flashdsa.quantize_kv_fp8(kv) if fp8 else kv
    _run_and_check(q, cache, None, None, indices=idx, topk_length=tl, attn_sink=attn_sink, backend=backend)


# ------------------------------------------------------------------------------------ (3) topk 32768
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_sparse_decode_topk_32768(fp8, device):
    """B 2, H 16, topk 32768 over caches of 33000 and 32768 tokens (CPU: topk 4096 over 4328 and 4096): request 0
    picks topk of its positions, request 1 every position, in random order (a -1 and an out-of-range slot inside
    each list), request 1 cut to topk - topk / 32 by topk_length."""
    backend = _backend(device)
    B, s_q, H, bs = 2, 1, 16, 64
    topk = _size(32768, device)
    q, kv, table, seqlens = _make(B, s_q, H, bs, [topk + 232, topk], seed=32768 + fp8)
    n_slots = kv.shape[0] * bs
    idx = _sparse_indices(table, seqlens, bs, s_q, topk, seed=5, n_slots=n_slots)
    assert int(((idx[1] >= 0) & (idx[1] < n_slots)).sum()) == topk - 2
    tl = torch.tensor([topk, topk - topk // 32], dtype=I32)
    attn_sink = _sink(H, seed=3) if fp8 else None
    q, kv, idx, tl, attn_sink = _to(device, q, kv, idx, tl, attn_sink)
    cache = flashdsa.quantize_kv_fp8(kv) if fp8 else kv
    _run_and_check(q, cache, None, None, indices=idx, topk_length=tl, attn_sink=attn_sink, backend=backend)


# ------------------------------------------------------------------------------------ (4) dense over the FP8 cache
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H", [16, 128])
def test_dense_decode_fp8_cache_long(H, device):
    """Dense causal decode over the 656-byte cache: s_q 4, block size 256, cache lengths 32768 (CPU: 4096), 3
    (fewer than s_q: the first query sees nothing) and 1000, shuffled table, sink with +-inf entries."""
    backend = _backend(device)
    B, s_q, bs = 3, 4, 256
    q, kv, table, seqlens = _make(B, s_q, H, bs, [_size(32768, device), 3, 1000], seed=H)
    attn_sink = _sink(H, seed=H + 2)
    q, kv, table, seqlens, attn_sink = _to(device, q, kv, table, seqlens, attn_sink)
    _run_and_check(q, flashdsa.quantize_kv_fp8(kv), table, seqlens, attn_sink=attn_sink, backend=backend)
