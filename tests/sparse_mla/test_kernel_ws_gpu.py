"""GPU: the warp-specialised TileLang sparse MLA forward kernel (kernel_fwd_ws) against the
PyTorch reference (run with ``pytest -m gpu``).

Hang canary (the smallest case only):
  FLASHDSA_TEST_WS=1 timeout -s KILL 120 python -u -m pytest -x -q -s \
      -p no:cacheprovider tests/sparse_mla/test_kernel_ws_gpu.py -k "kv64-"

Mirrors test_kernel_gpu.py (same inputs, poisoning and tolerances; the helpers are copied so the
two files evolve independently) for the subset kernel_fwd_ws supports (H in {64, 128}).
Compiles are per (H, Dqk, ceil(topk/64), sm_scale, sink, topk_length); the cases below share
4 compiles (each ~15-25 s of TileLang lowering + nvcc, paid by the first case that uses it):
  A 576/128/32 blocks/-/-       (headline shape; also the perf print)
  B 576/128/4 blocks/sink/tl    (also the CUDA-graph test; random topk_length -> nblk 0..4,
                                 odd and even, so the tail-skip of every role is exercised)
  C 512/64/3 blocks/sink/tl     (odd block count: the last buffer pair is half used)
  D 512/128/2 blocks/-/-
Hang safety: this kernel hung once (setmaxnreg over-subscription, see kernel_fwd_ws.py).
Every launch is followed by ``_sync_or_die``, which polls the stream and, if the kernel is
not done within HANG_S seconds, prints which case hung and hard-exits the process (a hung
kernel cannot be interrupted, and every later CUDA call would block behind it).  Tests also
carry ``pytest.mark.timeout(60, method="thread")`` when pytest-timeout is installed (the
thread method is the one that works while the main thread is blocked in a CUDA call).
Cases run small first.  Quick GPU check of the two 576/128 compiles (B, A) + perf, < 90 s:
  FLASHDSA_TEST_WS=1 timeout -s KILL 88 python -u -m pytest -x -q -s -p no:cacheprovider \
      tests/sparse_mla/test_kernel_ws_gpu.py -k "not d512"
"""

import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")
if os.environ.get("FLASHDSA_TEST_WS") != "1":
    # This variant hung at 61a94777 (setmaxnreg asked for 512 > 504 registers/thread); fixed to 240/176/88 and
    # run at 48a0c95 (8 passed, -k "not d512"). It is not dispatched yet, so its tests run on request only.
    pytest.skip("warp-specialized variant (not dispatched): set FLASHDSA_TEST_WS=1 to run", allow_module_level=True)

try:  # pytest-timeout is on the GPU host; keep the module importable without it
    import pytest_timeout  # noqa: F401

    _timeout = pytest.mark.timeout(60, method="thread")
except ImportError:  # pragma: no cover

    def _timeout(fn):
        return fn

from flashdsa.sparse import kernel_fwd_ws as kmod  # noqa: E402

D_V = 512
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
HANG_S = 20.0  # the largest launch here (perf shape, 10 iterations) takes well under 1 s

# (dqk, heads, tkv, topk, n_tok, sink, topk_length, q layout); small cases first
CASES = [
    (576, 128, 64, 256, 3, True, True, "contig"),  # B, tiny hang canary: full / clamped / empty rows
    (576, 128, 592, 200, 62, True, True, "contig"),  # B, tail block masked
    (576, 128, 1840, 256, 213, True, True, "sliced"),  # B
    (576, 128, 8192, 2048, 1, False, False, "transposed"),  # A
    (576, 128, 8192, 2048, 62, False, False, "contig"),  # A
    (512, 64, 128, 130, 213, True, True, "contig"),  # C, topk > Tkv (duplicates)
    (512, 64, 1840, 192, 62, True, True, "transposed"),  # C
    (512, 128, 128, 128, 62, False, False, "transposed"),  # D
    (512, 128, 4096, 100, 213, False, False, "sliced"),  # D
]


def _sync_or_die(what, timeout_s=HANG_S):
    sync_or_die("kernel_fwd_ws", what, timeout_s)


# inputs, poisoning and tolerances: the same as the pipelined kernel's tests
from ._hang import sync_or_die  # noqa: E402
from .test_kernel_gpu import _make_inputs, _poison_allocator, check_against_reference  # noqa: E402


@pytest.mark.parametrize(
    "dqk,heads,tkv,topk,n_tok,sink,use_tl,layout",
    CASES,
    ids=[f"d{c[0]}-h{c[1]}-kv{c[2]}-k{c[3]}-t{c[4]}{'-sink' if c[5] else ''}{'-tl' if c[6] else ''}-{c[7]}" for c in CASES],
)
def test_sparse_mla_fwd_ws_kernel(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout):
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout)
    sm_scale = dqk**-0.5
    assert kmod.kernel_unsupported(q, kv, indices, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink) is None

    _poison_allocator((n_tok, heads, D_V), (n_tok, heads), (n_tok, heads))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, lse, max_logits = kmod.run_sparse_mla_fwd(
        q, kv, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink
    )
    t1 = time.perf_counter()  # compile (first use of a config) + launch
    _sync_or_die(f"dqk={dqk} H={heads} Tkv={tkv} topk={topk} T={n_tok} sink={sink} tl={use_tl} {layout}")
    print(f"[ws] d{dqk}-h{heads}-k{topk}-t{n_tok}: compile+launch {t1 - t0:.1f} s, kernel done")
    check_against_reference(out, lse, max_logits, q, kv, indices, sm_scale, topk_length, attn_sink, valid)


def test_sparse_mla_fwd_ws_unsupported_heads():
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(8, 576, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    assert kmod.kernel_unsupported(q, kv, idx, d_v=D_V) is not None


@_timeout
def test_sparse_mla_fwd_ws_kernel_cuda_graph():
    """Capturable (no host sync, no value reads); replays with new indices/lengths correctly."""
    dqk, heads, tkv, topk, n_tok = 576, 128, 1840, 256, 62  # compile B
    q, kv, indices, topk_length, attn_sink, _ = _make_inputs(dqk, heads, tkv, topk, n_tok, True, True, "contig", 1)
    kw = dict(sm_scale=dqk**-0.5, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink)
    eager = kmod.run_sparse_mla_fwd(q, kv, indices, **kw)  # compiles outside the capture
    _sync_or_die("cuda graph test, eager run")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kmod.run_sparse_mla_fwd(q, kv, indices, **kw)
    torch.cuda.current_stream().wait_stream(s)
    _sync_or_die("cuda graph test, side-stream run")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = kmod.run_sparse_mla_fwd(q, kv, indices, **kw)
    g.replay()
    _sync_or_die("cuda graph test, first replay")
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    # replay with different indices and lengths written in place
    _, kv2, indices2, topk_length2, _, _ = _make_inputs(dqk, heads, tkv, topk, n_tok, True, True, "contig", 2)
    indices.copy_(indices2)
    topk_length.copy_(topk_length2)
    kv.copy_(torch.nan_to_num(kv2, nan=0.0))
    g.replay()
    fresh = kmod.run_sparse_mla_fwd(q, kv, indices, **kw)
    _sync_or_die("cuda graph test, replay with new indices")
    for a, b in zip(fresh, graphed):
        assert torch.equal(a, b)


