"""GPU: ``kernel_fwd_pair_cache`` (the pair schedule over the 656-byte FP8 cache) against the reference on the
exactly dequantized cache, and bitwise against ``kernel_fwd_pair`` on that dequantized cache (same consumer
code on the same bf16 tiles, so the outputs must be identical); the same for the dispatcher with and without the
whole-cache copy (``kernel_dequant656``), whose copy must be bitwise ``dequantize_kv_fp8``.  Unreferenced cache
rows are poisoned.  A hung
producer / consumer protocol aborts the run instead of blocking it (``_hang.sync_or_die``)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.quant import dequantize_kv_fp8, quantize_kv_fp8  # noqa: E402
from flashdsa.sparse import kernel_dequant656, kernel_fwd_fp8cache, kernel_fwd_pair  # noqa: E402
from flashdsa.sparse import kernel_fwd_pair_cache as kmod  # noqa: E402

from ._hang import assert_same_as_default, sync_or_die  # noqa: E402
from .test_kernel_fp8cache_gpu import _fp8_cache  # noqa: E402
from .test_kernel_gpu import _make_inputs, check_against_reference  # noqa: E402

D_V = 512
DQK = 576
HANG_S = 30.0

# (heads, tkv, topk, n_tok, sink, topk_length, q layout, kv row stride in bytes); small cases first
CASES = [
    (128, 64, 256, 3, True, True, "contig", 656),  # tiny: full / clamped / empty rows
    (128, 592, 200, 62, True, True, "contig", 672),  # tail block masked, odd block count, padded rows
    (64, 128, 130, 213, True, True, "sliced", 656),  # topk > Tkv (duplicates), half-used last pair
    (64, 1840, 256, 62, False, True, "transposed", 704),
    (128, 8192, 2048, 62, False, False, "contig", 656),  # the headline config
    (128, 4096, 100, 213, True, False, "sliced", 656),
]


_over_cases = pytest.mark.parametrize(
    "heads,tkv,topk,n_tok,sink,use_tl,layout,row_stride",
    CASES,
    ids=[f"h{c[0]}-kv{c[1]}-k{c[2]}-t{c[3]}{'-sink' if c[4] else ''}{'-tl' if c[5] else ''}-{c[6]}-rs{c[7]}"
         for c in CASES],
)


@_over_cases
def test_sparse_mla_fwd_pair_cache(heads, tkv, topk, n_tok, sink, use_tl, layout, row_stride):
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(DQK, heads, tkv, topk, n_tok, sink, use_tl, layout)
    kv8, kv_deq = _fp8_cache(kv, row_stride, torch.Generator(device="cuda").manual_seed(5))
    sm_scale = DQK**-0.5
    kw = dict(sm_scale=sm_scale, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink)
    assert kmod.kernel_unsupported(q, kv8, indices, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink) is None
    what = f"H={heads} Tkv={tkv} topk={topk} T={n_tok} sink={sink} tl={use_tl} {layout} rs={row_stride}"
    out = kmod.run_sparse_mla_fwd(q, kv8, indices, **kw)
    sync_or_die("kernel_fwd_pair_cache", what, HANG_S)
    check_against_reference(*out, q, kv_deq, indices, sm_scale, topk_length, attn_sink, valid)
    # the dispatcher (its rule, then each path forced), and the bf16 pair kernel on the dequantized cache: bitwise
    bf16_pair = kernel_fwd_pair.run_sparse_mla_fwd(q, kv_deq, indices, **kw)
    for choice in (None, True, False):
        dispatched = kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv8, indices, dequant_once=choice, **kw)
        sync_or_die("kernel_fwd_pair / dispatched", what, HANG_S)
        for name, a, b, c in zip(("out", "lse", "max_logits"), out, dispatched, bf16_pair):
            assert torch.equal(a, b), f"{name}: the dispatched cache656 forward (dequant_once={choice}) differs"
            assert torch.equal(a, c), f"{name}: differs from kernel_fwd_pair on the dequantized cache"


@pytest.mark.parametrize("tkv,row_stride", [(1, 656), (7, 672), (8, 656), (9, 704), (1000, 656), (8193, 688)])
def test_dequantize_cache(tkv, row_stride):
    """``kernel_dequant656.dequantize_cache`` equals ``dequantize_kv_fp8`` bit for bit (NaN where it is NaN) over
    random rows, rows of poison bytes (0xFF / 0x7F: NaN e4m3 and scales), padded row strides and a row count
    that is no multiple of the CTA's 8 rows; the output is allocated from a NaN-poisoned pool."""
    gen = torch.Generator(device="cuda").manual_seed(tkv)
    kv = (torch.randn(tkv, DQK, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    kv[torch.rand(tkv, generator=gen, device="cuda") < 0.2] = float("nan")  # -> poison rows in the cache
    kv8, ref = _fp8_cache(kv, row_stride, gen)
    got = kernel_dequant656.dequantize_cache(kv8)
    torch.cuda.synchronize()
    assert got.shape == (tkv, DQK) and got.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), ref.isnan())
    fin = ~ref.isnan()
    assert torch.equal(got.view(torch.int16)[fin], ref.view(torch.int16)[fin])


def test_sparse_mla_fwd_pair_cache_unsupported():
    q = torch.zeros(2, 16, DQK, dtype=torch.bfloat16, device="cuda")
    kv8 = torch.zeros(8, 656, dtype=torch.uint8, device="cuda")
    idx = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    assert kmod.kernel_unsupported(q, kv8, idx, d_v=D_V) is not None
    with pytest.raises(ValueError, match="H=16"):
        kmod.run_sparse_mla_fwd(q, kv8, idx, sm_scale=0.1, d_v=D_V)
    q64 = torch.zeros(2, 64, DQK, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="656"):
        kmod.run_sparse_mla_fwd(q64, torch.zeros(8, 576, dtype=torch.uint8, device="cuda"), idx, sm_scale=0.1,
                                d_v=D_V)


@pytest.mark.parametrize("staging", ["consumer", "converter"])
@_over_cases
def test_sparse_mla_fwd_pair_cache_staging(heads, tkv, topk, n_tok, sink, use_tl, layout, row_stride, staging):
    """The other stagings against the reference on the dequantized cache (bitwise against the default build:
    ``test_sparse_mla_fwd_pair_cache_same_order_builds``): "consumer" (the first-reading consumer converts; the
    default before session 21), "converter" (raw chunks landing in the bf16 slots, converted in place; the default
    in session 21)."""
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(DQK, heads, tkv, topk, n_tok, sink, use_tl, layout)
    kv8, kv_deq = _fp8_cache(kv, row_stride, torch.Generator(device="cuda").manual_seed(5))
    sm_scale = DQK**-0.5
    out = kmod.run_sparse_mla_fwd(q, kv8, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length,
                                  attn_sink=attn_sink, staging=staging)
    sync_or_die(f"kernel_fwd_pair_cache {staging}", f"H={heads} Tkv={tkv} topk={topk} T={n_tok}", HANG_S)
    check_against_reference(*out, q, kv_deq, indices, sm_scale, topk_length, attn_sink, valid)


@pytest.mark.parametrize("variant", [dict(overlap_qk=False), dict(staging="consumer"),
                                     dict(staging="converter"), dict(persistent=5), dict(q_gate="off"),
                                     dict(q_gate="al"), dict(q_gate="ar"), dict(q_gate="al", staging="converter"),
                                     dict(q_gate="tma"), dict(q_gate="tma_al"), dict(q_gate="tma", staging="consumer")],
                         ids=["no_overlap_qk", "consumer", "converter", "persistent5", "q_gate_off", "q_gate_al",
                              "q_gate_ar", "q_gate_al_converter", "q_tma", "q_tma_al", "q_tma_consumer"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4]],
                         ids=["tiny", "odd-blocks", "topk>tkv", "headline"])
def test_sparse_mla_fwd_pair_cache_same_order_builds(case, variant):
    """A build with the default's products in its order, bitwise equal to the default build: ``overlap_qk=False``
    (the consumers retire their remote PV before the next QK); the consumer staging (the default converter
    staging splits each PV by columns: the same products per output column); converter; the persistent grid (5
    CTAs looping over the items, uneven counts: ``$FLASHDSA_CACHE656_PERSISTENT``'s timing builds); the Q gates
    against the default (gated only in the two 62-token H 128 cases: 124 CTAs; the tiny case's empty rows have no
    pair and must not wait on the gate); Q by TMA ("tma*", every case, also without the converter)."""
    heads, tkv, topk, n_tok, sink, use_tl, layout, row_stride = case
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(DQK, heads, tkv, topk, n_tok, sink, use_tl, layout)
    kv8, _ = _fp8_cache(kv, row_stride, torch.Generator(device="cuda").manual_seed(5))
    kw = dict(sm_scale=DQK**-0.5, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink)
    assert_same_as_default("kernel_fwd_pair_cache", lambda **v: kmod.run_sparse_mla_fwd(q, kv8, indices, **kw, **v),
                           variant, f"H={heads} Tkv={tkv} topk={topk} T={n_tok} rs={row_stride}", HANG_S)


@pytest.mark.parametrize("q_gate", ["off", "tma"])
def test_sparse_mla_fwd_pair_cache_unaligned_q(q_gate):
    """A contiguous q whose base is not 16-byte aligned (a view 2 bytes into its storage): the launch copies it
    (Q's 16-byte loads and TMA boxes need the alignment); outputs bitwise those of an aligned copy."""
    heads, tkv, topk, n_tok, sink, use_tl, layout, row_stride = CASES[1]
    q, kv, indices, topk_length, attn_sink, _ = _make_inputs(DQK, heads, tkv, topk, n_tok, sink, use_tl, layout)
    kv8, _ = _fp8_cache(kv, row_stride, torch.Generator(device="cuda").manual_seed(5))
    store = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    q_odd = store[1:].view(q.shape)
    q_odd.copy_(q)
    assert q_odd.is_contiguous() and q_odd.data_ptr() % 16 != 0
    kw = dict(sm_scale=DQK**-0.5, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink, q_gate=q_gate)
    got = kmod.run_sparse_mla_fwd(q_odd, kv8, indices, **kw)
    sync_or_die("kernel_fwd_pair_cache", f"unaligned q, q_gate {q_gate}", HANG_S)
    want = kmod.run_sparse_mla_fwd(q, kv8, indices, **kw)
    for name, a, b in zip(("out", "lse", "max_logits"), got, want):
        assert torch.equal(a, b), f"{name}: the unaligned q gives other outputs (q_gate {q_gate})"


@pytest.mark.parametrize("staging", ["converter", "converter_contig", "consumer"])
@pytest.mark.parametrize("max_exp", [12, 7])
def test_sparse_mla_fwd_pair_cache_every_e4m3_code(staging, max_exp):
    """Every finite e4m3 byte (subnormals and both zeros included) in every latent position, under power-of-two
    scales from 2^-13 to 2^max_exp (above 2^7 the conversion takes its two-multiply path; with 2^7 at most,
    "converter_contig" takes its one-multiply path in every warp): bitwise the bf16 pair kernel on
    ``dequantize_kv_fp8`` of the same cache, so no conversion flushes or rounds anything."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    heads, tkv, topk, n_tok = 64, 512, 256, 40
    kv8 = quantize_kv_fp8((torch.randn(tkv, DQK, generator=gen, device="cuda") * 0.1).to(torch.bfloat16))
    codes = (torch.arange(512, device="cuda")[None, :] * 5 + torch.arange(tkv, device="cuda")[:, None] * 3) % 256
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)  # 0x7F / 0xFF: the format's NaN, never stored
    kv8[:, :512] = codes.to(torch.uint8)
    exps = torch.randint(-13, max_exp + 1, (tkv, 4), generator=gen, device="cuda").float()
    kv8[:, 512:528] = torch.exp2(exps).contiguous().view(torch.uint8)
    kv_deq = dequantize_kv_fp8(kv8)
    q = (torch.randn(n_tok, heads, DQK, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    idx = torch.randint(0, tkv, (n_tok, topk), generator=gen, device="cuda", dtype=torch.int32)
    kw = dict(sm_scale=DQK**-0.5, d_v=D_V)
    got = kmod.run_sparse_mla_fwd(q, kv8, idx, staging=staging, **kw)
    sync_or_die(f"kernel_fwd_pair_cache {staging}", "every e4m3 code", HANG_S)
    want = kernel_fwd_pair.run_sparse_mla_fwd(q, kv_deq, idx, **kw)
    for name, a, b in zip(("out", "lse", "max_logits"), got, want):
        assert torch.equal(a, b), f"{name}: {staging} differs from kernel_fwd_pair on the dequantized cache"
