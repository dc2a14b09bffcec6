"""GPU: the kernel-backed public ops given contiguous inputs whose base address is not 16-byte aligned (a view that
starts one element past an aligned buffer) give exactly what they give on the same values at an aligned address:
indexer_logits, indexer_logits_paged, topk_indices, sparse_mla_fwd (bf16, FP8 compute, the 656-byte cache's q /
indices), sparse_mla's backward, sparse_attn, mla_decode (dense: the fused, split and pair paths; sparse over the
656-byte cache).

The kernels read their inputs in 16-byte pieces (cp.async, vector loads, TMA boxes); the launch paths realign such
views with ``flashdsa._tilelang.aligned`` (a copy) instead of faulting.  Each op is called twice on the misaligned
inputs, so a plan stored by the first call (``_dispatch.PlanCache``) would serve the second: the plan caches refuse
misaligned inputs, whose replayed launch would not realign them; ``test_sparse_mla_fwd_optional_misaligned`` has only
topk_length / sink misaligned, which the kernels read per row.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

import flashdsa  # noqa: E402
from flashdsa import _dispatch  # noqa: E402

from decode.checks import make_paged  # noqa: E402


def misaligned(x):
    """A contiguous copy of ``x`` whose data pointer is one element (at most 8 bytes) past a 16-byte boundary."""
    es = x.element_size()
    buf = torch.empty(x.numel() * es + 16, dtype=torch.uint8, device=x.device)
    v = buf[es:es + x.numel() * es].view(x.dtype).view(x.shape)
    v.copy_(x)
    assert v.is_contiguous() and v.data_ptr() % 16 == es
    return v


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _assert_same(got, want, what):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: output {i} differs from the aligned call's"


def _twice(fn, args, what, op):
    """fn(*aligned args) against fn(*misaligned args), called twice, on the kernel path."""
    _dispatch._LAST_CHOICE.pop(op, None)  # (a value left by an earlier test must not count)
    want = fn(*args)
    assert _dispatch.last_choice(op) == "kernel", f"{what}: the aligned call did not run the kernel"
    bad = [misaligned(a) if isinstance(a, torch.Tensor) else a for a in args]
    for call in range(2):
        _dispatch._LAST_CHOICE.pop(op, None)
        got = fn(*bad)
        torch.cuda.synchronize()
        assert _dispatch.last_choice(op) == "kernel", f"{what}: call {call} left the kernel path"
        _assert_same(got, want, f"{what} (call {call})")


def test_indexer_logits_misaligned():
    g = _gen(1)
    M, N, H, D = 96, 512, 64, 128
    q = torch.randn(M, H, D, generator=g, device="cuda").to(torch.float8_e4m3fn)
    k = torch.randn(N, D, generator=g, device="cuda").to(torch.float8_e4m3fn)
    w = torch.rand(M, H, generator=g, device="cuda")
    ks = torch.rand(N, generator=g, device="cuda") + 0.5
    ke = (torch.arange(M, device="cuda", dtype=torch.int32) + N - M + 1)
    kst = torch.randint(0, 64, (M,), generator=g, device="cuda", dtype=torch.int32)
    _twice(lambda q, k, w, ks, kst, ke: flashdsa.indexer_logits(q, k, w, ks, k_start=kst, k_end=ke),
           (q, k, w, ks, kst, ke), "indexer_logits", "indexer_logits")


def test_indexer_logits_paged_misaligned():
    g = _gen(2)
    B, NN, H, D, bs, nb = 3, 2, 64, 128, 64, 20
    q = torch.randn(B, NN, H, D, generator=g, device="cuda").to(torch.float8_e4m3fn)
    cache = torch.randn(nb, bs, D, generator=g, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.rand(nb, bs, generator=g, device="cuda") + 0.5
    w = torch.rand(B * NN, H, generator=g, device="cuda")
    lens = torch.tensor([300, 2, 0], dtype=torch.int32, device="cuda")
    table = torch.randperm(nb, generator=g, device="cuda")[:18].view(B, 6).to(torch.int32)
    _twice(lambda q, c, w, lens, t, s: flashdsa.indexer_logits_paged(q, c, w, lens, t, k_scale_cache=s,
                                                                     max_context=320),
           (q, cache, w, lens, table, scale), "indexer_logits_paged", "indexer_logits_paged")


def test_topk_indices_misaligned():
    g = _gen(3)
    M, N, k = 64, 4096, 2048
    scores = torch.randn(M, N, generator=g, device="cuda")
    starts = torch.randint(0, 100, (M,), generator=g, device="cuda", dtype=torch.int32)
    ends = torch.randint(1000, N + 1, (M,), generator=g, device="cuda", dtype=torch.int32)
    _twice(lambda s, st, en: flashdsa.topk_indices(s, k, starts=st, ends=en), (scores, starts, ends),
           "topk_indices", "topk_indices")


def _sparse_inputs(heads, dqk=576, tkv=592, topk=128, n_tok=62, seed=4):
    g = _gen(seed)
    q = (torch.randn(n_tok, heads, dqk, generator=g, device="cuda") * 0.1).to(torch.bfloat16)
    kv = (torch.randn(tkv, dqk, generator=g, device="cuda") * 0.1).to(torch.bfloat16)
    idx = torch.randint(-2, tkv + 2, (n_tok, topk), generator=g, device="cuda", dtype=torch.int32)
    tl = torch.randint(0, topk + 1, (n_tok,), generator=g, device="cuda", dtype=torch.int32)
    sink = torch.randn(heads, generator=g, device="cuda")
    return q, kv, idx, tl, sink


@pytest.mark.parametrize("heads", [16, 64])
def test_sparse_mla_fwd_bf16_misaligned(heads):
    q, kv, idx, tl, sink = _sparse_inputs(heads)
    _twice(lambda q, kv, idx, tl, sink: flashdsa.sparse_mla_fwd(q, kv, idx, topk_length=tl, attn_sink=sink,
                                                                 return_max_logits=True),
           (q, kv, idx, tl, sink), f"sparse_mla_fwd bf16 H {heads}", "sparse_mla_fwd")


def test_sparse_mla_fwd_optional_misaligned():
    """q / kv / indices aligned (the plan cache would take them), topk_length and attn_sink misaligned."""
    q, kv, idx, tl, sink = _sparse_inputs(64, seed=15)
    fn = lambda tl, sink: flashdsa.sparse_mla_fwd(q, kv, idx, topk_length=tl, attn_sink=sink)  # noqa: E731
    _twice(fn, (tl, sink), "sparse_mla_fwd bf16, topk_length / sink misaligned", "sparse_mla_fwd")


def test_sparse_attn_misaligned():
    """The DeepSeek-V4 op (K = V, d 512, batched kv) at b 2, h 64, topk 640, with a sink."""
    g = _gen(16)
    b, m, n, h, topk = 2, 40, 600, 64, 640
    q = (torch.randn(b, m, h, 512, generator=g, device="cuda") * 0.1).to(torch.bfloat16)
    kv = (torch.randn(b, n, 512, generator=g, device="cuda") * 0.1).to(torch.bfloat16)
    idx = torch.randint(-2, n + 2, (b, m, topk), generator=g, device="cuda", dtype=torch.int32)
    sink = torch.randn(h, generator=g, device="cuda")
    _twice(lambda q, kv, sink, idx: flashdsa.sparse_attn(q, kv, sink, idx), (q, kv, sink, idx), "sparse_attn",
           "sparse_mla_fwd")


@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_mla_fwd_fp8_compute_misaligned(heads):
    q, kv, idx, tl, sink = _sparse_inputs(heads, seed=5)
    g = _gen(6)
    q8, kv8 = (q * 8).to(torch.float8_e4m3fn), (kv * 8).to(torch.float8_e4m3fn)
    qs = torch.rand(q.shape[:2], generator=g, device="cuda") * 0.25
    ks = torch.rand(kv.shape[0], generator=g, device="cuda") * 0.25
    _twice(lambda q8, kv8, idx, tl, sink, qs, ks: flashdsa.sparse_mla_fwd(q8, kv8, idx, topk_length=tl,
                                                                         attn_sink=sink, q_scale=qs, kv_scale=ks),
           (q8, kv8, idx, tl, sink, qs, ks), f"sparse_mla_fwd fp8 H {heads}", "sparse_mla_fwd_fp8")


@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_mla_fwd_cache656_misaligned_q(heads):
    """q, indices, topk_length and sink misaligned; the 656-byte cache itself must be 16-byte aligned (a
    misaligned cache is not taken by the kernel: ``kernel_fwd_fp8cache.kernel_unsupported``)."""
    q, kv, idx, tl, sink = _sparse_inputs(heads, seed=7)
    cache = flashdsa.quantize_kv_fp8(kv)
    fn = lambda q, idx, tl, sink: flashdsa.sparse_mla_fwd(q, cache, idx, topk_length=tl, attn_sink=sink)  # noqa: E731
    _twice(fn, (q, idx, tl, sink), f"sparse_mla_fwd cache656 H {heads}", "sparse_mla_fwd_cache656")


def test_sparse_mla_bwd_misaligned():
    """The deterministic backward (bitwise reproducible) on misaligned q / kv / indices / sink and gradient."""
    q, kv, idx, tl, sink = _sparse_inputs(64, seed=8)
    dout = (torch.randn(q.shape[0], 64, 512, generator=_gen(9), device="cuda") * 0.1).to(torch.bfloat16)

    def grads(q, kv, idx, sink, dout):
        q, kv, sink = (x.detach().requires_grad_() for x in (q, kv, sink))
        out = flashdsa.sparse_mla(q, kv, idx, attn_sink=sink, deterministic=True)
        out.backward(dout)
        return out, q.grad, kv.grad, sink.grad

    _dispatch._LAST_CHOICE.pop("sparse_mla_bwd", None)
    want = grads(q, kv, idx, sink, dout)
    assert _dispatch.last_choice("sparse_mla_bwd") == "kernel", "the aligned backward did not run the kernel"
    _dispatch._LAST_CHOICE.pop("sparse_mla_bwd", None)
    got = grads(*(misaligned(x) for x in (q, kv, idx, sink, dout)))
    torch.cuda.synchronize()
    assert _dispatch.last_choice("sparse_mla_bwd") == "kernel", "the misaligned backward left the kernel path"
    _assert_same(got, want, "sparse_mla backward")


@pytest.mark.parametrize("B,s_q,H", [(4, 2, 16), (64, 1, 64), (128, 1, 64)])  # the fused, split, pair paths
def test_mla_decode_dense_misaligned(B, s_q, H):
    lens = [300 + 37 * b for b in range(B)]
    q, kv_cache, table, seqlens = make_paged(B, s_q, H, 64, lens, seed=10, device="cuda")
    sink = torch.randn(H, generator=_gen(11), device="cuda")
    _twice(lambda q, c, t, n, sink: flashdsa.mla_decode(q, c, t, n, attn_sink=sink),
           (q, kv_cache, table, seqlens, sink), f"mla_decode dense B {B} H {H}", "mla_decode")


@pytest.mark.parametrize("H", [16, 64])
def test_mla_decode_sparse_fp8_misaligned(H):
    B, s_q, topk = 8, 1, 256
    q, kv_cache, table, seqlens = make_paged(B, s_q, H, 64, [1000] * B, seed=12, device="cuda")
    cache = flashdsa.quantize_kv_fp8(torch.nan_to_num(kv_cache.view(-1, 576))).view(*kv_cache.shape[:2], 656)
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    idx = torch.randint(-1, rows, (B, s_q, topk), generator=_gen(13), device="cuda", dtype=torch.int32)
    tl = torch.randint(0, topk + 1, (B,), generator=_gen(14), device="cuda", dtype=torch.int32)
    fn = lambda q, idx, tl: flashdsa.mla_decode(q, cache, None, None, indices=idx, topk_length=tl)  # noqa: E731
    _twice(fn, (q, idx, tl), f"mla_decode sparse fp8 H {H}", "mla_decode")
