"""mla_decode (reference backend) against the float64 oracle: dense causal/non-causal, sparse, bf16 and FP8 caches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import flashdsa
from oracles import INT32_MAX, INT32_MIN, decode_slots, mla_decode_oracle

I32 = torch.int32
BF16 = torch.bfloat16


def make_cache(g, lens, bs, dqk, extra_blocks=3, dtype=BF16):
    """Shuffled block table covering each sequence's length; the cache holds NaN in every slot no position uses."""
    B = len(lens)
    max_blocks = max([1] + [-(-L // bs) for L in lens])
    nb = B * max_blocks + extra_blocks
    bt = torch.randperm(nb, generator=g)[: B * max_blocks].view(B, max_blocks).to(I32)
    cache = torch.full((nb, bs, dqk), math.nan, dtype=dtype)
    for b, L in enumerate(lens):
        for p in range(L):
            cache[int(bt[b, p // bs]), p % bs] = torch.randn(dqk, generator=g).to(dtype)
    return cache, bt, torch.tensor(lens, dtype=I32)


def check_decode(out, lse, ro, rl, *, tight=False):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    inf = torch.isinf(rl)
    assert torch.equal(torch.isinf(lse), inf) and (lse[inf] == math.inf).all()
    assert (out[inf] == 0).all()
    if tight:
        torch.testing.assert_close(out.double(), ro, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse.double()[~inf], rl[~inf], rtol=1e-10, atol=1e-10)
    else:
        torch.testing.assert_close(out.double(), ro, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(lse.double()[~inf], rl[~inf], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("s_q", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dqk,d_v", [(576, 512), (512, 512), (576, 64)])
def test_dense_decode_vs_oracle(s_q, causal, dqk, d_v, gen):
    lens = [13, 0, 1, 33, 2][: 5]
    H, bs = 4, 8
    cache, bt, cl = make_cache(gen, lens, bs, dqk)
    q = torch.randn(len(lens), s_q, H, dqk, generator=gen).bfloat16()
    sink = torch.tensor([0.3, math.inf, -math.inf, -1.0])
    out, lse = flashdsa.mla_decode(q, cache, bt, cl, d_v=d_v, causal=causal, attn_sink=sink, backend="reference")
    assert out.shape == (len(lens), s_q, H, d_v) and lse.shape == (len(lens), s_q, H)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    slots = decode_slots(bt, cl, cache.shape[0], bs, s_q, causal)
    ro, rl = mla_decode_oracle(q, cache.reshape(-1, dqk), slots, d_v=d_v, attn_sink=sink)
    check_decode(out, lse, ro, rl)
    assert (lse[1] == math.inf).all() and (out[1] == 0).all()  # cache_seqlens 0
    if causal and s_q > 1:  # the first queries of a 1-token sequence see nothing
        assert (lse[2, : s_q - 1] == math.inf).all()


def test_dense_decode_4d_cache_float64_and_default_scale(gen):
    lens = [9, 4]
    cache, bt, cl = make_cache(gen, lens, 4, 512, dtype=torch.float64)
    q = torch.randn(2, 3, 2, 512, generator=gen, dtype=torch.float64)
    out, lse = flashdsa.mla_decode(q, cache.unsqueeze(2), bt, cl, backend="reference")
    assert out.dtype == torch.float64
    ro, rl = mla_decode_oracle(q, cache.reshape(-1, 512), decode_slots(bt, cl, cache.shape[0], 4, 3, True),
                               sm_scale=512 ** -0.5)
    check_decode(out, lse, ro, rl, tight=True)


def test_dense_decode_bad_block_ids_are_skipped(gen):
    lens = [16, 12]
    cache, bt, cl = make_cache(gen, lens, 4, 512)
    bt = bt.clone()
    bt[0, 1] = -1
    bt[1, 2] = cache.shape[0] + 3
    q = torch.randn(2, 1, 3, 512, generator=gen).bfloat16()
    out, lse = flashdsa.mla_decode(q, cache, bt, cl, backend="reference")
    ro, rl = mla_decode_oracle(q, cache.reshape(-1, 512), decode_slots(bt, cl, cache.shape[0], 4, 1, True))
    check_decode(out, lse, ro, rl)


@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("use_tl", [False, True])
def test_sparse_decode_vs_oracle(s_q, use_tl, gen):
    B, H, nb, bs, topk, dqk = 3, 4, 6, 8, 10, 576
    cache = torch.randn(nb, bs, dqk, generator=gen).bfloat16()
    n = nb * bs
    idx = torch.randint(0, n, (B, s_q, topk), generator=gen, dtype=I32)
    bad = torch.tensor([-1, n, n + 5, INT32_MIN, INT32_MAX], dtype=I32)
    mask = torch.rand(B, s_q, topk, generator=gen) < 0.3
    idx = torch.where(mask, bad[torch.randint(0, 5, (B, s_q, topk), generator=gen)], idx)
    idx[1, 0] = -1  # an empty row
    tl = torch.tensor([10, 4, 0], dtype=I32) if use_tl else None
    used = set()
    for b in range(B):
        for i in range(s_q):
            k = topk if tl is None else int(tl[b])
            used.update(x for x in idx[b, i, :k].tolist() if 0 <= x < n)
    flat = cache.view(n, dqk)
    for r in range(n):
        if r not in used:
            flat[r] = math.nan
    q = torch.randn(B, s_q, H, dqk, generator=gen).bfloat16()
    out, lse = flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl, backend="reference")
    lists = [[[x for x in idx[b, i, : (topk if tl is None else int(tl[b]))].tolist()] for i in range(s_q)]
             for b in range(B)]
    ro, rl = mla_decode_oracle(q, flat, lists)
    check_decode(out, lse, ro, rl)
    assert (out[1, 0] == 0).all() and (lse[1, 0] == math.inf).all()
    if use_tl:
        assert (lse[2] == math.inf).all()
    # block_table / cache_seqlens are ignored for sparse decode
    bt = torch.zeros(B, 2, dtype=I32)
    out2, lse2 = flashdsa.mla_decode(q, cache, bt, torch.zeros(B, dtype=I32), indices=idx, topk_length=tl,
                                     backend="reference")
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("sparse", [False, True])
def test_fp8_cache_equals_dequantized_bf16_cache(sparse, gen):
    lens = [21, 0, 7]
    bs, H, s_q = 8, 3, 2
    cache, bt, cl = make_cache(gen, lens, bs, 576)
    cache = torch.nan_to_num(cache, nan=0.0)  # quantizing NaN rows is not the point here
    fp8 = flashdsa.quantize_kv_fp8(cache)
    assert fp8.shape == (cache.shape[0], bs, 656) and fp8.dtype == torch.uint8
    deq = flashdsa.dequantize_kv_fp8(fp8)
    q = torch.randn(len(lens), s_q, H, 576, generator=gen).bfloat16()
    kw = dict(attn_sink=torch.randn(H, generator=gen), backend="reference")
    if sparse:
        n = cache.shape[0] * bs
        kw["indices"] = torch.randint(-2, n + 2, (len(lens), s_q, 12), generator=gen, dtype=I32)
        kw["topk_length"] = torch.tensor([12, 5, 0], dtype=I32)
    a = flashdsa.mla_decode(q, fp8, bt, cl, **kw)
    b = flashdsa.mla_decode(q, deq, bt, cl, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = flashdsa.mla_decode(q, fp8.unsqueeze(2), bt, cl, **kw)  # [..., 1, 656] layout
    assert torch.equal(c[0], a[0])
    if not sparse:
        ro, rl = mla_decode_oracle(q, deq.reshape(-1, 576), decode_slots(bt, cl, cache.shape[0], bs, s_q, True),
                                   attn_sink=kw["attn_sink"])
        check_decode(a[0], a[1], ro, rl)


def test_decode_strided_equals_contiguous(gen):
    lens = [10, 5]
    cache, bt, cl = make_cache(gen, lens, 4, 512, extra_blocks=1)
    big = torch.randn(2, 2, 5, 520, generator=gen).bfloat16()
    q = big[:, :, 1:4, :512]
    bt_s = torch.stack([bt, bt], 1)[:, 0]  # row stride 2 * max_blocks
    assert not q.is_contiguous() and not bt_s.is_contiguous()
    cache_s = torch.cat([cache, cache], -1)[..., :512]
    a = flashdsa.mla_decode(q, cache_s, bt_s, cl, backend="reference")
    b = flashdsa.mla_decode(q.contiguous(), cache, bt, cl, backend="reference")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@given(B=st.integers(1, 3), s_q=st.integers(1, 4), H=st.integers(1, 128), bs=st.sampled_from([1, 4, 16]),
       causal=st.booleans(), sink=st.sampled_from([None, "randn", "inf", "-inf"]), seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_dense_decode_property(B, s_q, H, bs, causal, sink, seed, data):
    g = torch.Generator().manual_seed(seed)
    lens = data.draw(st.lists(st.integers(0, 24), min_size=B, max_size=B))
    cache, bt, cl = make_cache(g, lens, bs, 512, extra_blocks=2)
    q = torch.randn(B, s_q, H, 512, generator=g).bfloat16()
    s = {None: None, "randn": torch.randn(H, generator=g), "inf": torch.full((H,), math.inf),
         "-inf": torch.full((H,), -math.inf)}[sink]
    out, lse = flashdsa.mla_decode(q, cache, bt, cl, d_v=128, causal=causal, attn_sink=s, backend="reference")
    ro, rl = mla_decode_oracle(q, cache.reshape(-1, 512), decode_slots(bt, cl, cache.shape[0], bs, s_q, causal),
                               d_v=128, attn_sink=s)
    check_decode(out, lse, ro, rl)


def test_degenerate_sizes():
    """No sequences, an empty block table, a cache with no blocks: shapes hold, empty rows give 0 / +inf."""
    out, lse = flashdsa.mla_decode(torch.randn(0, 1, 2, 576).bfloat16(), torch.randn(2, 4, 576).bfloat16(),
                                   torch.zeros(0, 1, dtype=I32), torch.zeros(0, dtype=I32), backend="reference")
    assert out.shape == (0, 1, 2, 512) and lse.shape == (0, 1, 2)
    q = torch.randn(2, 2, 2, 576).bfloat16()
    out, lse = flashdsa.mla_decode(q, torch.randn(2, 4, 576).bfloat16(), torch.zeros(2, 0, dtype=I32),
                                   torch.tensor([3, 0], dtype=I32), backend="reference")
    assert (out == 0).all() and (lse == math.inf).all()
    out, lse = flashdsa.mla_decode(q, torch.zeros(0, 4, 656, dtype=torch.uint8), torch.zeros(2, 1, dtype=I32),
                                   torch.tensor([3, 1], dtype=I32), backend="reference")
    assert (out == 0).all() and (lse == math.inf).all()
    out, lse = flashdsa.mla_decode(q, torch.zeros(0, 4, 576).bfloat16(), None, None,
                                   indices=torch.zeros(2, 2, 3, dtype=I32), backend="reference")
    assert (out == 0).all() and (lse == math.inf).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("sparse", [False, True])
def test_fp8_cache_output_dtypes_match_across_backends(dtype, sparse):
    """Over the FP8 cache, "auto" (the sparse forward's route) and "reference" give q's dtype and f32 / f64 lse."""
    q = torch.randn(2, 2, 4, 576).to(dtype)
    cache = flashdsa.quantize_kv_fp8(torch.randn(3, 16, 576).bfloat16())
    bt, cl = torch.tensor([[0, 1], [2, -1]], dtype=I32), torch.tensor([20, 5], dtype=I32)
    idx = torch.randint(-1, 48, (2, 2, 7), dtype=I32) if sparse else None
    want = (dtype, torch.float64 if dtype == torch.float64 else torch.float32)
    for backend in ("auto", "reference"):
        out, lse = flashdsa.mla_decode(q, cache, bt, cl, indices=idx, backend=backend)
        assert (out.dtype, lse.dtype) == want, backend
