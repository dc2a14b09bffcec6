"""CPU: split-KV of the decode forms that run as one sparse forward (``decode.kernel_split``): the plan rule, and
the split inputs merged by the combine kernel's formula (here in float64) against the unsplit reference (sink,
topk_length 0 and partial, -1 / out-of-range slots, chunks with no key, a NaN row attended)."""

import math
import os
from unittest import mock

import pytest
import torch

from flashdsa.decode import kernel_split
from flashdsa.sparse.reference import sparse_mla_fwd_reference


@pytest.mark.parametrize("tokens,heads,topk", [(1, 128, 2048), (1, 16, 32768), (8, 16, 2048), (64, 64, 2048),
                                               (2, 3, 256), (6, 9, 512), (33, 128, 2048), (1, 64, 8)])
def test_split_plan_fills_the_sms_with_whole_chunks(tokens, heads, topk):
    n_split, chunk = kernel_split.split_plan(tokens, heads, topk, 132)
    units = tokens * -(-heads // 64)
    n_blocks = -(-topk // 64)
    if n_blocks < 2 * kernel_split.MIN_SPLIT_BLOCKS:
        assert (n_split, chunk) == (1, topk)
        return
    assert n_split > 1 and chunk % 64 == 0 and (chunk // 64) & (chunk // 64 - 1) == 0  # a power-of-two of blocks
    assert chunk >= 64 * kernel_split.MIN_SPLIT_BLOCKS
    assert (n_split - 1) * chunk < topk <= n_split * chunk  # every chunk holds slots of the list
    assert units * n_split <= 132 or chunk == 64 * kernel_split.MIN_SPLIT_BLOCKS  # at most one wave, or min chunks
    assert 2 * units * n_split > 132 or chunk == 64 * kernel_split.MIN_SPLIT_BLOCKS  # fills more than half


@pytest.mark.parametrize("tokens,heads", [(128, 128), (128, 64), (128, 16), (67, 64), (34, 128), (512, 16)])
def test_no_split_where_the_ctas_fill_half_the_sms(tokens, heads):
    assert kernel_split.split_plan(tokens, heads, 2048, 132) == (1, 2048)


def test_split_env():
    with mock.patch.dict(os.environ, {kernel_split.SPLIT_ENV: "0"}):
        assert kernel_split.split_plan(1, 128, 2048, 132) == (1, 2048)
    with mock.patch.dict(os.environ, {kernel_split.SPLIT_ENV: "1"}):
        assert kernel_split.split_plan(1, 128, 2048, 132) == (32, 64)
    with mock.patch.dict(os.environ, {kernel_split.SPLIT_ENV: "8"}):
        assert kernel_split.split_plan(1, 128, 2048, 132) == (4, 512)


def _combine64(out_p, lse_p, sink, n_split, heads=None):
    """The combine kernel's arithmetic in float64 (kernel_split module docstring), over the first ``heads`` heads
    of the partials (None: all)."""
    n, Hp, D = out_p.shape
    H = Hp if heads is None else heads
    o = out_p.double().view(n // n_split, n_split, Hp, D)[:, :, :H]
    lk = lse_p.double().view(n // n_split, n_split, Hp)[:, :, :H]
    lk = torch.where(torch.isinf(lk) & (lk > 0), torch.full_like(lk, -math.inf), lk)
    m = lk.amax(dim=1)
    empty = torch.isinf(m) & (m < 0)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(lk - m_safe.unsqueeze(1))
    tot = w.sum(dim=1)
    denom = tot if sink is None else tot + torch.exp(sink.double().view(1, H) - m_safe)
    out = (w.unsqueeze(-1) * o).sum(dim=1) / torch.where(empty, torch.ones_like(denom), denom).unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(m, math.inf), m_safe + torch.log(tot))
    return torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out), lse


@pytest.mark.parametrize("n_split,chunk,with_tl", [(5, 64, True), (3, 128, False), (2, 256, True), (2, 192, True)])
def test_split_then_combine_matches_the_unsplit_forward(n_split, chunk, with_tl):
    g = torch.Generator().manual_seed(n_split * 13 + chunk)
    T, H, D, topk, n_kv = 5, 4, 576, 300, 700
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(n_kv, D, generator=g, dtype=torch.float64)
    slots = torch.randint(0, n_kv, (T, topk), generator=g, dtype=torch.int32)
    slots[:, 7] = -1
    slots[:, 11] = n_kv + 5
    slots[2, 64:] = -1  # token 2: chunks past the first hold no valid slot
    tl = torch.tensor([topk, 0, 190, 65, 1], dtype=torch.int32) if with_tl else None
    sink = torch.tensor([0.5, math.inf, -math.inf, -1.0], dtype=torch.float64)
    assert (n_split - 1) * chunk < topk <= n_split * chunk  # as split_plan's plans
    ref_out, ref_lse, _ = sparse_mla_fwd_reference(q, kv, slots, sm_scale=0.05, d_v=512, attn_sink=sink,
                                                   topk_length=tl)
    slots_s, tl_s = kernel_split.split_inputs(slots, tl, n_split, chunk)
    q_s = q.repeat_interleave(n_split, dim=0)  # the kernels read q row t for rows t * n_split ..
    assert slots_s.shape == (T * n_split, chunk)
    out_p, lse_p, _ = sparse_mla_fwd_reference(q_s, kv, slots_s, sm_scale=0.05, d_v=512, topk_length=tl_s)
    out, lse = _combine64(out_p, lse_p, sink, n_split)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    if with_tl:
        assert int(lse[1].isinf().all()) and float(out[1].abs().max()) == 0.0  # topk_length 0: empty row


def test_split_combine_keeps_nan():
    """A NaN row attended in one chunk makes the token's out and lse NaN, as in the unsplit forward."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(300, 576, generator=g, dtype=torch.float64)
    kv[5] = math.nan
    slots = torch.arange(256, dtype=torch.int32).view(1, 256)
    ref_out, ref_lse, _ = sparse_mla_fwd_reference(q, kv, slots, sm_scale=0.05, d_v=512)
    slots_s, _ = kernel_split.split_inputs(slots, None, 2, 128)
    q_s = q.repeat_interleave(2, dim=0)
    out_p, lse_p, _ = sparse_mla_fwd_reference(q_s, kv, slots_s, sm_scale=0.05, d_v=512)
    out, lse = _combine64(out_p, lse_p, None, 2)
    assert ref_lse.isnan().all() and lse.isnan().all() and out.isnan().all()


@pytest.mark.parametrize("heads,env,expected", [(128, "", True), (64, "", True), (16, "", True), (3, "", True),
                                                (32, "", False), (100, "", False), (16, "ring_er_f16", False),
                                                (16, "mma", True), (16, "mma_a64", False), (16, "0", False)])
def test_fp32_partials_only_from_the_forms_that_write_them(heads, env, expected):
    from flashdsa.sparse import kernel_fwd_fp8cache

    with mock.patch.dict(os.environ, {kernel_fwd_fp8cache.NARROW_ENV: env}):
        assert kernel_fwd_fp8cache.writes_f32(heads) is expected


@pytest.mark.parametrize("heads,fp8,env,expected", [(128, True, "", 128), (64, False, "", 64), (16, True, "", 16),
                                                    (3, True, "", 3), (16, False, "", 64), (1, False, "", 64),
                                                    (32, True, "", 64), (17, True, "", 64), (65, True, "", 128),
                                                    (100, False, "", 128), (16, True, "0", 64),
                                                    (16, True, "mma_a64", 64)])
def test_split_forward_heads(heads, fp8, env, expected):
    """The split forward runs where a kernel writes fp32 partials: at H itself, else the next pair form."""
    from flashdsa.sparse import kernel_fwd_fp8cache

    with mock.patch.dict(os.environ, {kernel_fwd_fp8cache.NARROW_ENV: env}):
        assert kernel_split.forward_heads(heads, fp8) == expected


def test_padded_heads_merge_to_the_unsplit_forward():
    """q padded with zero heads (``pad_heads``), split and merged over the real heads: the unsplit forward's
    output for those heads (the padded heads' partials are never read)."""
    g = torch.Generator().manual_seed(7)
    T, H, Hp, topk, n_kv, n_split, chunk = 3, 5, 8, 256, 400, 2, 128
    q = torch.randn(T, H, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(n_kv, 576, generator=g, dtype=torch.float64)
    slots = torch.randint(-1, n_kv, (T, topk), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    ref_out, ref_lse, _ = sparse_mla_fwd_reference(q, kv, slots, sm_scale=0.05, d_v=512, attn_sink=sink)
    q_p = kernel_split.pad_heads(q, Hp)
    assert q_p.shape == (T, Hp, 576) and torch.equal(q_p[:, :H], q) and not q_p[:, H:].any()
    assert kernel_split.pad_heads(q, H) is q
    slots_s, _ = kernel_split.split_inputs(slots, None, n_split, chunk)
    out_p, lse_p, _ = sparse_mla_fwd_reference(q_p.repeat_interleave(n_split, dim=0), kv, slots_s, sm_scale=0.05,
                                               d_v=512)
    out, lse = _combine64(out_p, lse_p, sink, n_split, heads=H)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)


def test_split_combine_kernel_tests_its_partials_for_nan():
    """The combine's NaN flag survives lowering (TVM's simplifier folds ``x != x`` to false, which removed the
    flag from session 44's build; ``T.isnan`` lowers to a test the CUDA keeps)."""
    pytest.importorskip("tilelang")
    import re

    from flashdsa._tilelang import lower_to_cuda_source

    src = lower_to_cuda_source(kernel_split.build_combine_kernel(heads=16, has_sink=False), None, "sm_90a")
    assert re.search(r"\(w\[0\] != w\[0\]\)", src), "no NaN test of the partial lse in the lowered combine"


@pytest.mark.parametrize("tokens,heads,fp8,split", [(11, 16, False, True), (12, 16, False, False),
                                                   (34, 16, True, True), (66, 16, True, True), (66, 17, False, True),
                                                   (66, 64, False, True), (67, 64, False, False)])
def test_split_fill_per_form(tokens, heads, fp8, split):
    """bf16 H <= 16 splits only up to 11 tokens (``split_fill`` 12), other forms where their CTAs fill at most
    half of the SMs."""
    n_split, _ = kernel_split.split_plan(tokens, heads, 2048, 132, kernel_split.split_fill(heads, fp8))
    assert (n_split > 1) is split
