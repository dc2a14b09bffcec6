"""Issue #4's criteria for indexer logits against their reference, shared by the GPU indexer tests.

A plain module (no ``pytest.skip`` at import), so the contract tests' CPU variants can use it too."""

import math

import torch

TOL = 5e-6


def check_close(out, ref):
    """float32, no NaN, the -inf mask exactly the reference's, and 1 - 2<x,y>/(<x,x>+<y,y>) < TOL on the rest."""
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in the output (unwritten or poisoned element)"
    ref_inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(out), ref_inf), "-inf mask differs"
    assert (out[ref_inf] == -math.inf).all()
    x = out[~ref_inf].double()
    y = ref[~ref_inf].double()
    den = (x * x).sum() + (y * y).sum()
    err = 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)
    assert err < TOL, f"relative error {err:.3e} >= {TOL}"
