"""GPU: ``mla_decode_plan`` on the kernels -- every dense path ``prepare_dense`` picks (the fused single launch,
the split-KV partial + combine, the pair schedule, no attendable cache, an empty batch) and the FP8 cache (through
``mla_decode``'s op): ``plan.run`` per layer is bitwise ``mla_decode`` on the same inputs and within the
reference's tolerances; a CUDA graph of a whole step (plan + two layers) replayed with new lengths.  Inputs as
test_kernel_gpu.py (shuffled tables, NaN in unused slots, bad block ids past each sequence)."""

import math

import pytest
import torch

import flashdsa
from flashdsa.bench.harness import capture_graph
from flashdsa.quant import quantize_kv_fp8

from .test_kernel_gpu import _check, _kernel, _make, _reference

pytestmark = pytest.mark.gpu


def _layers(B, s_q, H, bs, lens, seed):
    """Two layers' (q, kv_cache) over one block table / lengths (layer 1: another cache and q, same NaN slots)."""
    q, kv, table, seqlens = _make(B, s_q, H, bs, lens, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    kv2 = torch.where(torch.isnan(kv), kv, (torch.randn(kv.shape, generator=g, device="cuda") * 0.1).to(kv.dtype))
    q2 = (torch.randn(q.shape, generator=g, device="cuda") * 0.1).to(q.dtype)
    return [(q, kv), (q2, kv2)], table, seqlens


def _sink(H, on):
    if not on:
        return None
    s = torch.randn(H, device="cuda", dtype=torch.float32)
    s[0] = math.inf
    return s


# (B, s_q, H, block_size, lens (cycled), causal, sink, the DenseStep path "auto" takes)
CASES = [
    (6, 1, 16, 64, (4096, 20, 140, 0, 32768, 1), True, False, "fused"),
    (2, 2, 9, 16, (140, 3), True, True, "fused"),
    (2, 1, 64, 64, (4096, 20), True, True, "split"),
    (3, 2, 128, 256, (20, 4096, 0), True, False, "split"),
    (0, 1, 16, 64, (), True, False, "empty"),
]


@pytest.mark.parametrize("B,s_q,H,bs,lens,causal,sink,path", CASES,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-bs{c[3]}-{c[7]}" for c in CASES])
def test_plan_run_matches_mla_decode(B, s_q, H, bs, lens, causal, sink, path):
    _kernel()
    lens = [lens[i % len(lens)] for i in range(B)] if B else [0]
    layers, table, seqlens = _layers(max(B, 1), s_q, H, bs, lens, seed=B * 31 + H)
    if B == 0:
        layers = [(q[:0], kv) for q, kv in layers]
        table, seqlens = table[:0], seqlens[:0]
    attn_sink = _sink(H, sink)
    plan = flashdsa.mla_decode_plan(table, seqlens, layers[0][1], num_heads=H, s_q=s_q, sm_scale=0.05, causal=causal,
                                    has_sink=sink)
    assert plan.path == "kernel" and plan._step.path == path
    for q, kv in layers:
        out, lse = plan.run(q, kv, attn_sink)
        want = flashdsa.mla_decode(q, kv, table, seqlens, sm_scale=0.05, causal=causal, attn_sink=attn_sink)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), "plan.run differs from mla_decode"
        if B:
            _check(out, lse, *_reference(q, kv, table, seqlens, sm_scale=0.05, causal=causal, sink=attn_sink))
    if sink:  # the kernels take a float32 sink (mla_decode would send a float64 one to the reference)
        with pytest.raises(TypeError, match="attn_sink"):
            plan.run(*layers[0], attn_sink.double())


def test_plan_pair_path_and_no_cache():
    _kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layers, table, seqlens = _layers(sms, 1, 64, 64, [(300, 20, 0, 1000)[i % 4] for i in range(sms)], seed=5)
    plan = flashdsa.mla_decode_plan(table, seqlens, layers[0][1], num_heads=64, sm_scale=0.05)
    assert plan._step.path == "pair"
    for q, kv in layers:
        out, lse = plan.run(q, kv)
        want = flashdsa.mla_decode(q, kv, table, seqlens, sm_scale=0.05)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    q, kv = layers[0]
    empty_table = table[:, :0]
    plan = flashdsa.mla_decode_plan(empty_table, seqlens, kv, num_heads=64)
    assert plan._step.path == "no_cache"
    out, lse = plan.run(q, kv)
    assert (out == 0).all() and torch.isinf(lse).all() and (lse > 0).all()


def test_plan_fp8_cache_runs_the_op():
    _kernel()
    layers, table, seqlens = _layers(3, 1, 16, 64, [300, 0, 77], seed=9)
    caches = [quantize_kv_fp8(torch.nan_to_num(kv).view(-1, 576)).view(kv.shape[0], kv.shape[1], 656)
              for _, kv in layers]
    plan = flashdsa.mla_decode_plan(table, seqlens, caches[0], num_heads=16, sm_scale=0.05)
    assert plan.path == "op"
    for (q, _), kv8 in zip(layers, caches):
        out, lse = plan.run(q, kv8)
        want = flashdsa.mla_decode(q, kv8, table, seqlens, sm_scale=0.05)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.parametrize("H", [16, 128])
def test_plan_cuda_graph_of_a_step(H):
    """Plan + two layers captured once; replayed after the caller writes new lengths into its cache_seqlens (the
    plan's copy is a node of the graph), each replay equal to eager ``mla_decode`` on those lengths."""
    _kernel()
    B, s_q, bs = 6, 2, 64
    lens_a = [4096, 20, 140, 0, 3000, 1]
    lens_b = [3000, 0, 4096, 140, 20, 2000]
    layers, table, _ = _layers(B, s_q, H, bs, [max(x, y) for x, y in zip(lens_a, lens_b)], seed=13 + H)
    seqlens = torch.tensor(lens_a, dtype=torch.int32, device="cuda")

    def step():
        plan = flashdsa.mla_decode_plan(table, seqlens, layers[0][1], num_heads=H, s_q=s_q, sm_scale=0.05)
        return [plan.run(q, kv) for q, kv in layers]

    graph, outs = capture_graph(step)
    for lens in (lens_b, lens_a):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for (q, kv), (out, lse) in zip(layers, outs):
            want = flashdsa.mla_decode(q, kv, table, seqlens, sm_scale=0.05)
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), f"replay with {lens} differs"
