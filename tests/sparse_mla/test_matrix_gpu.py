"""GPU: the public sparse MLA forward over issue #8's whole test matrix and, restricted to Dqk 576, issue #7's.

Every cell of Dqk {512, 576} x H {1, 16, 64, 128} x (SKV, topk) {(128, 128), (592, 128), (1840, 256), (4096, 100),
(8192, 2048)} x S {1, 62, 213} runs twice: once with and once without the sink, once with and once without
topk_length.  Which two of the four (sink, topk_length) pairs a cell gets depends on (Dqk, H, ceil(topk / 64))
only, the kernels' compile key, so the matrix compiles two builds per key instead of four; the block counts 2, 4
and 32 alternate the two choices, so all four pairs run at every (Dqk, H).  q's layout (contiguous, row-padded,
transposed) rotates over the cells, across S and across the cells' other factors.

Inputs and checks are the per-kernel files' (``_make_inputs``: duplicates, ~10% invalid indices of every kind,
~2% all-invalid rows, NaN in unreferenced kv rows, sinks with +-inf; the issues' tolerances), through
``flashdsa.sparse_mla_fwd(..., backend="kernel")`` so the dispatcher's choice per H is what runs.
"""

import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

import flashdsa  # noqa: E402

from .test_kernel_fp8_gpu import _check as check_fp8, _fp8_inputs  # noqa: E402
from .test_kernel_fp8cache_gpu import _fp8_cache  # noqa: E402
from .test_kernel_gpu import _make_inputs, check_against_reference  # noqa: E402

D_V = 512
DQKS = (512, 576)
HEADS = (1, 16, 64, 128)
SKV_TOPK = ((128, 128), (592, 128), (1840, 256), (4096, 100), (8192, 2048))
TOKENS = (1, 62, 213)
LAYOUTS = ("contig", "sliced", "transposed")
# two (sink, topk_length) pairs per cell: each cell runs with and without either
PAIRS = (((False, False), (True, True)), ((True, False), (False, True)))
BLOCK_COUNTS = sorted({(topk + 63) // 64 for _, topk in SKV_TOPK})  # 2, 4, 32


def _cells(dqks):
    """(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout) for every cell of the matrix and both its runs."""
    cells = []
    for n, (dqk, heads, (tkv, topk), n_tok) in enumerate(itertools.product(dqks, HEADS, SKV_TOPK, TOKENS)):
        parity = (DQKS.index(dqk) + HEADS.index(heads) + BLOCK_COUNTS.index((topk + 63) // 64)) % 2
        for sink, use_tl in PAIRS[parity]:
            cells.append((dqk, heads, tkv, topk, n_tok, sink, use_tl, LAYOUTS[(n + n // 3) % 3]))
    return cells


def _id(c):
    return f"d{c[0]}-h{c[1]}-kv{c[2]}-k{c[3]}-t{c[4]}{'-sink' if c[5] else ''}{'-tl' if c[6] else ''}-{c[7]}"


BF16_CELLS = _cells(DQKS)
FP8_CELLS = _cells((576,))


@pytest.mark.parametrize("case", BF16_CELLS, ids=[_id(c) for c in BF16_CELLS])
def test_matrix_bf16(case):
    dqk, heads, tkv, topk, n_tok, sink, use_tl, layout = case
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout,
                                                                 seed=len(BF16_CELLS) + BF16_CELLS.index(case))
    out, lse, max_logits = flashdsa.sparse_mla_fwd(q, kv, indices, topk_length=topk_length, attn_sink=attn_sink,
                                                   return_max_logits=True, backend="kernel")
    torch.cuda.synchronize()
    check_against_reference(out, lse, max_logits, q, kv, indices, dqk**-0.5, topk_length, attn_sink, valid)


@pytest.mark.parametrize("case", FP8_CELLS, ids=[_id(c) for c in FP8_CELLS])
def test_matrix_fp8_compute(case):
    """#7 path 1: q and kv float8_e4m3fn with per-(token, head) and per-token scales; NaN bytes and NaN scales in
    unreferenced kv rows."""
    dqk, heads, tkv, topk, n_tok, sink, use_tl, layout = case
    q8, q_scale, kv8, kv_scale, indices, topk_length, attn_sink, valid = _fp8_inputs(
        dqk, heads, tkv, topk, n_tok, sink, use_tl, layout, seed=FP8_CELLS.index(case))
    out, lse, max_logits = flashdsa.sparse_mla_fwd(q8, kv8, indices, q_scale=q_scale, kv_scale=kv_scale,
                                                   topk_length=topk_length, attn_sink=attn_sink,
                                                   return_max_logits=True, backend="kernel")
    torch.cuda.synchronize()
    check_fp8(out, lse, max_logits, q8, q_scale, kv8, kv_scale, indices, dqk**-0.5, topk_length, attn_sink, valid)


@pytest.mark.parametrize("case", FP8_CELLS, ids=[_id(c) for c in FP8_CELLS])
def test_matrix_cache656(case):
    """#7 path 2: kv as the 656-byte FP8 cache (unreferenced rows poisoned byte-wise); the reference runs on its
    exact dequantization, with the bf16 forward's tolerances."""
    dqk, heads, tkv, topk, n_tok, sink, use_tl, layout = case
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout,
                                                                 seed=2 * len(BF16_CELLS) + FP8_CELLS.index(case))
    kv8, kv_deq = _fp8_cache(kv, 656, torch.Generator(device="cuda").manual_seed(FP8_CELLS.index(case)))
    out, lse, max_logits = flashdsa.sparse_mla_fwd(q, kv8, indices, topk_length=topk_length, attn_sink=attn_sink,
                                                   return_max_logits=True, backend="kernel")
    torch.cuda.synchronize()
    check_against_reference(out, lse, max_logits, q, kv_deq, indices, dqk**-0.5, topk_length, attn_sink, valid)
