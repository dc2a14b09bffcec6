"""CPU: the gather probe (``sparse/_gather_probe.py``, not dispatched) lowers for sm_90a with the predicated cp.async
gather and wgmma in both modes (and "deep" with the ``.L2::128B`` hint).  GPU: both modes match torch (``pytest -m gpu``)."""

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from flashdsa.sparse import _gather_probe as gp  # noqa: E402


@pytest.mark.parametrize("case", range(len(gp.MODES) + 1))
def test_gather_probe_lowers(case):
    from flashdsa._tilelang import lower_to_cuda_source

    name, fn, cfg = gp.lowering_cases()[case]
    src = lower_to_cuda_source(fn, cfg)
    assert "cp_async_gs_conditional" in src
    assert "wgmma_ss" in src
    # the L2 prefetch build defines the switch before TileLang's headers; the others do not
    at = src.find(gp.tc.L2_PREFETCH_PRELUDE.strip())
    assert (0 <= at < src.find("#include <tl_templates")) == name.endswith("_l2pf")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", gp.MODES)
@pytest.mark.parametrize("n_tok,n_kv,nb", [(37, 600, 3), (5, 4096, 8)])
def test_gather_probe_gpu(mode, n_tok, n_kv, nb):
    g = torch.Generator(device="cuda").manual_seed(n_tok)
    q = (torch.randn(n_tok, 64, gp.q_cols(576, mode), generator=g, device="cuda") * 0.1).bfloat16()
    kv = (torch.randn(n_kv, 576, generator=g, device="cuda") * 0.1).bfloat16()
    idx = torch.randint(0, n_kv // 2, (n_tok, 64 * nb), generator=g, device="cuda", dtype=torch.int32)
    bad = torch.tensor([-2**31, -123456, -1, n_kv, 114514, 2**31 - 1], device="cuda", dtype=torch.int32)
    pos = torch.rand(idx.shape, generator=g, device="cuda") < 0.1
    idx[pos] = bad[torch.randint(0, 6, (int(pos.sum()),), generator=g, device="cuda")]
    idx[1] = -1
    kv[n_kv // 2:] = float("nan")  # never selected: must never be read
    out = gp.run_gather_qk(q, kv, idx, mode)
    torch.testing.assert_close(out, gp.reference_gather_qk(q, kv, idx), atol=1e-3, rtol=1e-3)
