"""CPU: ``mla_decode_plan`` (reference backend) -- ``plan.run`` equals ``mla_decode`` layer by layer (dense bf16 and
the FP8 cache, sinks, s_q > 1, strided block tables, empty batches), attends the block_table / cache_seqlens values
held when the plan was made, and rejects bad arguments (at plan time with ``mla_decode``'s messages, at run time
anything that does not match the plan)."""

import pytest
import torch

import flashdsa
from flashdsa.quant import quantize_kv_fp8


def _step(B, s_q, H, bs, lens, *, seed, fp8=False, layers=2):
    g = torch.Generator().manual_seed(seed)
    need = [(n + bs - 1) // bs for n in lens]
    max_blocks = max(1, max(need, default=0) + 1)
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[pos:pos + n].to(torch.int32)
        pos += n
    caches = [(torch.randn(nb, bs, 576, generator=g) * 0.3).to(torch.bfloat16) for _ in range(layers)]
    if fp8:
        caches = [quantize_kv_fp8(c.view(nb * bs, 576)).view(nb, bs, 656) for c in caches]
    qs = [(torch.randn(B, s_q, H, 576, generator=g) * 0.3).to(torch.bfloat16) for _ in range(layers)]
    return qs, caches, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("B,s_q,H,bs,lens,causal,sink,fp8", [
    (2, 1, 4, 16, (20, 0), True, False, False),
    (3, 2, 16, 32, (70, 5, 33), True, True, False),
    (2, 3, 2, 16, (40, 17), False, False, False),
    (2, 1, 3, 16, (50, 1), True, True, True),
    (0, 1, 4, 16, (), True, False, False),
])
def test_plan_run_equals_mla_decode(B, s_q, H, bs, lens, causal, sink, fp8):
    qs, caches, table, seqlens = _step(B, s_q, H, bs, lens, seed=B * 7 + H, fp8=fp8)
    attn_sink = torch.randn(H, dtype=torch.float32) if sink else None
    plan = flashdsa.mla_decode_plan(table, seqlens, caches[0], num_heads=H, s_q=s_q, sm_scale=0.07, causal=causal,
                                    has_sink=sink, backend="reference")
    assert plan.path == "op"
    for q, cache in zip(qs, caches):
        out, lse = plan.run(q, cache, attn_sink)
        want = flashdsa.mla_decode(q, cache, table, seqlens, sm_scale=0.07, causal=causal, attn_sink=attn_sink,
                                   backend="reference")
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_plan_keeps_the_values_it_was_made_with():
    qs, caches, table, seqlens = _step(2, 1, 4, 16, (40, 30), seed=3, layers=1)
    plan = flashdsa.mla_decode_plan(table, seqlens, caches[0], num_heads=4, backend="reference")
    want = flashdsa.mla_decode(qs[0], caches[0], table, seqlens, backend="reference")
    seqlens.fill_(1)  # the caller writes the next step's lengths: this plan still attends its own step
    table.fill_(-1)
    out, lse = plan.run(qs[0], caches[0])
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_plan_strided_block_table():
    qs, caches, table, seqlens = _step(2, 1, 4, 16, (40, 30), seed=4, layers=1)
    wide = torch.full((2, 2 * table.shape[1]), 7, dtype=torch.int32)
    wide[:, ::2] = table
    strided = wide[:, ::2]  # last dim stride 2: mla_decode rejects it, so the plan must too
    with pytest.raises(ValueError, match="block_table"):
        flashdsa.mla_decode_plan(strided, seqlens, caches[0], num_heads=4, backend="reference")


def test_plan_argument_errors():
    qs, caches, table, seqlens = _step(2, 1, 4, 16, (20, 3), seed=5, layers=1)
    cache = caches[0]
    with pytest.raises(ValueError, match="num_heads"):
        flashdsa.mla_decode_plan(table, seqlens, cache, num_heads=0)
    with pytest.raises(TypeError, match="s_q"):
        flashdsa.mla_decode_plan(table, seqlens, cache, num_heads=4, s_q=1.0)
    with pytest.raises(TypeError, match="has_sink"):
        flashdsa.mla_decode_plan(table, seqlens, cache, num_heads=4, has_sink=1)
    with pytest.raises(TypeError, match="q_dtype"):
        flashdsa.mla_decode_plan(table, seqlens, cache, num_heads=4, q_dtype=torch.int32)
    with pytest.raises(TypeError, match="block_table"):
        flashdsa.mla_decode_plan(table.long(), seqlens, cache, num_heads=4)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashdsa.mla_decode_plan(table, seqlens[:1], cache, num_heads=4)
    with pytest.raises(TypeError, match="kv_cache"):
        flashdsa.mla_decode_plan(table, seqlens, cache.float(), num_heads=4)  # q is bf16: the cache must be too
    with pytest.raises(ValueError, match="d_v"):
        flashdsa.mla_decode_plan(table, seqlens, cache, num_heads=4, d_v=600)
    with pytest.raises(ValueError, match="backend"):
        flashdsa.mla_decode_plan(table, seqlens, cache, num_heads=4, backend="fast")
    plan = flashdsa.mla_decode_plan(table, seqlens, cache, num_heads=4, backend="reference")
    with pytest.raises(ValueError, match="q"):
        plan.run(qs[0][:, :, :3], cache)
    with pytest.raises(TypeError, match="q"):
        plan.run(qs[0].float(), cache)
    with pytest.raises(ValueError, match="q: the last dim"):
        plan.run(torch.empty(2, 1, 4, 1152, dtype=torch.bfloat16)[..., ::2], cache)
    with pytest.raises(ValueError, match="kv_cache"):
        plan.run(qs[0], cache[:-1])
    with pytest.raises(TypeError, match="kv_cache"):
        plan.run(qs[0], None)
    with pytest.raises(ValueError, match="attn_sink"):
        plan.run(qs[0], cache, torch.zeros(4))
    sink_plan = flashdsa.mla_decode_plan(table, seqlens, cache, num_heads=4, has_sink=True, backend="reference")
    with pytest.raises(ValueError, match="attn_sink"):
        sink_plan.run(qs[0], cache)
    with pytest.raises(ValueError, match="attn_sink"):
        sink_plan.run(qs[0], cache, torch.zeros(5))
    out, _ = sink_plan.run(qs[0], cache.unsqueeze(2), torch.zeros(4))  # the [..., 1, Dqk] cache layout works too
    assert out.shape == (2, 1, 4, 512)


def test_fp8_cache_layout_check():
    """The per-layer check of the FP8 split step (``kernel_fwd_fp8cache.cache_layout_unsupported``): rows 656 or
    672 bytes apart pass; 660-byte rows, a base off 16 bytes and a strided last dim are refused, with the reason."""
    pytest.importorskip("tilelang")
    from flashdsa.sparse.kernel_fwd_fp8cache import cache_layout_unsupported

    big = torch.zeros(8 * 1312 + 16, dtype=torch.uint8)
    assert cache_layout_unsupported(big[:8 * 656].view(8, 656)) is None
    assert cache_layout_unsupported(big[:8 * 672].view(8, 672)[:, :656]) is None
    assert "row stride" in cache_layout_unsupported(big[:8 * 660].view(8, 660)[:, :656])
    assert "aligned" in cache_layout_unsupported(big[1:1 + 8 * 656].view(8, 656))
    assert "contiguous" in cache_layout_unsupported(big[:8 * 656 * 2].view(8, 1312)[:, ::2])
