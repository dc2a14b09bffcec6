"""The paged-cache writers (``write_kv_cache``, ``write_indexer_cache``): byte-exact rows at their slots, nothing
else touched, and the ops that read a paged cache (``mla_decode``, ``indexer_logits_paged``) see through the written
cache exactly the rows the writer was given. CPU, and on the GPU (marked ``gpu``) through the kernels."""

import math

import pytest
import torch

import flashdsa
from devices import DEVICES, backend_for as _backend
from oracles import e4m3_encode, kv_fp8_pack_oracle



def _slots(T, num_slots, gen):
    """T distinct slots in random order; a few entries replaced by padding that must be skipped."""
    slots = torch.randperm(num_slots, generator=gen)[:T]
    skip = torch.tensor([-1, num_slots, num_slots + 7, -(2**31)])
    pos = torch.randperm(T, generator=gen)[:len(skip)]
    slots[pos] = skip[:len(pos)]
    return slots, (slots >= 0) & (slots < num_slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_dim_axis", [False, True])  # [nb, bs, D] or [nb, bs, 1, D]
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_cache_rows_at_slots(device, fp8, head_dim_axis, slot_dtype, gen):
    nb, bs, T = 5, 4, 9
    kv = (torch.randn(T, 576, generator=gen) * torch.logspace(-2, 2, 576)).to(torch.bfloat16)
    slots, ok = _slots(T, nb * bs, gen)
    width = 656 if fp8 else 576
    if fp8:
        cache = torch.full((nb, bs, width), 0xAB, dtype=torch.uint8)
    else:
        cache = torch.full((nb, bs, width), 7.0, dtype=torch.bfloat16)
    if head_dim_axis:
        cache = cache.unsqueeze(2)
    before = cache.clone()
    got = flashdsa.write_kv_cache(kv.to(device), cache.to(device), slots.to(device, slot_dtype))
    assert got.shape == cache.shape and got.dtype == cache.dtype
    flat, old = got.cpu().view(-1, width), before.view(-1, width)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[ok]] = True
    assert torch.equal(flat[~written], old[~written]), "a slot no token maps to was written"
    for t in torch.nonzero(ok).flatten().tolist():
        want = torch.tensor(list(kv_fp8_pack_oracle(kv[t])), dtype=torch.uint8) if fp8 else kv[t]
        assert torch.equal(flat[slots[t]], want), f"token {t} -> slot {int(slots[t])}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [64, 128])
def test_write_indexer_cache_rows_at_slots(device, D, gen):
    nb, bs, T = 4, 8, 13
    k = torch.randn(T, D, generator=gen) * torch.logspace(-3, 3, T).unsqueeze(1)
    slots, ok = _slots(T, nb * bs, gen)
    kc = torch.full((nb, bs, D), 3.0).to(torch.float8_e4m3fn)
    sc = torch.full((nb, bs), -5.0)
    kc_old, sc_old = kc.clone(), sc.clone()
    kc_d, sc_d = kc.to(device), sc.to(device)
    out = flashdsa.write_indexer_cache(k.to(device), kc_d, sc_d, slots.to(device))
    assert out[0] is kc_d and out[1] is sc_d, "the caches are written in place and returned"
    codes, scales = kc_d.cpu().view(torch.uint8).view(-1, D), sc_d.cpu().view(-1)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[ok]] = True
    assert torch.equal(codes[~written], kc_old.view(torch.uint8).view(-1, D)[~written])
    assert torch.equal(scales[~written], sc_old.view(-1)[~written])
    for t in torch.nonzero(ok).flatten().tolist():
        s = float(scales[slots[t]])
        amax = float(k[t].abs().max())
        assert math.frexp(s)[0] == 0.5 and amax / 448 <= s < 2 * amax / 448 * (1 + 1e-6), (t, s, amax)
        assert torch.equal(codes[slots[t]], e4m3_encode((k[t].double() / s).clamp(-448, 448)))


def _table(lens, bs, gen, spare=3):
    """A shuffled block table (any physical order) for the given lengths, and the slot of every position."""
    need = [max(1, -(-n // bs)) for n in lens]
    nb = sum(need) + spare
    perm = torch.randperm(nb, generator=gen)
    table = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    pos_slots, used = [], 0
    for b, n in enumerate(lens):
        table[b, :need[b]] = perm[used:used + need[b]].to(torch.int32)
        used += need[b]
        p = torch.arange(n)
        pos_slots.append(table[b, p // bs].long() * bs + p % bs)
    return nb, table, pos_slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_decode_reads_what_write_kv_cache_wrote(device, fp8, gen):
    """Causal dense decode (s_q 2) over a written cache == sparse attention over each query's visible rows."""
    lens, bs, H, s_q, sm_scale = [37, 0, 64, 130], 16, 16, 2, 576**-0.5
    nb, table, pos_slots = _table(lens, bs, gen)
    cache = torch.zeros(nb, bs, 656, dtype=torch.uint8) if fp8 else torch.full((nb, bs, 576), math.nan,
                                                                              dtype=torch.bfloat16)
    cache = cache.to(device)
    rows = [(torch.randn(n, 576, generator=gen) * 0.3).to(torch.bfloat16) for n in lens]
    # every sequence's tokens in one shuffled stream, written in two calls: a slot mix-up moves rows between
    # sequences or past a causal boundary, which the attention below sees (a permutation within a set would not)
    all_rows, all_slots = torch.cat(rows), torch.cat(pos_slots)
    order = torch.randperm(len(all_rows), generator=gen)
    for part in order.chunk(2):
        flashdsa.write_kv_cache(all_rows[part].to(device), cache, all_slots[part].to(device))
    q = (torch.randn(len(lens), s_q, H, 576, generator=gen) * 0.3).to(torch.bfloat16)
    out, lse = flashdsa.mla_decode(q.to(device), cache, table.to(device), torch.tensor(lens, dtype=torch.int32,
                                   device=device), sm_scale=sm_scale, causal=True,
                                   backend=_backend(device))
    out, lse = out.cpu(), lse.cpu()
    for b, n in enumerate(lens):
        kv = flashdsa.dequantize_kv_fp8(flashdsa.quantize_kv_fp8(rows[b])) if fp8 else rows[b]
        for i in range(s_q):
            visible = max(0, n - s_q + 1 + i)
            if visible == 0:
                assert (out[b, i] == 0).all() and torch.isinf(lse[b, i]).all() and (lse[b, i] > 0).all()
                continue
            ref_o, ref_l = flashdsa.sparse_mla_fwd(q[b, i:i + 1], kv, torch.arange(visible, dtype=torch.int32)[None],
                                                   sm_scale=sm_scale, backend="reference")
            err = (out[b, i].double() - ref_o[0].double()).abs()
            assert ((err <= 1e-3) | (err <= (2 / 128) * ref_o[0].double().abs())).all(), f"b={b} i={i}"
            assert ((lse[b, i].double() - ref_l[0].double()).abs() <= (8 / 65536) * ref_l[0].double().abs()).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("next_n", [1, 2])
def test_indexer_paged_reads_what_write_indexer_cache_wrote(device, next_n, gen):
    """Paged indexer logits over a written key cache == the prefill indexer over each sequence's quantized keys."""
    lens, bs, H, D = [70, 3, 0, 129], 16, 8, 128
    nb, table, pos_slots = _table(lens, bs, gen)
    kc = torch.zeros(nb, bs, D, dtype=torch.float8_e4m3fn, device=device)
    sc = torch.zeros(nb, bs, device=device)
    keys = [torch.randn(n, D, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1) for n in lens]
    for b in range(len(lens)):
        flashdsa.write_indexer_cache(keys[b].to(device), kc, sc, pos_slots[b].to(device))
    q = torch.randn(len(lens), next_n, H, D, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(len(lens) * next_n, H, generator=gen)
    L = max(lens)
    got = flashdsa.indexer_logits_paged(q.to(device), kc, w.to(device), torch.tensor(lens, dtype=torch.int32,
                                        device=device), table.to(device), k_scale_cache=sc, max_context=L,
                                        backend=_backend(device)).cpu()
    for b, n in enumerate(lens):
        k8, ks = flashdsa.quantize_fp8(keys[b], block=D) if n else (torch.zeros(0, D), torch.zeros(0, 1))
        k8 = k8.to(torch.float8_e4m3fn)
        for j in range(next_n):
            row, visible = got[b * next_n + j], max(0, n - next_n + 1 + j)
            assert torch.isneginf(row[visible:]).all(), f"b={b} j={j}: a position past the context is finite"
            if visible == 0:
                continue
            ref = flashdsa.indexer_logits(q[b, j:j + 1], k8[:visible], w[b * next_n + j:b * next_n + j + 1],
                                          ks[:visible, 0], backend="reference")[0]
            x, y = row[:visible].double(), ref.double()
            assert 1 - 2 * (x @ y) / (x @ x + y @ y) < 5e-6, f"b={b} j={j}"
