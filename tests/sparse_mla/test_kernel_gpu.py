"""GPU: the TileLang sparse MLA forward kernel against the PyTorch reference (run with ``pytest -m gpu``).

Each case is (Dqk, H, Tkv, topk, T, sink, topk_length, q layout).  The kernel is compiled per
(H, Dqk, ceil(topk/64), sm_scale, sink, topk_length); the list below needs 13 compiles.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.sparse import kernel_fwd  # noqa: E402
from flashdsa.sparse.reference import sparse_mla_fwd_reference  # noqa: E402

D_V = 512
INT_MIN, INT_MAX = -(2**31), 2**31 - 1

# (dqk, heads, tkv, topk, n_tok, sink, topk_length, q_layout)
CASES = [
    (576, 128, 8192, 2048, 62, False, False, "contig"),
    (576, 128, 8192, 2048, 213, True, True, "sliced"),
    (512, 128, 8192, 2048, 62, True, False, "transposed"),
    (576, 64, 8192, 2048, 1, False, False, "contig"),
    (512, 64, 4096, 100, 213, False, True, "sliced"),
    (576, 64, 1840, 256, 62, True, True, "contig"),
    (576, 16, 592, 128, 213, False, False, "transposed"),
    (512, 16, 128, 128, 1, True, True, "contig"),
    (576, 1, 4096, 100, 62, True, False, "sliced"),
    (512, 1, 1840, 256, 213, False, True, "contig"),
    (576, 128, 128, 128, 1, False, True, "contig"),
    (576, 100, 592, 128, 62, True, True, "sliced"),  # 2 head blocks, the second partially padded
    (512, 128, 4096, 100, 213, True, True, "transposed"),
    (576, 128, 1840, 256, 62, False, False, "contig"),
]


def _make_q(n_tok, heads, dqk, layout, gen, scale):
    if layout == "sliced":  # last dim contiguous, row stride padded
        base = (torch.randn(n_tok, heads, dqk + 64, generator=gen, device="cuda") * scale).to(torch.bfloat16)
        return base[..., :dqk]
    if layout == "transposed":  # [H, T, D] storage viewed as [T, H, D]
        return (torch.randn(heads, n_tok, dqk, generator=gen, device="cuda") * scale).to(torch.bfloat16).transpose(0, 1)
    if layout != "contig":  # an unknown name must not silently give a contiguous q
        raise ValueError(f"layout={layout!r}: expected 'contig', 'sliced' or 'transposed'")
    return (torch.randn(n_tok, heads, dqk, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout, seed=0, scale=0.1):
    """q, kv ~ N(0, scale^2) in bf16. scale=0.1 is the distribution FlashMLA's sparse tests use with these
    tolerances; scale=1 gives peaky softmax rows (see test_sparse_mla_fwd_kernel_peaky)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = _make_q(n_tok, heads, dqk, layout, gen, scale)
    kv = (torch.randn(tkv, dqk, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    # mostly distinct valid rows, some duplicates, ~10% invalid of every kind
    idx = torch.randint(0, tkv, (n_tok, topk), generator=gen, device="cuda", dtype=torch.int64)
    if topk <= tkv:
        perm = torch.argsort(torch.rand(n_tok, tkv, generator=gen, device="cuda"), dim=1)[:, :topk]
        use_perm = torch.rand(n_tok, 1, generator=gen, device="cuda") < 0.7
        idx = torch.where(use_perm, perm, idx)
    bad_vals = torch.tensor([INT_MIN, -123456, -1, tkv, 114514, INT_MAX], device="cuda", dtype=torch.int64)
    bad = bad_vals[torch.randint(0, len(bad_vals), (n_tok, topk), generator=gen, device="cuda")]
    is_bad = torch.rand(n_tok, topk, generator=gen, device="cuda") < 0.1
    idx = torch.where(is_bad, bad, idx)
    # ~2% rows with no valid index at all (at least one when n_tok > 1)
    empty = torch.rand(n_tok, generator=gen, device="cuda") < 0.02
    if n_tok > 1:
        empty[n_tok // 2] = True
    idx = torch.where(empty.unsqueeze(1), bad, idx)
    indices = idx.to(torch.int32)

    topk_length = None
    if use_tl:
        topk_length = torch.randint(0, topk + 1, (n_tok,), generator=gen, device="cuda", dtype=torch.int32)
        topk_length[0] = topk  # full
        if n_tok > 2:
            topk_length[1] = topk + 7  # larger than topk: clamps to topk
            topk_length[2] = 0  # empty
        if n_tok > 3:
            topk_length[3] = -5  # negative: empty

    attn_sink = None
    if sink:
        attn_sink = torch.randn(heads, generator=gen, device="cuda", dtype=torch.float32) * 2.0 + 3.0
        attn_sink[0] = -math.inf
        if heads > 1:
            attn_sink[1] = math.inf
        if heads > 2:
            attn_sink[2] = 40.0

    # kv rows referenced by no valid (position, index) pair hold NaN
    pos = torch.arange(topk, device="cuda")
    valid = (idx >= 0) & (idx < tkv)
    if topk_length is not None:
        valid &= pos.unsqueeze(0) < topk_length.unsqueeze(1).long()
    referenced = torch.zeros(tkv, dtype=torch.bool, device="cuda")
    referenced[idx[valid]] = True
    kv[~referenced] = float("nan")
    return q, kv, indices, topk_length, attn_sink, valid


def _check_close_out(out, ref, name):
    out64, ref64 = out.double(), ref.double()
    err = (out64 - ref64).abs()
    ok = (err <= 8e-4) | (err <= (3 / 128) * ref64.abs())
    assert torch.isfinite(out64).all(), f"{name}: non-finite output"
    assert ok.all(), f"{name}: out max abs err {err.max().item():.3e}, {int((~ok).sum())} elements out of tolerance"
    a, b = out64.flatten(), ref64.flatten()
    na, nb = a.norm(), b.norm()
    if nb > 0:
        cos_dist = 1 - (a @ b) / (na * nb).clamp_min(1e-300)
        assert cos_dist <= 7e-6, f"{name}: cosine distance {cos_dist.item():.3e}"
    else:
        assert na == 0


def _check_close_stat(x, ref, name):
    x64, ref64 = x.double(), ref.double()
    same_inf = torch.isinf(ref64) & (x64 == ref64)
    err = (x64 - ref64).abs()
    ok = same_inf | (err <= 1e-6) | (err <= (2 / 65536) * ref64.abs())
    assert not torch.isnan(x64).any(), f"{name}: NaN"
    assert ok.all(), f"{name}: max err {err[~same_inf].max().item():.3e}, {int((~ok).sum())} out of tolerance"


def check_against_reference(out, lse, max_logits, q, kv, indices, sm_scale, topk_length, attn_sink, valid):
    """Shapes, dtypes and values of a forward kernel's outputs against the reference on the same inputs."""
    n_tok, heads = q.shape[:2]
    assert out.shape == (n_tok, heads, D_V) and out.dtype == torch.bfloat16
    assert lse.shape == (n_tok, heads) and lse.dtype == torch.float32
    assert max_logits.shape == (n_tok, heads) and max_logits.dtype == torch.float32

    # out: float64 reference on the same bf16 inputs; lse / max_logits: float32 reference
    ref_out, _, _ = sparse_mla_fwd_reference(
        q.double(), kv.double(), indices, sm_scale=sm_scale, d_v=D_V, attn_sink=attn_sink, topk_length=topk_length
    )
    _, ref_lse, ref_max = sparse_mla_fwd_reference(
        q.float(), kv.float(), indices, sm_scale=sm_scale, d_v=D_V, attn_sink=attn_sink, topk_length=topk_length
    )
    _check_close_out(out, ref_out, "out")
    _check_close_stat(lse, ref_lse, "lse")
    _check_close_stat(max_logits, ref_max, "max_logits")

    # rows with no valid key: exactly 0 / +inf / -inf
    empty = ~valid.any(dim=1)
    if empty.any():
        assert (out[empty] == 0).all()
        assert torch.isposinf(lse[empty]).all()
        assert torch.isneginf(max_logits[empty]).all()


@pytest.mark.parametrize(
    "dqk,heads,tkv,topk,n_tok,sink,use_tl,layout",
    CASES,
    ids=[f"d{c[0]}-h{c[1]}-kv{c[2]}-k{c[3]}-t{c[4]}{'-sink' if c[5] else ''}{'-tl' if c[6] else ''}-{c[7]}" for c in CASES],
)
def test_sparse_mla_fwd_kernel(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout):
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout)
    sm_scale = dqk**-0.5
    assert kernel_fwd.kernel_unsupported(q, kv, indices, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink) is None

    out, lse, max_logits = kernel_fwd.run_sparse_mla_fwd(
        q, kv, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink
    )
    torch.cuda.synchronize()
    check_against_reference(out, lse, max_logits, q, kv, indices, sm_scale, topk_length, attn_sink, valid)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] <= 32],
                         ids=lambda c: f"d{c[0]}-h{c[1]}-kv{c[2]}-k{c[3]}-t{c[4]}{'-sink' if c[5] else ''}-{c[7]}")
def test_sparse_mla_fwd_narrow_row_gather(case):
    """The narrow kernel's dispatched gather by rows (``row_gather``: 4 row lookups per thread, same bytes and
    layout): bitwise equal to its ``T.Parallel`` gather."""
    from flashdsa.sparse import kernel_fwd_narrow

    dqk, heads, tkv, topk, n_tok, sink, use_tl, layout = case
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout)
    kw = dict(sm_scale=dqk**-0.5, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink)
    base = kernel_fwd.launch(lambda *a: kernel_fwd_narrow._compiled(*a, False), q, kv, indices, **kw)
    got = kernel_fwd.launch(lambda *a: kernel_fwd_narrow._compiled(*a, True), q, kv, indices, **kw)
    for name, a, b in zip(("out", "lse", "max_logits"), got, base):
        assert torch.equal(a, b), f"{name}: the row gather differs from the T.Parallel gather"


FEW_HEAD_CASES = [c for c in CASES if c[1] <= 16] + [
    (576, 9, 4096, 2048, 62, True, True, "sliced"),
    (512, 13, 592, 100, 213, False, False, "contig"),
    (576, 24, 1840, 256, 62, True, False, "contig"),  # H > 16: two head tiles
    (512, 32, 4096, 2048, 62, True, True, "sliced"),
    (576, 17, 592, 100, 213, False, True, "transposed"),
]


FEW_HEAD_FORMS = [(c, f) for c in FEW_HEAD_CASES
                  for f in ("narrow", "mma_q18", "mma_c2q18", "mma_c2q6", "mma_g3", "mma_t2", "mma_c4", "mma_c3n3",
                            "mma_ws")
                  if f == "narrow" or (c[1] > 16) == (f == "mma_t2")] + [
    # kernel_fwd_mma_ws is persistent (132 CTAs of four token groups): several tokens per group, with topk_length
    ((576, 16, 4096, 256, 1200, True, True, "contig"), "mma_ws"),
    ((512, 7, 1840, 100, 700, False, True, "sliced"), "mma_ws"),
]


@pytest.mark.parametrize("case,form", FEW_HEAD_FORMS, ids=[
    f"{f}-d{c[0]}-h{c[1]}-kv{c[2]}-k{c[3]}-t{c[4]}{'-sink' if c[5] else ''}-{c[7]}" for c, f in FEW_HEAD_FORMS])
def test_sparse_mla_fwd_few_head_forms(case, form):
    """Each few-head kernel (``kernel_fwd_narrow``; ``kernel_fwd_mma``'s forms: one head tile for H <= 16, two
    above; ``kernel_fwd_mma_ws``) against the reference, whichever the dispatcher picks."""
    from flashdsa.sparse import kernel_fwd_mma, kernel_fwd_mma_ws, kernel_fwd_narrow

    dqk, heads, tkv, topk, n_tok, sink, use_tl, layout = case
    assert form == "narrow" or heads <= kernel_fwd_mma.MAX_HEADS
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout)
    kw = dict(sm_scale=dqk**-0.5, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink)
    compiled = (kernel_fwd_narrow._compiled if form == "narrow" else kernel_fwd_mma_ws._compiled if form == "mma_ws"
                else lambda *a: kernel_fwd_mma._compiled(*a, form))
    out, lse, max_logits = kernel_fwd.launch(compiled, q, kv, indices, **kw)
    torch.cuda.synchronize()
    check_against_reference(out, lse, max_logits, q, kv, indices, kw["sm_scale"], topk_length, attn_sink, valid)


@pytest.mark.parametrize("heads,n_tok", [(64, 62), (16, 62), (16, 600)])  # H 16 / 600 tokens: kernel_fwd_mma_ws
def test_sparse_mla_fwd_kernel_cuda_graph(heads, n_tok):
    """The launch is capturable (no host sync, no value reads) and replays to the same result."""
    dqk, tkv, topk = 576, 1840, 256
    q, kv, indices, topk_length, attn_sink, _ = _make_inputs(dqk, heads, tkv, topk, n_tok, True, True, "contig", 1)
    kw = dict(sm_scale=dqk**-0.5, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink)
    eager = kernel_fwd.run_sparse_mla_fwd(q, kv, indices, **kw)  # compiles outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernel_fwd.run_sparse_mla_fwd(q, kv, indices, **kw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = kernel_fwd.run_sparse_mla_fwd(q, kv, indices, **kw)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    # new indices (with invalid ones) and lengths written into the captured tensors: the replay follows them
    gen = torch.Generator(device="cuda").manual_seed(5)
    kv.nan_to_num_(0.0)  # every row may be selected now
    indices.copy_(torch.randint(-2, tkv + 2, indices.shape, generator=gen, device="cuda", dtype=torch.int32))
    topk_length.copy_(torch.randint(0, topk + 1, topk_length.shape, generator=gen, device="cuda", dtype=torch.int32))
    g.replay()
    eager = kernel_fwd.run_sparse_mla_fwd(q, kv, indices, **kw)
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_mla_fwd_misaligned_views(heads):
    """Contiguous q / kv views that start 2 bytes past a 16-byte boundary (the kernels copy 16-byte pieces): the
    public op gives the reference's result, eagerly and on the repeated (planned) call."""
    import flashdsa

    dqk, tkv, topk, n_tok = 576, 592, 128, 62
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, True, True, "contig", 4)
    q_buf = torch.empty(q.numel() + 8, dtype=torch.bfloat16, device="cuda")
    kv_buf = torch.empty(kv.numel() + 8, dtype=torch.bfloat16, device="cuda")
    q_off = q_buf[1:1 + q.numel()].view(q.shape).copy_(q)
    kv_off = kv_buf[1:1 + kv.numel()].view(kv.shape).copy_(kv)
    assert q_off.is_contiguous() and q_off.data_ptr() % 16 and kv_off.data_ptr() % 16
    for _ in range(2):
        out, lse, max_logits = flashdsa.sparse_mla_fwd(q_off, kv_off, indices, attn_sink=attn_sink,
                                                       topk_length=topk_length, return_max_logits=True)
        torch.cuda.synchronize()
        check_against_reference(out, lse, max_logits, q, kv, indices, dqk**-0.5, topk_length, attn_sink, valid)


def _bf16_p_emulation(q, kv, indices, sm_scale, topk_length):
    """fp32 reference that rounds the probabilities to bf16 before PV, as every bf16 tensor-core kernel does."""
    from flashdsa.sparse.reference import _gather, valid_mask

    valid = valid_mask(indices, kv.shape[0], topk_length)
    k = _gather(kv, indices, valid, torch.float32)
    s = torch.einsum("thd,tkd->thk", q.float(), k) * sm_scale
    s = s.masked_fill(~valid.unsqueeze(1), -math.inf)
    m = s.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(s - m)
    out = torch.einsum("thk,tkd->thd", p.bfloat16().float(), k[..., :D_V]) / p.sum(-1, keepdim=True).clamp_min(1e-30)
    return out


@pytest.mark.parametrize("dqk,heads,tkv,topk,n_tok,use_tl", [(576, 128, 1840, 256, 62, True), (512, 16, 4096, 100, 213, False)])
def test_sparse_mla_fwd_kernel_peaky(dqk, heads, tkv, topk, n_tok, use_tl):
    """Unscaled N(0, 1) inputs: logits of std ~1 make rows dominated by a few keys, where rounding P to bf16 for
    the PV wgmma is the leading error. The kernel's error (vs float64) must stay within 2x that of an fp32
    reference that rounds P the same way, plus one bf16 output ulp; lse keeps the strict tolerance."""
    q, kv, indices, topk_length, _, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, False, use_tl, "contig", 3, 1.0)
    sm_scale = dqk**-0.5
    out, lse, _ = kernel_fwd.run_sparse_mla_fwd(q, kv, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length)
    ref_out, _, _ = sparse_mla_fwd_reference(q.double(), kv.double(), indices, sm_scale=sm_scale, d_v=D_V,
                                             topk_length=topk_length)
    _, ref_lse, _ = sparse_mla_fwd_reference(q.float(), kv.float(), indices, sm_scale=sm_scale, d_v=D_V,
                                             topk_length=topk_length)
    emu = _bf16_p_emulation(q, kv, indices, sm_scale, topk_length).double()
    kern_err = (out.double() - ref_out).abs()
    emu_err = (emu - ref_out).abs()
    assert torch.isfinite(out.double()).all()
    # per (token, head) row: the worst element error against 2x the emulation's worst, + one bf16 ulp, + 8e-4
    bound = 2 * emu_err.amax(-1) + ref_out.abs().amax(-1) * 2**-8 + 8e-4
    assert (kern_err.amax(-1) <= bound).all(), f"max excess {(kern_err.amax(-1) - bound).max().item():.3e}"
    assert kern_err.norm() <= 2 * emu_err.norm() + 1e-3 * ref_out.norm()
    _check_close_stat(lse, ref_lse, "lse")

