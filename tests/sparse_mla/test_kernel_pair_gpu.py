"""GPU: the "pair" warp-specialised sparse MLA forward (kernel_fwd_pair) against the PyTorch reference.

Same inputs, poisoning and tolerances as test_kernel_gpu.py, for the shapes the kernel takes (H in {64, 128}).
Compiles: (576, 128, 4 blocks, sink, tl), (576, 128, 32 blocks), (512, 64, 3 blocks, sink, tl), (512, 128, 2 blocks).
Hang guard: a producer / consumer protocol bug hangs the kernel, so every launch is followed by a polling
synchronize that hard-exits the process after HANG_S seconds (a hung kernel cannot be interrupted).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

from flashdsa.sparse import kernel_fwd_pair as kmod  # noqa: E402

from ._hang import assert_same_as_default, sync_or_die  # noqa: E402
from .test_kernel_gpu import _make_inputs, check_against_reference  # noqa: E402

D_V = 512
HANG_S = 30.0

# (dqk, heads, tkv, topk, n_tok, sink, topk_length, q layout); small cases first
CASES = [
    (576, 128, 64, 256, 3, True, True, "contig"),  # tiny: full / clamped / empty rows
    (576, 128, 592, 200, 62, True, True, "contig"),  # tail block masked, odd block counts
    (576, 128, 1840, 256, 213, True, True, "sliced"),
    (576, 128, 8192, 2048, 62, False, False, "transposed"),  # the headline config
    (512, 64, 128, 130, 213, True, True, "contig"),  # topk > Tkv (duplicates), 3 blocks: half-used last pair
    (512, 64, 1840, 192, 62, True, True, "transposed"),
    (512, 128, 128, 128, 62, False, False, "transposed"),
    (512, 128, 4096, 100, 213, False, False, "sliced"),
]


_over_cases = pytest.mark.parametrize(
    "dqk,heads,tkv,topk,n_tok,sink,use_tl,layout",
    CASES,
    ids=[f"d{c[0]}-h{c[1]}-kv{c[2]}-k{c[3]}-t{c[4]}{'-sink' if c[5] else ''}{'-tl' if c[6] else ''}-{c[7]}"
         for c in CASES],
)


def _sync_or_die(what, timeout_s=HANG_S):
    sync_or_die("kernel_fwd_pair", what, timeout_s)


@_over_cases
def test_sparse_mla_fwd_pair_kernel(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout):
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout)
    sm_scale = dqk**-0.5
    assert kmod.kernel_unsupported(q, kv, indices, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink) is None
    out, lse, max_logits = kmod.run_sparse_mla_fwd(
        q, kv, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink
    )
    _sync_or_die(f"dqk={dqk} H={heads} Tkv={tkv} topk={topk} T={n_tok} sink={sink} tl={use_tl} {layout}")
    check_against_reference(out, lse, max_logits, q, kv, indices, sm_scale, topk_length, attn_sink, valid)
    # deterministic: a second launch gives bitwise the same outputs
    again = kmod.run_sparse_mla_fwd(q, kv, indices, sm_scale=sm_scale, d_v=D_V, topk_length=topk_length,
                                    attn_sink=attn_sink)
    _sync_or_die("second launch")
    for a, b in zip((out, lse, max_logits), again):
        assert torch.equal(a, b)


def test_sparse_mla_fwd_pair_unsupported_heads():
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(8, 576, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    assert kmod.kernel_unsupported(q, kv, idx, d_v=D_V) is not None
    with pytest.raises(ValueError, match="H=16"):
        kmod.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=D_V)


# timing builds that compute the same products in the same order as the default: bitwise equal outputs (the sink
# normaliser's rounding is pinned, _tl_common.sink_exponent, so the persistent grid does not change a bit either)
SAME_ORDER_BUILDS = [(("overlap_qk", False),), (("l2_prefetch", True),), (("persistent", 132),),
                     (("persistent", 7),), (("row_gather", True),), (("persistent", 132), ("row_gather", True)),
                     (("row_gather", True), ("evict_first", True)),
                     (("persistent", 132), ("row_gather", True), ("evict_first", True)),
                     (("row_gather", True), ("q_gate", "tma")),
                     (("persistent", 132), ("row_gather", True), ("q_gate", "next")),
                     (("persistent", 7), ("row_gather", True), ("q_gate", "next"))]
# the evict_first gather at Dqk 576 raised "illegal instruction" (session 31): it is built and dispatched for Dqk 512
_DQK512_ONLY = ("evict_first",)


_SAME_ORDER_CASES = {"tiny": CASES[0], "odd-blocks": CASES[1], "headline": CASES[3], "d512-topk>tkv": CASES[4]}
_SAME_ORDER_PARAMS = [pytest.param(case, kw, id=f"{name}-" + "-".join(f"{k}={v}" for k, v in kw))
                      for name, case in _SAME_ORDER_CASES.items() for kw in SAME_ORDER_BUILDS
                      if case[0] == 512 or not any(k in _DQK512_ONLY for k, _ in kw)]


@pytest.mark.parametrize("case,build_kw", _SAME_ORDER_PARAMS)
def test_sparse_mla_fwd_pair_same_order_builds(case, build_kw):
    """Timing builds with the default's products in its order (``overlap_qk=False``: WG0 retires its remote PV
    before it issues the next QK; ``l2_prefetch``: cp.async with the L2 hint; ``persistent``: P CTAs looping over
    the items, 132 = the H200's SM count, 7: many items per CTA, the phase carry and an uneven last round;
    ``row_gather``: the producer's gather by rows, same bytes and layout; ``evict_first``: its copies with an L2
    eviction policy, Dqk 512 cases only; ``q_gate`` "tma": Q loaded by TMA; "next": the persistent grid's producer
    loading each item's Q by TMA once the previous item's last QK retired, O written from the fragments): against
    the reference and bitwise equal to the default build."""
    _same_as_default(case, build_kw)


def _same_as_default(case, build_kw):
    """``build_kw``'s build bitwise equal to the one-CTA-per-item default build, and against the reference (the
    run_sparse_mla_fwd dispatch picks the persistent grid or the row gather, so the base is ``kmod._compiled``)."""
    from flashdsa.sparse import kernel_fwd

    dqk, heads, tkv, topk, n_tok, sink, use_tl, layout = case
    q, kv, indices, topk_length, attn_sink, valid = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout)
    kw = dict(sm_scale=dqk**-0.5, d_v=D_V, topk_length=topk_length, attn_sink=attn_sink)
    got = assert_same_as_default(
        "kernel_fwd_pair",
        lambda build_kw=(): kernel_fwd.launch(lambda *a: kmod._compiled(*a, build_kw), q, kv, indices, **kw),
        dict(build_kw=build_kw), f"dqk={dqk} H={heads} Tkv={tkv} topk={topk} T={n_tok}", HANG_S)
    check_against_reference(*got, q, kv, indices, kw["sm_scale"], topk_length, attn_sink, valid)
