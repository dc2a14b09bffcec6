"""CPU: when the pair forward splits its last partial round (``_tail_split.tail_plan``), and the host side of the
split launch (``tail_launcher``) with its three kernels stood in for by float64 PyTorch (the flat and the batched
main launch, the fp32-partial forward, the merge): the composed outputs equal the reference's."""

import math

import pytest
import torch

from flashdsa.decode import kernel_split
from flashdsa.sparse import _tail_split, kernel_fwd_pair
from flashdsa.sparse.reference import sparse_mla_fwd_reference


@pytest.mark.parametrize("tokens,heads,topk,n_sm,want", [
    (4096, 64, 2048, 132, (4092, 16, 128)),  # 31 rounds + 4 items: 4 tail tokens in 16 chunks of 2 blocks
    (4096, 128, 2048, 132, (4092, 16, 128)),  # 62 rounds + 8 items: 4 tokens of 2 head groups
    (4096, 64, 640, 132, (4092, 5, 128)),  # V4's topk: 10 blocks in 5 chunks
    (4100, 64, 2048, 132, (4092, 16, 128)),  # 8 tail tokens
    (4092, 64, 2048, 132, None),  # whole rounds
    (4096 + 17, 64, 2048, 132, None),  # a last round of 21 items > 132 / 8
    (100, 64, 2048, 132, None),  # no whole round (decode shapes: kernel_split's domain)
    (4096, 64, 448, 132, None),  # 7 blocks < TAIL_MIN_BLOCKS
    (4096, 64, 2048, 0, None),  # not on a GPU
    (4096, 96, 2048, 132, None),  # not whole head groups
    (1145, 64, 2048, 114, (1140, 16, 128)),  # 114 SMs: 10 rounds + 5 items
    (4096, 64, 2048, 114, None),  # 114 SMs: 35 rounds + 106 items
])
def test_tail_plan(tokens, heads, topk, n_sm, want, monkeypatch):
    monkeypatch.setenv(_tail_split.TAIL_ENV, "1")
    monkeypatch.delenv(kernel_split.SPLIT_ENV, raising=False)
    assert _tail_split.tail_plan(tokens, heads, topk, n_sm) == want


def test_tail_plan_switches(monkeypatch):
    monkeypatch.delenv(kernel_split.SPLIT_ENV, raising=False)
    monkeypatch.delenv(_tail_split.TAIL_ENV, raising=False)
    assert _tail_split.TAIL_DEFAULT == "auto"
    # auto: the one-CTA-per-item grid only (more blocks than the persistent grid's bound, 10)
    assert _tail_split.tail_plan(4096, 64, 2048, 132) == (4092, 16, 128)
    assert _tail_split.tail_plan(4096, 64, 704, 132) == (4092, 6, 128)  # 11 blocks
    assert _tail_split.tail_plan(4096, 64, 640, 132) is None  # 10 blocks: the persistent grid
    monkeypatch.setenv("FLASHDSA_PAIR_PERSISTENT_MAX", "32")
    assert _tail_split.tail_plan(4096, 64, 2048, 132) is None
    monkeypatch.delenv("FLASHDSA_PAIR_PERSISTENT_MAX")
    for mode in ("1", "serial"):  # any grid with TAIL_MIN_BLOCKS blocks
        monkeypatch.setenv(_tail_split.TAIL_ENV, mode)
        assert _tail_split.tail_plan(4096, 64, 640, 132) == (4092, 5, 128)
    monkeypatch.setenv(_tail_split.TAIL_ENV, "0")
    assert _tail_split.tail_plan(4096, 64, 2048, 132) is None
    monkeypatch.setenv(_tail_split.TAIL_ENV, "1")
    assert _tail_split.tail_plan(4096, 64, 2048, 132) == (4092, 16, 128)
    monkeypatch.setenv(kernel_split.SPLIT_ENV, "0")  # the decode split's "never" reaches the tail too
    assert _tail_split.tail_plan(4096, 64, 2048, 132) is None
    monkeypatch.setenv(kernel_split.SPLIT_ENV, "")
    monkeypatch.setenv(_tail_split.TAIL_ENV, "yes")
    with pytest.raises(ValueError, match="FLASHDSA_PAIR_TAIL"):
        _tail_split.tail_plan(4096, 64, 2048, 132)


def _reference_launch(sm_scale, d_v, has_sink, has_tl, calls, name):
    """A stand-in for a forward launch ``(q, kv, idx, tl, sink, out, lse, max_logits, *extra)`` (``extra`` =
    (S, S_kv): batched positions) computing the reference in float64; with q fewer rows than idx (the partials'
    build), row r reads q row r // (rows / q rows)."""

    def run(q, kv, idx, tl, sink, out, lse, mx, *extra):
        calls.append((name, q.shape[0], idx.shape[0]))
        rows = idx.shape[0]
        qr = q.repeat_interleave(rows // q.shape[0], dim=0)
        if extra:  # batched positions -> flat rows (outside [0, S_kv): invalid)
            s, s_kv = extra
            base = (torch.arange(rows) // s * s_kv).view(rows, 1)
            idx = torch.where((idx >= 0) & (idx < s_kv), idx + base, torch.full_like(idx, -1))
        o, l, m = sparse_mla_fwd_reference(qr.double(), kv.double(), idx, sm_scale=sm_scale, d_v=d_v,
                                           attn_sink=sink if has_sink else None, topk_length=tl if has_tl else None)
        out.copy_(o), lse.copy_(l), mx.copy_(m)

    return run


def _reference_merge(calls):
    def merge(out_p, lse_p, max_p, sink, out, lse, mx, n_split):  # kernel_split's combine formula, with a sink
        calls.append(("merge", out_p.shape[0], n_split))
        t, h = out.shape[:2]
        lp = lse_p.double().view(t, n_split, h)
        lp = torch.where(torch.isposinf(lp), torch.full_like(lp, -math.inf), lp)
        m = lp.amax(1)
        w = torch.exp(lp - m.unsqueeze(1)).nan_to_num(0.0)
        tot = w.sum(1)
        o = (w.unsqueeze(-1) * out_p.double().view(t, n_split, h, -1)).sum(1)
        den = tot + torch.exp(sink.double() - m)
        out.copy_(torch.where(tot.unsqueeze(-1) > 0, o / den.unsqueeze(-1), 0.0))
        lse.copy_(torch.where(tot > 0, m + torch.log(tot), math.inf))
        mx.copy_(max_p.view(t, n_split, h).amax(1))

    return merge


@pytest.mark.parametrize("batched", [False, True])
def test_tail_launcher_composes(batched, monkeypatch):
    heads, dqk, d_v, topk, sm_scale = 64, 96, 32, 640, 0.2
    b, s, s_kv = (2, 68, 300) if batched else (1, 136, 600)
    n = b * s
    monkeypatch.setenv(_tail_split.TAIL_ENV, "serial")  # the chunks after the main launch: no CUDA stream here
    plan = _tail_split.tail_plan(n, heads, topk, 132)
    assert plan == (132, 5, 128)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, dqk, generator=gen, dtype=torch.float64)
    kv = torch.randn(b * s_kv, dqk, generator=gen, dtype=torch.float64)
    idx = torch.randint(-3, s_kv + 3, (n, topk), generator=gen, dtype=torch.int32)
    idx[-1] = -1  # an empty tail row
    tl = torch.randint(0, topk + 1, (n,), generator=gen, dtype=torch.int32)
    tl[-2], tl[-3] = 0, 70
    sink = torch.randn(heads, generator=gen, dtype=torch.float64)
    calls = []
    monkeypatch.setattr(kernel_fwd_pair, "_compiled",
                        lambda *a: _reference_launch(sm_scale, d_v, False, a[6], calls, "part"))
    monkeypatch.setattr(kernel_split, "_compiled_combine", lambda *a: _reference_merge(calls))
    main = _reference_launch(sm_scale, d_v, True, True, calls, "main")
    run = _tail_split.tail_launcher(main, plan, heads=heads, dqk=dqk, d_v=d_v, sm_scale=sm_scale, has_sink=True,
                                    has_topk_length=True)
    out, lse, mx = (torch.full((n, heads, d_v), math.nan, dtype=torch.float64),
                    torch.full((n, heads), math.nan, dtype=torch.float64),
                    torch.full((n, heads), math.nan, dtype=torch.float64))
    run(q, kv, idx, tl, sink, out, lse, mx, *((s, s_kv) if batched else ()))
    assert calls == [("main", 132, 132), ("part", 4, 20), ("merge", 20, 5)]
    flat = idx
    if batched:
        base = (torch.arange(n) // s * s_kv).view(n, 1)
        flat = torch.where((idx >= 0) & (idx < s_kv), idx + base, torch.full_like(idx, -1))
    ro, rl, rm = sparse_mla_fwd_reference(q, kv, flat, sm_scale=sm_scale, d_v=d_v, attn_sink=sink, topk_length=tl)
    for got, ref in ((out, ro), (lse, rl), (mx, rm)):
        torch.testing.assert_close(got[:132], ref[:132], rtol=1e-12, atol=1e-12)
        # the tail: partials in float32 (as the kernel's)
        torch.testing.assert_close(got[132:], ref[132:], rtol=1e-6, atol=1e-6)
    assert (out[-1] == 0).all() and torch.isposinf(lse[-1]).all() and torch.isneginf(mx[-1]).all()


def test_tail_launcher_batched_tail_across_batches(monkeypatch):
    """Tail tokens in two batches (S smaller than the tail): the main launch runs over every token, unsplit."""
    monkeypatch.setenv(_tail_split.TAIL_ENV, "serial")
    calls = []
    monkeypatch.setattr(kernel_fwd_pair, "_compiled", lambda *a: _reference_launch(0.2, 32, False, a[6], calls, "p"))
    monkeypatch.setattr(kernel_split, "_compiled_combine", lambda *a: _reference_merge(calls))
    main = _reference_launch(0.2, 32, True, False, calls, "main")
    run = _tail_split.tail_launcher(main, (132, 5, 128), heads=64, dqk=96, d_v=32, sm_scale=0.2, has_sink=True,
                                    has_topk_length=False)
    n, f64 = 136, torch.float64
    q, kv = torch.randn(n, 64, 96, dtype=f64), torch.randn(20, 96, dtype=f64)
    idx = torch.randint(0, 10, (n, 640), dtype=torch.int32)
    out, lse, mx = torch.empty(n, 64, 32, dtype=f64), torch.empty(n, 64, dtype=f64), torch.empty(n, 64, dtype=f64)
    run(q, kv, idx, torch.zeros(1, dtype=torch.int32), torch.zeros(64, dtype=f64), out, lse, mx, 2, 10)
    assert calls == [("main", 136, 136)]
