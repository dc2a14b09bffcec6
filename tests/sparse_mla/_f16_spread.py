"""GPU helper shared by the f16-product tests over the 656-byte cache: rows whose 128-dim tiles are scaled by
2^k, k uniform in [-spread, spread], and heads of q by 2^j, j in [-8, 4]."""

import torch

from flashdsa.sparse.reference import sparse_mla_fwd_reference

from .test_kernel_fp8cache_gpu import _fp8_cache
from .test_kernel_gpu import _make_inputs, check_against_reference

D_V = 512
DQK = 576


def check_f16_spread(heads: int, spread: int, run_f16, run_bf16, tkv: int = 2048, topk: int = 512, n_tok: int = 24):
    """``run_f16`` / ``run_bf16``: ``(q, kv8, indices, **kw) -> (out, lse, max_logits)``.  Spread <= 4: the f16
    outputs within the usual tolerances of the reference.  Larger spreads (values up to ~300, outputs that cancel to
    near 0: no bf16-output kernel meets the absolute tolerance there): errors against the float64 reference no
    larger than those of ``run_bf16`` (x 1.25)."""
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(DQK, heads, tkv, topk, n_tok, True, True, "contig",
                                                                 seed=3)
    gen = torch.Generator(device="cuda").manual_seed(11)
    k = torch.randint(-spread, spread + 1, (tkv, 4, 1), generator=gen, device="cuda").float()
    kv = kv.clone()
    kv[:, :D_V] = (kv[:, :D_V].float().view(tkv, 4, 128) * torch.exp2(k)).view(tkv, D_V).to(torch.bfloat16)
    j = torch.randint(-8, 5, (1, heads, 1), generator=gen, device="cuda").float()
    q = (q.float() * torch.exp2(j)).to(torch.bfloat16)
    kv8, kv_deq = _fp8_cache(kv, 656, gen)
    kw = dict(sm_scale=DQK**-0.5, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink)
    out, lse, max_logits = run_f16(q, kv8, indices, **kw)
    torch.cuda.synchronize()
    if spread <= 4:
        check_against_reference(out, lse, max_logits, q, kv_deq, indices, DQK**-0.5, topk_length, attn_sink, valid)
        return
    out_bf, lse_bf, _ = run_bf16(q, kv8, indices, **kw)
    ref_out, ref_lse, _ = sparse_mla_fwd_reference(q.double(), kv_deq.double(), indices, sm_scale=DQK**-0.5,
                                                   d_v=D_V, attn_sink=attn_sink, topk_length=topk_length)
    assert torch.isfinite(out.float()).all()
    fin = torch.isfinite(ref_lse)  # empty rows: lse +inf
    assert torch.equal(lse[~fin].double(), ref_lse[~fin])
    for got, base, ref in ((out, out_bf, ref_out), (lse[fin], lse_bf[fin], ref_lse[fin])):
        err = (got.double() - ref).abs().max().item()
        err_bf = (base.double() - ref).abs().max().item()
        assert err <= 1.25 * err_bf + 1e-6, (err, err_bf)
