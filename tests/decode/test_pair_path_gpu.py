"""GPU: dense bf16 decode through the "pair" path (one sparse MLA forward on the pair schedule, H 64 / 128)
against the reference, with test_kernel_gpu.py's inputs (shuffled tables, NaN in every unused slot, bad block ids
past each sequence, mixed and zero lengths) and tolerances; "auto" picking it where its CTAs fill the SM waves;
a CUDA-graph replay with new lengths.  Compiles: one per (H, ceil(L / 64), sink) below (6)."""

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
