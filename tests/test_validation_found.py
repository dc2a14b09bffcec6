"""What tests/test_validation_fuzz.py found, pinned as plain cases (one-mutation draws reach some only rarely)."""

from __future__ import annotations

import pytest
import torch

import flashdsa
from test_validation_fuzz import B, BF16, BS, D, FP8, H, I32, INT_MIN, M, N, NB, NN, T, TKV, _same, ii, rn


def _paged(nb, bs):
    return lambda: flashdsa.indexer_logits_paged(rn(B, NN, H, D, dtype=BF16), rn(nb, bs, D, dtype=BF16),
                                                 torch.rand(B * NN, H), ii(5, 9), ii(0, 1, 2, 3).view(2, 2))


def _plan_with(cache):
    return lambda: flashdsa.mla_decode_plan(ii(0, 1, 2, 3).view(2, 2), ii(5, 9), cache, num_heads=H)


def _dsa_chunked(**kw):
    base = dict(q=rn(M, H, D, dtype=BF16), k=rn(N, D, dtype=BF16), weights=torch.rand(M, H), topk=3,
                max_chunk_bytes=4 * N)
    return lambda: flashdsa.dsa_topk(**{**base, **kw})


REGRESSIONS = [
    ("dsa_topk chunked, weights one row too many", _dsa_chunked(weights=torch.rand(M + 1, H)), ValueError, "weights"),
    ("dsa_topk chunked, k_start 0-d", _dsa_chunked(k_start=ii(0)[0]), ValueError, "k_start"),
    ("dsa_topk chunked, k_end float", _dsa_chunked(k_end=1.0), TypeError, "k_end"),
    ("sparse_mla_fwd return_max_logits=1",
     lambda: flashdsa.sparse_mla_fwd(rn(T, H, 512, dtype=BF16), rn(TKV, 512, dtype=BF16), ii(0, 1, 2).view(3, 1),
                                     return_max_logits=1), TypeError, "return_max_logits"),
    ("quantize_fp8 pow2_scale=1", lambda: flashdsa.quantize_fp8(rn(2, 128), pow2_scale=1), TypeError, "pow2_scale"),
    ("indexer_logits_paged block_size 0", _paged(NB, 0), ValueError, "k_cache"),
    ("mla_decode_plan kv_cache Dqk 0", _plan_with(rn(NB, BS, 0, dtype=BF16)), ValueError, "kv_cache"),
    ("mla_decode_plan float 656-wide kv_cache", _plan_with(rn(NB, BS, 656)), ValueError, "kv_cache"),
    ("sparse_attn d 0", lambda: flashdsa.sparse_attn(rn(1, T, H, 0, dtype=BF16), rn(1, 5, 0, dtype=BF16), None,
                                                     torch.zeros(1, T, 2, dtype=I32)), ValueError, "q"),
    ("write_kv_cache rows of 0", lambda: flashdsa.write_kv_cache(rn(T, 0, dtype=BF16), rn(NB, BS, 0, dtype=BF16),
                                                                 ii(0, 1, 2)), ValueError, "kv"),
    ("write_indexer_cache keys of 0", lambda: flashdsa.write_indexer_cache(rn(T, 0), torch.zeros(NB, BS, 0, dtype=FP8),
                                                                           torch.zeros(NB, BS), ii(0, 1, 2)),
     ValueError, "k"),
]


@pytest.mark.parametrize("case,fn,exc,arg", REGRESSIONS, ids=[r[0] for r in REGRESSIONS])
def test_found_by_fuzzing(case, fn, exc, arg):
    with pytest.raises(exc, match=rf"^{arg}:"):
        fn()


def test_fp8_form_zero_heads():
    """q_scale `[T, 0]` was reshaped with -1 (RuntimeError: ambiguous for 0 elements)."""
    out, lse = flashdsa.sparse_mla_fwd(rn(T, 0, 512, dtype=FP8), rn(TKV, 512, dtype=FP8), ii(0, 1, 2).view(3, 1),
                                       q_scale=torch.ones(T, 0), kv_scale=torch.ones(TKV), attn_sink=torch.zeros(0))
    assert out.shape == (T, 0, 512) and lse.shape == (T, 0)


@pytest.mark.parametrize("planned", [False, True])
def test_dense_fp8_decode_int_min_seqlen(planned):
    """cache_seqlens INT_MIN with s_q 2 (causal): int32 ``INT_MIN - 1`` wrapped to INT_MAX on the sparse-forward
    path (backend auto), so that query attended the whole block table instead of nothing."""
    q = rn(B, 2, H, 576, dtype=BF16)
    cache = flashdsa.quantize_kv_fp8(rn(NB, BS, 576, dtype=BF16))
    bt, lens = ii(0, 1, 2, 3).view(2, 2), ii(INT_MIN, 16)
    res = {}
    for backend in ("auto", "reference"):
        if planned:
            res[backend] = flashdsa.mla_decode_plan(bt, lens, cache, num_heads=H, s_q=2, backend=backend).run(q, cache)
        else:
            res[backend] = flashdsa.mla_decode(q, cache, bt, lens, backend=backend)
    assert torch.isinf(res["auto"][1][0]).all() and (res["auto"][0][0] == 0).all()
    _same(res["auto"], res["reference"], "INT_MIN cache_seqlens")


def test_paged_indexer_without_cache_blocks():
    """num_blocks 0 (raised IndexError): legal, every position lies outside the cache, so all -inf."""
    out = _paged(0, BS)()
    assert out.shape == (B * NN, 9) and torch.isneginf(out).all()
