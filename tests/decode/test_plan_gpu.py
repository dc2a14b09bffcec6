"""GPU: ``mla_decode_plan`` on the kernels -- every dense path ``prepare_dense`` picks (the fused single launch,
the split-KV partial + combine, the pair schedule, no attendable cache, an empty batch) and the FP8 cache (its
split step where the op splits, else the op): ``plan.run`` per layer is bitwise ``mla_decode`` on the same inputs
and within the reference's tolerances; CUDA graphs of a whole step (plan + two layers) replayed with new lengths.
Inputs as test_kernel_gpu.py (shuffled tables, NaN in unused slots, bad block ids past each sequence)."""

import math

import pytest
import torch

import flashdsa
from flashdsa.bench.harness import capture_graph
from flashdsa.decode import _fp8_step

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


def _strided_cache(cache, row_bytes):
    """``cache`` [nb, bs, 656] as a view of rows ``row_bytes`` apart (the padding bytes 0xFF)."""
    nb, bs, w = cache.shape
    big = torch.full((nb, bs, row_bytes), 0xFF, dtype=torch.uint8, device=cache.device)
    big[..., :w] = cache
    return big[..., :w]


def _plain(*args, **kw):
    """``mla_decode`` on its plain path: no eager plan stored from an earlier call (``decode.api._PLANS``) runs it,
    so it is not the plan's own code that ``plan.run`` is compared with."""
    from flashdsa.decode import api as decode_api

    decode_api._PLANS._plans.clear()
    return flashdsa.mla_decode(*args, **kw)


# (B, s_q, H, block_size, lens (cycled), sink, the split forward's heads or None where the plan runs the op)
FP8_CASES = [
    (1, 1, 16, 64, (8192,), False, 16),  # the H <= 16 "mma" form writes fp32 partials itself
    (2, 2, 128, 64, (4096, 300), True, 128),
    (1, 1, 32, 32, (5000,), True, 64),  # heads padded to the 64-head pair form
    (0, 1, 16, 64, (300, 20, 0, 1000), False, None),  # B 0 below: one token per SM, too many to split
]


@pytest.mark.parametrize("B,s_q,H,bs,lens,sink,heads_s", FP8_CASES,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-{c[6] or 'op'}" for c in FP8_CASES])
def test_plan_fp8_cache(B, s_q, H, bs, lens, sink, heads_s, monkeypatch):
    """Over the FP8 cache: where the op splits, the plan runs its split step (bitwise the op's plain path);
    lengths written after the plan is made are not seen; a layer whose rows are 672 bytes apart runs the step, one
    with 660-byte rows (no kernel takes them) the op; NaN bytes in every unused row.  ``$FLASHDSA_DECODE_FP8_STEP``
    0: the op."""
    _kernel()
    B = B or torch.cuda.get_device_properties(0).multi_processor_count
    lens = [lens[i % len(lens)] for i in range(B)]
    layers, table, seqlens = _layers(B, s_q, H, bs, lens, seed=17 + H)
    caches = [flashdsa.quantize_kv_fp8(kv) for _, kv in layers]  # unused rows: quantized NaN (NaN bytes)
    attn_sink = _sink(H, sink)
    saved = seqlens.clone()
    monkeypatch.setenv(_fp8_step.STEP_ENV, "0")
    assert flashdsa.mla_decode_plan(table, seqlens, caches[0], num_heads=H, s_q=s_q).path == "op"
    monkeypatch.setenv(_fp8_step.STEP_ENV, "1")
    plan = flashdsa.mla_decode_plan(table, seqlens, caches[0], num_heads=H, s_q=s_q, sm_scale=0.05, has_sink=sink)
    seqlens.copy_(seqlens.flip(0) // 2)  # written after the plan: run attends the lengths held at plan time
    if heads_s is None:
        assert plan.path == "op"
    else:
        assert plan.path == "kernel" and plan._step.path == "split"
        assert plan._step.launch.heads_s == heads_s and plan._step.launch.n_split > 1
    runs = [(layers[0][0], caches[0]), (layers[1][0], _strided_cache(caches[1], 672))]
    if heads_s is not None and B == 1:  # the reference on the op's fallback: keep it to one small case
        runs.append((layers[1][0], _strided_cache(caches[1], 660)))
    for q, kv8 in runs:
        out, lse = plan.run(q, kv8, attn_sink)
        want = _plain(q, kv8, table, saved, sm_scale=0.05, attn_sink=attn_sink)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), "plan.run differs from mla_decode"
        ref = flashdsa.mla_decode(q, flashdsa.dequantize_kv_fp8(kv8.contiguous()), table, saved, sm_scale=0.05,
                                  attn_sink=attn_sink, backend="reference")
        _check(out, lse, ref[0].to(torch.bfloat16), ref[1].float())


def test_plan_fp8_split_cuda_graph_of_a_step(monkeypatch):
    """Plan + two FP8-cache layers on the split step captured once, replayed with new lengths and q written in
    place; each replay equal to eager ``mla_decode`` and within the reference's tolerances."""
    _kernel()
    monkeypatch.setenv(_fp8_step.STEP_ENV, "1")
    B, s_q, H, bs = 2, 1, 64, 64
    lens_a, lens_b = [4096, 300], [1000, 4096]
    layers, table, _ = _layers(B, s_q, H, bs, [4096, 4096], seed=23)
    caches = [flashdsa.quantize_kv_fp8(kv) for _, kv in layers]
    seqlens = torch.tensor(lens_a, dtype=torch.int32, device="cuda")

    def step():
        plan = flashdsa.mla_decode_plan(table, seqlens, caches[0], num_heads=H, s_q=s_q, sm_scale=0.05)
        assert plan.path == "kernel"
        return [plan.run(q, kv8) for (q, _), kv8 in zip(layers, caches)]

    graph, outs = capture_graph(step)
    g = torch.Generator(device="cuda").manual_seed(24)
    for lens in (lens_b, lens_a):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        for q, _ in layers:
            q.copy_((torch.randn(q.shape, generator=g, device="cuda") * 0.1).to(q.dtype))
        for out, _ in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for ((q, _), kv8), (out, lse) in zip(zip(layers, caches), outs):
            want = _plain(q, kv8, table, seqlens, sm_scale=0.05)
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), f"replay with {lens} differs"
            ref = flashdsa.mla_decode(q, flashdsa.dequantize_kv_fp8(kv8), table, seqlens, sm_scale=0.05,
                                      backend="reference")
            _check(out, lse, ref[0].to(torch.bfloat16), ref[1].float())


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
