"""GPU: sparse MLA decode (bf16 and FP8 656-byte caches) and dense decode over the FP8 cache, through
``flashdsa.mla_decode`` with ``backend="kernel"`` (they run as one sparse MLA forward over the flat cache), against
the reference on the same (for FP8: dequantized) cache.

Inputs as tests/decode/test_kernel_gpu.py: shuffled block tables, NaN in every unused slot (FP8: the quantized NaN
rows, so a stray read shows), topk larger than the cached tokens (trailing -1), out-of-range slots, all-invalid
requests (topk_length 0), attention sinks including +-inf. Tolerances: those of the dense decode tests.
"""

import math
import os
from unittest import mock

import pytest
import torch

import flashdsa
from flashdsa import _dispatch

from .test_kernel_gpu import _check, _make

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")


def _sparse_indices(table, seqlens, block_size, s_q, topk, seed, n_slots):
    """[B, s_q, topk] slots of random cached positions (no repeats), -1 / out-of-range sprinkled, -1 tail."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = table.shape[0]
    idx = torch.full((B, s_q, topk), -1, dtype=torch.int32)
    tab, lens = table.cpu(), seqlens.cpu()
    for b in range(B):
        n = int(lens[b])
        for i in range(s_q):
            pos = torch.randperm(n, generator=g)[:topk] if n else torch.zeros(0, dtype=torch.long)
            slots = tab[b, pos // block_size].long() * block_size + pos % block_size
            idx[b, i, :len(slots)] = slots.to(torch.int32)
            if len(slots) > 4:  # a few invalid entries inside the list
                idx[b, i, 1] = -1
                idx[b, i, 3] = n_slots + 1000
    return idx.to(table.device)


# (B, s_q, H, block_size, lens, topk, fp8, sink)
SPARSE = [
    (1, 1, 16, 64, (4096,), 2048, True, False),
    (2, 2, 3, 16, (140, 0), 256, True, True),
    (6, 1, 9, 256, (0, 20, 140, 4096, 32768, 140), 512, True, False),
    (64, 1, 64, 64, (4096, 140, 20, 0), 2048, True, False),
    (74, 2, 128, 64, (140, 4096, 20), 2048, True, True),
    (6, 4, 126, 16, (1, 2, 3, 140, 4096, 20), 100, False, False),
    (2, 1, 128, 64, (32768, 4096), 2048, False, True),
]


@pytest.mark.parametrize("B,s_q,H,bs,lens,topk,fp8,sink", SPARSE,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-bs{c[3]}-k{c[5]}-{'fp8' if c[6] else 'bf16'}"
                              + ("-sink" if c[7] else "") for c in SPARSE])
def test_sparse_decode_matches_reference(B, s_q, H, bs, lens, topk, fp8, sink):
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, bs, lens, seed=B * 7 + H)
    idx = _sparse_indices(table, seqlens, bs, s_q, topk, seed=B + H, n_slots=kv.shape[0] * bs)
    tl = torch.randint(0, topk + 1, (B,), device="cuda", dtype=torch.int32)
    tl[0] = topk
    if B > 1:
        tl[1] = 0  # all-invalid request
    attn_sink = None
    if sink:
        attn_sink = torch.randn(H, device="cuda")
        attn_sink[0] = math.inf
        attn_sink[-1] = -math.inf
    cache = flashdsa.quantize_kv_fp8(kv) if fp8 else kv
    ref_cache = flashdsa.dequantize_kv_fp8(cache) if fp8 else kv
    out, lse = flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl, attn_sink=attn_sink,
                                   backend="kernel")
    assert _dispatch.last_choice("mla_decode") == "kernel"
    ref_out, ref_lse = flashdsa.mla_decode(q, ref_cache, None, None, indices=idx, topk_length=tl,
                                           attn_sink=attn_sink, backend="reference")
    _check(out, lse, ref_out.to(torch.bfloat16), ref_lse.float())


@pytest.mark.parametrize("B,s_q,H,bs,lens", [(2, 2, 16, 64, (140, 0)), (6, 1, 64, 16, (0, 20, 140, 4096, 1, 33))])
def test_dense_decode_fp8_cache(B, s_q, H, bs, lens):
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, bs, lens, seed=3)
    cache = flashdsa.quantize_kv_fp8(kv)
    out, lse = flashdsa.mla_decode(q, cache, table, seqlens, backend="kernel")
    ref_out, ref_lse = flashdsa.mla_decode(q, flashdsa.dequantize_kv_fp8(cache), table, seqlens, backend="reference")
    _check(out, lse, ref_out.to(torch.bfloat16), ref_lse.float())


@pytest.mark.parametrize("H,fp8", [(64, True), (16, True), (32, False), (128, False)])
def test_sparse_decode_cuda_graph_replay(H, fp8):
    """Capture one sparse decode step, replay it with new indices and lengths written in place (B 8: split-KV;
    FP8 H 64: the pair kernel, H 16: the few-head kernel; bf16 cache H 32: padded to the 64-head pair kernel)."""
    B, s_q, bs, topk = 8, 1, 64, 512
    lens = [4096, 140, 20, 0, 4096, 1000, 77, 512]
    q, kv, table, seqlens = _make(B, s_q, H, bs, lens, seed=11)
    cache = flashdsa.quantize_kv_fp8(kv) if fp8 else kv
    idx = _sparse_indices(table, seqlens, bs, s_q, topk, seed=1, n_slots=kv.shape[0] * bs)
    tl = torch.full((B,), topk, device="cuda", dtype=torch.int32)
    flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl, backend="kernel")  # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl, backend="kernel")
    for seed in (2, 3):
        idx.copy_(_sparse_indices(table, seqlens, bs, s_q, topk, seed=seed, n_slots=kv.shape[0] * bs))
        tl.copy_(torch.randint(0, topk + 1, (B,), device="cuda", dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = flashdsa.mla_decode(q, flashdsa.dequantize_kv_fp8(cache) if fp8 else kv, None, None,
                                               indices=idx, topk_length=tl, backend="reference")
        _check(out, lse, ref_out.to(torch.bfloat16), ref_lse.float())


@pytest.mark.parametrize("H", [16, 64])
def test_dense_decode_fp8_cuda_graph_replay(H):
    """Capture one dense decode step over the FP8 cache (the slots are derived from the block table and lengths
    on the GPU), replay it with new q and shorter lengths written in place."""
    B, s_q, bs = 8, 2, 64
    lens = [4096, 140, 20, 0, 4096, 1000, 77, 512]
    q, kv, table, seqlens = _make(B, s_q, H, bs, lens, seed=13)
    cache = flashdsa.quantize_kv_fp8(kv)
    flashdsa.mla_decode(q, cache, table, seqlens, backend="kernel")  # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashdsa.mla_decode(q, cache, table, seqlens, backend="kernel")
    g = torch.Generator(device="cuda").manual_seed(14)
    for _ in range(2):
        q.copy_((torch.randn(q.shape, generator=g, device="cuda") * 0.1).to(q.dtype))
        new = (torch.rand(B, generator=g, device="cuda") * (seqlens.float() + 1)).to(torch.int32)
        new[0] = seqlens[0]
        seqlens.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = flashdsa.mla_decode(q, flashdsa.dequantize_kv_fp8(cache), table, seqlens,
                                               backend="reference")
        _check(out, lse, ref_out.to(torch.bfloat16), ref_lse.float())


# (B, s_q, H, block_size, lens, topk, fp8): few query tokens, so split-KV runs (decode.kernel_split)
SPLIT = [
    (1, 1, 128, 64, (32768,), 2048, True),
    (1, 1, 16, 64, (4096,), 2048, True),
    (3, 2, 64, 16, (4096, 0, 300), 1024, True),
    (2, 1, 128, 256, (20000, 140), 4096, True),
    (5, 1, 9, 64, (4096, 33, 1000, 0, 2048), 2048, True),
    (2, 1, 32, 64, (4096, 500), 2048, True),  # the 64-head pair form with zero-padded heads
    (1, 2, 100, 16, (8000,), 2048, True),  # the 128-head pair form, padded
    (1, 1, 128, 64, (32768,), 2048, False),  # bf16 cache: the pair kernel's fp32 build
    (3, 2, 64, 16, (4096, 0, 300), 1024, False),
    (5, 1, 9, 64, (4096, 33, 1000, 0, 2048), 2048, False),  # bf16, padded to 64 heads
    (2, 1, 77, 256, (20000, 140), 4096, False),  # bf16, padded to 128 heads
]


@pytest.mark.parametrize("B,s_q,H,bs,lens,topk,fp8", SPLIT,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-k{c[5]}-{'fp8' if c[6] else 'bf16'}" for c in SPLIT])
def test_split_sparse_decode_matches_reference(B, s_q, H, bs, lens, topk, fp8):
    """Split-KV sparse decode (fp32 partials, heads padded where the H has no such build; a sink incl. +-inf,
    topk_length incl. 0 and short) against the reference, and the same call with ``$FLASHDSA_DECODE_SPLIT=0`` (one
    forward row per token) too."""
    from flashdsa.decode import kernel_split

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert kernel_split.split_plan(B * s_q, H, topk, sms, kernel_split.split_fill(H, fp8))[0] > 1  # the dispatch's
    q, kv, table, seqlens = _make(B, s_q, H, bs, list(lens), seed=B * 5 + H)
    idx = _sparse_indices(table, seqlens, bs, s_q, topk, seed=B + 2 * H, n_slots=kv.shape[0] * bs)
    tl = torch.tensor([topk, 0, 77, 130, 1][:B], device="cuda", dtype=torch.int32)
    attn_sink = torch.randn(H, device="cuda")
    attn_sink[0] = math.inf
    attn_sink[-1] = -math.inf
    cache = flashdsa.quantize_kv_fp8(kv) if fp8 else kv
    ref_cache = flashdsa.dequantize_kv_fp8(cache) if fp8 else kv
    ref_out, ref_lse = flashdsa.mla_decode(q, ref_cache, None, None, indices=idx, topk_length=tl,
                                           attn_sink=attn_sink, backend="reference")
    for env in ("", "0"):
        with mock.patch.dict(os.environ, {kernel_split.SPLIT_ENV: env}):
            out, lse = flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl, attn_sink=attn_sink,
                                           backend="kernel")
        assert _dispatch.last_choice("mla_decode") == "kernel"
        _check(out, lse, ref_out.to(torch.bfloat16), ref_lse.float())


@pytest.mark.parametrize("B,s_q,H,lens", [(1, 1, 128, (32768,)), (2, 2, 64, (20000, 0)), (3, 1, 16, (9000, 1, 64)),
                                          (2, 1, 24, (9000, 300))])
def test_split_dense_decode_fp8_cache(B, s_q, H, lens):
    """Dense decode over the FP8 cache with few query tokens: the whole cache in chunks (split-KV)."""
    q, kv, table, seqlens = _make(B, s_q, H, 64, list(lens), seed=B + H)
    cache = flashdsa.quantize_kv_fp8(kv)
    out, lse = flashdsa.mla_decode(q, cache, table, seqlens, backend="kernel")
    ref_out, ref_lse = flashdsa.mla_decode(q, flashdsa.dequantize_kv_fp8(cache), table, seqlens, backend="reference")
    _check(out, lse, ref_out.to(torch.bfloat16), ref_lse.float())


@pytest.mark.parametrize("split", ["", "0"])
@pytest.mark.parametrize("B,H,s_q,sink", [(6, 16, 1, False), (6, 16, 2, True), (6, 64, 1, True), (6, 3, 2, False),
                                          (1, 128, 1, True), (6, 32, 1, True)])
def test_sparse_decode_fp8_eager_plan(B, H, s_q, sink, split):
    """The eager plan of a sparse FP8 decode signature (``decode.api._PLANS``): stored by the first call, replayed
    by the next ones (new index values and lengths, outputs bitwise equal to the plain path's), and checked
    against the reference; an environment switch of the kernel choice is part of the signature.  B 6 runs
    split-KV (``decode.kernel_split``) unless ``$FLASHDSA_DECODE_SPLIT`` is 0."""
    with mock.patch.dict(os.environ, {"FLASHDSA_DECODE_SPLIT": split}):
        _eager_plan(B, H, s_q, sink)


def _eager_plan(B, H, s_q, sink):
    from flashdsa.decode import api as decode_api

    bs, topk = 64, 512
    lens = [4096, 140, 20, 0, 1000, 77][:B]
    q, kv, table, seqlens = _make(B, s_q, H, bs, lens, seed=5)
    cache = flashdsa.quantize_kv_fp8(kv)
    sink_t = torch.randn(H, device="cuda") if sink else None
    n_slots = kv.shape[0] * bs
    decode_api._PLANS._plans.clear()
    for seed in (1, 2, 3):
        idx = _sparse_indices(table, seqlens, bs, s_q, topk, seed=seed, n_slots=n_slots)
        tl = torch.randint(0, topk + 1, (B,), device="cuda", dtype=torch.int32)
        out, lse = flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl, attn_sink=sink_t)
        assert len(decode_api._PLANS) == 1
        key = decode_api._plan_key(q, cache, None, None, None, 512, True, idx, tl, sink_t, "auto")
        plain = decode_api._PLANS._plans.pop(key)  # the plain path once more, then the plan back
        out2, lse2 = flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl, attn_sink=sink_t)
        decode_api._PLANS.put(key, plain)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        ref_out, ref_lse = flashdsa.mla_decode(q, flashdsa.dequantize_kv_fp8(cache), None, None, indices=idx,
                                               topk_length=tl, attn_sink=sink_t, backend="reference")
        _check(out, lse, ref_out.to(torch.bfloat16), ref_lse.float())
    if H <= 16:
        with mock.patch.dict(os.environ, {"FLASHDSA_NARROW_CACHE656": "ring_er_f16"}):
            out3, lse3 = flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl, attn_sink=sink_t)
        assert len(decode_api._PLANS) == 2
        _check(out3, lse3, ref_out.to(torch.bfloat16), ref_lse.float())


@pytest.mark.parametrize("B,H,s_q,sink", [(1, 16, 1, False), (2, 64, 2, True), (1, 32, 1, True), (2, 128, 1, False)])
def test_dense_decode_fp8_eager_plan(B, H, s_q, sink, monkeypatch):
    """The eager plan of a split dense FP8 decode signature (``decode.api._DenseCache656Plan``): stored by the first
    call, replayed by the next ones with new lengths and q (bitwise the plain path, within the reference's
    tolerances); a call with one token per SM does not split: its signature is marked for the plain path, whose
    outputs its next call repeats."""
    from flashdsa.decode import _fp8_step, api as decode_api

    monkeypatch.setenv(_fp8_step.STEP_ENV, "1")
    bs = 64
    lens = [4096, 300][:B]
    q, kv, table, seqlens = _make(B, s_q, H, bs, lens, seed=B + H)
    cache = flashdsa.quantize_kv_fp8(kv)
    sink_t = torch.randn(H, device="cuda") if sink else None
    decode_api._PLANS._plans.clear()
    g = torch.Generator(device="cuda").manual_seed(B * H)
    cached = seqlens.clone()  # new lengths stay within the cached tokens (the slots past them hold NaN)
    for step in range(3):
        if step:
            q.copy_((torch.randn(q.shape, generator=g, device="cuda") * 0.1).to(q.dtype))
            seqlens.copy_((torch.rand(B, generator=g, device="cuda") * (cached + 1)).to(torch.int32))
        out, lse = flashdsa.mla_decode(q, cache, table, seqlens, attn_sink=sink_t)
        assert len(decode_api._PLANS) == 1
        key = decode_api._plan_key(q, cache, table, seqlens, None, 512, True, None, None, sink_t, "auto")
        assert isinstance(decode_api._PLANS.get(key), decode_api._DenseCache656Plan)
        plain = decode_api._PLANS._plans.pop(key)  # the plain path once more, then the plan back
        out2, lse2 = flashdsa.mla_decode(q, cache, table, seqlens, attn_sink=sink_t)
        decode_api._PLANS.put(key, plain)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        ref_out, ref_lse = flashdsa.mla_decode(q, flashdsa.dequantize_kv_fp8(cache), table, seqlens,
                                               attn_sink=sink_t, backend="reference")
        _check(out, lse, ref_out.to(torch.bfloat16), ref_lse.float())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, kv, table, seqlens = _make(sms, 1, 16, bs, [300] * sms, seed=7)
    cache = flashdsa.quantize_kv_fp8(kv)
    decode_api._PLANS._plans.clear()
    out, lse = flashdsa.mla_decode(q, cache, table, seqlens)
    key = decode_api._plan_key(q, cache, table, seqlens, None, 512, True, None, None, None, "auto")
    assert len(decode_api._PLANS) == 1 and decode_api._PLANS.get(key) is decode_api._PLAIN_PATH
    out2, lse2 = flashdsa.mla_decode(q, cache, table, seqlens)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
