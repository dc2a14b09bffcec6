"""CPU: the numerics of ``kernel_fwd_mma656`` (the H <= 16 decode over the 656-byte cache), emulated per token with
its roundings: Q' = f16(q 2^-e) per (dim half, head), K and V as the exact e4m3 values, S in true units per tile, the
lazy exp reference (moves only when a chunk's max exceeds it by more than 2^8 in the exp2 domain), P'' = f16(P s /
sigma) with sigma the running largest tile scale of the group, four key groups of every fourth 16-key chunk merged at
the end.  Against the float64 reference on the dequantized cache, with the GPU tests' tolerances."""

import math

import pytest
import torch

from flashdsa.quant import dequantize_kv_fp8, quantize_kv_fp8
from flashdsa.sparse.reference import sparse_mla_fwd_reference

LOG2E = 1.0 / math.log(2.0)


def _q_f16(q):
    """(Q' [H, 512] f16, 2^e [H, 2]) per dim half: each head's largest times 2^-e in [2^13, 2^14)."""
    halves = q[:, :512].float().view(-1, 2, 256)
    amax = halves.abs().amax(-1)
    ex = torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.zeros_like(amax))
    sh = (13 - ex).clamp(-120, 120)
    q16 = (halves * torch.exp2(sh)[..., None]).to(torch.float16).view(-1, 512)
    return q16, torch.exp2(-sh)


def _emulate(q, kv8, idx, sm_scale, groups=4, chunk=16, tau=8.0):
    """out [H, 512] f64, lse [H] f64 of one token as the kernel computes them (idx: its valid rows, in order)."""
    c = sm_scale * LOG2E
    lat = kv8[:, :512].contiguous().view(torch.float8_e4m3fn).double().view(-1, 4, 128)
    scale = kv8[:, 512:528].contiguous().view(torch.float32).double()  # [rows, 4]
    rope = kv8[:, 528:].contiguous().view(torch.bfloat16).double()
    q16, qf = _q_f16(q)
    qd = q16.double().view(-1, 4, 128)
    H = q.shape[0]
    parts = []
    for g in range(groups):
        m = torch.full((H,), -1e30, dtype=torch.float64)
        l_sum = torch.zeros(H, dtype=torch.float64)
        o = torch.zeros(H, 4, 128, dtype=torch.float64)
        sig = torch.zeros(4, dtype=torch.float64)
        for c0 in range(g * chunk, idx.numel(), groups * chunk):
            rows = idx[c0:c0 + chunk]
            # S: per tile Q'_t K8_t times the row's tile scale; the half's 2^e; the bf16 rope
            st = torch.einsum("htd,ktd->hkt", qd, lat[rows]) * scale[rows][None]
            s = (st[..., :2].sum(-1) * qf[:, 0:1] + st[..., 2:].sum(-1) * qf[:, 1:2]
                 + q[:, 512:].double() @ rope[rows].T).float().double()
            mx = s.amax(-1)
            up = (mx - m) * c > tau
            new_m = torch.where(up, mx, m)
            alpha = torch.exp2((m - new_m) * c)
            m, l_sum, o = new_m, l_sum * alpha, o * alpha[:, None, None]
            p = torch.exp2(s * c - (m * c)[:, None]).float().double()
            l_sum = l_sum + p.sum(-1)
            cm = scale[rows].amax(0)
            grow = cm > sig
            o = torch.where(grow[None, :, None] & (sig > 0)[None, :, None], o * (sig / cm)[None, :, None], o)
            sig = torch.where(grow, cm, sig)
            p16 = (p[:, :, None] * (scale[rows] / sig.clamp_min(1e-300))[None]).to(torch.float16).double()
            o = o + torch.einsum("hkt,ktd->htd", p16, lat[rows])
        parts.append((m, l_sum, o * sig[None, :, None]))
    big_m = torch.stack([p[0] for p in parts]).amax(0)
    w = [torch.exp2((p[0] - big_m) * c) for p in parts]
    big_l = sum(p[1] * wi for p, wi in zip(parts, w))
    out = sum(p[2] * wi[:, None, None] for p, wi in zip(parts, w)).view(H, 512) / big_l[:, None]
    return out, (torch.log2(big_l) + big_m * c) / LOG2E


@pytest.mark.parametrize("heads,topk,spread,seed", [(16, 2048, 0, 0), (16, 300, 4, 1), (3, 100, 10, 2)])
def test_mma656_emulation_matches_reference(heads, topk, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = 4096
    kv = torch.randn(rows, 576, generator=gen) * 0.5
    k = torch.randint(-spread, spread + 1, (rows, 4, 1), generator=gen).float()
    kv[:, :512] = (kv[:, :512].view(rows, 4, 128) * torch.exp2(k)).view(rows, 512)
    kv8 = quantize_kv_fp8(kv.to(torch.bfloat16))
    q = (torch.randn(heads, 576, generator=gen) * 2.0).to(torch.bfloat16)
    idx = torch.randperm(rows, generator=gen)[:topk]
    sm_scale = 576 ** -0.5
    out, lse = _emulate(q, kv8, idx, sm_scale)
    ref_out, ref_lse, _ = sparse_mla_fwd_reference(q.double()[None], dequantize_kv_fp8(kv8).double(),
                                                   idx[None].int(), sm_scale=sm_scale, d_v=512)
    ref_out, ref_lse = ref_out[0], ref_lse[0]
    # the bf16-output tolerances of the GPU tests (out abs 8e-4 or rel 3/128; lse abs 1e-6 or rel 2/65536)
    assert ((out - ref_out).abs() <= 8e-4 + 3 / 128 * ref_out.abs()).all()
    assert ((lse - ref_lse).abs() <= 1e-6 + 2 / 65536 * ref_lse.abs()).all()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref_out.flatten(), dim=0)
    assert 1 - cos < 7e-6


def test_lazy_reference_bounds_p():
    """With the exp reference moving only past 2^8, P stays <= 2^8: one chunk's scores rising by 7 (in exp2 units)
    above the first chunk's keep the old reference (P up to 2^7), a rise by 9 moves it (P <= 1 again)."""
    for rise, moved in ((7.0, False), (9.0, True)):
        m = torch.tensor([0.0], dtype=torch.float64)
        mx = torch.tensor([rise], dtype=torch.float64)
        up = (mx - m) > 8.0
        assert bool(up) is moved
        ref = torch.where(up, mx, m)
        assert torch.exp2(mx - ref).item() <= 2 ** 8
