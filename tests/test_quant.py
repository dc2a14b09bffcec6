"""FP8 formats: the 656-byte KV record field by field, exact dequantization, quantize_fp8 scales and error bound."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, strategies as st

import flashdsa
from oracles import E4M3_TABLE, e4m3_encode, kv_fp8_pack_oracle, kv_fp8_unpack_oracle


def test_e4m3_oracle_matches_torch_decoding():
    """Sanity of the oracle's own table against torch's float8_e4m3fn (codes 0x7F/0xFF are NaN)."""
    codes = torch.arange(256, dtype=torch.uint8)
    t = codes.view(torch.float8_e4m3fn).double()
    nan = torch.isnan(E4M3_TABLE)
    assert torch.equal(nan, torch.isnan(t)) and nan.sum() == 2
    assert torch.equal(t[~nan], E4M3_TABLE[~nan])
    assert E4M3_TABLE[0x7E] == 448.0 and E4M3_TABLE[1] == 2.0**-9


def _kv_rows(g, n, spread=True):
    x = torch.randn(n, 576, generator=g)
    if spread:  # very different magnitudes per tile, incl. tiny tiles that hit the 1e-4 scale floor
        x[:, :512] *= torch.tensor([1.0, 1e3, 1e-6, 7.0]).repeat_interleave(128)
        x[0, 128:256] = 0.0
        x[1, 384:512] = 448.0 * 2.0**-3  # amax/448 exactly a power of two
        x[2, :128] = -1e-3
    return x.bfloat16()


def test_quantize_kv_fp8_byte_layout_field_by_field(gen):
    kv = _kv_rows(gen, 6)
    packed = flashdsa.quantize_kv_fp8(kv)
    assert packed.shape == (6, 656) and packed.dtype == torch.uint8
    for r in range(kv.shape[0]):
        got = bytes(packed[r].tolist())
        want = kv_fp8_pack_oracle(kv[r])
        assert got[512:528] == want[512:528], f"row {r}: scales"
        assert got[528:] == want[528:], f"row {r}: rope bf16 bytes"
        assert got[:512] == want[:512], f"row {r}: e4m3 bytes"
        for t, s in enumerate(struct.unpack("<4f", got[512:528])):
            m, e = math.frexp(s)
            assert m == 0.5, f"scale {s} is not a power of two"
            amax = float(kv[r, t * 128:(t + 1) * 128].float().abs().max())
            assert s == 2.0 ** math.ceil(math.log2(max(amax / 448.0, 1e-4)))


def test_dequantize_kv_fp8_vs_oracle_and_exact(gen):
    kv = _kv_rows(gen, 5)
    packed = flashdsa.quantize_kv_fp8(kv)
    deq = flashdsa.dequantize_kv_fp8(packed)
    assert deq.shape == (5, 576) and deq.dtype == torch.bfloat16
    for r in range(5):
        assert torch.equal(deq[r].double(), kv_fp8_unpack_oracle(bytes(packed[r].tolist())))
    assert torch.equal(deq[:, 512:], kv[:, 512:]), "rope dims are stored losslessly"
    # idempotent: quantizing what was dequantized reproduces it bitwise (and the same bytes)
    again = flashdsa.quantize_kv_fp8(deq)
    assert torch.equal(flashdsa.dequantize_kv_fp8(again), deq)
    assert torch.equal(again, packed)


@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=3), log_mag=st.integers(-20, 8),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 2**31 - 1))
def test_kv_fp8_round_trip_property(lead, log_mag, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(*lead, 576, generator=g) * 2.0**log_mag).to(dtype)
    packed = flashdsa.quantize_kv_fp8(kv)
    assert packed.shape == (*lead, 656)
    deq = flashdsa.dequantize_kv_fp8(packed)
    assert deq.shape == (*lead, 576) and not torch.isnan(deq).any()
    assert torch.equal(flashdsa.dequantize_kv_fp8(flashdsa.quantize_kv_fp8(deq)), deq)
    scales = packed[..., 512:528].contiguous().view(torch.float32)
    m, _ = torch.frexp(scales)
    assert (m == 0.5).all()
    # per-element error: half an e4m3 step (relative 2**-4) or half the subnormal step 2**-10 * scale
    x = kv[..., :512].double().unflatten(-1, (4, 128))
    d = deq[..., :512].double().unflatten(-1, (4, 128))
    bound = x.abs() * 2.0**-4 + scales.double().unsqueeze(-1) * 2.0**-10
    assert ((x - d).abs() <= bound * (1 + 1e-9) + x.abs() * 2.0**-8).all()  # + one bf16 rounding of the output


def test_quantize_kv_fp8_strided_input(gen):
    big = _kv_rows(gen, 8)
    kv = big[::2]
    assert torch.equal(flashdsa.quantize_kv_fp8(kv), flashdsa.quantize_kv_fp8(kv.contiguous()))
    packed = flashdsa.quantize_kv_fp8(big)
    wide = torch.zeros(8, 700, dtype=torch.uint8)
    wide[:, 10:666] = packed
    assert torch.equal(flashdsa.dequantize_kv_fp8(wide[:, 10:666]), flashdsa.dequantize_kv_fp8(packed))


# --------------------------------------------------------------------------------------------- quantize_fp8
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_fp8_vs_oracle(block, pow2, dtype, gen):
    x = (torch.randn(3, 2, 256, generator=gen) * torch.logspace(-3, 3, 256)).to(dtype)
    x[0, 0, :block] = 0.0  # an all-zero block
    xq, scale = flashdsa.quantize_fp8(x, block=block, pow2_scale=pow2)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (3, 2, 256 // block)
    xb = x.double().unflatten(-1, (256 // block, block))
    amax = xb.abs().amax(-1).clamp_min(1e-10)
    want = amax / 448.0
    if pow2:
        m, _ = torch.frexp(scale)
        assert (m == 0.5).all(), "pow2 scales must be powers of two"
        assert (scale.double() >= want * (1 - 1e-6)).all() and (scale.double() < 2 * want * (1 + 1e-6)).all()
    else:
        torch.testing.assert_close(scale.double(), want, rtol=1e-6, atol=0)
    # the e4m3 codes are the round-to-nearest-even of x / scale (computed in float32, like the op)
    ratio = (x.float().unflatten(-1, (256 // block, block)) / scale.unsqueeze(-1)).clamp(-448, 448)
    assert torch.equal(xq.view(torch.uint8).flatten(), e4m3_encode(ratio.double().flatten()))
    # error bound: relative 2**-4 (half an e4m3 step), or 2**-10 * scale below the normal range
    deq = xq.double().unflatten(-1, (256 // block, block)) * scale.double().unsqueeze(-1)
    bound = xb.abs() * 2.0**-4 + scale.double().unsqueeze(-1) * 2.0**-10
    assert ((deq - xb).abs() <= bound * (1 + 1e-6)).all()


def test_quantize_fp8_strided_and_1d(gen):
    x = torch.randn(4, 300, generator=gen)[:, 10:266]
    a = flashdsa.quantize_fp8(x)
    b = flashdsa.quantize_fp8(x.contiguous())
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
    xq, s = flashdsa.quantize_fp8(torch.randn(128))
    assert xq.shape == (128,) and s.shape == (1,)
