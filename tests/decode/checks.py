"""Issue #6's inputs and tolerances for the decode tests: a paged cache builder and the output check.

A plain module (no ``pytest.skip`` at import), so the contract tests' CPU variants can use it too."""

import torch


def check_close(out, lse, ref_out, ref_lse):
    """out within abs 1e-3 or rel 2/128 elementwise and cosine distance <= 5e-6; finite lse within rel 8/65536 (or
    abs 8/65536 where |lse| < 1: a single visible key near 0 puts fp32 rounding of the score above any relative
    bound); empty rows (reference lse = +inf) give lse = +inf and out = 0; no NaN anywhere."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    o, r = out.double(), ref_out.double()
    err = (o - r).abs()
    ok = (err <= 1e-3) | (err <= (2 / 128) * r.abs())
    assert ok.all(), f"out: max abs err {err.max().item():.3e} at {tuple(int(i) for i in (~ok).nonzero()[0])}"
    n_o, n_r = o.flatten(), r.flatten()
    denom = n_o.norm() * n_r.norm()
    if denom > 0:
        cos_dist = 1 - (n_o @ n_r) / denom
        assert cos_dist <= 5e-6, f"cosine distance {cos_dist.item():.3e}"
    inf_k, inf_r = torch.isinf(lse), torch.isinf(ref_lse)
    assert torch.equal(inf_k, inf_r), "empty rows (lse = +inf) differ"
    if inf_r.any():
        assert (lse[inf_r] > 0).all(), "empty rows must give lse = +inf"
        assert (out[inf_r] == 0).all(), "empty rows must give out = 0"
    fin = ~inf_r
    if fin.any():
        d = (lse[fin].double() - ref_lse[fin].double()).abs()
        rel = d / ref_lse[fin].double().abs().clamp_min(1e-30)
        ok = (rel <= 8 / 65536) | (d <= 8 / 65536)
        assert ok.all(), f"lse: max rel err {rel.max().item():.3e}"


def make_paged(B, s_q, H, block_size, lens, *, seed=0, extra_blocks=2, device="cpu"):
    """q `[B, s_q, H, 576]` bf16, kv_cache (NaN in every unused slot), shuffled block_table, cache_seqlens, built
    on the CPU from ``seed`` and moved to ``device``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = [int(x) for x in lens]
    assert len(lens) == B
    need = [(n + block_size - 1) // block_size for n in lens]
    max_blocks = max(1, max(need) + extra_blocks)
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    kv = torch.full((num_blocks, block_size, 576), float("nan"), dtype=torch.bfloat16)
    pos = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[pos:pos + n].to(torch.int32)
        pos += n
        # entries past the sequence: a mix of -1, too-large ids and INT_MIN/INT_MAX (never dereferenced)
        for j in range(n, max_blocks):
            table[b, j] = (-1, num_blocks, 2**31 - 1, -(2**31))[(b + j) % 4]
        for p0 in range(0, lens[b], block_size):
            blk = int(table[b, p0 // block_size])
            cnt = min(block_size, lens[b] - p0)
            kv[blk, :cnt] = (torch.randn(cnt, 576, generator=g) * 0.1).to(torch.bfloat16)
    # N(0, 0.01) q and kv: the distribution FlashMLA's MLA tests pair with these tolerances
    q = (torch.randn(B, s_q, H, 576, generator=g) * 0.1).to(torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    return q.to(device), kv.to(device), table.to(device), seqlens.to(device)
