"""GPU: ``kernel_fwd_rs656`` (both products on register-A wgmma over the raw 656-byte rows) against the reference on
the exactly dequantized cache, over ``test_kernel_pair_cache_gpu``'s cases (unreferenced rows poisoned, outputs
poisoned before launch), every e4m3 code under small and large scales, and bad heads."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.quant import dequantize_kv_fp8, quantize_kv_fp8  # noqa: E402
from flashdsa.sparse import kernel_fwd_rs656 as kmod  # noqa: E402

from ._hang import sync_or_die  # noqa: E402
from .test_kernel_fp8cache_gpu import _fp8_cache  # noqa: E402
from .test_kernel_gpu import _make_inputs, _poison_allocator, check_against_reference  # noqa: E402
from .test_kernel_pair_cache_gpu import CASES  # noqa: E402

D_V = 512
DQK = 576
HANG_S = 30.0


@pytest.mark.parametrize(
    "heads,tkv,topk,n_tok,sink,use_tl,layout,row_stride", CASES,
    ids=[f"h{c[0]}-kv{c[1]}-k{c[2]}-t{c[3]}{'-sink' if c[4] else ''}{'-tl' if c[5] else ''}-{c[6]}-rs{c[7]}"
         for c in CASES])
def test_sparse_mla_fwd_rs656(heads, tkv, topk, n_tok, sink, use_tl, layout, row_stride):
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(DQK, heads, tkv, topk, n_tok, sink, use_tl, layout)
    kv8, kv_deq = _fp8_cache(kv, row_stride, torch.Generator(device="cuda").manual_seed(5))
    sm_scale = DQK**-0.5
    _poison_allocator((n_tok, heads, D_V), (n_tok, heads), (n_tok, heads))
    out = kmod.run_sparse_mla_fwd(q, kv8, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length,
                                  attn_sink=attn_sink)
    sync_or_die("kernel_fwd_rs656", f"H={heads} Tkv={tkv} topk={topk} T={n_tok} rs={row_stride}", HANG_S)
    check_against_reference(*out, q, kv_deq, indices, sm_scale, topk_length, attn_sink, valid)
    again = kmod.run_sparse_mla_fwd(q, kv8, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length,
                                    attn_sink=attn_sink)
    for name, a, b in zip(("out", "lse", "max_logits"), out, again):
        assert torch.equal(a, b), f"{name}: two runs differ"


@pytest.mark.parametrize("max_exp", [12, 7])
def test_sparse_mla_fwd_rs656_every_e4m3_code(max_exp):
    """Every finite e4m3 byte (subnormals and both zeros included) in every latent position, under power-of-two
    scales from 2^-13 to 2^max_exp (above 2^7 the conversions take their two-multiply paths)."""
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
    # small q: the huge dequantized values must not push the scores out of the softmax's useful range
    q = q * 2.0 ** (-max_exp - 4)
    idx = torch.randint(0, tkv, (n_tok, topk), generator=gen, device="cuda", dtype=torch.int32)
    sm_scale = DQK**-0.5
    got = kmod.run_sparse_mla_fwd(q, kv8, idx, sm_scale=sm_scale, d_v=D_V)
    sync_or_die("kernel_fwd_rs656", "every e4m3 code", HANG_S)
    valid = torch.ones_like(idx, dtype=torch.bool)
    check_against_reference(*got, q, kv_deq, idx, sm_scale, None, None, valid)


def test_sparse_mla_fwd_rs656_unsupported():
    q = torch.zeros(2, 16, DQK, dtype=torch.bfloat16, device="cuda")
    kv8 = torch.zeros(8, 656, dtype=torch.uint8, device="cuda")
    idx = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="H=16"):
        kmod.run_sparse_mla_fwd(q, kv8, idx, sm_scale=0.1, d_v=D_V)
