"""GPU tests of the dense bf16 paged MLA decode kernel (``flashdsa.decode.kernel_dense``) against the reference.

Inputs: shuffled block tables, unused cache slots (and unused blocks) filled with NaN, block-table entries past
each sequence's pages set to out-of-range ids, mixed cache lengths within a batch.
Tolerances: out elementwise within abs 1e-3 or rel 2/128, cosine distance <= 5e-6, lse rel 8/65536 (finite rows;
empty rows must give lse = +inf and out = 0 on both sides).
The tests call ``run_mla_decode_dense`` without ``variant=``, so ``$FLASHDSA_DECODE_VARIANT`` picks the kernel
(default "auto": the single-launch fused narrow kernel for s_q * H <= 32, else "ws"; e.g.
``FLASHDSA_DECODE_VARIANT=narrow`` or ``pipelined`` for the others).
"""

import math

import pytest
import torch

from flashdsa.bench.harness import capture_graph

from .checks import check_close as _check, make_paged  # noqa: F401 - the other decode GPU files import _check

pytestmark = pytest.mark.gpu

LENS = (0, 20, 140, 4096, 32768)


def _kernel():
    pytest.importorskip("tilelang")
    from flashdsa.decode import kernel_dense

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the dense decode kernel targets Hopper (sm_90a)")
    return kernel_dense


def _make(*args, device="cuda", **kw):
    """``checks.make_paged`` on the GPU."""
    return make_paged(*args, device=device, **kw)


def _reference(q, kv, table, seqlens, *, sm_scale, causal, sink):
    from flashdsa.decode.reference import mla_decode_reference

    return mla_decode_reference(q, kv, table, seqlens, sm_scale=sm_scale, d_v=512, causal=causal, attn_sink=sink)


# (B, s_q, H, block_size, lens (cycled over the batch), causal, sink)
CASES = [
    (1, 1, 16, 64, (4096,), True, False),
    (1, 1, 1, 16, (20,), True, False),
    (2, 2, 3, 16, (140, 0), True, False),
    (6, 1, 9, 256, (0, 20, 140, 4096, 32768, 140), True, False),
    (2, 4, 63, 32, (32768, 20), True, True),
    (64, 1, 16, 64, (4096, 140, 20, 0), True, False),
    (74, 1, 64, 128, (140, 4096, 20), True, False),
    (6, 2, 126, 256, (20, 4096, 0, 140, 32768, 1), True, True),
    (2, 1, 128, 64, (32768, 4096), False, False),
    (6, 4, 128, 16, (1, 2, 3, 140, 4096, 20), True, False),
    (74, 2, 16, 16, (4096, 20, 0, 140), False, True),
    (1, 4, 3, 256, (3,), True, False),  # fewer cached tokens than s_q: early queries see nothing
]


@pytest.mark.parametrize("B,s_q,H,block_size,lens,causal,sink", CASES,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-bs{c[3]}-{'causal' if c[5] else 'full'}"
                              f"{'-sink' if c[6] else ''}" for c in CASES])
def test_dense_decode_matches_reference(B, s_q, H, block_size, lens, causal, sink):
    K = _kernel()
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, block_size, lens, seed=B * 131 + H)
    attn_sink = None
    if sink:
        attn_sink = torch.randn(H, device="cuda", dtype=torch.float32)
        attn_sink[0] = math.inf
        if H > 1:
            attn_sink[1] = -math.inf
    assert K.kernel_unsupported(q, kv, table, seqlens, d_v=512, causal=causal, attn_sink=attn_sink) is None
    scale = 576 ** -0.5
    out, lse = K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=scale, d_v=512, causal=causal,
                                      attn_sink=attn_sink)
    torch.cuda.synchronize()
    ref_out, ref_lse = _reference(q, kv, table, seqlens, sm_scale=scale, causal=causal, sink=attn_sink)
    _check(out, lse, ref_out, ref_lse)


def test_dense_decode_strided_q_and_4d_cache():
    K = _kernel()
    q, kv, table, seqlens = _make(2, 2, 16, 64, [300, 77], seed=7)
    big = torch.zeros(2, 2, 20, 640, dtype=torch.bfloat16, device="cuda")
    big[:, :, 2:18, :576] = q
    qs = big[:, :, 2:18, :576]
    out, lse = K.run_mla_decode_dense(qs, kv.unsqueeze(2), table, seqlens, sm_scale=0.1, d_v=512, causal=True)
    ref_out, ref_lse = _reference(q, kv, table, seqlens, sm_scale=0.1, causal=True, sink=None)
    _check(out, lse, ref_out, ref_lse)


def test_dense_decode_deterministic():
    K = _kernel()
    q, kv, table, seqlens = _make(6, 1, 16, 64, [4096, 20, 140, 0, 32768, 5], seed=3)
    a = K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=0.05, d_v=512, causal=True)
    b = K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=0.05, d_v=512, causal=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_dense_decode_unsupported_reasons():
    K = _kernel()
    q, kv, table, seqlens = _make(1, 1, 4, 64, [10], seed=1)
    assert K.kernel_unsupported(q, kv, table, seqlens, d_v=512, causal=True) is None
    assert K.kernel_unsupported(q, kv, table, seqlens, d_v=256, causal=True) is not None
    assert K.kernel_unsupported(q, kv, table, seqlens, d_v=512, causal=True,
                                indices=torch.zeros(1, 1, 4, dtype=torch.int32, device="cuda")) is not None
    assert K.kernel_unsupported(q.float(), kv, table, seqlens, d_v=512, causal=True) is not None
    kv8 = torch.zeros(4, 8, 576, dtype=torch.bfloat16, device="cuda")
    assert K.kernel_unsupported(q, kv8, table, seqlens, d_v=512, causal=True) is not None  # block_size 8
    q129 = torch.zeros(1, 1, 129, 576, dtype=torch.bfloat16, device="cuda")
    assert K.kernel_unsupported(q129, kv, table, seqlens, d_v=512, causal=True) is not None


def test_dense_decode_cuda_graph_replay():
    """The whole step (default variant at s_q 2 x H 16: the fused single launch, its counters zeroed inside the
    graph) is captured once and replayed with new lengths."""
    K = _kernel()
    B, s_q, H, bs = 6, 2, 16, 64
    lens_a = [4096, 20, 140, 0, 32768, 1]
    lens_b = [32768, 0, 4096, 140, 20, 2000]
    # one cache/table that serves both length sets: build for the element-wise max
    q, kv, table, _ = _make(B, s_q, H, bs, [max(x, y) for x, y in zip(lens_a, lens_b)], seed=11)
    seqlens = torch.tensor(lens_a, dtype=torch.int32, device="cuda")
    scale = 576 ** -0.5
    graph, (out, lse) = capture_graph(lambda: K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=scale,
                                                                     d_v=512, causal=True))
    for lens in (lens_a, lens_b, lens_a):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        # the unused tail of a shorter sequence is stale data, not NaN: the kernel must not read it either way
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(q, kv, table, seqlens, sm_scale=scale, causal=True, sink=None)
        _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("B,n_mt,max_blocks,bs", [(1, 1, 4, 64), (6, 2, 600, 64), (64, 1, 128, 64), (300, 1, 2048, 16),
                                                  (1000, 2, 40, 128)])
def test_device_plan_equals_torch_plan(B, n_mt, max_blocks, bs):
    """The one-launch split plan (``_plan_kernel``) is bit-identical to the torch-ops plan it replaced, over
    random lengths incl. 0, lengths past the table, negative lengths and B > the kernel's 256 threads."""
    K = _kernel()
    g = torch.Generator(device="cpu").manual_seed(B * 7 + n_mt)
    cap = max_blocks * bs
    lens = torch.randint(-5, cap + 100, (B,), generator=g, dtype=torch.int32)
    lens[0] = 0
    configs = [(64, 3, 2), (32, 5, 2)]
    for sms in (132, 7):
        for tile, ovh, mc in configs:
            kw = dict(max_blocks=max_blocks, block_size=bs, n_mt=n_mt, num_sms=sms, tile=tile, overhead=ovh,
                      min_chunk=mc)
            want = K._plan(lens.cuda(), **kw)
            got = K._plan_device(lens.cuda(), **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (sms, tile)
