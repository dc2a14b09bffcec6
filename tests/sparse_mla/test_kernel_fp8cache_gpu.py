"""GPU: the sparse MLA forward on the 656-byte FP8 cache (``kernel_fwd_fp8cache``) against the reference on
``dequantize_kv_fp8(kv)`` (dequantization is exact, so quantization error is excluded) with the bf16 forward's
tolerances.  Run with ``pytest -m gpu``.

Unreferenced cache rows are poisoned byte-wise (0xFF: NaN e4m3 / NaN scale / NaN rope; 0x7F: NaN e4m3, scale
3.4e38, rope 3.4e38) so any stray read of them shows up.  Speed: ``flashdsa bench --op sparse_mla_fwd_fp8``.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.quant import dequantize_kv_fp8, quantize_kv_fp8  # noqa: E402
from flashdsa.sparse import kernel_fwd_fp8cache  # noqa: E402

from .test_kernel_gpu import _make_inputs, check_against_reference  # noqa: E402

D_V = 512
DQK = 576

# (heads, tkv, topk, n_tok, sink, topk_length, kv row stride in bytes)
CASES = [
    (128, 8192, 2048, 62, False, False, 656),
    (128, 8192, 2048, 213, True, True, 672),  # padded rows: the kernel reads the cache in place
    (64, 1840, 256, 62, True, True, 656),
    (16, 592, 100, 213, False, True, 656),
    (1, 4096, 100, 62, True, False, 704),
    # H 33..63 and 65..127: this module's own pipelined kernel (heads padded to 64), no other form takes them
    (48, 1840, 256, 62, True, True, 656),
    (100, 4096, 2048, 213, False, True, 672),
]


def _fp8_cache(kv_bf16, row_stride, gen):
    """Quantize (NaN rows -> 0 first), lay the rows out with ``row_stride`` bytes, poison the unreferenced rows and
    the padding bytes.  Returns (kv uint8 [Tkv, 656] view, its exact bf16 dequantization)."""
    tkv = kv_bf16.shape[0]
    unref = torch.isnan(kv_bf16).any(dim=1)
    packed = quantize_kv_fp8(torch.where(unref.unsqueeze(1), torch.zeros_like(kv_bf16), kv_bf16))
    poison = torch.where(torch.rand(tkv, generator=gen, device="cuda") < 0.5, 0xFF, 0x7F).to(torch.uint8)
    packed[unref] = poison[unref].unsqueeze(1).expand(-1, packed.shape[1])
    base = torch.full((tkv, row_stride), 0xFF, dtype=torch.uint8, device="cuda")
    base[:, :656] = packed
    kv8 = base[:, :656]
    return kv8, dequantize_kv_fp8(kv8)


@pytest.mark.parametrize(
    "heads,tkv,topk,n_tok,sink,use_tl,row_stride",
    CASES,
    ids=[f"h{c[0]}-kv{c[1]}-k{c[2]}-t{c[3]}{'-sink' if c[4] else ''}{'-tl' if c[5] else ''}-rs{c[6]}" for c in CASES],
)
def test_sparse_mla_fwd_fp8cache(heads, tkv, topk, n_tok, sink, use_tl, row_stride):
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(DQK, heads, tkv, topk, n_tok, sink, use_tl, "contig")
    gen = torch.Generator(device="cuda").manual_seed(7)
    kv8, kv_deq = _fp8_cache(kv, row_stride, gen)
    assert kv8.stride(0) == row_stride
    sm_scale = DQK**-0.5
    assert kernel_fwd_fp8cache.kernel_unsupported(
        q, kv8, indices, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink
    ) is None

    out, lse, max_logits = kernel_fwd_fp8cache.run_sparse_mla_fwd(
        q, kv8, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink
    )
    torch.cuda.synchronize()
    check_against_reference(out, lse, max_logits, q, kv_deq, indices, sm_scale, topk_length, attn_sink, valid)


def test_fp8cache_unsupported_reasons():
    q = torch.zeros(4, 16, DQK, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(4, 64, dtype=torch.int32, device="cuda")
    kv8 = torch.zeros(32, 656, dtype=torch.uint8, device="cuda")
    assert kernel_fwd_fp8cache.kernel_unsupported(q, kv8, idx, d_v=D_V) is None
    assert kernel_fwd_fp8cache.kernel_unsupported(q, kv8.view(torch.int8), idx, d_v=D_V) is not None
    assert kernel_fwd_fp8cache.kernel_unsupported(q, torch.zeros(32, 664, dtype=torch.uint8, device="cuda")[:, :656],
                                                  idx, d_v=D_V) is not None  # row stride not a multiple of 16
    assert kernel_fwd_fp8cache.kernel_unsupported(q[..., :512], kv8, idx, d_v=D_V) is not None


