"""GPU: the FP8 (e4m3 q and KV, both products on fp8 wgmma) sparse MLA forward (kernel_fwd_fp8) against the
reference on the dequantized inputs (run with ``pytest -m gpu``).

Inputs: ``_make_inputs`` of test_kernel_gpu (bf16 N(0, 0.1^2), duplicates, ~10 % invalid indices of every
kind, empty rows, sink with +-inf, topk_length incl. 0 / negative / > topk), quantized with
``quantize_fp8(x, block=576)`` (q_scale [T, H], kv_scale [Tkv]); kv rows no valid slot references hold
0x7F bytes (NaN in e4m3fn) and a NaN scale. Reference: q8 * q_scale and kv8 * kv_scale (exact in float32)
through ``sparse_mla_fwd_reference`` in float64 (out) / float32 (lse, max_logits).
Compiles (per H, Dqk, ceil(topk/64), sm_scale, sink, topk_length, p_split): 3 cases. Speed (the timing smoke
that lived here): ``flashdsa bench --op sparse_mla_fwd_fp8`` and the kernel modules' ``--variants``.
    source .gpu/env.sh && python -m pytest tests/sparse_mla/test_kernel_fp8_gpu.py -q -s -p no:cacheprovider
"""


import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.quant import quantize_fp8  # noqa: E402
from flashdsa.sparse import kernel_fwd_fp8  # noqa: E402
from flashdsa.sparse.reference import sparse_mla_fwd_reference  # noqa: E402

from .test_kernel_gpu import _make_inputs  # noqa: E402

D_V = 512

# (dqk, heads, tkv, topk, n_tok, sink, topk_length, q layout)
CASES = [
    (576, 128, 8192, 2048, 62, False, False, "contig"),  # headline config (shares its compile with the timing)
    (576, 64, 4096, 100, 213, True, True, "sliced"),  # masked tail block, sink +-inf, topk_length, strided q
    (576, 16, 592, 128, 62, True, True, "transposed"),  # padded heads, transposed (strided) q
]


def _fp8_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout, seed=0):
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, "contig",
                                                                 seed)
    referenced = torch.zeros(tkv, dtype=torch.bool, device="cuda")
    referenced[indices[valid].long()] = True
    kv = torch.where(referenced.unsqueeze(1), kv, torch.zeros((), dtype=kv.dtype, device="cuda"))  # finite scales
    q8, q_scale = quantize_fp8(q, block=dqk)
    kv8, kv_scale = quantize_fp8(kv, block=dqk)
    q_scale, kv_scale = q_scale[..., 0].contiguous(), kv_scale[..., 0].contiguous()
    # unreferenced rows: NaN bytes and NaN scale (the kernel must never read them)
    kv8.view(torch.uint8)[~referenced] = 0x7F
    kv_scale[~referenced] = float("nan")
    if layout == "sliced":  # last dim contiguous, row stride padded
        base = torch.zeros(n_tok, heads, dqk + 64, dtype=torch.float8_e4m3fn, device="cuda")
        base[..., :dqk] = q8
        q8 = base[..., :dqk]
    elif layout == "transposed":  # [H, T, D] storage viewed as [T, H, D]
        q8 = q8.transpose(0, 1).contiguous().transpose(0, 1)
    return q8, q_scale, kv8, kv_scale, indices, topk_length, attn_sink, valid


def _dequant(q8, q_scale, kv8, kv_scale, dtype):
    return (q8.float().to(dtype) * q_scale.to(dtype).unsqueeze(-1), kv8.float().to(dtype) * kv_scale.to(dtype).unsqueeze(-1))


def _cos_dist(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (1 - (a @ b) / (a.norm() * b.norm()).clamp_min(1e-300)).item()


def _check(out, lse, max_logits, q8, q_scale, kv8, kv_scale, indices, sm_scale, topk_length, attn_sink, valid):
    n_tok, heads = q8.shape[:2]
    assert out.shape == (n_tok, heads, D_V) and out.dtype == torch.bfloat16
    assert lse.shape == (n_tok, heads) and lse.dtype == torch.float32
    assert max_logits.shape == (n_tok, heads) and max_logits.dtype == torch.float32
    kw = dict(sm_scale=sm_scale, d_v=D_V, attn_sink=attn_sink, topk_length=topk_length)
    ref_out, _, _ = sparse_mla_fwd_reference(*_dequant(q8, q_scale, kv8, kv_scale, torch.float64), indices, **kw)
    _, ref_lse, ref_max = sparse_mla_fwd_reference(*_dequant(q8, q_scale, kv8, kv_scale, torch.float32), indices, **kw)

    out64, r64 = out.double(), ref_out.double()
    assert torch.isfinite(out64).all(), "non-finite output"
    err = (out64 - r64).abs()
    ok = (err <= 2e-3) | (err <= (4 / 128) * r64.abs())
    assert ok.all(), f"out: max abs err {err.max().item():.3e}, {int((~ok).sum())} elements out of tolerance"
    if r64.norm() > 0:
        cd = _cos_dist(out64, r64)
        assert cd < 1e-4, f"out: cosine distance {cd:.3e}"
    else:
        assert out64.norm() == 0
    for name, x, r in (("lse", lse, ref_lse), ("max_logits", max_logits, ref_max)):
        x64, r64 = x.double(), r.double()
        same_inf = torch.isinf(r64) & (x64 == r64)
        e = (x64 - r64).abs()
        good = same_inf | (e <= 1e-2)
        assert not torch.isnan(x64).any(), f"{name}: NaN"
        assert good.all(), f"{name}: max err {e[~same_inf].max().item():.3e}, {int((~good).sum())} out of tolerance"
    empty = ~valid.any(dim=1)
    if empty.any():
        assert (out[empty] == 0).all()
        assert torch.isposinf(lse[empty]).all()
        assert torch.isneginf(max_logits[empty]).all()


@pytest.mark.parametrize(
    "dqk,heads,tkv,topk,n_tok,sink,use_tl,layout",
    CASES,
    ids=[f"d{c[0]}-h{c[1]}-kv{c[2]}-k{c[3]}-t{c[4]}{'-sink' if c[5] else ''}{'-tl' if c[6] else ''}-{c[7]}" for c in CASES],
)
def test_sparse_mla_fwd_fp8_kernel(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout):
    q8, q_scale, kv8, kv_scale, indices, topk_length, attn_sink, valid = _fp8_inputs(
        dqk, heads, tkv, topk, n_tok, sink, use_tl, layout)
    sm_scale = dqk**-0.5
    assert kernel_fwd_fp8.kernel_unsupported(q8, kv8, indices, q_scale=q_scale, kv_scale=kv_scale, d_v=D_V,
                                             topk_length=topk_length, attn_sink=attn_sink) is None
    out, lse, max_logits = kernel_fwd_fp8.run_sparse_mla_fwd_fp8(
        q8, kv8, indices, q_scale=q_scale, kv_scale=kv_scale, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length,
        attn_sink=attn_sink)
    torch.cuda.synchronize()
    _check(out, lse, max_logits, q8, q_scale, kv8, kv_scale, indices, sm_scale, topk_length, attn_sink, valid)


