"""CPU: the single-launch decode ("narrow_fused", ``decode/kernel_dense_fused.py``) derives each CTA's work item with
the split plan's arithmetic.

``cta_item`` (the per-CTA specification the kernel's ``derive_item`` follows) must equal the column of
``kernel_dense._plan`` (the torch-ops plan the other variants run) for every CTA index, over random lengths incl. 0,
negative, past the block table, and batches larger than the kernel's 128 threads (several scan rounds).  The
kernel itself against ``_plan`` on the GPU: ``test_fused_gpu.py::test_item_probe_equals_plan``.
"""

import random

import pytest
import torch

pytest.importorskip("tilelang")

from flashdsa.decode import kernel_dense as kd  # noqa: E402
from flashdsa.decode import kernel_dense_fused as kf  # noqa: E402
from flashdsa.decode import kernel_dense_narrow as kn  # noqa: E402


def _plan_columns(lens, *, cap, num_sms):
    plan, seq_plan = kd._plan(torch.tensor(lens, dtype=torch.int32), max_blocks=cap // 64, block_size=64, n_mt=1,
                              num_sms=num_sms, tile=kn.BLOCK_N, overhead=kn._OVERHEAD_TILES,
                              min_chunk=kn._MIN_CHUNK_TILES)
    return plan.tolist(), seq_plan.tolist()


def _lengths(rng, B, cap, kind):
    if kind == "uniform":
        return [rng.randint(-5, cap + 100) for _ in range(B)]
    if kind == "equal":
        return [cap] * B
    if kind == "sparse":  # mostly empty, a few long: 1-split, multi-split and empty sequences together
        return [rng.choice([0, 0, 0, 1, 63, 64, 65, cap]) for _ in range(B)]
    raise ValueError(kind)


@pytest.mark.parametrize("B", [1, 2, 7, 64, 127, 128, 129, 300, 1000])
@pytest.mark.parametrize("kind", ["uniform", "equal", "sparse"])
def test_cta_item_equals_plan(B, kind):
    rng = random.Random(B * 31 + len(kind))
    for cap in (64 * 3, 8192, 64 * 2048):
        lens = _lengths(rng, B, cap, kind)
        for num_sms in (132, 264, 7, 1):
            plan, seq_plan = _plan_columns(lens, cap=cap, num_sms=num_sms)
            n_items = kd.max_items(B, 1, num_sms)
            assert len(plan[0]) == n_items
            items = range(n_items)
            if B * n_items > 200_000:  # the spec is O(B) per item: sample the large cases
                items = sorted(set(range(64)) | set(range(n_items - 64, n_items)) | set(rng.sample(items, 128)))
            for it in items:
                got = kf.cta_item(lens, it, cap=cap, num_sms=num_sms)
                want = tuple(plan[r][it] for r in range(4))
                assert got[:4] == want, (cap, num_sms, it)
                if got[0] >= 0:
                    assert got[4] == seq_plan[0][got[0]] and got[3] == seq_plan[1][got[0]], (cap, num_sms, it)


def test_cta_item_mixed_splits():
    """The GPU tests' mixed batch has empty, one-split and several-split sequences (what the merge must handle)."""
    from .test_fused_gpu import MIXED_LENS

    B = 70
    lens = [MIXED_LENS[i % len(MIXED_LENS)] for i in range(B)]
    _, seq_plan = _plan_columns(lens, cap=64 * 600, num_sms=132 * kn.ctas_per_sm(16))
    nsplit = seq_plan[1]
    assert 0 in lens and 1 in nsplit and max(nsplit) >= 3


@pytest.mark.parametrize("rows", [1, 16, 17, 32, 33, 64, 128, 512])
def test_fused_variant_rule(rows):
    """"auto" (the default) and "narrow_fused" run the fused kernel exactly where "narrow" runs the narrow kernel
    (else the same module as "narrow"); "narrow", "ws" and "pipelined" never run it."""
    assert "narrow_fused" in kd.VARIANTS and kd.DEFAULT_VARIANT == "auto"
    assert kd._ws_module("narrow_fused", rows) is kd._ws_module("narrow", rows)
    assert (rows <= kf.MAX_ROWS) == (rows <= kn.MAX_ROWS)
    narrow_runs = kd._ws_module("narrow", rows) is kn
    assert kd._runs_fused("narrow_fused", rows) == narrow_runs
    assert kd._runs_fused("auto", rows) == (narrow_runs and rows <= kd.AUTO_NARROW_ROWS)
    assert kd._runs_fused("auto", rows) == (kd._ws_module("auto", rows) is kn)
    for v in ("narrow", "ws", "pipelined"):
        assert not kd._runs_fused(v, rows), v


@pytest.fixture
def counters(monkeypatch):
    """``kernel_dense_fused`` with an empty counter cache and a settable current stream (``stream[0]``) and
    capture flag (``capturing[0]``) in place of the CUDA queries, on the CPU."""
    stream, capturing = [11], [False]
    monkeypatch.setattr(kf, "_COUNTERS", {})
    monkeypatch.setattr(kf, "_stream_key", lambda dev: stream[0])
    monkeypatch.setattr(kf, "_capturing", lambda dev: capturing[0])
    return stream, capturing


def test_seq_counters_per_stream_cached_and_grown(counters):
    stream, _ = counters
    dev = torch.device("cpu")
    a = kf.seq_counters(5, dev)
    assert a.shape == (5,) and a.dtype == torch.int32 and int(a.abs().sum()) == 0
    assert kf.seq_counters(3, dev).data_ptr() == a.data_ptr()  # one zeroed allocation per stream, reused
    stream[0] = 12
    b = kf.seq_counters(5, dev)
    assert b.data_ptr() != a.data_ptr() and int(b.abs().sum()) == 0  # another stream: its own counters
    stream[0] = 11
    assert kf.seq_counters(5, dev).data_ptr() == a.data_ptr()
    big = kf.seq_counters(kf._COUNTER_MIN + 1, dev)
    assert big.shape == (kf._COUNTER_MIN + 1,) and int(big.abs().sum()) == 0 and big.data_ptr() != a.data_ptr()
    assert kf.seq_counters(5, dev).data_ptr() == big.data_ptr()  # regrown, then reused
    stream[0] = 12
    assert kf.seq_counters(5, dev).data_ptr() == b.data_ptr()  # the other stream's counters are untouched
    assert set(kf._COUNTERS) == {(dev, 11), (dev, 12)}


def test_seq_counters_fresh_during_capture(counters):
    """Under a CUDA-graph capture every call gets a new zeroed [B] buffer (its zero fill is recorded into the graph)
    and the persistent per-stream counters are neither used nor created."""
    _, capturing = counters
    dev = torch.device("cpu")
    eager = kf.seq_counters(5, dev)
    cached = dict(kf._COUNTERS)
    capturing[0] = True
    c1 = kf.seq_counters(5, dev)
    c1.fill_(3)  # as a dirty buffer would be
    c2 = kf.seq_counters(5, dev)
    assert c1.shape == c2.shape == (5,) and c2.dtype == torch.int32 and int(c2.abs().sum()) == 0
    assert len({eager.data_ptr(), c1.data_ptr(), c2.data_ptr()}) == 3
    assert kf._COUNTERS == cached and int(eager.abs().sum()) == 0
    capturing[0] = False
    assert kf.seq_counters(5, dev).data_ptr() == eager.data_ptr()


def test_seq_counters_off_cuda_without_fakes(monkeypatch):
    """The real capture / stream queries on a CPU device: not capturing, stream key 0."""
    monkeypatch.setattr(kf, "_COUNTERS", {})
    dev = torch.device("cpu")
    assert not kf._capturing(dev) and kf._stream_key(dev) == 0
    a = kf.seq_counters(4, "cpu")
    assert kf.seq_counters(2, dev).data_ptr() == a.data_ptr() and set(kf._COUNTERS) == {(dev, 0)}
