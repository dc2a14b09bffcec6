"""GPU: the backward's preprocess ``delta = sum_d out * dout`` (``kernel_delta.row_dot``) against a float64 sum, on
row counts that do not fill the last 16-row CTA, strided inputs, NaN-poisoned output memory, and bitwise repeatability (the deterministic
backward relies on it)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.sparse import kernel_delta  # noqa: E402

from .test_kernel_gpu import _poison_allocator  # noqa: E402


def _check(out, dout):
    _poison_allocator(out.shape[:-1])
    got = kernel_delta.row_dot(out, dout)
    torch.cuda.synchronize()
    want = (out.double() * dout.double()).sum(-1)
    # fp32 sum of 512 products: error <= ~512 * 2^-24 * sum |products|
    bound = (out.double() * dout.double()).abs().sum(-1) * 512 * 2.0**-24 + 1e-30
    assert got.shape == out.shape[:-1] and got.dtype == torch.float32
    assert torch.all((got.double() - want).abs() <= bound), float(((got.double() - want).abs() / bound).max())
    again = kernel_delta.row_dot(out, dout)
    assert torch.equal(got, again)


@pytest.mark.parametrize("T,H", [(1, 1), (3, 7), (17, 64), (1000, 128), (4096, 64)])
def test_row_dot_matches_float64(T, H):
    gen = torch.Generator(device="cuda").manual_seed(T * 131 + H)
    out = torch.randn(T, H, 512, generator=gen, device="cuda").bfloat16()
    dout = (torch.randn(T, H, 512, generator=gen, device="cuda") * 1e-3).bfloat16()
    _check(out, dout)


def test_row_dot_strided_and_wide_range():
    gen = torch.Generator(device="cuda").manual_seed(3)
    base = torch.randn(64, 33, 512, generator=gen, device="cuda")
    base[:, :, ::97] *= 1e4  # a few large entries among ordinary ones
    out = base.bfloat16().transpose(0, 1)  # [33, 64, 512], not contiguous
    dout = torch.randn(33, 64, 512, generator=gen, device="cuda").bfloat16()
    assert not out.is_contiguous()
    _check(out, dout)

