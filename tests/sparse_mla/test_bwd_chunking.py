"""CPU: the deterministic backward's chunking (``kernel_bwd._det_chunk``): the partial buffer stays within its cap and
a chunk that holds at least one wave of the main kernel (n_hblk CTAs per token, one per SM) is whole waves."""

import pytest

kernel_bwd = pytest.importorskip("flashdsa.sparse.kernel_bwd")


@pytest.mark.parametrize("n_tok,n_hblk,topk,dqk,n_sm", [(4096, 2, 2048, 576, 132), (4096, 1, 2048, 576, 132),
                                                          (4096, 1, 640, 512, 132), (4096, 2, 2048, 576, 114),
                                                          (4096, 2, 2048, 576, 7), (300, 2, 8192, 576, 132),
                                                          (50, 2, 2048, 576, 132), (1, 1, 64, 512, 132)])
def test_det_chunk(n_tok, n_hblk, topk, dqk, n_sm):
    cap = max(1, kernel_bwd._PARTIAL_ELEMS // (n_hblk * topk * dqk))
    chunk = kernel_bwd._det_chunk(n_tok, n_hblk, topk, dqk, n_sm)
    assert 1 <= chunk <= min(n_tok, cap)
    if n_tok <= cap:
        assert chunk == n_tok
    elif n_hblk * cap >= n_sm and n_sm % n_hblk == 0:
        assert (n_hblk * chunk) % n_sm == 0 and n_hblk * (chunk + n_sm // n_hblk) > n_hblk * cap
    else:
        assert chunk == cap


def test_det_chunk_suite_shape():
    """The suite's H 128 / topk 2048 shape on 132 SMs: 198 tokens = 3 waves under the 2 GiB cap (227 would fit)."""
    assert kernel_bwd._PARTIAL_ELEMS == 1 << 29
    assert kernel_bwd._det_chunk(4096, 2, 2048, 576, 132) == 198
