"""CPU checks of the host-path helpers of small calls (their GPU use: tests/test_host_path_gpu.py).

* ``sparse.api._offset_batched_indices`` (PyTorch path) against a per-element loop over extreme int32 values;
* ``decode.kernel_dense._workspace``: the four views are the requested shapes and dtypes, 256-byte aligned, and
  do not overlap;
* ``_tilelang.dummy`` is cached per (dtype, device); ``_tilelang.direct_launcher`` falls back to the kernel object
  for anything that is not a TVM-FFI adapter without TileLang-allocated outputs;
* ``_dispatch.call_signature`` tells apart what validation reads (dtype, shape, strides, alignment, argument types,
  ``$FLASHDSA_BACKEND``); ``_dispatch.PlanCache`` is bounded and ignores unhashable keys; CPU calls never store an
  eager plan, and bad arguments still raise the plain path's errors.
"""

import random
import warnings

import pytest
import torch

import flashdsa
from flashdsa import _dispatch, _tilelang
from flashdsa.sparse import api as sparse_api

INT_MIN, INT_MAX = -(2**31), 2**31 - 1


@pytest.mark.parametrize("B,S,k,skv", [(1, 1, 1, 1), (3, 4, 7, 5), (2, 3, 16, 1000)])
def test_offset_batched_indices_against_loop(B, S, k, skv):
    rng = random.Random(B * 100 + k)
    pool = [INT_MIN, INT_MAX, -1, 0, skv - 1, skv, skv + 1, -skv]
    vals = [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(-2 * skv, 2 * skv) for _ in range(B * S * k)]
    idx = torch.tensor(vals, dtype=torch.int32).view(B, S, k)
    got = sparse_api._offset_batched_indices(idx, skv)
    assert got.shape == (B * S, k) and got.dtype == torch.int32
    for b in range(B):
        for s in range(S):
            for j in range(k):
                i = int(idx[b, s, j])
                want = i + b * skv if 0 <= i < skv else -1
                assert int(got[b * S + s, j]) == want, (b, s, j, i)


@pytest.mark.parametrize("B,M,n_items", [(1, 1, 1), (64, 16, 329), (3, 37, 5)])
def test_decode_workspace_views(B, M, n_items):
    from flashdsa.decode import kernel_dense as kd

    plan, seq_plan, o_part, lse_part = kd._workspace(B, M, n_items, torch.device("cpu"))
    assert plan.shape == (4, n_items) and plan.dtype == torch.int32 and plan.is_contiguous()
    assert seq_plan.shape == (2, B) and seq_plan.dtype == torch.int32 and seq_plan.is_contiguous()
    assert o_part.shape == (n_items, M, kd.D_V) and o_part.dtype == torch.float32 and o_part.is_contiguous()
    assert lse_part.shape == (n_items, M) and lse_part.dtype == torch.float32 and lse_part.is_contiguous()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (plan, seq_plan, o_part,
                                                                                        lse_part))
    base = spans[0][0]
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, "workspace views overlap"
    for a0, _ in spans:
        assert (a0 - base) % 256 == 0, "every view starts on a 256-byte boundary"
    # writing one view leaves the others untouched
    for t in (plan, seq_plan, o_part, lse_part):
        t.zero_()
    o_part.fill_(1.5)
    assert int(plan.abs().sum()) == 0 and int(seq_plan.abs().sum()) == 0 and float(lse_part.abs().sum()) == 0


def test_dummy_is_cached_per_dtype_and_device():
    a = _tilelang.dummy(torch.float32, torch.device("cpu"))
    b = _tilelang.dummy(torch.float32, torch.device("cpu"))
    c = _tilelang.dummy(torch.int32, torch.device("cpu"))
    assert a is b and a is not c
    assert a.shape == (1,) and c.dtype == torch.int32 and float(a) == 0 and int(c) == 0


class _Adapter:
    def __init__(self, result_idx, callee_alloc):
        self.result_idx = result_idx
        self._ffi_callee_allocated_output_abi = callee_alloc

    def _get_executable(self):
        return "executable"


class _Kernel:
    def __init__(self, adapter=None):
        if adapter is not None:
            self.adapter = adapter


@pytest.mark.parametrize("adapter,direct", [
    (_Adapter([], False), True),  # TVM-FFI, outputs passed in: the executable
    (_Adapter([2], False), False),  # TileLang allocates outputs: the kernel's own wrapper
    (_Adapter([], True), False),  # callee-allocated output ABI
    (None, False),  # no adapter attribute (another backend)
])
def test_direct_launcher_fallbacks(adapter, direct):
    k = _Kernel(adapter)
    got = _tilelang.direct_launcher(k)
    assert (got == "executable") if direct else (got is k)


def test_call_signature_tells_apart_what_validation_reads(monkeypatch):
    x = torch.zeros(4, 8)
    base = _dispatch.call_signature(x, 1.0, "auto")
    assert base == _dispatch.call_signature(torch.ones(4, 8), 1.0, "auto")  # values are not part of it
    assert base != _dispatch.call_signature(x.double(), 1.0, "auto")
    assert base != _dispatch.call_signature(torch.zeros(8, 4).t(), 1.0, "auto")  # same shape, other strides
    assert base != _dispatch.call_signature(torch.zeros(4, 9)[:, 1:], 1.0, "auto")  # data pointer mod 16
    assert base != _dispatch.call_signature(x, 1, "auto")
    assert _dispatch.call_signature(x, True) != _dispatch.call_signature(x, 1)
    assert _dispatch.call_signature(x, None) != _dispatch.call_signature(x, 0)
    monkeypatch.setenv(_dispatch.ENV_VAR, "reference")
    assert base != _dispatch.call_signature(x, 1.0, "auto")


def test_plan_cache_bounded_and_unhashable_keys():
    cache = _dispatch.PlanCache(size=3)
    for i in range(3):
        cache.put(("k", i), i)
    assert len(cache) == 3 and cache.get(("k", 2)) == 2
    cache.put(("k", 3), 3)  # full: cleared first
    assert len(cache) == 1 and cache.get(("k", 0)) is None and cache.get(("k", 3)) == 3
    cache.put(("k", [1]), 4)
    assert cache.get(("k", [1])) is None and len(cache) == 1


def test_cpu_calls_store_no_plan_and_still_validate():
    before = len(sparse_api._PLANS)
    q = torch.randn(2, 1, 4, 512, dtype=torch.bfloat16)
    kv = torch.randn(2, 10, 512, dtype=torch.bfloat16)
    idx = torch.tensor([[[0, 1]], [[2, -1]]], dtype=torch.int32)
    for _ in range(2):
        flashdsa.sparse_attn(q, kv, None, idx)
        flashdsa.sparse_mla_fwd(q.view(2, 4, 512), kv[0], idx.view(2, 2))
    assert len(sparse_api._PLANS) == before
    with pytest.raises(TypeError, match="softmax_scale"):
        flashdsa.sparse_attn(q, kv, None, idx, softmax_scale=[1.0])
    with pytest.raises(TypeError, match="sm_scale"):
        flashdsa.sparse_mla_fwd(q.view(2, 4, 512), kv[0], idx.view(2, 2), sm_scale=True)


def test_stored_plan_is_replayed_with_the_lead_dims(monkeypatch):
    """Routing of a hit (no GPU needed): a plan stored under a CPU call's signature is what the next call with that
    signature returns, reshaped to the call's lead dims, for each public form; other signatures miss it."""
    monkeypatch.setattr(sparse_api, "_PLANS", _dispatch.PlanCache())  # stubs stay out of the other tests

    class StubPlan:
        lead = None

        def __init__(self, lead, heads, d_v):
            self.lead, self.calls = lead, 0
            n = 1
            for x in lead:
                n *= x
            self.out = (torch.arange(n * heads * d_v, dtype=torch.float32).view(n, heads, d_v).bfloat16(),
                        torch.full((n, heads), 2.0), torch.full((n, heads), 3.0))

        def __call__(self, q, kv, indices, topk_length, attn_sink):
            self.calls += 1
            return self.out

    q = torch.randn(2, 3, 4, 512, dtype=torch.bfloat16)
    kv = torch.randn(2, 10, 512, dtype=torch.bfloat16)
    idx = torch.zeros(2, 3, 5, dtype=torch.int32)
    sink = torch.zeros(4)
    cases = [
        (("attn", q, kv, idx, None, sink, None, "auto"), lambda: flashdsa.sparse_attn(q, kv, sink, idx)),
        (("fwd", q, kv, idx, None, None, None, 512, "auto"),
         lambda: flashdsa.sparse_mla_fwd(q, kv, idx, return_max_logits=True)),
        (("mla", q, kv, idx, None, None, None, 512, False, "auto"), lambda: flashdsa.sparse_mla(q, kv, idx)),
    ]
    for key_args, call in cases:
        stub = StubPlan((2, 3), 4, 512)
        sparse_api._PLANS.put(sparse_api._plan_key(*key_args), stub)
        got = call()
        assert stub.calls == 1
        out = got[0] if isinstance(got, tuple) else got
        assert torch.equal(out, stub.out[0].view(2, 3, 4, 512))
        if isinstance(got, tuple):
            assert torch.equal(got[1], stub.out[1].view(2, 3, 4)) and torch.equal(got[2], stub.out[2].view(2, 3, 4))
    miss = StubPlan((2, 3), 4, 512)
    sparse_api._PLANS.put(sparse_api._plan_key("attn", q, kv, idx, None, sink, None, "auto"), miss)
    flashdsa.sparse_attn(q, kv, sink, idx, softmax_scale=0.5)  # another signature: the plain path
    flashdsa.sparse_attn(q.float(), kv.float(), sink, idx)
    assert miss.calls == 0
    with torch.enable_grad():
        flashdsa.sparse_attn(q.clone().requires_grad_(), kv, sink, idx)  # needs autograd: the plain path
    assert miss.calls == 0
    # a kernel-choice switch set after the plan was stored: another signature (the plain path, which reads it)
    from flashdsa.sparse import kernel_fwd_pair

    monkeypatch.setenv(kernel_fwd_pair.QTMA_ENV, "0")
    flashdsa.sparse_attn(q, kv, sink, idx)
    assert miss.calls == 0


def test_aligned_copies_views_and_warns_on_large_copies(monkeypatch):
    base = torch.randn(8, 12)
    assert _tilelang.aligned(base) is base  # contiguous and aligned: no copy
    view = base[:, :6]  # rows strided
    monkeypatch.setattr(_tilelang, "COPY_WARN_BYTES", view.numel() * view.element_size())
    with pytest.warns(UserWarning, match=r"shape \(8, 6\).*strides \(12, 1\)"):
        out = _tilelang.aligned(view)
    assert out.is_contiguous() and out.data_ptr() % 16 == 0 and torch.equal(out, view)
    monkeypatch.setattr(_tilelang, "COPY_WARN_BYTES", view.numel() * view.element_size() + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_tilelang.aligned(view), view)  # one byte under the threshold: a silent copy
