"""sparse_mla_fwd / sparse_mla / sparse_attn (reference backend) against the float64 oracle, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import flashdsa
from oracles import (INT32_MAX, INT32_MIN, sparse_mla_oracle, sparse_mla_oracle_batched,
                     sparse_mla_oracle_grads)

I32 = torch.int32
BF16 = torch.bfloat16
F64 = torch.float64
INVALID = [-1, INT32_MIN, INT32_MAX, -2, 2**30, -(2**30)]  # plus Tkv and Tkv + 1, added per case


def make_indices(g, T, topk, Tkv, p_invalid=0.3, empty_rows=()):
    """`[T, topk]` int32: valid positions (duplicates likely when topk > Tkv) mixed with every kind of invalid."""
    idx = torch.randint(0, Tkv, (T, topk), generator=g)
    bad = torch.tensor(INVALID + [Tkv, Tkv + 1])
    pick = bad[torch.randint(0, len(bad), (T, topk), generator=g)]
    mask = torch.rand(T, topk, generator=g) < p_invalid
    idx = torch.where(mask, pick, idx)
    for t in empty_rows:
        idx[t] = pick[t]
    return idx.to(I32)


def used_rows(indices, Tkv, topk_length=None):
    used = set()
    for t, row in enumerate(indices.tolist()):
        n = len(row) if topk_length is None else max(0, min(int(topk_length[t]), len(row)))
        used.update(i for i in row[:n] if 0 <= i < Tkv)
    return used


def poison_unused(kv, indices, topk_length=None):
    """Copy of kv `[Tkv, D]` with NaN in every row that no used valid index references."""
    kv = kv.clone()
    used = used_rows(indices, kv.shape[0], topk_length)
    for r in range(kv.shape[0]):
        if r not in used:
            kv[r] = math.nan
    return kv


def assert_attn_close(out, lse, ref_out, ref_lse, *, exact_dtype=False):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ro, rl = ref_out.to(F64), ref_lse.to(F64)
    inf = torch.isinf(rl)
    assert torch.equal(torch.isinf(lse), inf) and (lse[inf] == math.inf).all(), "lse +inf pattern differs"
    if exact_dtype:  # float64 in, float64 out
        torch.testing.assert_close(out.to(F64), ro, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse.to(F64)[~inf], rl[~inf], rtol=1e-10, atol=1e-10)
    else:  # bf16 out (one rounding of an fp32 result), fp32 lse
        torch.testing.assert_close(out.to(F64), ro, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(lse.to(F64)[~inf], rl[~inf], rtol=1e-5, atol=1e-4)
    assert (out[inf] == 0).all(), "empty rows must give out 0"


def _inputs(g, T, H, Tkv, dqk, dtype=BF16):
    q = torch.randn(T, H, dqk, generator=g).to(dtype)
    kv = torch.randn(Tkv, dqk, generator=g).to(dtype)
    return q, kv


# --------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("dqk,d_v", [(576, 512), (512, 512), (576, 64)])
@pytest.mark.parametrize("sink", [None, "finite", "mixed"])
@pytest.mark.parametrize("use_tl", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F64], ids=["bf16", "f64"])
def test_sparse_mla_fwd_vs_oracle(dqk, d_v, sink, use_tl, dtype, gen):
    T, H, Tkv, topk = 6, 5, 19, 24
    q, kv = _inputs(gen, T, H, Tkv, dqk, dtype)
    idx = make_indices(gen, T, topk, Tkv, empty_rows=(2,))
    attn_sink = None
    if sink == "finite":
        attn_sink = torch.randn(H, generator=gen)
    elif sink == "mixed":
        attn_sink = torch.tensor([math.inf, -math.inf, 0.5, -3.0, 40.0])
    tl = torch.tensor([24, 0, 24, 7, 1, 100], dtype=I32) if use_tl else None
    scale = 0.07
    out, lse, mx = flashdsa.sparse_mla_fwd(q, kv, idx, sm_scale=scale, d_v=d_v, attn_sink=attn_sink,
                                           topk_length=tl, return_max_logits=True, backend="reference")
    assert out.shape == (T, H, d_v) and lse.shape == (T, H) and mx.shape == (T, H)
    assert out.dtype == dtype and lse.dtype == (F64 if dtype == F64 else torch.float32)
    ro, rl, rm = sparse_mla_oracle(q, kv, idx, sm_scale=scale, d_v=d_v, attn_sink=attn_sink, topk_length=tl)
    assert_attn_close(out, lse, ro, rl, exact_dtype=dtype == F64)
    assert torch.equal(torch.isinf(mx), torch.isinf(rm))
    fin = torch.isfinite(rm)
    torch.testing.assert_close(mx.to(F64)[fin], rm[fin], rtol=1e-5, atol=1e-5)
    assert (lse[2] == math.inf).all() and (out[2] == 0).all() and (mx[2] == -math.inf).all()
    if sink == "mixed":
        assert (out[:, 0] == 0).all(), "sink +inf zeroes the output"


def test_sparse_mla_default_scale_and_layouts(gen):
    T, H, Tkv, topk = 4, 3, 10, 6
    q, kv = _inputs(gen, T, H, Tkv, 576)
    idx = make_indices(gen, T, topk, Tkv)
    out, lse = flashdsa.sparse_mla_fwd(q, kv, idx, backend="reference")
    ro, rl, _ = sparse_mla_oracle(q, kv, idx, sm_scale=576 ** -0.5)
    assert_attn_close(out, lse, ro, rl)
    out3, lse3 = flashdsa.sparse_mla_fwd(q, kv.unsqueeze(1), idx.unsqueeze(1), backend="reference")
    assert torch.equal(out3, out) and torch.equal(lse3, lse)


def test_sparse_mla_batched_form(gen):
    B, S, H, SKV, topk = 3, 4, 2, 9, 7
    q = torch.randn(B, S, H, 512, generator=gen).bfloat16()
    kv = torch.randn(B, SKV, 512, generator=gen).bfloat16()
    idx = torch.stack([make_indices(gen, S, topk, SKV) for _ in range(B)])
    tl = torch.randint(0, topk + 2, (B, S), generator=gen, dtype=I32)
    sink = torch.randn(H, generator=gen)
    out, lse, mx = flashdsa.sparse_mla_fwd(q, kv, idx, attn_sink=sink, topk_length=tl, return_max_logits=True,
                                           backend="reference")
    assert out.shape == (B, S, H, 512) and lse.shape == (B, S, H) and mx.shape == (B, S, H)
    ro, rl, _ = sparse_mla_oracle_batched(q, kv, idx, sm_scale=512 ** -0.5, d_v=512, attn_sink=sink, topk_length=tl)
    assert_attn_close(out, lse, ro, rl)
    # batch b's indices never reach another batch's kv: poison everything else in the flat view
    kvp = torch.stack([poison_unused(kv[b], idx[b], tl[b]) for b in range(B)])
    outp, lsep = flashdsa.sparse_mla_fwd(q, kvp, idx, attn_sink=sink, topk_length=tl, backend="reference")
    assert torch.equal(outp, out) and torch.equal(lsep, lse)


def test_empty_rows_all_invalid():
    T, H, Tkv = 3, 4, 5
    q = torch.randn(T, H, 512).bfloat16()
    kv = torch.full((Tkv, 512), math.nan).bfloat16()  # never read
    idx = torch.tensor([[-1, INT32_MIN, INT32_MAX, Tkv], [-1] * 4, [Tkv + 1, -5, 2**30, -1]], dtype=I32)
    for sink in (None, torch.tensor([math.inf, -math.inf, 0.0, 1.0])):
        out, lse, mx = flashdsa.sparse_mla_fwd(q, kv, idx, attn_sink=sink, return_max_logits=True, backend="reference")
        assert (out == 0).all() and (lse == math.inf).all() and (mx == -math.inf).all()
    # topk_length 0 empties a row whose indices are all valid
    kv = torch.randn(Tkv, 512).bfloat16()
    idx = torch.tensor([[0, 1, 2, 3]] * T, dtype=I32)
    out, lse = flashdsa.sparse_mla_fwd(q, kv, idx, topk_length=torch.tensor([0, 2, 0], dtype=I32),
                                       backend="reference")
    assert (out[[0, 2]] == 0).all() and (lse[[0, 2]] == math.inf).all() and torch.isfinite(lse[1]).all()


def test_nan_in_unreferenced_rows_and_topk_length_tail(gen):
    T, H, Tkv, topk = 5, 4, 30, 12
    q, kv = _inputs(gen, T, H, Tkv, 576)
    idx = make_indices(gen, T, topk, Tkv, p_invalid=0.2)
    tl = torch.tensor([12, 3, 0, 7, 12], dtype=I32)
    kvp = poison_unused(kv, idx, tl)
    a = flashdsa.sparse_mla_fwd(q, kvp, idx, topk_length=tl, backend="reference")
    b = flashdsa.sparse_mla_fwd(q, kv, idx, topk_length=tl, backend="reference")
    assert not torch.isnan(a[0]).any()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_permutation_and_minus_one_invariance(gen):
    T, H, Tkv, topk = 4, 3, 16, 10
    q, kv = _inputs(gen, T, H, Tkv, 512, F64)
    idx = make_indices(gen, T, topk, Tkv, p_invalid=0.25)
    out, lse = flashdsa.sparse_mla_fwd(q, kv, idx, backend="reference")
    perm = torch.stack([torch.randperm(topk, generator=gen) for _ in range(T)])
    out_p, lse_p = flashdsa.sparse_mla_fwd(q, kv, idx.gather(1, perm), backend="reference")
    torch.testing.assert_close(out_p, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_p, lse, rtol=1e-12, atol=1e-12)
    pad = torch.full((T, 5), -1, dtype=I32)
    out_m, lse_m = flashdsa.sparse_mla_fwd(q, kv, torch.cat([pad[:, :2], idx, pad], 1), backend="reference")
    torch.testing.assert_close(out_m, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_m, lse, rtol=1e-12, atol=1e-12)


def test_duplicates_count_twice(gen):
    q, kv = _inputs(gen, 1, 2, 4, 512, F64)
    a = flashdsa.sparse_mla_fwd(q, kv, torch.tensor([[0, 1, 1]], dtype=I32), backend="reference")
    b = flashdsa.sparse_mla_fwd(q, kv, torch.tensor([[0, 1]], dtype=I32), backend="reference")
    assert not torch.allclose(a[0], b[0])
    torch.testing.assert_close(a[1] - b[1], torch.log(1 + torch.exp(
        (q[0] @ kv[1] * 512 ** -0.5) - b[1][0])).unsqueeze(0))


@given(T=st.integers(1, 3), H=st.integers(1, 128), Tkv=st.integers(1, 40), topk=st.integers(1, 300),
       dqk=st.sampled_from([512, 576]), p_invalid=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
       sink_kind=st.sampled_from([None, "randn", "inf", "-inf", "mixed"]), tl_kind=st.sampled_from([None, "rand", "zero"]),
       f64=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_sparse_mla_fwd_property(T, H, Tkv, topk, dqk, p_invalid, sink_kind, tl_kind, f64, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = F64 if f64 else BF16
    q, kv = _inputs(g, T, H, Tkv, dqk, dtype)
    idx = make_indices(g, T, topk, Tkv, p_invalid=p_invalid)
    sink = {None: None, "randn": torch.randn(H, generator=g), "inf": torch.full((H,), math.inf),
            "-inf": torch.full((H,), -math.inf),
            "mixed": torch.tensor([math.inf, -math.inf, 0.0, 2.0])[torch.randint(0, 4, (H,), generator=g)]}[sink_kind]
    tl = {None: None, "rand": torch.randint(0, topk + 3, (T,), generator=g, dtype=I32),
          "zero": torch.zeros(T, dtype=I32)}[tl_kind]
    kvp = poison_unused(kv, idx, tl)
    out, lse, mx = flashdsa.sparse_mla_fwd(q, kvp, idx, attn_sink=sink, topk_length=tl, return_max_logits=True,
                                           backend="reference")
    assert not torch.isnan(out).any() and not torch.isnan(lse).any() and not torch.isnan(mx).any()
    ro, rl, rm = sparse_mla_oracle(q, kvp, idx, sm_scale=dqk ** -0.5, d_v=512, attn_sink=sink, topk_length=tl)
    assert_attn_close(out, lse, ro, rl, exact_dtype=f64)
    assert torch.equal(torch.isinf(mx), torch.isinf(rm))
    if tl_kind == "zero" or p_invalid == 1.0:
        assert (out == 0).all() and (lse == math.inf).all()
    if tl is None:  # permuting each row's indices changes only the summation order
        perm = torch.stack([torch.randperm(topk, generator=g) for _ in range(T)])
        out_p, lse_p = flashdsa.sparse_mla_fwd(q, kvp, idx.gather(1, perm), attn_sink=sink, backend="reference")
        assert torch.equal(torch.isinf(lse_p), torch.isinf(lse))
        fin = torch.isfinite(lse)
        tol = dict(rtol=1e-12, atol=1e-12) if f64 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(out_p, out, **tol)
        torch.testing.assert_close(lse_p[fin], lse[fin], **(tol if f64 else dict(rtol=1e-5, atol=1e-5)))


def test_sparse_mla_strided_equals_contiguous(gen):
    T, H, Tkv, topk = 4, 3, 12, 8
    qb = torch.randn(2 * T, H + 1, 600, generator=gen).bfloat16()
    kvb = torch.randn(Tkv, 2, 640, generator=gen).bfloat16()
    ib = make_indices(gen, 2 * T, topk + 3, Tkv)
    q, kv, idx = qb[::2, 1:, :576], kvb[:, 1, :576], ib[1::2, 2:topk + 2]
    sink = torch.randn(H, generator=gen)  # 1-D: its only dim is the last dim, which must be contiguous
    tl = torch.randint(0, topk + 1, (2 * T,), generator=gen, dtype=I32)[::2]
    assert not any(t.is_contiguous() for t in (q, kv, idx, tl))
    a = flashdsa.sparse_mla_fwd(q, kv, idx, attn_sink=sink, topk_length=tl, backend="reference")
    b = flashdsa.sparse_mla_fwd(q.contiguous(), kv.contiguous(), idx.contiguous(), attn_sink=sink.contiguous(),
                                topk_length=tl.contiguous(), backend="reference")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --------------------------------------------------------------------------------------------- sparse_attn
@pytest.mark.parametrize("h", [1, 3, 16])
@pytest.mark.parametrize("d", [64, 512])
def test_sparse_attn_vs_oracle(h, d, gen):
    b, m, n, topk = 2, 3, 11, 9
    q = torch.randn(b, m, h, d, generator=gen).bfloat16()
    kv = torch.randn(b, n, d, generator=gen).bfloat16()
    idx = torch.stack([make_indices(gen, m, topk, n, empty_rows=(1,)) for _ in range(b)])
    sink = torch.randn(h, generator=gen)
    out = flashdsa.sparse_attn(q, kv, sink, idx, backend="reference")
    assert out.shape == (b, m, h, d) and out.dtype == BF16
    ro, rl, _ = sparse_mla_oracle_batched(q, kv, idx, sm_scale=d ** -0.5, d_v=d, attn_sink=sink)
    torch.testing.assert_close(out.double(), ro, rtol=1.6e-2, atol=1e-2)
    assert (out[:, 1] == 0).all()
    out2 = flashdsa.sparse_attn(q, kv, None, idx, softmax_scale=0.1, backend="reference")
    ro2, _, _ = sparse_mla_oracle_batched(q, kv, idx, sm_scale=0.1, d_v=d)
    torch.testing.assert_close(out2.double(), ro2, rtol=1.6e-2, atol=1e-2)


# --------------------------------------------------------------------------------------------- backward
def _grad_case(g, T, H, Tkv, topk, dqk, dtype, sink_kind="randn", use_tl=False, p_invalid=0.3):
    q, kv = _inputs(g, T, H, Tkv, dqk, dtype)
    idx = make_indices(g, T, topk, Tkv, p_invalid=p_invalid, empty_rows=(0,) if T > 1 else ())
    sink = {None: None, "randn": torch.randn(H, generator=g, dtype=F64 if dtype == F64 else torch.float32),
            "mixed": torch.tensor([math.inf, -math.inf, 0.3, -1.0] * H)[:H].to(F64 if dtype == F64 else torch.float32)
            }[sink_kind]
    tl = torch.randint(0, topk + 1, (T,), generator=g, dtype=I32) if use_tl else None
    return q, kv, idx, sink, tl


@pytest.mark.parametrize("dqk,d_v", [(576, 512), (512, 512), (512, 128)])
@pytest.mark.parametrize("sink_kind", [None, "randn", "mixed"])
@pytest.mark.parametrize("use_tl", [False, True])
def test_sparse_mla_backward_float64_vs_autograd_oracle(dqk, d_v, sink_kind, use_tl, gen):
    T, H, Tkv, topk = 5, 4, 9, 12  # topk > Tkv: duplicates
    q, kv, idx, sink, tl = _grad_case(gen, T, H, Tkv, topk, dqk, F64, sink_kind, use_tl)
    kv = poison_unused(kv, idx, tl)
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    sg = sink.clone().requires_grad_() if sink is not None else None
    out = flashdsa.sparse_mla(qg, kvg, idx, d_v=d_v, attn_sink=sg, topk_length=tl, backend="reference")
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    out.backward(dout)
    rq, rkv, rs = sparse_mla_oracle_grads(q, kv, idx, dout, attn_sink=sink, d_v=d_v, topk_length=tl,
                                          sm_scale=dqk ** -0.5)
    assert not torch.isnan(qg.grad).any() and not torch.isnan(kvg.grad).any()
    torch.testing.assert_close(qg.grad, rq, rtol=1e-9, atol=1e-10)
    unused = torch.isnan(kv).any(-1)
    assert (kvg.grad[unused] == 0).all()
    torch.testing.assert_close(kvg.grad[~unused], rkv[~unused], rtol=1e-9, atol=1e-10)
    if sink is not None:
        assert sg.grad.dtype == F64
        torch.testing.assert_close(sg.grad, rs, rtol=1e-9, atol=1e-10)
        assert (sg.grad[torch.isinf(sink)] == 0).all()


def test_sparse_mla_fwd_lse_gradient(gen):
    """Gradients also flow through lse (dlse) of sparse_mla_fwd."""
    q, kv, idx, sink, tl = _grad_case(gen, 4, 3, 8, 10, 512, F64, "randn")
    qg, kvg, sg = (t.clone().requires_grad_() for t in (q, kv, sink))
    out, lse = flashdsa.sparse_mla_fwd(qg, kvg, idx, attn_sink=sg, backend="reference")
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=F64)
    loss = (out * dout).sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).mul(dlse).sum()
    loss.backward()
    rq, rkv, rs = sparse_mla_oracle_grads(q, kv, idx, dout, attn_sink=sink, dlse=dlse, d_v=512, sm_scale=512 ** -0.5)
    torch.testing.assert_close(qg.grad, rq, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(kvg.grad, rkv, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(sg.grad, rs, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("batched", [False, True])
def test_sparse_mla_backward_bf16_vs_autograd_oracle(batched, gen):
    T, H, Tkv, topk = 6, 4, 10, 8
    q, kv, idx, sink, tl = _grad_case(gen, T, H, Tkv, topk, 576, BF16, "randn", use_tl=True)
    dout = torch.randn(T, H, 512, generator=gen).bfloat16()
    if batched:  # two batches of 3 queries over 5 keys each
        qb, kvb = q.view(2, 3, H, 576), kv.view(2, 5, 576)
        ib = make_indices(gen, 6, topk, 5).view(2, 3, topk)
        tlb = tl.view(2, 3)
    qg, kvg, sg = q.clone().requires_grad_(), kv.clone().requires_grad_(), sink.clone().requires_grad_()
    if batched:
        out = flashdsa.sparse_mla(qg.view(2, 3, H, 576), kvg.view(2, 5, 576), ib, attn_sink=sg, topk_length=tlb,
                                  backend="reference")
        out.backward(dout.view(2, 3, H, 512))
        flat_idx = torch.where((ib >= 0) & (ib < 5), ib + 5 * torch.arange(2, dtype=I32).view(2, 1, 1),
                               torch.full_like(ib, -1)).view(6, topk)
        rq, rkv, rs = sparse_mla_oracle_grads(qb.reshape(6, H, 576), kvb.reshape(10, 576), flat_idx, dout,
                                              attn_sink=sink, topk_length=tlb.reshape(6), sm_scale=576 ** -0.5)
    else:
        out = flashdsa.sparse_mla(qg, kvg, idx, attn_sink=sg, topk_length=tl, backend="reference")
        out.backward(dout)
        rq, rkv, rs = sparse_mla_oracle_grads(q, kv, idx, dout, attn_sink=sink, topk_length=tl, sm_scale=576 ** -0.5)
    assert qg.grad.dtype == BF16 and kvg.grad.dtype == BF16 and sg.grad.dtype == torch.float32
    for got, want in ((qg.grad, rq), (kvg.grad, rkv), (sg.grad, rs)):
        assert not torch.isnan(got).any()
        tol = 2e-2 * want.abs().max().item() + 1e-3
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=tol)


def test_sparse_attn_backward_vs_autograd_oracle(gen):
    b, m, h, n, d, topk = 2, 3, 3, 6, 64, 5
    q = torch.randn(b, m, h, d, generator=gen, dtype=F64)
    kv = torch.randn(b, n, d, generator=gen, dtype=F64)
    sink = torch.randn(h, generator=gen, dtype=F64)
    idx = torch.stack([make_indices(gen, m, topk, n) for _ in range(b)])
    qg, kvg, sg = (t.clone().requires_grad_() for t in (q, kv, sink))
    out = flashdsa.sparse_attn(qg, kvg, sg, idx, backend="reference")
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    out.backward(dout)
    flat_idx = torch.where((idx >= 0) & (idx < n), idx + n * torch.arange(b, dtype=I32).view(b, 1, 1),
                           torch.full_like(idx, -1)).view(b * m, topk)
    rq, rkv, rs = sparse_mla_oracle_grads(q.view(b * m, h, d), kv.view(b * n, d), flat_idx, dout.view(b * m, h, d),
                                          attn_sink=sink, d_v=d, sm_scale=d ** -0.5)
    torch.testing.assert_close(qg.grad.view(b * m, h, d), rq, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(kvg.grad.view(b * n, d), rkv, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(sg.grad, rs, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("with_sink", [False, True])
def test_sparse_mla_gradcheck(with_sink, gen):
    T, H, Tkv, topk = 3, 2, 5, 6
    q = torch.randn(T, H, 512, generator=gen, dtype=F64, requires_grad=True)
    kv = torch.randn(Tkv, 512, generator=gen, dtype=F64, requires_grad=True)
    sink = torch.randn(H, generator=gen, dtype=F64, requires_grad=True)
    idx = torch.tensor([[0, 1, 1, -1, 4, Tkv], [-1] * topk, [3, 2, 0, INT32_MIN, 2, 1]], dtype=I32)
    tl = torch.tensor([6, 6, 4], dtype=I32)

    def f(q, kv, sink):
        return flashdsa.sparse_mla(q, kv, idx, d_v=32, attn_sink=sink if with_sink else None, topk_length=tl,
                                   sm_scale=0.05, backend="reference")

    assert torch.autograd.gradcheck(f, (q, kv, sink), fast_mode=True)

    def g(q, kv, sink):  # lse is differentiable too (rows 0 and 2 are non-empty)
        out, lse = flashdsa.sparse_mla_fwd(q, kv, idx[[0, 2]], attn_sink=sink if with_sink else None,
                                           sm_scale=0.05, backend="reference")
        return out[..., :16], lse

    assert torch.autograd.gradcheck(g, (q[[0, 2]].detach().requires_grad_(), kv, sink), fast_mode=True)


def test_degenerate_sizes():
    """No KV rows at all, no queries, no heads: shapes hold, empty rows give out 0 / lse +inf, no errors."""
    q = torch.randn(2, 3, 512).bfloat16()
    out, lse = flashdsa.sparse_mla_fwd(q, torch.randn(0, 512).bfloat16(), torch.zeros(2, 4, dtype=I32),
                                       backend="reference")
    assert out.shape == (2, 3, 512) and (out == 0).all() and (lse == math.inf).all()
    out, lse = flashdsa.sparse_mla_fwd(q.view(1, 2, 3, 512), torch.randn(1, 0, 512).bfloat16(),
                                       torch.zeros(1, 2, 4, dtype=I32), backend="reference")
    assert out.shape == (1, 2, 3, 512) and (out == 0).all() and (lse == math.inf).all()
    out, lse = flashdsa.sparse_mla_fwd(q[:0], torch.randn(3, 512).bfloat16(), torch.zeros(0, 4, dtype=I32),
                                       backend="reference")
    assert out.shape == (0, 3, 512) and lse.shape == (0, 3)
    qg = torch.randn(2, 2, 512, dtype=F64, requires_grad=True)
    kvg = torch.randn(0, 512, dtype=F64, requires_grad=True)
    flashdsa.sparse_mla(qg, kvg, torch.zeros(2, 3, dtype=I32), backend="reference").sum().backward()
    assert (qg.grad == 0).all() and kvg.grad.shape == (0, 512)


def test_backward_deterministic_flag_matches_default():
    """deterministic=True changes only the summation order of duplicated kv rows: same gradients on CPU."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(6, 3, 512, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(9, 512, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, 9, (6, 12), generator=g, dtype=torch.int32)
    grads = []
    for det in (False, True):
        q.grad = kv.grad = None
        flashdsa.sparse_mla(q, kv, idx, deterministic=det, backend="reference").square().sum().backward()
        grads.append((q.grad.clone(), kv.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=1e-12)
    assert not torch.are_deterministic_algorithms_enabled()  # the global flag is restored


def test_backward_bf16_operands_rounds_p_and_ds():
    """bf16_operands=True rounds P and sm_scale * dS to bf16 before their products (the kernel's wgmma operands),
    and only those: against the products written out from the reference's own P and dS, and against the default."""
    from flashdsa.sparse.reference import sparse_mla_bwd_reference

    g = torch.Generator().manual_seed(12)
    T, H, Tkv, topk, dqk, d_v = 4, 3, 10, 6, 512, 512
    q = torch.randn(T, H, dqk, generator=g, dtype=F64) * 0.5
    kv = torch.randn(Tkv, dqk, generator=g, dtype=F64) * 0.5
    idx = torch.randint(0, Tkv, (T, topk), generator=g, dtype=I32)
    idx[0, 2] = -1  # one invalid slot
    dout = torch.randn(T, H, d_v, generator=g, dtype=F64)
    sm = dqk ** -0.5
    out, lse = flashdsa.sparse_mla_fwd(q, kv, idx, sm_scale=sm, backend="reference")
    args = (q, kv, idx, out, lse, dout)
    dq0, dkv0, _ = sparse_mla_bwd_reference(*args, sm_scale=sm, d_v=d_v)
    dq1, dkv1, _ = sparse_mla_bwd_reference(*args, sm_scale=sm, d_v=d_v, bf16_operands=True)
    # written out: P, dS from the module docstring's math, then the rounded operands' products
    valid = idx >= 0
    k = torch.where(valid[..., None], kv[idx.clamp_min(0).long()], 0.0)
    p = torch.where(valid[:, None], torch.exp(torch.einsum("thd,tkd->thk", q, k) * sm - lse[..., None]), 0.0)
    ds = p * (torch.einsum("thd,tkd->thk", dout, k[..., :d_v]) - (out * dout).sum(-1)[..., None])
    ds_b = (ds * sm).to(BF16).to(F64)
    dk = torch.einsum("thk,thd->tkd", ds_b, q)
    dk[..., :d_v] += torch.einsum("thk,thd->tkd", p.to(BF16).to(F64), dout)
    dkv = torch.zeros(Tkv, dqk, dtype=F64).index_add_(0, idx.long()[valid], dk[valid])
    torch.testing.assert_close(dq1, torch.einsum("thk,tkd->thd", ds_b, k), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv1, dkv, rtol=1e-12, atol=1e-12)
    # the rounding moves the gradients by bf16-sized amounts, not more
    assert 0 < (dkv1 - dkv0).abs().max() < 2e-2 * dkv0.abs().max()
