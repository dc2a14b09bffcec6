"""GPU: the pair forward with its last partial round as split-KV chunks (``sparse/_tail_split.py``) against the
reference, and against the unsplit forward (``$FLASHDSA_PAIR_TAIL=0``): the first ``t_main`` tokens bitwise
equal (the same grid over them), the tail tokens within the reference's tolerance.

Token counts are one whole round of the GPU's SMs plus 4 items, so ``tail_plan`` splits (asserted, and the tail
launcher is seen to run).  The tail tokens include an empty row, a row with ``topk_length`` 0 and one whose
``topk_length`` ends inside the first chunk; KV rows no valid index selects hold NaN (``_make_inputs``).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tilelang")

import flashdsa  # noqa: E402
from flashdsa import _dispatch  # noqa: E402
from flashdsa.decode import kernel_split  # noqa: E402
from flashdsa.sparse import _tail_split, kernel_fwd  # noqa: E402

from ._hang import sync_or_die  # noqa: E402
from .test_kernel_gpu import _make_inputs, check_against_reference  # noqa: E402

D_V = 512
HANG_S = 30.0

# (dqk, heads, tkv, topk, sink, topk_length, q layout): the H 64 prefill row's grid (one CTA per item, Q by TMA),
# H 128 on the persistent grid with a list the chunks pad (9 blocks), V4's d 512 / topk 640 with sink
CASES = [
    (576, 64, 4096, 2048, False, False, "contig"),
    (576, 128, 2048, 576, True, True, "sliced"),
    (512, 64, 4096, 640, True, True, "contig"),
]


def _tokens(heads: int) -> int:
    """One whole round of items on this GPU plus 4 items."""
    return (_dispatch.sm_count(torch.cuda.current_device()) + 4) // (heads // 64)


def _tail_rows(indices, topk_length, tkv):
    """Corner cases in the last tokens (the split ones): an empty row, and with topk_length a zero length and one
    ending inside the first chunk.  Returns the valid mask [T, topk] of the changed inputs."""
    indices[-1] = -1
    if topk_length is not None:
        topk_length[-2] = 0
        topk_length[-3] = 70
    pos = torch.arange(indices.shape[1], device=indices.device)
    valid = (indices >= 0) & (indices < tkv)
    if topk_length is not None:
        valid &= pos.unsqueeze(0) < topk_length.unsqueeze(1).long()
    return valid


@pytest.fixture
def tail_calls(monkeypatch):
    """The plans ``_tail_split.tail_launcher`` built launches for, and (``tail_calls.runs``) how many split launches
    ran their chunks (``kernel_split.split_inputs`` is called per split launch, never on the unsplit fallback); the
    split switched on, whatever its default."""
    monkeypatch.setenv(_tail_split.TAIL_ENV, "1")
    calls = _Calls()
    real, real_inputs = _tail_split.tail_launcher, kernel_split.split_inputs

    def spy(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    def spy_inputs(*a, **k):
        calls.runs += 1
        return real_inputs(*a, **k)

    monkeypatch.setattr(_tail_split, "tail_launcher", spy)
    monkeypatch.setattr(kernel_split, "split_inputs", spy_inputs)
    return calls


class _Calls(list):
    runs = 0


@pytest.mark.parametrize("dqk,heads,tkv,topk,sink,use_tl,layout", CASES,
                         ids=[f"d{c[0]}-h{c[1]}-k{c[3]}{'-sink' if c[4] else ''}{'-tl' if c[5] else ''}-{c[6]}"
                              for c in CASES])
def test_tail_split_forward(dqk, heads, tkv, topk, sink, use_tl, layout, tail_calls, monkeypatch):
    n_tok = _tokens(heads)
    q, kv, indices, topk_length, attn_sink, _ = _make_inputs(dqk, heads, tkv, topk, n_tok, sink, use_tl, layout,
                                                             seed=3)
    valid = _tail_rows(indices, topk_length, tkv)
    plan = _tail_split.tail_plan(n_tok, heads, topk, _dispatch.sm_count(torch.cuda.current_device()))
    assert plan is not None and plan[0] < n_tok, plan
    sm_scale = dqk**-0.5
    run = lambda: kernel_fwd.run_sparse_mla_fwd(q, kv, indices, sm_scale=sm_scale, d_v=D_V,  # noqa: E731
                                                topk_length=topk_length, attn_sink=attn_sink)
    got = run()
    sync_or_die("tail split", f"dqk={dqk} H={heads} topk={topk}", HANG_S)
    assert tail_calls == [plan] and tail_calls.runs == 1
    check_against_reference(*got, q, kv, indices, sm_scale, topk_length, attn_sink, valid)

    monkeypatch.setenv(_tail_split.TAIL_ENV, "0")
    base = run()
    sync_or_die("unsplit", f"dqk={dqk} H={heads} topk={topk}", HANG_S)
    assert len(tail_calls) == 1 and tail_calls.runs == 1
    t0 = plan[0]
    for name, a, b in zip(("out", "lse", "max_logits"), got, base):
        assert torch.equal(a[:t0], b[:t0]), f"{name}: the main grid's rows differ from the unsplit forward"
    # max_logits: the largest of the chunks' maxima is the row's maximum (the same products)
    torch.testing.assert_close(got[2][t0:], base[2][t0:], rtol=1e-6, atol=0)
    assert (got[0][t0:].float() - base[0][t0:].float()).abs().max().item() < 2e-2


def test_tail_split_sparse_attn_batched(tail_calls):
    """DeepSeek-V4's ``sparse_attn`` (b 2, the eager plan's batched build): the first call flattens the indices,
    the replay runs the batched build over the first tokens and the chunks over the last batch's kv rows; both
    against the reference, the replay equal to the first call."""
    heads, d, topk = 64, 512, 640
    n_tok = _tokens(heads)
    b, m, n = 2, n_tok // 2, 1024
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = (torch.randn(b, m, heads, d, generator=gen, device="cuda") * 0.1).bfloat16()
    kv = (torch.randn(b, n, d, generator=gen, device="cuda") * 0.1).bfloat16()
    idx = torch.argsort(torch.rand(b, m, n, generator=gen, device="cuda"), dim=-1)[..., :topk].int()
    idx[..., ::7] = -1
    idx[1, -1] = -1  # an empty row in the tail
    idx[1, -2, :5] = n  # out of the batch's range: invalid, never the next rows
    sink = torch.randn(heads, generator=gen, device="cuda") + 2.0
    first = flashdsa.sparse_attn(q, kv, sink, idx)
    again = flashdsa.sparse_attn(q, kv, sink, idx)
    sync_or_die("tail split", "sparse_attn batched", HANG_S)
    assert len(tail_calls) == 2, tail_calls  # the plain path's launch, then the plan's
    assert tail_calls.runs == 2  # both ran their chunks (the tail is in the last batch)
    ref = flashdsa.sparse_attn(q.double(), kv.double(), sink, idx, backend="reference")
    for got in (first, again):
        err = (got.double() - ref).abs().max().item()
        assert err < 2e-2, err
        assert (got[1, -1] == 0).all()
    assert (first.float() - again.float()).abs().max().item() < 1e-2
