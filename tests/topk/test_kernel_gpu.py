"""GPU: the TileLang radix top-k kernel against the PyTorch reference, exactly (run with ``pytest -m gpu``).

Every comparison is exact equality of the int32 index tensors (the contract is exact: ties to the lower position,
-inf/NaN never selected, -1 in leftover slots).  The kernel is compiled per (threads, cache) variant (chosen by N),
order (index, or score with next_pow2(k) sort slots) and whether starts/ends are given; the cases below need about
20 compiles.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.topk import kernel_radix  # noqa: E402
from flashdsa.topk.reference import topk_indices_reference  # noqa: E402

POISON_BYTE = 0x5A  # every CUDA allocation in these tests starts as 0x5A5A5A5A (tests/poison.py): not -1
NS = (1, 100, 2047, 8192, 33000, 131072)
KS = (1, 64, 2048)
MS = (1, 3, 64, 300)
KINDS = ("randn", "ties", "allequal", "infnan", "signed_zero")


def _scores(kind, M, N, gen):
    x = torch.randn(M, N, generator=gen, device="cuda")
    if kind == "ties":  # a handful of levels: heavy ties at the threshold
        x = torch.round(x * 2) / 2
    elif kind == "allequal":
        x = torch.full((M, N), 0.75, device="cuda")
    elif kind == "infnan":
        r = torch.rand(M, N, generator=gen, device="cuda")
        x = torch.where(r < 0.3, torch.full_like(x, -float("inf")), x)
        x = torch.where((r >= 0.3) & (r < 0.5), torch.full_like(x, float("nan")), x)
        x = torch.where((r >= 0.5) & (r < 0.52), torch.full_like(x, float("inf")), x)
        x = torch.where((r >= 0.52) & (r < 0.56), -torch.full_like(x, float("nan")), x)  # negative NaN bits
        x[0] = -float("inf")  # a row with nothing selectable
        if M > 1:
            x[1, ::2] = float("nan")
    elif kind == "signed_zero":  # +0.0 and -0.0 must tie; subnormals stay ordered
        r = torch.rand(M, N, generator=gen, device="cuda")
        x = torch.where(r < 0.5, torch.zeros_like(x), -torch.zeros_like(x))
        x = torch.where(r > 0.9, torch.full_like(x, 1e-40), x)
        x = torch.where(r < 0.05, torch.full_like(x, -1e-40), x)
    return x.contiguous()


def _ranges(M, N, gen):
    """starts > 0, empty ranges (start == end and start > end), ranges past N, negative starts."""
    st = torch.randint(-4, max(1, N) + 4, (M,), generator=gen, device="cuda", dtype=torch.int32)
    ln = torch.randint(-3, max(1, N) + 1, (M,), generator=gen, device="cuda", dtype=torch.int32)
    en = st + ln
    if M >= 3:
        st[0], en[0] = 0, N  # full row
        st[1], en[1] = N // 2, N // 2  # empty
        st[2], en[2] = min(5, N), N + 100  # starts > 0, end clamped
    return st.contiguous(), en.contiguous()


def _check(scores, k, starts=None, ends=None, order="index"):
    M = scores.shape[0]
    got = kernel_radix.run_topk_indices(scores, k, starts, ends, order)
    torch.cuda.synchronize()
    ref = topk_indices_reference(scores, k, starts, ends, order)
    assert got.dtype == torch.int32 and got.shape == (M, k)
    if not torch.equal(got, ref):
        bad = (got != ref).any(dim=1).nonzero()[0, 0].item()
        diff = (got[bad] != ref[bad]).nonzero()[:8, 0].tolist()
        raise AssertionError(
            f"row {bad} (of {M}), k={k}, order={order}: first mismatching slots {diff}; "
            f"got {got[bad, diff].tolist()} ref {ref[bad, diff].tolist()}"
        )
    return got


@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("order", ["index", "score"])
def test_matches_reference(N, k, order):
    gen = torch.Generator(device="cuda").manual_seed(1000 * N + k)
    for M in MS:
        if M * N > 64 * 131072:  # keep the reference's sort cheap
            continue
        for kind in KINDS:
            x = _scores(kind, M, N, gen)
            _check(x, k, order=order)
            st, en = _ranges(M, N, gen)
            _check(x, k, st, en, order=order)
            _check(x, k, None, en, order=order)


@pytest.mark.parametrize("N", [1, 100, 8192, 33000])
def test_rows_shorter_than_k(N):
    gen = torch.Generator(device="cuda").manual_seed(N)
    x = _scores("randn", 3, N, gen)
    for k in (N, N + 1, 2 * N + 37):
        if k <= kernel_radix.MAX_SCORE_K:
            _check(x, k, order="score")
        _check(x, k, order="index")


def test_strided_rows_and_any_order():
    gen = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(64, 9000, generator=gen, device="cuda")
    x = base[:, 100:8292]  # row stride 9000, last dim contiguous
    got = _check(x, 2048)
    assert torch.equal(kernel_radix.run_topk_indices(x, 2048, order="any"), got)
    _check(x[::2], 64, order="score")
    _check(base[:1, :1], 1)  # size-1 dims with arbitrary strides


def test_large_rows():
    gen = torch.Generator(device="cuda").manual_seed(11)
    _check(torch.randn(16, 131072, generator=gen, device="cuda"), 2048)
    _check(torch.randn(1, 1048576, generator=gen, device="cuda"), 2048)
    x = torch.round(torch.randn(1, 1048576 + 3, generator=gen, device="cuda") * 4) / 4
    _check(x, 2048)
    _check(x, 2048, order="score")


def test_decode_shape_with_lengths():
    gen = torch.Generator(device="cuda").manual_seed(3)
    M, N = 4096, 8192
    x = torch.randn(M, N, generator=gen, device="cuda")
    ends = torch.randint(0, N + 1, (M,), generator=gen, device="cuda", dtype=torch.int32)
    x = torch.where(torch.arange(N, device="cuda") < ends[:, None].long(), x, torch.full_like(x, -float("inf")))
    _check(x, 2048, None, ends)


@pytest.mark.parametrize("order", ["index", "score"])
@pytest.mark.parametrize("N,kind", [(8192, "ties"), (33000, "randn"), (131072, "ties"), (2047, "infnan")])
def test_bitwise_deterministic(N, kind, order):
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = _scores(kind, 64, N, gen)
    st, en = _ranges(64, N, gen)
    first = kernel_radix.run_topk_indices(x, 2048, st, en, order)
    for _ in range(4):
        again = kernel_radix.run_topk_indices(x, 2048, st, en, order)
        assert torch.equal(first, again)


def test_unsupported_reasons():
    x = torch.randn(4, 100, device="cuda")
    assert kernel_radix.kernel_unsupported(x, 8) is None
    assert kernel_radix.kernel_unsupported(x.double(), 8) is not None
    assert kernel_radix.kernel_unsupported(x.cpu(), 8) is not None
    assert kernel_radix.kernel_unsupported(x.t(), 8) is not None
    assert kernel_radix.kernel_unsupported(x, kernel_radix.MAX_SCORE_K + 1, order="score") is not None
    assert kernel_radix.kernel_unsupported(x, kernel_radix.MAX_SCORE_K + 1, order="index") is None
    assert kernel_radix.kernel_unsupported(x, 8, ends=torch.zeros(4, dtype=torch.int64, device="cuda")) is not None


def test_empty_shapes():
    assert kernel_radix.run_topk_indices(torch.empty(0, 10, device="cuda"), 4).shape == (0, 4)
    out = kernel_radix.run_topk_indices(torch.empty(3, 0, device="cuda"), 4)
    assert torch.equal(out, torch.full((3, 4), -1, dtype=torch.int32, device="cuda"))


# ---- multi-CTA path (kernel_radix_multi): forced, whatever the routing rule says ----

from flashdsa.topk import kernel_radix_multi  # noqa: E402

MULTI_NS = (40000, 131072, 1048576)
MULTI_MS = (1, 3, 16)


def _check_multi(scores, k, starts=None, ends=None, groups=None):
    M = scores.shape[0]
    got = kernel_radix_multi.run_topk_indices_multi(scores, k, starts, ends, groups=groups)
    torch.cuda.synchronize()
    ref = topk_indices_reference(scores, k, starts, ends, "index")
    assert got.dtype == torch.int32 and got.shape == (M, k)
    if not torch.equal(got, ref):
        bad = (got != ref).any(dim=1).nonzero()[0, 0].item()
        diff = (got[bad] != ref[bad]).nonzero()[:8, 0].tolist()
        raise AssertionError(
            f"multi: row {bad} (of {M}), k={k}, groups={groups}: first mismatching slots {diff}; "
            f"got {got[bad, diff].tolist()} ref {ref[bad, diff].tolist()}"
        )
    return got


@pytest.mark.parametrize("N", MULTI_NS)
@pytest.mark.parametrize("k", (1, 2048))
def test_multi_matches_reference(N, k):
    gen = torch.Generator(device="cuda").manual_seed(77 * N + k)
    for M in MULTI_MS:
        for kind in KINDS:
            x = _scores(kind, M, N, gen)
            for groups in (None, 7):  # the routing's G and an odd split
                _check_multi(x, k, groups=groups)
            st, en = _ranges(M, N, gen)
            _check_multi(x, k, st, en)
            _check_multi(x, k, None, en, groups=5)
            _check_multi(x, k, st, None, groups=3)


def test_multi_pass2_ties_and_short_rows():
    gen = torch.Generator(device="cuda").manual_seed(21)
    # values sharing the top 22 key bits (all three passes), heavy ties at the threshold
    x = 1.0 + torch.randint(0, 3000, (3, 131072), generator=gen, device="cuda").float() * 2.0**-23
    for k in (1, 2048, 5000):
        _check_multi(x, k)
        _check_multi(x, k, groups=132)
    y = _scores("randn", 3, 40000, gen)
    for k in (40000, 40001, 2 * 40000 + 37):  # rows shorter than k
        _check_multi(y, k)
        _check_multi(y, k, groups=33)
    _check_multi(y, 2048, groups=1)  # one CTA per row still works
    base = torch.randn(3, 140000, generator=gen, device="cuda")
    _check_multi(base[:, 1000:132072], 2048)  # row stride 140000


@pytest.mark.parametrize("kind", ["ties", "randn"])
def test_multi_bitwise_deterministic(kind):
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = _scores(kind, 3, 1048576, gen)
    st, en = _ranges(3, 1048576, gen)
    first = kernel_radix_multi.run_topk_indices_multi(x, 2048, st, en)
    for _ in range(4):
        again = kernel_radix_multi.run_topk_indices_multi(x, 2048, st, en)
        assert torch.equal(first, again)


def test_multi_routing():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert kernel_radix_multi.use_multi(1, 1048576, "index", sms)
    assert kernel_radix_multi.use_multi(16, 131072, "index", sms)
    assert not kernel_radix_multi.use_multi(16, 131072, "score", sms)
    assert not kernel_radix_multi.use_multi(4096, 8192, "index", sms)
    gen = torch.Generator(device="cuda").manual_seed(13)
    x = torch.randn(1, 1048576, generator=gen, device="cuda")
    got = _check(x, 2048)  # through run_topk_indices (routes to the multi path)
    assert torch.equal(got, kernel_radix_multi.run_topk_indices_multi(x, 2048))
    assert torch.equal(got, kernel_radix.run_topk_indices(x, 2048, multi=True))
    with pytest.raises(ValueError):
        kernel_radix.run_topk_indices(x, 2048, order="score", multi=True)


def test_multi_cuda_graph_capture():
    gen = torch.Generator(device="cuda").manual_seed(17)
    x = torch.randn(16, 131072, generator=gen, device="cuda")
    ref = topk_indices_reference(x, 2048)
    kernel_radix_multi.run_topk_indices_multi(x, 2048)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kernel_radix_multi.run_topk_indices_multi(x, 2048)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    x.copy_(torch.randn(16, 131072, generator=gen, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, topk_indices_reference(x, 2048))


# --------------------------------------------------------------------------------------------- dsa_topk
@pytest.mark.parametrize("max_chunk_bytes", [2**31, 4 * 3000 * 7 + 5])
def test_dsa_topk_kernel_streamed(max_chunk_bytes):
    """dsa_topk on the kernels (indexer + radix top-k, streamed over query chunks): bitwise equal to the radix top-k
    of the indexer kernel's own logits computed unchunked; against the reference pipeline, every selected key's
    reference logit is within the indexer's error of the reference's k-th value (FP8 wgmma accumulates with fewer
    mantissa bits than fp32, so near-ties may order differently). FP8 causal rows with an offset, empty rows and
    rows shorter than topk."""
    import flashdsa

    gen = torch.Generator(device="cuda").manual_seed(31)
    M, N, H, D, topk = 300, 3000, 64, 128, 512
    q = (torch.randn(M, H, D, generator=gen, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    k = (torch.randn(N, D, generator=gen, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    w = torch.randn(M, H, generator=gen, device="cuda")
    ks = torch.rand(N, generator=gen, device="cuda") + 0.5
    ken = (torch.arange(M, device="cuda", dtype=torch.int32) + (N - M + 1)).contiguous()
    kst = torch.zeros(M, dtype=torch.int32, device="cuda")
    kst[:40] = ken[:40] - 7  # rows shorter than topk
    ken[40:45] = kst[40:45]  # empty rows
    got = flashdsa.dsa_topk(q, k, w, topk, ks, k_start=kst, k_end=ken, max_chunk_bytes=max_chunk_bytes,
                            backend="kernel")
    logits = flashdsa.indexer_logits(q, k, w, ks, k_start=kst, k_end=ken, backend="kernel")
    assert torch.equal(got, flashdsa.topk_indices(logits, topk, starts=kst, ends=ken, backend="kernel"))
    assert (got[40:45] == -1).all() and (got[:40, 7:] == -1).all()
    assert torch.equal(got[:40, :7], kst[:40, None] + torch.arange(7, device="cuda", dtype=torch.int32))
    ref_logits = flashdsa.indexer_logits(q, k, w, ks, k_start=kst, k_end=ken, backend="reference")
    finite = ref_logits > -float("inf")
    assert torch.equal(finite, logits > -float("inf"))
    err = (logits - ref_logits)[finite].abs().max().item()
    assert err < 1e-3 * ref_logits[finite].abs().max().item()
    ref = flashdsa.topk_indices(ref_logits, topk, starts=kst, ends=ken, backend="reference")
    for m in range(45, M):  # full rows: the reference logits of the kernel's picks reach the reference k-th value
        kth = ref_logits[m, ref[m].long()].min()  # order "index": the k-th largest is the smallest picked
        assert (ref_logits[m, got[m].long()] >= kth - 2 * err).all(), f"row {m}"
        assert len(set(got[m].tolist())) == topk
