"""GPU: ``kernel_fwd_pair_fp8`` (e4m3 q and KV, both products on FP8 wgmma, the pair schedule, the PV as
O^T = V^T P'^T with V^T from registers, two K sets in flight) against the
reference on the dequantized inputs, with the FP8 forward's inputs and tolerances (test_kernel_fp8_gpu.py:
duplicates, ~10 % invalid indices, empty rows, +-inf sinks, topk_length incl. 0 / negative / > topk, strided q,
NaN bytes and NaN scales in every unreferenced kv row), outputs poisoned, and a second launch bitwise equal to
the first.  A hung producer / consumer protocol aborts the run (``_hang.sync_or_die``).
Compiles: one per (Dqk, H, ceil(topk / 64), sink, topk_length) below (7)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.sparse import kernel_fwd_fp8, kernel_fwd_pair_fp8 as kmod  # noqa: E402

from ._hang import sync_or_die  # noqa: E402
from .test_kernel_fp8_gpu import _check, _fp8_inputs  # noqa: E402

D_V = 512
HANG_S = 30.0

# (dqk, heads, tkv, topk, n_tok, sink, topk_length, q layout); small cases first
CASES = [
    (576, 128, 64, 256, 3, True, True, "contig"),  # tiny: full / clamped / empty rows
    (576, 64, 592, 200, 62, True, True, "sliced"),  # tail block masked, odd block count
    (576, 128, 128, 130, 213, True, True, "transposed"),  # topk > Tkv (duplicates), half-used last pair
    (576, 64, 4096, 100, 213, True, True, "contig"),
    (576, 128, 8192, 2048, 62, False, False, "contig"),  # the headline config
    (512, 64, 1840, 192, 62, True, True, "transposed"),
    (512, 128, 4096, 640, 62, False, False, "contig"),  # DeepSeek-V4 topk
]


@pytest.mark.parametrize(
    "dqk,heads,tkv,topk,n_tok,sink,use_tl,layout",
    CASES,
    ids=[f"d{c[0]}-h{c[1]}-kv{c[2]}-k{c[3]}-t{c[4]}{'-sink' if c[5] else ''}{'-tl' if c[6] else ''}-{c[7]}"
         for c in CASES],
)
def test_sparse_mla_fwd_pair_fp8(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout):
    q8, q_scale, kv8, kv_scale, indices, topk_length, attn_sink, valid = _fp8_inputs(
        dqk, heads, tkv, topk, n_tok, sink, use_tl, layout)
    sm_scale = dqk**-0.5
    kw = dict(q_scale=q_scale, kv_scale=kv_scale, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length,
              attn_sink=attn_sink)
    assert kmod.kernel_unsupported(q8, kv8, indices, q_scale=q_scale, kv_scale=kv_scale, d_v=D_V,
                                   topk_length=topk_length, attn_sink=attn_sink) is None
    what = f"dqk={dqk} H={heads} Tkv={tkv} topk={topk} T={n_tok} sink={sink} tl={use_tl} {layout}"
    out = kmod.run_sparse_mla_fwd_fp8(q8, kv8, indices, **kw)
    sync_or_die("kernel_fwd_pair_fp8", what, HANG_S)
    _check(*out, q8, q_scale, kv8, kv_scale, indices, sm_scale, topk_length, attn_sink, valid)
    # the dispatcher picks this kernel for H 64 / 128; a second launch is bitwise identical
    again = kernel_fwd_fp8.run_sparse_mla_fwd_fp8(q8, kv8, indices, **kw)
    sync_or_die("kernel_fwd_pair_fp8", what + " (second launch)", HANG_S)
    for name, a, b in zip(("out", "lse", "max_logits"), out, again):
        assert torch.equal(a, b), f"{name}: a second launch differs"


def test_sparse_mla_fwd_pair_fp8_unsupported():
    q = torch.zeros(2, 16, 576, dtype=torch.float8_e4m3fn, device="cuda")
    kv = torch.zeros(8, 576, dtype=torch.float8_e4m3fn, device="cuda")
    idx = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    qs = torch.ones(2, 16, device="cuda")
    ks = torch.ones(8, device="cuda")
    assert kmod.kernel_unsupported(q, kv, idx, q_scale=qs, kv_scale=ks, d_v=D_V) is not None
    with pytest.raises(ValueError, match="H=16"):
        kmod.run_sparse_mla_fwd_fp8(q, kv, idx, q_scale=qs, kv_scale=ks, sm_scale=0.1, d_v=D_V)
