"""The reference backend runs on CUDA tensors and agrees with the CPU reference (same inputs)."""

import pytest
import torch

import flashdsa

pytestmark = pytest.mark.gpu


def _both(fn, *args, **kw):
    """Run fn on CUDA copies of the tensor args and on the CPU originals; return (cuda_result, cpu_result)."""
    to = lambda x: x.cuda() if isinstance(x, torch.Tensor) else x  # noqa: E731
    gpu = fn(*[to(a) for a in args], **{k: to(v) for k, v in kw.items()}, backend="reference")
    cpu = fn(*args, **kw, backend="reference")
    return gpu, cpu


def _close(a, b, atol, rtol):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            _close(x, y, atol, rtol)
        return
    torch.testing.assert_close(a.cpu().float(), b.float(), atol=atol, rtol=rtol, equal_nan=False)


def test_indexer_reference_on_cuda():
    g = torch.Generator().manual_seed(0)
    q, _ = flashdsa.quantize_fp8(torch.randn(37, 8, 64, generator=g), block=64)
    k, ks = flashdsa.quantize_fp8(torch.randn(300, 64, generator=g), block=64)
    w = torch.rand(37, 8, generator=g)
    end = torch.randint(0, 301, (37,), generator=g, dtype=torch.int32)
    start = (end - 100).clamp_min(0)
    _close(*_both(flashdsa.indexer_logits, q, k, w, ks.squeeze(-1), k_start=start, k_end=end), 1e-3, 1e-4)


def test_topk_reference_on_cuda():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(64, 5000, generator=g)
    s[:, ::7] = s[:, 3:4]  # ties
    gpu, cpu = _both(flashdsa.topk_indices, s, 300, order="index")
    assert torch.equal(gpu.cpu(), cpu)


def test_sparse_mla_reference_on_cuda():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(50, 16, 576, generator=g).bfloat16()
    kv = torch.randn(700, 576, generator=g).bfloat16()
    idx = torch.randint(-5, 705, (50, 128), generator=g, dtype=torch.int32)
    sink = torch.randn(16, generator=g)
    _close(*_both(flashdsa.sparse_mla_fwd, q, kv, idx, attn_sink=sink), 2e-2, 2e-2)


def test_mla_decode_reference_on_cuda():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 16, 576, generator=g).bfloat16()
    cache = torch.randn(10, 64, 576, generator=g).bfloat16()
    bt = torch.randperm(10, generator=g)[:9].view(3, 3).int()
    lens = torch.tensor([0, 70, 192], dtype=torch.int32)
    _close(*_both(flashdsa.mla_decode, q, cache, bt, lens), 2e-2, 2e-2)
    fp8 = flashdsa.quantize_kv_fp8(cache)
    _close(*_both(flashdsa.mla_decode, q, fp8, bt, lens), 2e-2, 2e-2)


def test_sparse_mla_reference_backward_deterministic_on_cuda():
    """deterministic=True: the reference backward's dkv is bitwise identical over 5 runs (heavy duplicates)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(64, 16, 512, generator=g).bfloat16().cuda().requires_grad_()
    kv = torch.randn(40, 512, generator=g).bfloat16().cuda().requires_grad_()
    idx = torch.randint(-2, 40, (64, 96), generator=g, dtype=torch.int32).cuda()
    grads = []
    for _ in range(5):
        q.grad = kv.grad = None
        flashdsa.sparse_mla(q, kv, idx, deterministic=True, backend="reference").float().square().sum().backward()
        grads.append((q.grad.clone(), kv.grad.clone()))
    for dq, dkv in grads[1:]:
        assert torch.equal(dq, grads[0][0]) and torch.equal(dkv, grads[0][1])
