"""Issue #6's tolerances for a decode output against its reference, shared by the GPU decode tests.

A plain module (no ``pytest.skip`` at import), so the contract tests' CPU variants can use it too."""

import torch


def check_close(out, lse, ref_out, ref_lse):
    """out within abs 1e-3 or rel 2/128 elementwise and cosine distance <= 5e-6; finite lse within rel 8/65536 (or
    abs 8/65536 where |lse| < 1: a single visible key near 0 puts fp32 rounding of the score above any relative
    bound); empty rows (reference lse = +inf) give lse = +inf and out = 0; no NaN anywhere."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    o, r = out.double(), ref_out.double()
    err = (o - r).abs()
    ok = (err <= 1e-3) | (err <= (2 / 128) * r.abs())
    assert ok.all(), f"out: max abs err {err.max().item():.3e} at {tuple(int(i) for i in (~ok).nonzero()[0])}"
    n_o, n_r = o.flatten(), r.flatten()
    denom = n_o.norm() * n_r.norm()
    if denom > 0:
        cos_dist = 1 - (n_o @ n_r) / denom
        assert cos_dist <= 5e-6, f"cosine distance {cos_dist.item():.3e}"
    inf_k, inf_r = torch.isinf(lse), torch.isinf(ref_lse)
    assert torch.equal(inf_k, inf_r), "empty rows (lse = +inf) differ"
    if inf_r.any():
        assert (lse[inf_r] > 0).all(), "empty rows must give lse = +inf"
        assert (out[inf_r] == 0).all(), "empty rows must give out = 0"
    fin = ~inf_r
    if fin.any():
        d = (lse[fin].double() - ref_lse[fin].double()).abs()
        rel = d / ref_lse[fin].double().abs().clamp_min(1e-30)
        ok = (rel <= 8 / 65536) | (d <= 8 / 65536)
        assert ok.all(), f"lse: max rel err {rel.max().item():.3e}"
