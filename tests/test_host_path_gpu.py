"""GPU: the host-path shortcuts of small calls give the same results as the plain paths.

* ``kernel_index.offset_batched_indices`` (one launch) == the PyTorch map of batched indices to flat kv rows, on
  indices with negative, out-of-range and extreme int32 values, for several (B, S, topk, S_kv);
* the batched ``sparse_attn`` / ``sparse_mla_fwd`` forms (which use it) == the reference;
* ``mla_decode`` dense (one workspace allocation, direct launches, cached dummy sink) == the reference, with and
  without a sink, and the same numbers call after call (no state leaks between calls through cached buffers).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

import flashdsa  # noqa: E402
from flashdsa.sparse import api as sparse_api  # noqa: E402
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
