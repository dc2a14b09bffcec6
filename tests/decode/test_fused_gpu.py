"""GPU tests of the single-launch narrow decode (``decode/kernel_dense_fused.py``: what the default variant "auto"
runs for s_q * H <= 32, and ``variant="narrow_fused"``).

Same inputs and tolerances as ``test_kernel_gpu.py`` (NaN in unused cache slots, shuffled tables, out-of-range
table entries past each sequence).  Checked here beyond the reference match: every call twice in a row (the merge
counters must be back at zero: the second call equals the first bit for bit), batches mixing empty, one-split and
several-split sequences, CUDA-graph replays with changing lengths (captured on the graph's own side stream and on
an explicit one), calls in flight on two streams at once (per-stream counters), the per-CTA work items against
``_plan``, and equality with the three-launch "narrow" variant (same partial kernel, same merge arithmetic).
"""

import math

import pytest
import torch

from .test_kernel_gpu import CASES, _check, _make, _reference

pytestmark = pytest.mark.gpu

# cycled over a batch of 70 (H 16): chunk 41 tiles, so 32768 -> 13 splits, 8192 -> 4, 4096 -> 2, the rest 1 split
# or empty (tests/decode/test_fused_plan.py::test_cta_item_mixed_splits checks that mix on CPU)
MIXED_LENS = (0, 20, 140, 32768, 4096, 1, 8192, 0, 65, 2000)
NARROW_CASES = [c for c in CASES if c[1] * c[2] <= 32]


def _modules():
    pytest.importorskip("tilelang")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the dense decode kernel targets Hopper (sm_90a)")
    from flashdsa.decode import kernel_dense, kernel_dense_fused

    return kernel_dense, kernel_dense_fused


def _sink(H, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    s = torch.randn(H, generator=g, dtype=torch.float32)
    s[0] = math.inf
    if H > 1:
        s[1] = -math.inf
    return s.cuda()


def _run(K, q, kv, table, seqlens, *, causal, sink, variant="narrow_fused", scale=576 ** -0.5):
    return K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=scale, d_v=512, causal=causal, attn_sink=sink,
                                  variant=variant)


def _count_fused(monkeypatch, F):
    """A list that gets one entry per ``kernel_dense_fused.run_fused`` call (``kernel_dense`` looks it up per call)."""
    calls, real = [], F.run_fused

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(F, "run_fused", spy)
    return calls


def _counters_zero(F, B):
    torch.cuda.synchronize()
    c = F.seq_counters(B, torch.device("cuda", torch.cuda.current_device()))
    assert int(c.abs().sum()) == 0, "merge counters not reset"


def _twice_against_reference(K, F, q, kv, table, seqlens, *, causal, sink):
    ref_out, ref_lse = _reference(q, kv, table, seqlens, sm_scale=576 ** -0.5, causal=causal, sink=sink)
    out1, lse1 = _run(K, q, kv, table, seqlens, causal=causal, sink=sink)
    out1, lse1 = out1.clone(), lse1.clone()
    _counters_zero(F, q.shape[0])
    out2, lse2 = _run(K, q, kv, table, seqlens, causal=causal, sink=sink)
    _counters_zero(F, q.shape[0])
    _check(out1, lse1, ref_out, ref_lse)
    _check(out2, lse2, ref_out, ref_lse)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2), "second call differs from the first"


@pytest.mark.parametrize("B,s_q,H,block_size,lens,causal,sink", NARROW_CASES,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-bs{c[3]}-{'causal' if c[5] else 'full'}"
                              f"{'-sink' if c[6] else ''}" for c in NARROW_CASES])
def test_fused_matches_reference(B, s_q, H, block_size, lens, causal, sink):
    K, F = _modules()
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, block_size, lens, seed=B * 131 + H)
    _twice_against_reference(K, F, q, kv, table, seqlens, causal=causal, sink=_sink(H, B) if sink else None)


@pytest.mark.parametrize("s_q,H,block_size,causal,sink", [(1, 16, 64, True, False), (1, 16, 64, False, True),
                                                          (2, 16, 16, True, True), (3, 9, 256, True, False),
                                                          (1, 1, 32, False, False)])
def test_fused_mixed_lengths(s_q, H, block_size, causal, sink):
    """Empty, one-split and several-split sequences in one batch (s_q 2 x H 16: 32 rows, two merge passes)."""
    K, F = _modules()
    B = 70
    lens = [MIXED_LENS[(i * 7 + s_q) % len(MIXED_LENS)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, block_size, lens, seed=H * 17 + s_q)
    _twice_against_reference(K, F, q, kv, table, seqlens, causal=causal, sink=_sink(H, 5) if sink else None)


@pytest.mark.parametrize("s_q,H,block_size,sink", [(1, 16, 64, False), (2, 9, 16, True), (1, 32, 128, False)])
def test_fused_equals_narrow_bitwise(s_q, H, block_size, sink):
    """Same partial kernel per item and the same per-element merge arithmetic (``combine_row_macro``) as the
    three-launch "narrow" variant, so the results are expected to be identical; a mismatch here alone (with the
    reference tests passing) means the compiler contracted / ordered the merge differently, not a wrong result."""
    K, F = _modules()
    B = 70
    lens = [MIXED_LENS[(i * 3 + H) % len(MIXED_LENS)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, block_size, lens, seed=H + block_size)
    snk = _sink(H, 9) if sink else None
    a = _run(K, q, kv, table, seqlens, causal=True, sink=snk, variant="narrow")
    b = _run(K, q, kv, table, seqlens, causal=True, sink=snk, variant="narrow_fused")
    torch.cuda.synchronize()
    assert torch.equal(a[1], b[1]), "lse differs from the narrow variant"
    assert torch.equal(a[0], b[0]), "out differs from the narrow variant"


def test_fused_cuda_graph_replay():
    """Captured once on ``torch.cuda.graph``'s own side stream (after an eager warm-up on another stream, which
    compiles), replayed with new lengths: the capture's own counters are zeroed by a node of the graph."""
    K, F = _modules()
    B, s_q, H, bs = 6, 2, 16, 64
    lens_a = [4096, 20, 140, 0, 32768, 1]
    lens_b = [32768, 0, 4096, 140, 20, 2000]
    q, kv, table, _ = _make(B, s_q, H, bs, [max(x, y) for x, y in zip(lens_a, lens_b)], seed=11)
    seqlens = torch.tensor(lens_a, dtype=torch.int32, device="cuda")
    scale = 576 ** -0.5
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _run(K, q, kv, table, seqlens, causal=True, sink=None)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _run(K, q, kv, table, seqlens, causal=True, sink=None)
    for lens in (lens_a, lens_b, lens_a, lens_b):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(q, kv, table, seqlens, sm_scale=scale, causal=True, sink=None)
        _check(out, lse, ref_out, ref_lse)
    _counters_zero(F, B)


def test_fused_graph_capture_on_side_stream(monkeypatch):
    """The default variant ("auto": the fused kernel at s_q 2 x H 16) captured on an explicit side stream, not the
    warm-up's, and replayed on the current stream 3 times with new q and cache_seqlens copied into the static
    inputs: each replay matches the reference.  The capture allocates its own zeroed counters and neither takes
    nor creates a stream's persistent ones."""
    K, F = _modules()
    monkeypatch.delenv(K.VARIANT_ENV, raising=False)
    calls = _count_fused(monkeypatch, F)
    B, s_q, H, bs = 6, 2, 16, 64
    steps = ([4096, 20, 140, 0, 32768, 1], [32768, 0, 4096, 140, 20, 2000], [1, 8192, 32768, 4096, 0, 140])
    q, kv, table, _ = _make(B, s_q, H, bs, [max(x) for x in zip(*steps)], seed=23)
    g = torch.Generator(device="cpu").manual_seed(24)
    new_q = [(torch.randn(q.shape, generator=g) * 0.1).to(torch.bfloat16).cuda() for _ in steps]
    seqlens = torch.tensor(steps[0], dtype=torch.int32, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # compiles the kernel
        _run(K, q, kv, table, seqlens, causal=True, sink=None, variant=None)
    torch.cuda.current_stream().wait_stream(warm)
    cached = dict(F._COUNTERS)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out, lse = _run(K, q, kv, table, seqlens, causal=True, sink=None, variant=None)
    assert len(calls) == 2, "the default variant did not run the fused kernel"
    assert F._COUNTERS.keys() == cached.keys() and all(F._COUNTERS[k] is v for k, v in cached.items())
    for lens, qn in zip(steps, new_q):
        q.copy_(qn)
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(q, kv, table, seqlens, sm_scale=576 ** -0.5, causal=True, sink=None)
        _check(out, lse, ref_out, ref_lse)


def test_fused_two_streams_concurrent(monkeypatch):
    """Default-variant calls on two streams of one device, released together (both streams wait behind one sleep
    kernel, so their launches start at once and their CTAs interleave), 4 rounds each: both streams' results match
    their references.  With counters shared by the streams, the two calls would count each other's splits (a merge
    too early, or none) since every sequence is split many times with different split counts in the two inputs."""
    K, F = _modules()
    monkeypatch.delenv(K.VARIANT_ENV, raising=False)
    calls = _count_fused(monkeypatch, F)
    B, s_q, H, bs, rounds = 8, 1, 16, 64, 4
    lens = ([16384, 12000, 20000, 8192, 16384, 3000, 24576, 16384],
            [24576, 8192, 3000, 20000, 12000, 16384, 16384, 9000])
    inputs = [_make(B, s_q, H, bs, ln, seed=40 + k) for k, ln in enumerate(lens)]
    refs = [_reference(*x, sm_scale=576 ** -0.5, causal=True, sink=None) for x in inputs]
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    streams[0].wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(streams[0]):  # compiles the kernel before the concurrent part
        _run(K, *inputs[0], causal=True, sink=None, variant=None)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # tens of ms on the current stream: every launch below queues behind it
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = ([], [])
    for _ in range(rounds):
        for k, s in enumerate(streams):
            with torch.cuda.stream(s):
                results[k].append(_run(K, *inputs[k], causal=True, sink=None, variant=None))
    torch.cuda.synchronize()
    assert len(calls) == 1 + 2 * rounds, "the default variant did not run the fused kernel"
    for k in (0, 1):
        for out, lse in results[k]:
            _check(out, lse, *refs[k])
    dev = torch.device("cuda", torch.cuda.current_device())
    per_stream = []
    for s in streams:
        with torch.cuda.stream(s):
            _counters_zero(F, B)
            per_stream.append(F.seq_counters(B, dev).data_ptr())
    assert per_stream[0] != per_stream[1], "the two streams share merge counters"


def test_fused_selected_by_env(monkeypatch):
    K, F = _modules()
    monkeypatch.setenv(K.VARIANT_ENV, "narrow_fused")
    q, kv, table, seqlens = _make(3, 1, 16, 64, [5000, 0, 70], seed=4)
    before = F._compiled.cache_info()
    out, lse = K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=0.05, d_v=512, causal=True)
    after = F._compiled.cache_info()
    assert after.hits + after.misses == before.hits + before.misses + 1, "the fused kernel did not run"
    ref_out, ref_lse = _reference(q, kv, table, seqlens, sm_scale=0.05, causal=True, sink=None)
    _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("B,max_blocks", [(1, 4), (6, 600), (64, 128), (129, 64), (300, 2048), (1000, 40)])
def test_item_probe_equals_plan(B, max_blocks):
    """The kernel's per-CTA derivation (``derive_item``, via the probe kernel) is ``_plan`` column for column."""
    K, F = _modules()
    from flashdsa._tilelang import direct_launcher
    from flashdsa.decode import kernel_dense_narrow as kn

    g = torch.Generator(device="cpu").manual_seed(B)
    cap = max_blocks * 64
    lens = torch.randint(-5, cap + 100, (B,), generator=g, dtype=torch.int32)
    lens[0] = 0
    lens = lens.cuda()
    for num_sms in (132, 264, 7):
        plan, seq_plan = K._plan(lens, max_blocks=max_blocks, block_size=64, n_mt=1, num_sms=num_sms, tile=kn.BLOCK_N,
                                 overhead=kn._OVERHEAD_TILES, min_chunk=kn._MIN_CHUNK_TILES)
        items = torch.full((5, plan.shape[1]), 7, dtype=torch.int32, device="cuda")
        direct_launcher(F.compiled_item_probe(num_sms))(lens, items, cap)
        torch.cuda.synchronize()
        assert torch.equal(items[:4], plan), num_sms
        live = plan[0] >= 0
        assert torch.equal(items[4][live], seq_plan[0][plan[0][live].long()]), num_sms
