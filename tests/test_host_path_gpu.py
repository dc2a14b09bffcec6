"""GPU: the host-path shortcuts of small calls give the same results as the plain paths.

* ``kernel_index.offset_batched_indices`` (one launch) == the PyTorch map of batched indices to flat kv rows, on
  indices with negative, out-of-range and extreme int32 values, for several (B, S, topk, S_kv);
* the batched ``sparse_attn`` / ``sparse_mla_fwd`` forms (which use it) == the reference;
* ``mla_decode`` dense (one workspace allocation, direct launches, cached dummy sink) == the reference, with and
  without a sink, and the same numbers call after call (no state leaks between calls through cached buffers);
* the eager plans of ``sparse_attn`` / ``sparse_mla_fwd`` / ``sparse_mla`` (``_dispatch.PlanCache``): a call that
  replays a stored plan on new values is bitwise the plain path's result and matches the reference, for the
  pair (H 64 / 128: the batched forms through its ``batched`` build, which maps per-batch positions itself),
  narrow (H 16) and padded (H 48) kernels, batched and flat forms, topk_length and max_logits; a gradient request, a strided input or a bad argument still takes the plain path; a plan call
  captured in a CUDA graph replays correctly on new inputs.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

import flashdsa  # noqa: E402
from flashdsa.sparse import api as sparse_api  # noqa: E402
from flashdsa.bench.harness import capture_graph  # noqa: E402
from flashdsa.sparse import kernel_index  # noqa: E402

INT_MIN, INT_MAX = -(2**31), 2**31 - 1


@pytest.mark.parametrize("B,S,k,skv", [(1, 1, 1, 1), (3, 5, 300, 77), (128, 1, 640, 8192), (2, 700, 2048, 4096)])
def test_offset_batched_indices_matches_torch(B, S, k, skv):
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + S)
    idx = torch.randint(-skv // 2 - 2, skv + skv // 2 + 2, (B, S, k), generator=gen, device="cuda", dtype=torch.int32)
    idx.view(-1)[:: 7] = INT_MIN
    idx.view(-1)[3:: 11] = INT_MAX
    idx.view(-1)[5:: 13] = skv  # first invalid
    idx.view(-1)[6:: 17] = skv - 1  # last valid
    got = kernel_index.offset_batched_indices(idx, skv)
    offset = (torch.arange(B, device="cuda", dtype=torch.int64) * skv).view(B, 1, 1)
    ok = (idx >= 0) & (idx < skv)
    want = torch.where(ok, idx.long() + offset, -1).view(B * S, k).int()
    assert got.shape == (B * S, k) and got.dtype == torch.int32
    assert torch.equal(got, want)


def test_offset_batched_indices_strided_input():
    idx = torch.randint(-3, 40, (4, 6, 64), device="cuda", dtype=torch.int32)
    strided = idx.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    assert not strided.is_contiguous()
    assert torch.equal(kernel_index.offset_batched_indices(strided, 33), kernel_index.offset_batched_indices(idx, 33))


@pytest.mark.parametrize("b,m,n,h,topk", [(4, 1, 512, 64, 100), (2, 37, 300, 16, 64)])
def test_sparse_attn_batched_matches_reference(b, m, n, h, topk):
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = (torch.randn(b, m, h, 512, generator=gen, device="cuda") * 0.3).bfloat16()
    kv = (torch.randn(b, n, 512, generator=gen, device="cuda") * 0.3).bfloat16()
    idx = torch.randint(-5, n + 5, (b, m, topk), generator=gen, device="cuda", dtype=torch.int32)
    idx[0, 0, :] = -1  # an empty row
    sink = torch.randn(h, generator=gen, device="cuda")
    got = flashdsa.sparse_attn(q, kv, sink, idx)
    want = flashdsa.sparse_attn(q, kv, sink, idx, backend="reference")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.all(got[0, 0] == 0)
    # the flattening used by the kernel path equals the PyTorch one
    assert torch.equal(sparse_api._offset_batched_indices(idx, n), sparse_api._offset_batched_indices(idx, n, "reference"))


@pytest.mark.parametrize("sink", [False, True])
def test_mla_decode_dense_repeatable_and_correct(sink):
    gen = torch.Generator(device="cuda").manual_seed(3)
    B, H, bs, max_blocks = 5, 16, 64, 9
    nb = B * max_blocks
    kv = (torch.randn(nb, bs, 576, generator=gen, device="cuda") * 0.3).bfloat16()
    table = torch.randperm(nb, generator=gen, device="cuda").int().view(B, max_blocks)
    lens = torch.tensor([1, 0, 577, 64 * 9, 130], dtype=torch.int32, device="cuda")
    q = (torch.randn(B, 1, H, 576, generator=gen, device="cuda") * 0.3).bfloat16()
    s = torch.randn(H, generator=gen, device="cuda") if sink else None
    out_r, lse_r = flashdsa.mla_decode(q, kv, table, lens, attn_sink=s, backend="reference")
    first = None
    for _ in range(3):
        out, lse = flashdsa.mla_decode(q, kv, table, lens, attn_sink=s, backend="kernel")
        torch.testing.assert_close(out.float(), out_r.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, lse_r, atol=1e-3, rtol=1e-3)
        if first is None:
            first = (out.clone(), lse.clone())
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
    assert torch.all(out[1] == 0) and torch.all(torch.isinf(lse[1]))


def _v4_inputs(gen, b, m, n, h, topk):
    q = (torch.randn(b, m, h, 512, generator=gen, device="cuda") * 0.3).bfloat16()
    kv = (torch.randn(b, n, 512, generator=gen, device="cuda") * 0.3).bfloat16()
    idx = torch.randint(-3, n + 3, (b, m, topk), generator=gen, device="cuda", dtype=torch.int32)
    idx.view(-1)[::97] = INT_MIN
    idx.view(-1)[5::89] = INT_MAX
    idx.view(-1)[7::83] = n  # the first invalid position of every batch
    return q, kv, idx, torch.randn(h, generator=gen, device="cuda")


@pytest.mark.parametrize("h", [64, 128, 16, 48])
def test_sparse_attn_eager_plan_matches_plain_path(h):
    gen = torch.Generator(device="cuda").manual_seed(h)
    b, m, n, topk = 6, 2, 700, 200
    q, kv, idx, sink = _v4_inputs(gen, b, m, n, h, topk)
    flashdsa.sparse_attn(q, kv, sink, idx)  # plain path: validates, runs, stores the plan
    assert sparse_api._PLANS.get(sparse_api._plan_key("attn", q, kv, idx, None, sink, None, "auto")) is not None
    q2, kv2, idx2, sink2 = _v4_inputs(gen, b, m, n, h, topk)  # new values, same signature
    idx2[1, 0, :] = -1  # an empty row
    got = flashdsa.sparse_attn(q2, kv2, sink2, idx2)  # the plan
    plain = flashdsa.sparse_attn(q2, kv2, sink2, idx2, backend="kernel")  # another signature: the plain path
    assert torch.equal(got, plain)
    want = flashdsa.sparse_attn(q2, kv2, sink2, idx2, backend="reference")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.all(got[1, 0] == 0)
    if h != 64:
        return
    # a gradient request goes through autograd (plain path) and still works
    qg = q2.clone().requires_grad_()
    out = flashdsa.sparse_attn(qg, kv2, sink2, idx2)
    assert torch.equal(out.detach(), got)
    out.float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_sparse_mla_fwd_eager_plan_flat_topk_length_max_logits():
    gen = torch.Generator(device="cuda").manual_seed(11)
    T, H, SKV, topk = 37, 64, 600, 130

    def inputs():
        q = (torch.randn(T, H, 576, generator=gen, device="cuda") * 0.3).bfloat16()
        kv = (torch.randn(SKV, 576, generator=gen, device="cuda") * 0.3).bfloat16()
        idx = torch.randint(-2, SKV + 2, (T, topk), generator=gen, device="cuda", dtype=torch.int32)
        tl = torch.randint(0, topk + 1, (T,), generator=gen, device="cuda", dtype=torch.int32)
        return q, kv, idx, tl

    a = inputs()
    flashdsa.sparse_mla_fwd(*a[:3], topk_length=a[3], return_max_logits=True)
    q, kv, idx, tl = inputs()
    got = flashdsa.sparse_mla_fwd(q, kv, idx, topk_length=tl, return_max_logits=True)  # the plan
    plain = flashdsa.sparse_mla_fwd(q, kv, idx, topk_length=tl, return_max_logits=True, backend="kernel")
    assert all(torch.equal(x, y) for x, y in zip(got, plain))
    want = flashdsa.sparse_mla_fwd(q, kv, idx, topk_length=tl, return_max_logits=True, backend="reference")
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-3)
    # the batched form with topk_length (H 128: the pair kernel's batched build)
    B, S, n = 3, 5, 300
    qb = (torch.randn(B, S, 128, 576, generator=gen, device="cuda") * 0.3).bfloat16()
    kvb = (torch.randn(B, n, 576, generator=gen, device="cuda") * 0.3).bfloat16()
    ib = torch.randint(-2, n + 2, (B, S, 70), generator=gen, device="cuda", dtype=torch.int32)
    tb = torch.randint(0, 71, (B, S), generator=gen, device="cuda", dtype=torch.int32)
    first = flashdsa.sparse_mla_fwd(qb, kvb, ib, topk_length=tb)  # plain path, stores the plan
    again = flashdsa.sparse_mla_fwd(qb, kvb, ib, topk_length=tb)  # the plan
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    wb = flashdsa.sparse_mla_fwd(qb, kvb, ib, topk_length=tb, backend="reference")
    torch.testing.assert_close(again[0].float(), wb[0].float(), atol=2e-2, rtol=2e-2)
    # differentiable form without a gradient request: a plan too, same numbers
    with torch.no_grad():
        flashdsa.sparse_mla(*a[:3], topk_length=a[3])
        assert torch.equal(flashdsa.sparse_mla(q, kv, idx, topk_length=tl), got[0])


def test_eager_plan_strided_and_bad_arguments_take_the_plain_path():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, kv, idx, sink = _v4_inputs(gen, 3, 1, 300, 64, 64)
    qs = torch.empty(3, 1, 64, 1024, dtype=q.dtype, device="cuda")[..., :512]
    qs.copy_(q)  # strided (last dim contiguous): no plan, the plain path copies
    for _ in range(2):
        assert torch.equal(flashdsa.sparse_attn(qs, kv, sink, idx), flashdsa.sparse_attn(q, kv, sink, idx))
    assert sparse_api._PLANS.get(sparse_api._plan_key("attn", qs, kv, idx, None, sink, None, "auto")) is None
    with pytest.raises(TypeError, match="topk_idxs"):
        flashdsa.sparse_attn(q, kv, sink, idx.long())
    with pytest.raises(TypeError, match="softmax_scale"):
        flashdsa.sparse_attn(q, kv, sink, idx, softmax_scale=True)
    with pytest.raises(ValueError, match="attn_sink"):
        flashdsa.sparse_attn(q, kv, sink[:10], idx)


def test_eager_plan_in_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, kv, idx, sink = _v4_inputs(gen, 4, 1, 512, 64, 128)
    flashdsa.sparse_attn(q, kv, sink, idx)  # stores the plan
    graph, out = capture_graph(lambda: flashdsa.sparse_attn(q, kv, sink, idx))
    q2, kv2, idx2, sink2 = _v4_inputs(gen, 4, 1, 512, 64, 128)
    for dst, src in ((q, q2), (kv, kv2), (idx, idx2), (sink, sink2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flashdsa.sparse_attn(q2, kv2, sink2, idx2, backend="kernel"))
