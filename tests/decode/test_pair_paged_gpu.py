"""GPU: the pair path's paged kernel (``decode/kernel_pair_paged.py``: pages through the block table, TMA for full
blocks) against the reference and bit for bit against the slot-list path it replaces
(``$FLASHDSA_DECODE_PAIR_PAGED=0``), with test_kernel_gpu.py's inputs (shuffled tables, NaN in every unused slot,
bad block ids past each sequence) plus bad block ids inside the attended range, a strided block table and lengths
that end inside a block.  Compiles: one paged build per (H, s_q, block size, sink) below and the slot-list builds
they are compared with."""

import pytest
import torch

from .test_kernel_gpu import _check, _kernel, _make, _reference

pytestmark = pytest.mark.gpu

# (B, s_q, H, block_size, lens (cycled over the batch), causal, sink, bad ids inside the range)
CASES = [
    (4, 1, 128, 64, (4096, 4000, 64, 1), False, False, False),
    (6, 2, 64, 128, (20, 4096, 0, 140, 8191, 1), True, True, True),
    (5, 1, 64, 256, (700, 0, 4096, 3000, 65), True, False, True),
    (3, 3, 128, 64, (2048, 130, 5), True, True, False),
]


def _sink(H):
    """A random attn_sink [H] float32 with +inf and -inf in heads 0 and 1."""
    attn_sink = torch.randn(H, device="cuda", dtype=torch.float32)
    attn_sink[0], attn_sink[1] = float("inf"), float("-inf")
    return attn_sink


def _run(K, q, kv, table, seqlens, causal, sink):
    return K.run_mla_decode_dense(q, kv, table, seqlens, sm_scale=576 ** -0.5, d_v=512, causal=causal,
                                  attn_sink=sink, variant="pair")


@pytest.mark.parametrize("B,s_q,H,block_size,lens,causal,sink,bad", CASES,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-bs{c[3]}{'-sink' if c[6] else ''}{'-bad' if c[7] else ''}"
                              for c in CASES])
def test_paged_matches_reference_and_slot_lists(monkeypatch, B, s_q, H, block_size, lens, causal, sink, bad):
    from flashdsa.decode import _pair_path

    K = _kernel()
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, block_size, lens, seed=B * 31 + H + block_size)
    if bad:  # an out-of-range page inside sequences that have >= 3 pages: its positions are skipped, never read
        for b, n in enumerate(lens):
            if n > 2 * block_size:
                table[b, 1] = (-1, kv.shape[0], -(2**31))[b % 3]
    # a strided block table (a column slice of a wider one)
    wide = torch.full((B, table.shape[1] + 3), -7, dtype=torch.int32, device="cuda")
    wide[:, 1:1 + table.shape[1]] = table
    table_s = wide[:, 1:1 + table.shape[1]]
    attn_sink = _sink(H) if sink else None
    assert _pair_path.paged(block_size)
    out, lse = _run(K, q, kv, table_s, seqlens, causal, attn_sink)
    torch.cuda.synchronize()
    _check(out, lse, *_reference(q, kv, table, seqlens, sm_scale=576 ** -0.5, causal=causal, sink=attn_sink))
    again = _run(K, q, kv, table_s, seqlens, causal, attn_sink)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), "not bitwise repeatable"
    monkeypatch.setenv(_pair_path.PAGED_ENV, "0")
    assert not _pair_path.paged(block_size)
    slots = _run(K, q, kv, table, seqlens, causal, attn_sink)
    assert torch.equal(out, slots[0]) and torch.equal(lse, slots[1]), "paged != slot lists"


@pytest.mark.parametrize("B,s_q,H,block_size,lens,causal,sink,bad", [c for c in CASES if c[2] == 128] + [
    (133, 1, 128, 64, (8192, 4096, 64, 1, 0, 3000), True, False, True)])
def test_cluster_build_matches_the_paged_kernel(monkeypatch, B, s_q, H, block_size, lens, causal, sink, bad):
    """The 2-CTA cluster build (``$FLASHDSA_DECODE_PAIR_CLUSTER=1``: the two head groups of a token share each full
    page's TMA load by multicast) against the reference and bit for bit against the paged kernel (same products
    in the same order); B 133: an odd number of tokens, more CTAs than SMs, partial and bad pages."""
    from flashdsa.decode import kernel_pair_paged

    K = _kernel()
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, block_size, lens, seed=B * 17 + block_size)
    if bad:
        for b, n in enumerate(lens):
            if n > 2 * block_size:
                table[b, 1] = -1
    attn_sink = _sink(H) if sink else None
    monkeypatch.setenv(kernel_pair_paged.CLUSTER_ENV, "1")
    assert kernel_pair_paged.use_cluster(H)
    out, lse = _run(K, q, kv, table, seqlens, causal, attn_sink)
    torch.cuda.synchronize()
    _check(out, lse, *_reference(q, kv, table, seqlens, sm_scale=576 ** -0.5, causal=causal, sink=attn_sink))
    monkeypatch.setenv(kernel_pair_paged.CLUSTER_ENV, "0")
    plain = _run(K, q, kv, table, seqlens, causal, attn_sink)
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1]), "cluster != paged kernel"


@pytest.mark.parametrize("B,s_q,H,block_size,lens,causal,sink,bad", CASES,
                         ids=[f"B{c[0]}-sq{c[1]}-H{c[2]}-bs{c[3]}" for c in CASES])
def test_q_tma_build_matches_the_paged_kernel(monkeypatch, B, s_q, H, block_size, lens, causal, sink, bad):
    """The build loading Q by TMA (``$FLASHDSA_DECODE_PAIR_QTMA=1``, session 50; the launch is checked to use it)
    against the reference and bit for bit against the paged kernel (the same products in the same order; only Q's
    load differs).  ``bad`` (bad page ids) is the other tests' concern."""
    from flashdsa.decode import kernel_pair_paged

    K = _kernel()
    lens = [lens[i % len(lens)] for i in range(B)]
    q, kv, table, seqlens = _make(B, s_q, H, block_size, lens, seed=B * 23 + block_size)
    attn_sink = _sink(H) if sink else None
    from flashdsa.decode import _pair_path

    monkeypatch.delenv(_pair_path.PAGED_ENV, raising=False)
    monkeypatch.delenv(kernel_pair_paged.CLUSTER_ENV, raising=False)
    monkeypatch.setenv(kernel_pair_paged.QTMA_ENV, "1")
    assert kernel_pair_paged.use_q_tma(H) and _pair_path.paged(block_size)
    built = []
    compiled = kernel_pair_paged._compiled
    monkeypatch.setattr(kernel_pair_paged, "_compiled", lambda *a: built.append(a) or compiled(*a))
    out, lse = _run(K, q, kv, table, seqlens, causal, attn_sink)
    torch.cuda.synchronize()
    assert built and built[-1][-1] is True, f"the TMA build was not launched: {built}"
    _check(out, lse, *_reference(q, kv, table, seqlens, sm_scale=576 ** -0.5, causal=causal, sink=attn_sink))
    monkeypatch.setenv(kernel_pair_paged.QTMA_ENV, "0")
    plain = _run(K, q, kv, table, seqlens, causal, attn_sink)
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1]), "Q by TMA != paged kernel"
