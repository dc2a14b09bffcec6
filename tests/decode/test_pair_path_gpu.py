"""GPU: dense bf16 decode through the "pair" path (one sparse MLA forward on the pair schedule, H 64 / 128)
against the reference, with test_kernel_gpu.py's inputs (shuffled tables, NaN in every unused slot, bad block ids
past each sequence, mixed and zero lengths) and tolerances; "auto" picking it where its CTAs fill the SM waves;
a CUDA-graph replay with new lengths; the one-launch lengths / order kernel (``kernel_order``) against the
PyTorch ops it replaces.  Compiles: one per (H, ceil(L / 64), sink) below (6) + the order kernel."""

import math

import pytest
import torch

from flashdsa.bench.harness import capture_graph

from .test_kernel_gpu import _check, _kernel, _make, _reference

pytestmark = pytest.mark.gpu

# (B, s_q, H, block_size, lens (cycled over the batch), causal, sink)
CASES = [
    (2, 1, 128, 64, (32768, 4096), False, False),
    (6, 4, 128, 16, (1, 2, 3, 140, 4096, 20), True, False),
    (74, 1, 64, 128, (140, 4096, 20), True, False),
    (6, 2, 64, 256, (20, 4096, 0, 140, 32768, 1), True, True),
    (3, 2, 128, 32, (0, 0, 5), True, True),  # mostly empty rows
]


def _sink(H, on):
    if not on:
        return None
    s = torch.randn(H, device="cuda", dtype=torch.float32)
    s[0], s[1] = math.inf, -math.inf
    return s


@pytest.mark.parametrize("B,s_q,H,block_size,lens,causal,sink", CASES,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-bs{c[3]}-{'causal' if c[5] else 'full'}"
                              f"{'-sink' if c[6] else ''}" for c in CASES])
def test_pair_path_matches_reference(B, s_q, H, block_size, lens, causal, sink):
    K = _kernel()
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, block_size, lens, seed=B * 17 + H)
    attn_sink = _sink(H, sink)
    scale = 576 ** -0.5
    out, lse = K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=scale, d_v=512, causal=causal,
                                      attn_sink=attn_sink, variant="pair")
    torch.cuda.synchronize()
    _check(out, lse, *_reference(q, kv, table, seqlens, sm_scale=scale, causal=causal, sink=attn_sink))
    again = K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=scale, d_v=512, causal=causal,
                                   attn_sink=attn_sink, variant="pair")
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


def test_auto_takes_pair_path_when_waves_fill(monkeypatch):
    """B 132 x H 64: one full wave of the forward's CTAs, so "auto" runs the pair path (counted), same result."""
    from flashdsa.decode import _pair_path

    K = _kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B = sms
    q, kv, table, seqlens = _make(B, 1, 64, 64, [(300, 20, 0, 1000)[i % 4] for i in range(B)], seed=5)
    assert _pair_path.pair_efficiency(B, 1, 64, sms) >= _pair_path.PAIR_MIN_EFFICIENCY
    calls = []
    real = _pair_path.run
    monkeypatch.setattr(_pair_path, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    out, lse = K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=0.05, d_v=512, causal=True, variant="auto")
    assert calls == [1]
    _check(out, lse, *_reference(q, kv, table, seqlens, sm_scale=0.05, causal=True, sink=None))


def test_pair_path_cuda_graph_replay():
    K = _kernel()
    B, s_q, H, bs = 6, 2, 128, 64
    lens_a = [4096, 20, 140, 0, 3000, 1]
    lens_b = [3000, 0, 4096, 140, 20, 2000]
    q, kv, table, _ = _make(B, s_q, H, bs, [max(x, y) for x, y in zip(lens_a, lens_b)], seed=13)
    seqlens = torch.tensor(lens_a, dtype=torch.int32, device="cuda")
    run = lambda: K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=0.05, d_v=512, causal=True,  # noqa: E731
                                         variant="pair")
    graph, (out, lse) = capture_graph(run)
    for lens in (lens_a, lens_b, lens_a):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, *_reference(q, kv, table, seqlens, sm_scale=0.05, causal=True, sink=None))


@pytest.mark.parametrize("B", [1, 7, 128, 129, 300, 4096])
@pytest.mark.parametrize("s_q,causal", [(1, True), (2, True), (4, True), (3, False)])
def test_token_order_kernel_equals_torch_ops(B, s_q, causal):
    """``kernel_order`` (one launch) against ``query_lengths`` / ``token_order`` (the PyTorch ops it replaces), bit
    for bit: lengths of every int32 value (negative, past L, INT_MIN / INT_MAX), many ties (a stable sort), outputs
    poisoned (conftest)."""
    from flashdsa.decode import _pair_path, kernel_order

    g = torch.Generator().manual_seed(B * 7 + s_q)
    L = 64 * 37
    pool = torch.tensor([0, 1, 2, 63, 64, L - 1, L, L + 1, L + 5, -1, -5, 2**31 - 1, -(2**31), 1000, 1000],
                        dtype=torch.int32)
    lens = torch.where(torch.rand(B, generator=g) < 0.5, pool[torch.randint(0, len(pool), (B,), generator=g)],
                       torch.randint(-10, L + 10, (B,), generator=g, dtype=torch.int32)).cuda()
    lengths, order = kernel_order.lengths_and_order(lens, L, s_q, causal)
    ref_len = _pair_path.query_lengths(lens, L, s_q, causal)
    ref_order = _pair_path.token_order(ref_len, s_q)
    assert lengths.dtype == order.dtype == torch.int32
    assert torch.equal(lengths, ref_len) and torch.equal(order, ref_order)
    assert torch.equal(order.sort().values, torch.arange(B * s_q, dtype=torch.int32, device="cuda"))


def test_prepare_uses_token_order_kernel(monkeypatch):
    """Paged block sizes on CUDA: ``prepare`` takes the one-launch kernel (unless switched off), same tensors."""
    from flashdsa.decode import _pair_path, kernel_order

    table = torch.randint(0, 50, (5, 4), dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([70, 256, 0, 129, 256], dtype=torch.int32, device="cuda")
    calls = []
    real = kernel_order.lengths_and_order
    monkeypatch.setattr(kernel_order, "lengths_and_order", lambda *a: calls.append(1) or real(*a))
    slots, lengths, order = _pair_path.prepare(table, seqlens, 50, 64, 2, True)
    assert calls == [1] and slots is None
    monkeypatch.setenv(kernel_order.ORDER_ENV, "0")
    _, lengths2, order2 = _pair_path.prepare(table, seqlens, 50, 64, 2, True)
    assert calls == [1] and torch.equal(lengths, lengths2) and torch.equal(order, order2)
