"""Lightning-indexer contract cases (issue #4) the other indexer tests leave out, through the public
``flashdsa.indexer_logits`` / ``flashdsa.indexer_logits_paged``.

On CUDA every case calls ``backend="kernel"`` (a silent fall-back to the reference cannot pass: the call raises if the
kernel refuses, and the recorded path is checked) and compares against ``backend="reference"``. On CPU the identical
input construction runs (the 131072-token sizes and the determinism shapes scaled down) and ``backend="reference"``
is compared against the float64 oracles of tests/oracles.py (prefill: on a sample of rows, plus the -inf mask of
every row from the ranges), so every line but the kernel call is exercised without a GPU.

Criteria (issue #4, as tests/indexer/test_kernel_gpu.py): ``1 - 2<x,y>/(<x,x>+<y,y>) < 5e-6`` on the finite region,
the -inf mask exactly equal, no NaN (CUDA outputs are poisoned with NaN by tests/poison.py).
Paged caches: shuffled block tables, NaN in every slot no position uses (partial-page tails and blocks no table
entry names; fp8 keys and scales alike), an out-of-range id inside the first sequence's context, -1 /
num_blocks / INT_MAX / INT_MIN past each sequence's pages, zero-length and shorter-than-next_n contexts.

Cases: (5) every (dtype, H, D) the kernel tests leave out, prefill (fp8 H16/D64, H8/D128; bf16 all but H64/D128
and H16/D64) and paged (fp8 (64, 64), (32, 128), (16, 128), (8, 64); bf16 all but (64, 128) and (32, 128)), causal;
(6) a paged decode over a 131072-token context (B 2, next_n 2, H 64, D 128, block 64) and a prefill over
N = 131072 keys with M = 64 causal rows; (7) bitwise identical over 5 runs, prefill bf16 H64/D128 and fp8 H32/D64.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashdsa
from flashdsa import _dispatch
from oracles import INT32_MAX, INT32_MIN, indexer_logits_oracle, indexer_logits_paged_oracle

from devices import DEVICES, backend_for as _backend

from .checks import check_close as _check

I32 = torch.int32
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
CPU_MAX_KEYS = 4096  # key / context counts above this are scaled to it on CPU (the float64 oracles are slow)


def _size(n: int, device: str) -> int:
    return n if device == "cuda" else min(n, CPU_MAX_KEYS)


def _tag(dtype) -> str:
    return "fp8" if dtype == FP8 else "bf16"


# ------------------------------------------------------------------------------------------------ prefill
def _inputs(M, N, H, D, dtype, *, seed, device):
    """q `[M, H, D]`, k `[N, D]`, weights `[M, H]`, k_scale `[N]` (built on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(M, H, D, generator=g)
    k = torch.randn(N, D, generator=g)
    w = torch.randn(M, H, generator=g) * H**-0.5
    if dtype == FP8:
        q = (q * 8).to(FP8)
        k_scale = (k.abs().amax(-1).clamp_min(1e-4) / 448.0).float()
        k = (k / k_scale[:, None]).to(FP8)
    else:
        q, k = q.to(BF16), k.to(BF16)
        k_scale = torch.rand(N, generator=g) + 0.5
    return [x.to(device) for x in (q, k, w, k_scale)]


def _causal(M, N, device, empty_every=0):
    """Prefill of the last M tokens of an N-token sequence: ``[0, m + 1 + N - M)``; every ``empty_every``-th row
    empty (start = end) when nonzero."""
    m = torch.arange(M)
    st = torch.zeros(M, dtype=I32)
    en = (m + 1 + N - M).to(I32)
    if empty_every:
        st[::empty_every] = en[::empty_every]
    return st.to(device), en.to(device)


def _prefill(q, k, w, ks, st, en, backend, n_rows=8):
    """``indexer_logits`` on ``backend``, checked against the reference (CUDA) or, on CPU, the float64 oracle on
    ``n_rows`` rows spread over M (first and last included) and the -inf mask of every row from the ranges."""
    out = flashdsa.indexer_logits(q, k, w, ks, k_start=st, k_end=en, backend=backend)
    assert _dispatch.last_choice("indexer_logits") == backend
    if backend == "kernel":
        torch.cuda.synchronize()
        _check(out, flashdsa.indexer_logits(q, k, w, ks, k_start=st, k_end=en, backend="reference"))
        return out
    M, N = out.shape
    n = torch.arange(N)
    inside = (n >= st.long().clamp(0, N).unsqueeze(1)) & (n < en.long().clamp(0, N).unsqueeze(1))
    assert torch.equal(torch.isinf(out), ~inside), "-inf mask differs from the ranges"
    rows = torch.linspace(0, M - 1, min(n_rows, M)).round().long().unique()
    _check(out[rows], indexer_logits_oracle(q[rows], k, w[rows], ks, st[rows], en[rows]))
    return out


_PREFILL_MISSING = [(FP8, 16, 64), (FP8, 8, 128)] + [(BF16, h, d) for h, d in
                                                     [(64, 64), (32, 64), (32, 128), (16, 128), (8, 64), (8, 128)]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,H,D", _PREFILL_MISSING, ids=[f"{_tag(t)}-h{h}-d{d}" for t, h, d in _PREFILL_MISSING])
def test_prefill_missing_dtype_heads_dims(dtype, H, D, device):
    backend = _backend(device)
    M, N = 300, 1000
    q, k, w, ks = _inputs(M, N, H, D, dtype, seed=H * 3 + D, device=device)
    st, en = _causal(M, N, device)
    _prefill(q, k, w, ks, st, en, backend)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_131072_keys(device):
    """N = 131072 keys (CPU: 4096), M = 64 causal rows ending at N, fp8 H64/D128."""
    backend = _backend(device)
    M, N = 64, _size(131072, device)
    q, k, w, ks = _inputs(M, N, 64, 128, FP8, seed=17, device=device)
    st, en = _causal(M, N, device)
    _prefill(q, k, w, ks, st, en, backend)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,H,D", [(BF16, 64, 128), (FP8, 32, 64)], ids=["bf16-h64-d128", "fp8-h32-d64"])
def test_prefill_bitwise_deterministic(dtype, H, D, device):
    """5 runs bitwise identical: M 2048 over N 4096 (CPU: 128 over 512), causal with every 7th row empty."""
    backend = _backend(device)
    M, N = (2048, 4096) if device == "cuda" else (128, 512)
    q, k, w, ks = _inputs(M, N, H, D, dtype, seed=H + D + 1, device=device)
    st, en = _causal(M, N, device, empty_every=7)
    first = _prefill(q, k, w, ks, st, en, backend)
    for _ in range(4):
        again = flashdsa.indexer_logits(q, k, w, ks, k_start=st, k_end=en, backend=backend)
        assert torch.equal(again.view(I32), first.view(I32)), "not bitwise deterministic"


# ------------------------------------------------------------------------------------------------ paged decode
def _paged_inputs(next_n, H, D, bs, lens, dtype, *, seed, device, scale=True):
    """q `[B, next_n, H, D]`, k_cache `[num_blocks, bs, D]`, weights `[B*next_n, H]`, context_lens, block_table,
    k_scale_cache (None for bf16 without ``scale``); NaN in every slot no position uses (module notes)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    need = [(n + bs - 1) // bs for n in lens]
    max_blocks = max(need) + 1
    nb = sum(need) + 2  # two blocks no table entry names
    perm = torch.randperm(nb, generator=g).to(I32)
    table = torch.empty(B, max_blocks, dtype=I32)
    kc = torch.full((nb * bs, D), math.nan)
    sc = torch.full((nb * bs,), math.nan)
    used = 0
    for b, (n, L) in enumerate(zip(need, lens)):
        table[b, :n] = perm[used:used + n]
        used += n
        for j in range(n, max_blocks):  # past the sequence: never dereferenced
            table[b, j] = (-1, nb, INT32_MAX, INT32_MIN)[(b + j) % 4]
        p = torch.arange(L)
        slots = table[b, p // bs].long() * bs + p % bs
        kc[slots] = torch.randn(L, D, generator=g)
        sc[slots] = torch.rand(L, generator=g) + 0.5
    if need[0] >= 3:
        table[0, 1] = -1  # a bad block id inside the context: its positions are -inf
    q = torch.randn(B, next_n, H, D, generator=g)
    w = torch.randn(B * next_n, H, generator=g) * H**-0.5
    if dtype == FP8:
        q = (q * 8).to(FP8)
        sc = kc.abs().amax(-1) / 448.0  # NaN rows keep a NaN scale
        kc = (kc / sc[:, None]).to(FP8)
    else:
        q, kc = q.to(BF16), kc.to(BF16)
        sc = sc if scale else None
    kc = kc.view(nb, bs, D)
    sc = None if sc is None else sc.view(nb, bs)
    lens_t = torch.tensor(lens, dtype=I32)
    return [None if x is None else x.to(device) for x in (q, kc, w, lens_t, table, sc)]


def _paged(q, kc, w, lens, table, sc, L, backend):
    out = flashdsa.indexer_logits_paged(q, kc, w, lens, table, k_scale_cache=sc, max_context=L, backend=backend)
    assert _dispatch.last_choice("indexer_logits_paged") == backend
    if backend == "kernel":
        torch.cuda.synchronize()
        ref = flashdsa.indexer_logits_paged(q, kc, w, lens, table, k_scale_cache=sc, max_context=L,
                                            backend="reference")
    else:
        ref = indexer_logits_paged_oracle(q, kc, w, lens, table, sc, L)
    _check(out, ref)
    return out


# (dtype, H, D, next_n, block_size, context lens)
_PAGED_MISSING = [
    (FP8, 64, 64, 2, 64, [1300, 0, 1, 777]),
    (FP8, 32, 128, 3, 16, [900, 2, 0, 1025]),
    (FP8, 16, 128, 1, 128, [1500, 0, 130]),
    (FP8, 8, 64, 4, 32, [640, 3, 1111]),
    (BF16, 64, 64, 1, 32, [1000, 0, 77]),
    (BF16, 32, 64, 2, 128, [600, 1, 1301]),
    (BF16, 16, 64, 4, 64, [850, 4, 0, 129]),
    (BF16, 16, 128, 2, 16, [333, 2, 1200]),
    (BF16, 8, 64, 3, 128, [1234, 0, 5]),
    (BF16, 8, 128, 1, 64, [2000, 64, 0]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,H,D,next_n,bs,lens", _PAGED_MISSING,
                         ids=[f"{_tag(c[0])}-h{c[1]}-d{c[2]}-nn{c[3]}-bs{c[4]}" for c in _PAGED_MISSING])
def test_paged_missing_dtype_heads_dims(dtype, H, D, next_n, bs, lens, device):
    """Shuffled table, zero-length and shorter-than-next_n contexts, max_context past every context (-inf tail);
    bf16 with H 8 without a scale cache."""
    backend = _backend(device)
    q, kc, w, lens_t, table, sc = _paged_inputs(next_n, H, D, bs, lens, dtype, seed=H + D + next_n, device=device,
                                                scale=H > 8)
    _paged(q, kc, w, lens_t, table, sc, max(lens) + 17, backend)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_context_131072(device):
    """B 2, next_n 2, H 64, D 128, block 64, fp8: contexts 131072 and 77824 (CPU: 4096 and 2432), shuffled table."""
    backend = _backend(device)
    ctx = _size(131072, device)
    lens = [ctx, ctx * 19 // 32]
    q, kc, w, lens_t, table, sc = _paged_inputs(2, 64, 128, 64, lens, FP8, seed=131072, device=device)
    _paged(q, kc, w, lens_t, table, sc, ctx, backend)
