"""GPU tests of the single-launch narrow decode (``variant="narrow_fused"``, ``decode/kernel_dense_fused.py``).

Same inputs and tolerances as ``test_kernel_gpu.py`` (NaN in unused cache slots, shuffled tables, out-of-range
table entries past each sequence).  Checked here beyond the reference match: every call twice in a row (the merge
counters must be back at zero: the second call equals the first bit for bit), batches mixing empty, one-split and
several-split sequences, CUDA-graph replays with changing lengths, the per-CTA work items against ``_plan``, and
equality with the three-launch "narrow" variant (same partial kernel, same merge arithmetic).
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
    """Captured once (after an eager warm-up that also allocates the counters), replayed with new lengths: every
    replay must start from zeroed counters."""
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
