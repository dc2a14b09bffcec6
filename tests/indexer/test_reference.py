"""indexer_logits / indexer_logits_paged (reference backend) against the float64 oracles."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import flashdsa
from oracles import INT32_MAX, INT32_MIN, indexer_logits_oracle, indexer_logits_paged_oracle

I32 = torch.int32


def _rand(shape, dtype, g):
    x = torch.randn(*shape, generator=g)
    if dtype == torch.float8_e4m3fn:
        return (x * 4).to(dtype)
    return x.to(dtype)


def assert_logits_close(out, ref, rtol=1e-5, atol=1e-4):
    assert out.dtype == torch.float32
    ref = ref.to(torch.float64)
    o = out.to(torch.float64)
    assert not torch.isnan(o).any()
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(o), inf), "-inf pattern differs"
    assert (o[inf] == -math.inf).all()
    torch.testing.assert_close(o[~inf], ref[~inf], rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("use_scale", [False, True])
@pytest.mark.parametrize("ranges", [False, True])
def test_indexer_logits_vs_oracle(dtype, use_scale, ranges, gen):
    M, H, D, N = 7, 5, 32, 13
    q, k = _rand((M, H, D), dtype, gen), _rand((N, D), dtype, gen)
    w = torch.rand(M, H, generator=gen) - 0.3
    ks = torch.rand(N, generator=gen) + 0.5 if (use_scale or dtype == torch.float8_e4m3fn) else None
    kst = ken = None
    if ranges:
        kst = torch.tensor([0, -5, 3, 13, 2, 20, INT32_MIN], dtype=I32)
        ken = torch.tensor([13, 4, 3, 99, 12, 30, INT32_MAX], dtype=I32)
    out = flashdsa.indexer_logits(q, k, w, ks, k_start=kst, k_end=ken, backend="reference")
    assert out.shape == (M, N)
    assert_logits_close(out, indexer_logits_oracle(q, k, w, ks, kst, ken))


@given(M=st.integers(1, 6), H=st.integers(1, 64), N=st.integers(1, 24), D=st.sampled_from([16, 64, 128]),
       fp8=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_indexer_logits_property(M, H, N, D, fp8, seed, data):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q, k = _rand((M, H, D), dtype, g), _rand((N, D), dtype, g)
    w = torch.rand(M, H, generator=g)
    ks = torch.rand(N, generator=g) + 0.1 if fp8 or data.draw(st.booleans()) else None
    bound = st.one_of(st.integers(-3, N + 3), st.sampled_from([INT32_MIN, INT32_MAX, 0, N]))
    kst = torch.tensor(data.draw(st.lists(bound, min_size=M, max_size=M)), dtype=I32)
    ken = torch.tensor(data.draw(st.lists(bound, min_size=M, max_size=M)), dtype=I32)
    out = flashdsa.indexer_logits(q, k, w, ks, k_start=kst, k_end=ken, backend="reference")
    assert_logits_close(out, indexer_logits_oracle(q, k, w, ks, kst, ken), rtol=1e-5, atol=1e-3)
    # rows with an empty range are all -inf, and no NaN anywhere
    for m in range(M):
        if min(max(int(kst[m]), 0), N) >= min(max(int(ken[m]), 0), N):
            assert (out[m] == -math.inf).all()


def test_indexer_logits_float32_and_float64(gen):
    q = torch.randn(3, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(9, 16, generator=gen, dtype=torch.float64)
    w = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    out = flashdsa.indexer_logits(q, k, w, backend="reference")
    torch.testing.assert_close(out, indexer_logits_oracle(q, k, w), rtol=1e-12, atol=1e-12)
    out32 = flashdsa.indexer_logits(q.float(), k.float(), w.float(), backend="reference")
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), indexer_logits_oracle(q, k, w), rtol=1e-5, atol=1e-5)


def test_indexer_logits_strided_equals_contiguous(gen):
    M, H, D, N = 5, 3, 32, 11
    qb = torch.randn(M, H + 2, D + 16, generator=gen).bfloat16()
    kb = torch.randn(2 * N, D + 8, generator=gen).bfloat16()
    wb = torch.rand(2 * M, H + 3, generator=gen)
    ksb = torch.rand(2 * N, generator=gen)
    q, k, w, ks = qb[:, 1:H + 1, :D], kb[::2, :D], wb[::2, 1:H + 1], ksb[::2]
    assert not any(t.is_contiguous() for t in (q, k, w, ks))
    kst = torch.tensor([0, 2, 4, 6, 8, 10, 1, 3, 5, 7], dtype=I32)[::2]
    a = flashdsa.indexer_logits(q, k, w, ks, k_start=kst, backend="reference")
    b = flashdsa.indexer_logits(q.contiguous(), k.contiguous(), w.contiguous(), ks.contiguous(),
                                k_start=kst.contiguous(), backend="reference")
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------- paged
def _paged_case(g, B, next_n, H, D, bs, lens, dtype, extra_blocks=2, bad_ids=False):
    max_blocks = max([1] + [-(-L // bs) for L in lens])
    nb = B * max_blocks + extra_blocks
    perm = torch.randperm(nb, generator=g)[: B * max_blocks].view(B, max_blocks).to(I32)  # shuffled table
    if bad_ids:
        perm[0, -1] = -1 if nb > 0 else perm[0, -1]
        if B > 1:
            perm[1, 0] = nb + 7
    q = _rand((B, next_n, H, D), dtype, g)
    cache = _rand((nb, bs, D), dtype, g)
    w = torch.rand(B * next_n, H, generator=g)
    ksc = torch.rand(nb, bs, generator=g) + 0.25 if dtype == torch.float8_e4m3fn else None
    return q, cache, w, torch.tensor(lens, dtype=I32), perm, ksc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_indexer_logits_paged_vs_oracle(dtype, next_n, gen):
    lens = [17, 0, 5, 33, next_n, 1]
    q, cache, w, cl, bt, ksc = _paged_case(gen, len(lens), next_n, 4, 32, 8, lens, dtype)
    out = flashdsa.indexer_logits_paged(q, cache, w, cl, bt, k_scale_cache=ksc, backend="reference")
    assert out.shape == (len(lens) * next_n, max(lens))
    assert_logits_close(out, indexer_logits_paged_oracle(q, cache, w, cl, bt, ksc))


def test_indexer_logits_paged_max_context_and_bad_block_ids(gen):
    lens = [20, 9, 30]
    q, cache, w, cl, bt, _ = _paged_case(gen, 3, 2, 3, 16, 8, lens, torch.bfloat16, bad_ids=True)
    for mc in (0, 7, 30, 41):
        out = flashdsa.indexer_logits_paged(q, cache, w, cl, bt, max_context=mc, backend="reference")
        assert out.shape == (6, mc)
        assert_logits_close(out, indexer_logits_paged_oracle(q, cache, w, cl, bt, None, mc))


def test_indexer_logits_paged_nan_in_unused_slots(gen):
    lens = [10, 3]
    q, cache, w, cl, bt, _ = _paged_case(gen, 2, 1, 2, 16, 4, lens, torch.bfloat16, extra_blocks=3)
    used = set()
    for b, L in enumerate(lens):
        for p in range(L):
            used.add((int(bt[b, p // 4]), p % 4))
    poisoned = cache.clone()
    for blk in range(cache.shape[0]):
        for off in range(4):
            if (blk, off) not in used:
                poisoned[blk, off] = math.nan
    out = flashdsa.indexer_logits_paged(q, poisoned, w, cl, bt, backend="reference")
    assert not torch.isnan(out).any()
    assert torch.equal(out, flashdsa.indexer_logits_paged(q, cache, w, cl, bt, backend="reference"))


@given(B=st.integers(1, 4), next_n=st.integers(1, 3), H=st.integers(1, 32), bs=st.sampled_from([1, 4, 16]),
       fp8=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_indexer_logits_paged_property(B, next_n, H, bs, fp8, seed, data):
    g = torch.Generator().manual_seed(seed)
    lens = data.draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q, cache, w, cl, bt, ksc = _paged_case(g, B, next_n, H, 16, bs, lens, dtype)
    mc = data.draw(st.one_of(st.none(), st.integers(0, 48)))
    out = flashdsa.indexer_logits_paged(q, cache, w, cl, bt, k_scale_cache=ksc, max_context=mc, backend="reference")
    assert_logits_close(out, indexer_logits_paged_oracle(q, cache, w, cl, bt, ksc, mc), atol=1e-3)


def test_degenerate_sizes():
    q = torch.randn(2, 2, 16).bfloat16()
    assert flashdsa.indexer_logits(q, torch.randn(0, 16).bfloat16(), torch.rand(2, 2), backend="reference").shape == (2, 0)
    assert flashdsa.indexer_logits(q[:0], torch.randn(3, 16).bfloat16(), torch.rand(0, 2),
                                   backend="reference").shape == (0, 3)
    out = flashdsa.indexer_logits_paged(torch.randn(1, 1, 2, 16).bfloat16(), torch.randn(2, 4, 16).bfloat16(),
                                        torch.rand(1, 2), torch.tensor([3], dtype=I32), torch.zeros(1, 0, dtype=I32),
                                        backend="reference")
    assert out.shape == (1, 3) and (out == -math.inf).all()  # no block table: nothing to score
    out = flashdsa.indexer_logits_paged(torch.randn(0, 1, 2, 16).bfloat16(), torch.randn(2, 4, 16).bfloat16(),
                                        torch.rand(0, 2), torch.zeros(0, dtype=I32), torch.zeros(0, 1, dtype=I32),
                                        backend="reference")
    assert out.shape == (0, 0)
