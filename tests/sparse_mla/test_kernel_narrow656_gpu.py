"""GPU: the few-head forward over the 656-byte FP8 cache (``kernel_fwd_narrow656``: bulk row copies, keys on the
wgmma M side) against the reference on ``dequantize_kv_fp8(kv)`` with the bf16 forward's tolerances (same inputs
and poisoning as ``test_kernel_fp8cache_gpu``: unreferenced rows and row padding are NaN / huge bytes), over
head counts 1..32, both stage counts, the two-warpgroup forms of ``kernel_fwd_narrow656_dual`` (H <= 16; every
prefetch form; the f16 form also over widely spread row and head scales), ``kernel_fwd_mma656`` and its ``mma_par``
/ ``mma_ws`` builds, topk not a multiple of 64, topk > Tkv, invalid indices of every kind, empty rows, topk_length,
+/-inf sinks, padded row strides and strided q; a second launch must be bitwise equal."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.sparse import kernel_fwd_fp8cache  # noqa: E402

from .test_kernel_fp8cache_gpu import _fp8_cache  # noqa: E402

from ._f16_spread import check_f16_spread  # noqa: E402
from .test_kernel_gpu import _make_inputs, check_against_reference  # noqa: E402

D_V, DQK = 512, 576

# (heads, tkv, topk, n_tok, sink, topk_length, q layout, kv row stride in bytes, stages)
CASES = [
    (16, 4096, 2048, 40, False, False, "contig", 656, None),
    (16, 592, 100, 213, True, True, "contig", 672, None),
    (16, 300, 700, 17, True, False, "sliced", 656, 2),  # topk > Tkv: many invalid slots
    (1, 4096, 100, 62, True, False, "contig", 704, None),
    (3, 1000, 64, 9, False, True, "contig", 656, None),
    (9, 2000, 129, 33, True, True, "sliced", 656, 3),
    (17, 1840, 256, 62, True, True, "contig", 656, None),
    (32, 8192, 2048, 20, False, True, "contig", 688, None),
]
# the two-warpgroup forms (kernel_fwd_narrow656_dual): odd and even block counts, one block, empty rows, sinks
_DUAL = [(16, 4096, 2048, 40, False, False, "contig", 656), (16, 592, 100, 213, True, True, "contig", 672),
         (16, 300, 700, 17, True, False, "sliced", 656), (5, 1000, 64, 9, False, True, "contig", 656),
         (9, 2000, 129, 33, True, True, "sliced", 656)]
CASES += [c + (form,) for form in ("regs", "ring", "ring64", "ring_er", "ringx", "ring_er_f16")
          for c in _DUAL]
CASES += [c + ("ring16_er",) for c in _DUAL[1:3]]
# kernel_fwd_mma656 (per-warp mma.sync chains): groups with different step counts, more steps than stages,
# one chunk, H 1 / 3 / 16
CASES += [c + ("mma",) for c in _DUAL]
CASES += [(1, 4096, 100, 62, True, False, "contig", 704, "mma"), (3, 8192, 2048, 7, True, True, "sliced", 656, "mma"),
          (16, 8192, 2048, 20, False, False, "contig", 688, "mma"), (16, 64, 16, 5, True, False, "contig", 656, "mma")]
# its "mma_par" build (rows placed by source address bit 4): row strides of odd (656, 688) and even (672, 704)
# multiples of 16 bytes -- with even ones every row of a token is of one class, so half of them take the other
# class's slots; and the producer-warp builds "mma_ws" / "mma_ws_par" (4 producer warps, stages released on empty
# barriers)
CASES += [c + (form,) for form in ("mma_par", "mma_ws", "mma_ws_par") for c in _DUAL]
CASES += [c + (form,) for form in ("mma_par", "mma_ws_par")
          for c in ((1, 4096, 100, 62, True, False, "contig", 704), (3, 8192, 2048, 7, True, True, "sliced", 672),
                    (16, 8192, 2048, 20, False, False, "contig", 688), (16, 64, 16, 5, True, False, "contig", 672))]
CASES += [(3, 8192, 2048, 7, True, True, "sliced", 656, "mma_ws"),
          (16, 64, 16, 5, True, False, "contig", 656, "mma_ws")]
CASES += [(1, 4096, 100, 62, True, False, "contig", 704, "ring16"),
          (16, 8192, 2048, 20, False, False, "contig", 688, "ring16")]


@pytest.mark.parametrize(
    "heads,tkv,topk,n_tok,sink,use_tl,layout,row_stride,stages", CASES,
    ids=[f"h{c[0]}-kv{c[1]}-k{c[2]}-t{c[3]}{'-sink' if c[4] else ''}{'-tl' if c[5] else ''}-{c[6]}-rs{c[7]}"
         f"-ns{c[8]}" for c in CASES],
)
def test_sparse_mla_fwd_narrow656(heads, tkv, topk, n_tok, sink, use_tl, layout, row_stride, stages):
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(DQK, heads, tkv, topk, n_tok, sink, use_tl, layout)
    gen = torch.Generator(device="cuda").manual_seed(5)
    kv8, kv_deq = _fp8_cache(kv, row_stride, gen)
    sm_scale = DQK**-0.5
    kw = dict(sm_scale=sm_scale, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink,
              narrow=stages if isinstance(stages, str) else True,
              narrow_stages=None if isinstance(stages, str) else stages)
    out, lse, max_logits = kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv8, indices, **kw)
    torch.cuda.synchronize()
    check_against_reference(out, lse, max_logits, q, kv_deq, indices, sm_scale, topk_length, attn_sink, valid)
    again = kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv8, indices, **kw)
    for a, b in zip((out, lse, max_logits), again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", ["ring_er_f16", "mma", "mma_par", "mma_ws_par"])
@pytest.mark.parametrize("spread", [4, 10])
def test_f16_form_scale_spread(spread, form):
    """The f16 form ("ring_er_f16": each row's latent tile scaled by its scale over the token's largest, q by the
    token scales and a per-head power of two) over widely spread row and head scales (``_f16_spread``), against
    the bf16 form "ring_er"."""
    check_f16_spread(16, spread,
                     lambda *a, **kw: kernel_fwd_fp8cache.run_sparse_mla_fwd(*a, narrow=form, **kw),
                     lambda *a, **kw: kernel_fwd_fp8cache.run_sparse_mla_fwd(*a, narrow="ring_er", **kw))
