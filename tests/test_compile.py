"""torch.compile(fullgraph=True) traces through every public op (fake impls), and torch.library.opcheck passes on
each flashdsa::* custom op. CPU only; backend "aot_eager" keeps it fast and needs no C++ compiler."""

from __future__ import annotations

import math

import pytest
import torch

import flashdsa

I32 = torch.int32
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn):
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
        return
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a, b) or torch.allclose(a.float(), b.float(), equal_nan=True)


def _cases():
    g = torch.Generator().manual_seed(0)
    M, H, D, N = 4, 3, 32, 9
    q_i = torch.randn(M, H, D, generator=g).to(BF16)
    k_i = torch.randn(N, D, generator=g).to(BF16)
    w_i = torch.rand(M, H, generator=g)
    ends = torch.tensor([1, 4, 9, 0], dtype=I32)
    T, Hs, Tkv, topk = 3, 2, 8, 5
    q = torch.randn(T, Hs, 576, generator=g).to(BF16)
    kv = torch.randn(Tkv, 576, generator=g).to(BF16)
    idx = torch.tensor([[0, 3, -1, 7, 7], [-1] * 5, [1, 2, 100, 4, 0]], dtype=I32)
    sink = torch.randn(Hs, generator=g)
    tl = torch.tensor([5, 2, 3], dtype=I32)
    qd = torch.randn(2, 2, Hs, 576, generator=g).to(BF16)
    cache = torch.randn(4, 4, 576, generator=g).to(BF16)
    bt = torch.tensor([[2, 0], [3, 1]], dtype=I32)
    lens = torch.tensor([7, 0], dtype=I32)
    qp = torch.randn(2, 2, H, D, generator=g).to(BF16)
    kc = torch.randn(5, 4, D, generator=g).to(BF16)
    wp = torch.rand(4, H, generator=g)
    scores = torch.randn(5, 11, generator=g)
    scores[1, 3:] = -math.inf
    scores[2, ::2] = math.nan
    return {
        "indexer_logits": (lambda: flashdsa.indexer_logits(q_i, k_i, w_i, k_end=ends)),
        "indexer_logits_paged": (lambda: flashdsa.indexer_logits_paged(
            qp, kc, wp, torch.tensor([6, 3], dtype=I32),
            torch.tensor([[4, 1], [0, 2]], dtype=I32), max_context=8)),
        "topk_indices": (lambda: flashdsa.topk_indices(scores, 4, order="score")),
        "sparse_mla_fwd": (lambda: flashdsa.sparse_mla_fwd(q, kv, idx, attn_sink=sink, topk_length=tl,
                                                           return_max_logits=True)),
        "sparse_mla_fwd_batched": (lambda: flashdsa.sparse_mla_fwd(q.view(1, T, Hs, 576), kv.view(1, Tkv, 576),
                                                                   idx.view(1, T, topk))),
        "sparse_mla": (lambda: flashdsa.sparse_mla(q, kv, idx, attn_sink=sink, d_v=512)),
        "sparse_attn": (lambda: flashdsa.sparse_attn(q[..., :64].contiguous().view(1, T, Hs, 64),
                                                     kv[:, :64].contiguous().view(1, Tkv, 64), sink,
                                                     idx.view(1, T, topk))),
        "mla_decode": (lambda: flashdsa.mla_decode(qd, cache, bt, lens, attn_sink=sink)),
        "mla_decode_sparse": (lambda: flashdsa.mla_decode(qd, cache, None, None,
                                                          indices=torch.tensor([[[0, 5, -1]] * 2, [[15, 15, 16]] * 2],
                                                                               dtype=I32))),
        "mla_decode_fp8": (lambda: flashdsa.mla_decode(qd, flashdsa.quantize_kv_fp8(cache), bt, lens)),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_compile_fullgraph_matches_eager(name):
    # build the closure's inputs once, then call eagerly and compiled on the same tensors
    fn = CASES[name]
    eager = fn()
    compiled = _compiled(fn)()
    _same(compiled, eager)


def test_compile_sparse_mla_backward():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 512, generator=g, dtype=torch.float64)
    kv = torch.randn(6, 512, generator=g, dtype=torch.float64)
    sink = torch.randn(2, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 1, 5], [-1, -1, -1], [2, 2, 4]], dtype=I32)

    def loss(q, kv, sink):
        return flashdsa.sparse_mla(q, kv, idx, attn_sink=sink, d_v=64).square().sum()

    grads = []
    for f in (loss, _compiled(loss)):
        ins = [t.clone().requires_grad_() for t in (q, kv, sink)]
        f(*ins).backward()
        grads.append([t.grad for t in ins])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------- opcheck
def _opcheck_cases():
    g = torch.Generator().manual_seed(2)
    T, H, Tkv, topk = 3, 2, 6, 4
    q = torch.randn(T, H, 512, generator=g, dtype=torch.float64)
    kv = torch.randn(Tkv, 512, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 1, 5, -1], [-1, -1, -1, -1], [2, 2, 4, 9]], dtype=I32)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    tl = torch.tensor([4, 4, 3], dtype=I32)
    out, lse, _ = torch.ops.flashdsa.sparse_mla_fwd(q, kv, idx, 0.05, 64, sink, tl, False, "reference")
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    qi = torch.randn(4, 3, 32, generator=g).to(BF16)
    ki = torch.randn(7, 32, generator=g).to(BF16)
    wi = torch.rand(4, 3, generator=g)
    return {
        "indexer_logits": (torch.ops.flashdsa.indexer_logits.default,
                           (qi, ki, wi, torch.rand(7, generator=g), torch.tensor([0, 1, 2, 9], dtype=I32),
                            torch.tensor([7, 3, 2, 9], dtype=I32), "reference")),
        "indexer_logits_paged": (torch.ops.flashdsa.indexer_logits_paged.default,
                                 (torch.randn(2, 2, 3, 32, generator=g).to(BF16),
                                  torch.randn(5, 4, 32, generator=g).to(BF16), torch.rand(4, 3, generator=g),
                                  torch.tensor([6, 2], dtype=I32), torch.tensor([[4, 1], [0, 2]], dtype=I32), None,
                                  7, "reference")),
        "topk_indices": (torch.ops.flashdsa.topk_indices.default,
                         (torch.randn(4, 9, generator=g), 3, None, torch.tensor([9, 2, 0, 5], dtype=I32), "index",
                          "reference")),
        "sparse_mla_fwd": (torch.ops.flashdsa.sparse_mla_fwd.default,
                           (q.clone().requires_grad_(), kv.clone().requires_grad_(), idx, 0.05, 64,
                            sink.clone().requires_grad_(), tl, False, "reference")),
        "sparse_mla_fwd_nosink": (torch.ops.flashdsa.sparse_mla_fwd.default,
                                  (q.to(BF16), kv.to(BF16), idx, 0.05, 512, None, None, False, "reference")),
        "sparse_mla_fwd_cache656": (torch.ops.flashdsa.sparse_mla_fwd_cache656.default,
                                    (torch.randn(3, 2, 576, generator=g).to(BF16),
                                     flashdsa.quantize_kv_fp8(torch.randn(10, 576, generator=g)), idx, 0.05, 512,
                                     sink.float(), tl, "reference")),
        "sparse_mla_fwd_fp8": (torch.ops.flashdsa.sparse_mla_fwd_fp8.default,
                               (torch.randn(3, 2, 576, generator=g).to(torch.float8_e4m3fn), torch.rand(3, 2) + 0.5,
                                torch.randn(10, 576, generator=g).to(torch.float8_e4m3fn), torch.rand(10) + 0.5, idx,
                                0.05, 512, None, tl, "reference")),
        "sparse_mla_bwd": (torch.ops.flashdsa.sparse_mla_bwd.default,
                           (q, kv, idx, out, lse, dout, None, 0.05, 64, sink, tl, False, "reference")),
        "sparse_mla_bwd_nosink": (torch.ops.flashdsa.sparse_mla_bwd.default,
                                  (q, kv, idx, out, lse, dout, torch.randn(lse.shape, generator=g, dtype=torch.float64),
                                   0.05, 64, None, tl, False, "reference")),
        "mla_decode": (torch.ops.flashdsa.mla_decode.default,
                       (torch.randn(2, 2, 2, 576, generator=g).to(BF16), torch.randn(4, 4, 576, generator=g).to(BF16),
                        torch.tensor([[2, 0], [3, 1]], dtype=I32), torch.tensor([7, 0], dtype=I32), 0.04, 512, True,
                        None, None, torch.randn(2, generator=g), "reference")),
        "mla_decode_sparse_fp8": (torch.ops.flashdsa.mla_decode.default,
                                  (torch.randn(2, 1, 2, 576, generator=g).to(BF16),
                                   flashdsa.quantize_kv_fp8(torch.randn(4, 4, 576, generator=g)), None, None, 0.04, 512,
                                   True, torch.tensor([[[0, 3, 15, -1]], [[2, 2, 20, 1]]], dtype=I32),
                                   torch.tensor([4, 2], dtype=I32), None, "reference")),
    }


OPCHECK = _opcheck_cases()


def test_every_custom_op_has_an_opcheck_case():
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("flashdsa::")}
    covered = {case.split("_nosink")[0].split("_sparse_fp8")[0] for case in OPCHECK}
    assert ops and ops <= covered, f"no opcheck case for {sorted(ops - covered)}"


@pytest.mark.parametrize("name", list(OPCHECK))
def test_opcheck(name):
    op, args = OPCHECK[name]
    utils = torch.library._OPCHECK_DEFAULT_UTILS
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
        # test_schema multiplies the inputs to detect aliasing, which CPU float8 does not implement
        utils = tuple(u for u in utils if u != "test_schema")
    torch.library.opcheck(op, args, test_utils=utils)


def test_fake_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(5, 4, 576, dtype=BF16)
        kv = torch.empty(10, 576, dtype=BF16)
        idx = torch.empty(5, 7, dtype=I32)
        out, lse, mx = flashdsa.sparse_mla_fwd(q, kv, idx, d_v=512, return_max_logits=True)
        assert out.shape == (5, 4, 512) and lse.shape == (5, 4) and mx.shape == (5, 4)
        assert out.dtype == BF16 and lse.dtype == torch.float32
        s = flashdsa.indexer_logits(torch.empty(3, 2, 64, dtype=BF16), torch.empty(11, 64, dtype=BF16),
                                    torch.empty(3, 2))
        assert s.shape == (3, 11) and s.dtype == torch.float32
        t = flashdsa.topk_indices(torch.empty(3, 11), 300)
        assert t.shape == (3, 300) and t.dtype == I32
        o, l = flashdsa.mla_decode(torch.empty(2, 3, 4, 576, dtype=BF16), torch.empty(6, 16, 656, dtype=torch.uint8),
                                   torch.empty(2, 3, dtype=I32), torch.empty(2, dtype=I32), d_v=512)
        assert o.shape == (2, 3, 4, 512) and l.shape == (2, 3, 4) and o.dtype == BF16
        p = flashdsa.indexer_logits_paged(torch.empty(2, 2, 4, 64, dtype=BF16), torch.empty(3, 8, 64, dtype=BF16),
                                          torch.empty(4, 4), torch.empty(2, dtype=I32), torch.empty(2, 2, dtype=I32),
                                          max_context=13)
        assert p.shape == (4, 13)


def test_no_nan_in_compiled_empty_rows():
    q = torch.randn(2, 2, 512).to(BF16)
    kv = torch.full((3, 512), math.nan).to(BF16)
    idx = torch.full((2, 4), -1, dtype=I32)
    out, lse = _compiled(lambda: flashdsa.sparse_mla_fwd(q, kv, idx))()
    assert (out == 0).all() and (lse == math.inf).all()
