"""CPU: the f16 operands of ``kernel_fwd_narrow656_dual``'s "ring_er_f16" form (the H <= 16 default over the
656-byte cache), emulated with the kernel's roundings, against the exact bf16 dequantization the reference uses.
For the format's power-of-two scales: K' = f16(e4m3) * f16(s / sigma) and Q' = f16(q * sigma * 2^-e) are exact,
so 2^e K' Q'^T equals the reference's latent scores up to float64 summation order; a row whose tile scale lies
more than 2^14 below the token's largest loses low bits within the documented bound (2^-25 sigma)."""

import pytest
import torch

from flashdsa.quant import dequantize_kv_fp8, quantize_kv_fp8

pytest.importorskip("tilelang")
from flashdsa.sparse.kernel_fwd_narrow656_dual import Q_F16_TOP  # noqa: E402


def _f16_operands(kv8, q):
    """(K' [T, 512] f16, Q' [H, 512] f16, 2^e [H], sigma [4]) as the kernel forms them (every row valid)."""
    lat = kv8[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    scales = kv8[:, 512:528].contiguous().view(torch.float32)  # [T, 4]
    sigma = scales.amax(0).clamp_min(1e-30)
    ratio = (scales / sigma).to(torch.float16)  # cvt.rn.f16x2.f32 of s * (1 / sigma): exact for powers of two
    k16 = (lat.to(torch.float16) * ratio[:, :, None]).view(-1, 512)  # cvt e4m3 -> f16 (exact), mul.rn.f16x2
    qs = q[:, :512].float() * sigma.repeat_interleave(128)
    amax = qs.abs().amax(-1).clamp_min(1e-30)
    p2 = torch.exp2(torch.floor(torch.log2(amax)))  # fdsa_pow2_floor (exact here: log2 of a float's exponent)
    q16 = (qs * (Q_F16_TOP / p2)[:, None]).to(torch.float16)
    return k16, q16, p2 / Q_F16_TOP, sigma


def _cache(gen, rows, spread):
    kv = torch.randn(rows, 576, generator=gen) * 0.1
    k = torch.randint(-spread, spread + 1, (rows, 4, 1), generator=gen).float()
    kv[:, :512] = (kv[:, :512].view(rows, 4, 128) * torch.exp2(k)).view(rows, 512)
    kv8 = quantize_kv_fp8(kv.to(torch.bfloat16))
    return kv8, dequantize_kv_fp8(kv8)


def test_f16_operands_exact_for_power_of_two_scales():
    gen = torch.Generator().manual_seed(0)
    kv8, deq = _cache(gen, 300, spread=6)
    j = torch.randint(-8, 5, (16, 1), generator=gen).float()
    q = (torch.randn(16, 576, generator=gen) * 0.1 * torch.exp2(j)).to(torch.bfloat16)
    k16, q16, qscale, sigma = _f16_operands(kv8, q)
    # each operand exact: K' sigma = the dequantized latent, Q' 2^e / sigma = q
    assert torch.equal(k16.double().view(-1, 4, 128) * sigma.double()[:, None], deq[:, :512].double().view(-1, 4, 128))
    back = q16.double() * qscale.double()[:, None] / sigma.double().repeat_interleave(128)
    assert torch.equal(back, q[:, :512].double())
    s_f16 = (k16.double() @ q16.double().T) * qscale.double()
    s_ref = deq[:, :512].double() @ q[:, :512].double().T
    torch.testing.assert_close(s_f16, s_ref, rtol=1e-12, atol=1e-300)
    assert q16.abs().max() < 2**14  # inside f16's range with a binade to spare


def test_f16_operands_far_below_sigma_lose_low_bits_within_bound():
    # one row's tiles at ~1000 (scale 2^2..2^3), the others at ~1e-3 (the writer's scale floor, 2^-13): ratio 2^-16
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(64, 576, generator=gen) * 1e-3
    kv[0, :512] = torch.randn(512, generator=gen) * 1000
    kv8 = quantize_kv_fp8(kv.to(torch.bfloat16))
    deq = dequantize_kv_fp8(kv8)[:, :512].double()
    q = torch.randn(16, 576, generator=gen).to(torch.bfloat16)
    k16, _, _, sigma = _f16_operands(kv8, q)
    got = (k16.double().view(-1, 4, 128) * sigma.double()[:, None]).view(-1, 512)
    err = (got - deq).abs()
    assert torch.equal(got[0], deq[0])  # the row at sigma: exact
    bound = 2.0**-25 * sigma.double().repeat_interleave(128)
    assert (err <= bound).all()
    assert (err[1:] > 0).any()  # the small rows did lose bits (f16 subnormals)
