"""CPU: ``mla_decode``'s eager plans (calls over the 656-byte cache on CUDA only: sparse, and dense with a block
table) are never made elsewhere."""

import torch

import flashdsa
from flashdsa.decode import api as decode_api


def test_no_plan_key_on_cpu_or_bf16_cache():
    q = torch.randn(2, 1, 4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    fp8 = torch.zeros(3, 16, 656, dtype=torch.uint8)
    bf16 = torch.zeros(3, 16, 576, dtype=torch.bfloat16)
    for cache in (fp8, bf16):
        assert decode_api._plan_key(q, cache, None, None, None, 512, True, idx, None, None, "auto") is None
    assert decode_api._plan_key(q, fp8, None, None, None, 512, True, None, None, None, "auto") is None  # dense
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    assert decode_api._plan_key(q, fp8, table, lens, None, 512, True, None, None, None, "auto") is None  # on the CPU
    decode_api._PLANS._plans.clear()
    flashdsa.mla_decode(q, fp8, table, lens)
    assert len(decode_api._PLANS) == 0


def test_cpu_sparse_decode_stores_no_plan():
    decode_api._PLANS._plans.clear()
    q = torch.randn(2, 1, 4, 576, dtype=torch.bfloat16)
    cache = flashdsa.quantize_kv_fp8(torch.randn(48, 576, dtype=torch.bfloat16)).view(3, 16, 656)
    idx = torch.randint(-1, 48, (2, 1, 8), dtype=torch.int32)
    out, lse = flashdsa.mla_decode(q, cache, None, None, indices=idx)
    assert out.shape == (2, 1, 4, 512) and lse.shape == (2, 1, 4)
    assert len(decode_api._PLANS) == 0
