"""topk_indices and dsa_topk (reference backend) against a stable-sort oracle over Python lists."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import flashdsa
from oracles import INT32_MAX, INT32_MIN, indexer_logits_oracle, topk_oracle

I32 = torch.int32
ORDERS = ["index", "score", "any"]


def check_topk(out, scores, k, starts=None, ends=None, order="index"):
    assert out.dtype == torch.int32 and out.shape == (scores.shape[0], k)
    ref = topk_oracle(scores, k, starts, ends, order)
    if order == "any":
        for m in range(out.shape[0]):
            got, want = out[m].tolist(), ref[m].tolist()
            assert sorted(got) == sorted(want), f"row {m}: {got} vs {want}"
    else:
        assert torch.equal(out.long(), ref), f"\n{out}\n{ref}"


def _scores(M, N, g, kind="randn"):
    if kind == "randn":
        return torch.randn(M, N, generator=g)
    if kind == "ties":  # few distinct values: many ties
        return torch.randint(0, 3, (M, N), generator=g).float()
    if kind == "equal":
        return torch.full((M, N), 1.5)
    raise ValueError(kind)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", ["randn", "ties", "equal"])
@pytest.mark.parametrize("k", [1, 4, 16, 40])
def test_topk_vs_oracle(order, kind, k, gen):
    s = _scores(6, 23, gen, kind)
    check_topk(flashdsa.topk_indices(s, k, order=order, backend="reference"), s, k, order=order)


@pytest.mark.parametrize("order", ORDERS)
def test_topk_inf_nan_mix(order):
    inf, nan = math.inf, math.nan
    s = torch.tensor([
        [nan, -inf, 1.0, inf, nan, 2.0, -inf, 1.0],
        [nan] * 8,
        [-inf] * 8,
        [inf, inf, nan, -inf, inf, 0.0, -0.0, -1e30],
        [nan, -inf, nan, -inf, nan, -inf, nan, 3.0],
    ])
    for k in (1, 3, 8, 12):
        out = flashdsa.topk_indices(s, k, order=order, backend="reference")
        check_topk(out, s, k, order=order)
        sel = out.long()
        valid = sel >= 0
        picked = s.gather(1, sel.clamp_min(0))[valid]
        assert not torch.isnan(picked).any() and not (picked == -inf).any()
    assert (flashdsa.topk_indices(s, 4, backend="reference")[1:3] == -1).all()


@pytest.mark.parametrize("order", ORDERS)
def test_topk_ranges(order, gen):
    s = _scores(8, 30, gen, "ties")
    starts = torch.tensor([0, 5, 29, 30, -4, 10, INT32_MIN, 7], dtype=I32)
    ends = torch.tensor([30, 20, 30, 30, 3, 5, INT32_MAX, 7], dtype=I32)  # includes empty and inverted ranges
    for k in (1, 6, 31):
        out = flashdsa.topk_indices(s, k, starts=starts, ends=ends, order=order, backend="reference")
        check_topk(out, s, k, starts, ends, order)
        for m in range(8):
            for i in out[m].tolist():
                assert i == -1 or max(int(starts[m]), 0) <= i < min(int(ends[m]), 30)
    out = flashdsa.topk_indices(s, 3, starts=starts, ends=ends, backend="reference")
    assert (out[[3, 5, 7]] == -1).all()


def test_topk_index_order_layout_and_score_order(gen):
    s = torch.randn(5, 50, generator=gen)
    s[:, ::3] = -math.inf
    k = 40  # more than the finite entries: -1 padding at the end
    idx = flashdsa.topk_indices(s, k, order="index", backend="reference")
    for row in idx.tolist():
        valid = [i for i in row if i >= 0]
        assert valid == sorted(valid) and len(set(valid)) == len(valid)
        assert row == valid + [-1] * (k - len(valid))
    sc = flashdsa.topk_indices(s, k, order="score", backend="reference")
    for m, row in enumerate(sc.tolist()):
        vals = [float(s[m, i]) for i in row if i >= 0]
        assert vals == sorted(vals, reverse=True)
        assert sorted(i for i in row if i >= 0) == [i for i in idx[m].tolist() if i >= 0]


def test_topk_float64_and_strided(gen):
    base = torch.randn(12, 40, generator=gen, dtype=torch.float64)
    s = base[::2, 3:33]
    assert not s.is_contiguous()
    a = flashdsa.topk_indices(s, 7, order="score", backend="reference")
    check_topk(a, s, 7, order="score")
    assert torch.equal(a, flashdsa.topk_indices(s.contiguous(), 7, order="score", backend="reference"))
    st_ = torch.arange(6, dtype=I32).repeat_interleave(2)[::2]
    b = flashdsa.topk_indices(s.float(), 5, starts=st_, backend="reference")
    check_topk(b, s.float(), 5, st_)


score_values = st.one_of(
    st.floats(-4, 4, allow_nan=False, width=32),
    st.sampled_from([0.0, 1.0, -1.0, math.inf, -math.inf, math.nan]),
)


@given(M=st.integers(1, 6), N=st.integers(1, 60), k=st.integers(1, 300), order=st.sampled_from(ORDERS),
       use_range=st.booleans(), data=st.data())
def test_topk_property(M, N, k, order, use_range, data):
    s = torch.tensor(data.draw(st.lists(st.lists(score_values, min_size=N, max_size=N), min_size=M, max_size=M)),
                     dtype=torch.float32)
    starts = ends = None
    if use_range:
        b = st.one_of(st.integers(-2, N + 2), st.sampled_from([INT32_MIN, INT32_MAX]))
        starts = torch.tensor(data.draw(st.lists(b, min_size=M, max_size=M)), dtype=I32)
        ends = torch.tensor(data.draw(st.lists(b, min_size=M, max_size=M)), dtype=I32)
    out = flashdsa.topk_indices(s, k, starts=starts, ends=ends, order=order, backend="reference")
    check_topk(out, s, k, starts, ends, order)


# --------------------------------------------------------------------------------------------- dsa_topk
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_dsa_topk_matches_indexer_plus_topk(dtype, gen):
    M, H, D, N = 9, 4, 32, 21
    q = torch.randn(M, H, D, generator=gen).to(dtype)
    k = torch.randn(N, D, generator=gen).to(dtype)
    w = torch.rand(M, H, generator=gen)
    ks = torch.rand(N, generator=gen) + 0.5 if dtype == torch.float8_e4m3fn else None
    kst = torch.tensor([0, 0, 3, 5, 21, 0, 2, -1, 10], dtype=I32)
    ken = torch.tensor([1, 21, 9, 5, 21, 12, 18, 30, 21], dtype=I32)
    for topk in (1, 5, 25):
        out = flashdsa.dsa_topk(q, k, w, topk, ks, k_start=kst, k_end=ken, backend="reference")
        logits = flashdsa.indexer_logits(q, k, w, ks, k_start=kst, k_end=ken, backend="reference")
        assert torch.equal(out, flashdsa.topk_indices(logits, topk, starts=kst, ends=ken, backend="reference"))
        # and against the oracles end to end, where the float64 logits have no near-ties
        ref = topk_oracle(indexer_logits_oracle(q, k, w, ks, kst, ken), topk, kst, ken)
        for m in range(M):
            if set(out[m].tolist()) != set(ref[m].tolist()):
                lg = logits[m][logits[m] > -math.inf].sort(descending=True).values
                assert len(lg) > topk and torch.isclose(lg[topk - 1], lg[topk], rtol=1e-4)


@pytest.mark.parametrize("max_chunk_bytes", [1, 4 * 13, 4 * 13 * 2 + 3, 4 * 13 * 5])
def test_dsa_topk_chunked_equals_unchunked(max_chunk_bytes, gen):
    M, H, D, N = 11, 3, 16, 13
    q = torch.randn(M, H, D, generator=gen).bfloat16()
    k = torch.randn(N, D, generator=gen).bfloat16()
    w = torch.rand(M, H, generator=gen)
    kst = torch.randint(-2, 8, (M,), generator=gen, dtype=I32)
    ken = torch.randint(4, 16, (M,), generator=gen, dtype=I32)
    full = flashdsa.dsa_topk(q, k, w, 6, k_start=kst, k_end=ken, backend="reference")
    chunked = flashdsa.dsa_topk(q, k, w, 6, k_start=kst, k_end=ken, max_chunk_bytes=max_chunk_bytes,
                                backend="reference")
    assert torch.equal(full, chunked)
    assert torch.equal(flashdsa.dsa_topk(q, k, w, 20, backend="reference"),
                       flashdsa.dsa_topk(q, k, w, 20, max_chunk_bytes=8, backend="reference"))


def test_degenerate_sizes():
    assert flashdsa.topk_indices(torch.randn(0, 5), 3, backend="reference").shape == (0, 3)
    assert (flashdsa.topk_indices(torch.randn(2, 0), 3, backend="reference") == -1).all()
    q = torch.randn(2, 2, 16).bfloat16()
    assert (flashdsa.dsa_topk(q, torch.randn(0, 16).bfloat16(), torch.rand(2, 2), 3, backend="reference") == -1).all()
    assert flashdsa.dsa_topk(q[:0], torch.randn(4, 16).bfloat16(), torch.rand(0, 2), 3, max_chunk_bytes=4,
                             backend="reference").shape == (0, 3)
