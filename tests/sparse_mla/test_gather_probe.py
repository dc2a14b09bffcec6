"""CPU: the gather probe (``sparse/_gather_probe.py``, not dispatched) lowers for sm_90a; the TMA mode issues one
``1 x 64`` tensor-map load per (row, column tile) into the 128-byte-line starts of the swizzled tile.  GPU: both
gathers give bitwise-equal results that match torch (``pytest -m gpu``)."""

import re

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from flashdsa.sparse import _gather_probe as gp  # noqa: E402


def test_tma_gather_lowers_to_row_loads():
    from flashdsa._tilelang import lower_to_cuda_source

    (_, fn_tma, cfg_tma), (_, fn_cp, cfg_cp) = gp.lowering_cases()
    src = lower_to_cuda_source(fn_tma, cfg_tma)
    assert "__grid_constant__ const CUtensorMap KV_desc" in src
    assert re.search(r"tl::tma_load\(KV_desc, bar\[.*fdsa_byte_ptr\(", src)
    assert "expect_transaction(73728)" in src  # 64 rows x 9 boxes x 128 B, out-of-bounds boxes included
    assert "wgmma_ss" in src
    src_cp = lower_to_cuda_source(fn_cp, cfg_cp)
    assert "cp_async_gs_conditional" in src_cp


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n_tok,n_kv,nb", [(37, 600, 3), (5, 4096, 8)])
def test_gather_probe_gpu(n_tok, n_kv, nb):
    g = torch.Generator(device="cuda").manual_seed(n_tok)
    q = (torch.randn(n_tok, 64, 576, generator=g, device="cuda") * 0.1).bfloat16()
    kv = (torch.randn(n_kv, 576, generator=g, device="cuda") * 0.1).bfloat16()
    idx = torch.randint(0, n_kv // 2, (n_tok, 64 * nb), generator=g, device="cuda", dtype=torch.int32)
    bad = torch.tensor([-2**31, -123456, -1, n_kv, 114514, 2**31 - 1], device="cuda", dtype=torch.int32)
    pos = torch.rand(idx.shape, generator=g, device="cuda") < 0.1
    idx[pos] = bad[torch.randint(0, 6, (int(pos.sum()),), generator=g, device="cuda")]
    idx[1] = -1
    kv[n_kv // 2:] = float("nan")  # never selected: must never be read
    o_tma = gp.run_gather_qk(q, kv, idx, "tma")
    o_cp = gp.run_gather_qk(q, kv, idx, "cpasync")
    ref = gp.reference_gather_qk(q, kv, idx)
    assert torch.equal(o_tma, o_cp)
    torch.testing.assert_close(o_tma, ref, atol=1e-3, rtol=1e-3)
