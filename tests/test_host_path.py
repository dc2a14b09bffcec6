"""CPU checks of the host-path helpers of small calls (their GPU use: tests/test_host_path_gpu.py).

* ``sparse.api._offset_batched_indices`` (PyTorch path) against a per-element loop over extreme int32 values;
* ``decode.kernel_dense._workspace``: the four views are the requested shapes and dtypes, 256-byte aligned, and
  do not overlap;
* ``_tilelang.dummy`` is cached per (dtype, device); ``_tilelang.direct_launcher`` falls back to the kernel object
  for anything that is not a TVM-FFI adapter without TileLang-allocated outputs.
"""

import random

import pytest
import torch

from flashdsa import _tilelang
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
