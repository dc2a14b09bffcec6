"""CPU: the dense-decode "pair" path's slot lists and lengths (``decode._pair_path``) against the reference's
dense slot lists, and its wave-efficiency rule."""

import pytest
import torch

from flashdsa.decode import _pair_path
from flashdsa.decode.reference import dense_slots


@pytest.mark.parametrize("s_q,causal", [(1, True), (2, True), (4, True), (3, False)])
@pytest.mark.parametrize("bs", [16, 64, 256])
def test_slot_rows_match_reference_slots(s_q, causal, bs):
    g = torch.Generator().manual_seed(s_q * 31 + bs)
    B, max_blocks, num_blocks = 7, 9, 40
    table = torch.randint(0, num_blocks, (B, max_blocks), generator=g, dtype=torch.int32)
    bad = torch.tensor([-1, num_blocks, 2**31 - 1, -(2**31)], dtype=torch.int32)
    mask = torch.rand(B, max_blocks, generator=g) < 0.2
    table[mask] = bad[torch.randint(0, 4, (int(mask.sum()),), generator=g)]
    L = max_blocks * bs
    lens = torch.tensor([0, 1, 2, bs, L, L + 5, 3 * bs + 7], dtype=torch.int32)
    slots, lengths = _pair_path.slot_rows(table, lens, num_blocks, bs, s_q, causal)
    ref = dense_slots(table, lens, num_blocks, bs, s_q, causal).reshape(B * s_q, L)
    assert slots.dtype == torch.int32 and lengths.dtype == torch.int32
    assert slots.shape == (B * s_q, L) and lengths.shape == (B * s_q,)
    pos = torch.arange(L).view(1, L)
    inside = pos < lengths.view(-1, 1).long()
    # inside each length the slots are the reference's (incl. -1 for bad block ids); past it the reference masks
    assert torch.equal(torch.where(inside, slots, -1), ref)
    limit = lens.long().view(B, 1) + (torch.arange(s_q) - (s_q - 1) if causal else torch.zeros(s_q, dtype=torch.long))
    assert torch.equal(lengths.long(), limit.clamp(0, L).reshape(-1))


@pytest.mark.parametrize("B,s_q,H,sms,expected", [
    (128, 1, 128, 132, 256 / 264), (66, 1, 128, 132, 1.0), (74, 1, 64, 132, 74 / 132), (133, 1, 64, 132, 133 / 264),
    (64, 1, 16, 132, 0.0), (10, 2, 96, 132, 0.0), (0, 1, 64, 132, 0.0)])
def test_pair_efficiency(B, s_q, H, sms, expected):
    assert _pair_path.pair_efficiency(B, s_q, H, sms) == pytest.approx(expected)


def test_pair_fits(monkeypatch):
    assert _pair_path.pair_fits(128, 2, 32768, 16)
    assert not _pair_path.pair_fits(128, 4, 1 << 20, 16)  # 2 GiB of slot lists
    assert _pair_path.pair_fits(128, 4, 1 << 20, 64)  # paged: no slot lists
    assert not _pair_path.pair_fits(1, 1, 1 << 30, 64)
    monkeypatch.setenv(_pair_path.PAGED_ENV, "0")
    assert not _pair_path.pair_fits(128, 4, 1 << 20, 64)


def test_prepare_skips_slot_lists_where_paged(monkeypatch):
    table = torch.tensor([[2, 0, -1], [1, 5, 3]], dtype=torch.int32)
    seqlens = torch.tensor([70, 129], dtype=torch.int32)
    slots, lengths, order = _pair_path.prepare(table, seqlens, 6, 64, 2, True)
    assert slots is None and lengths.tolist() == [69, 70, 128, 129] and order.tolist() == [2, 3, 0, 1]
    monkeypatch.setenv(_pair_path.PAGED_ENV, "0")
    slots, lengths2, _ = _pair_path.prepare(table, seqlens, 6, 64, 2, True)
    assert slots.shape == (4, 192) and torch.equal(lengths, lengths2)
    assert slots[0, 64:66].tolist() == [0, 1] and slots[0, 128].item() == -1


@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_token_order_keeps_sequences_together_longest_first(s_q):
    gen = torch.Generator().manual_seed(s_q)
    B = 37
    lens = torch.randint(0, 5000, (B,), generator=gen, dtype=torch.int32)
    lens[3] = lens[9]  # a tie: the lower sequence first (stable)
    shift = torch.arange(s_q, dtype=torch.int32) - (s_q - 1)
    lengths = (lens.view(B, 1) + shift).clamp(min=0).view(-1)
    order = _pair_path.token_order(lengths, s_q)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(B * s_q))
    seq = order.view(B, s_q) // s_q
    assert torch.equal(seq, seq[:, :1].expand(B, s_q))  # a sequence's tokens adjacent
    assert torch.equal(order.view(B, s_q) % s_q, torch.arange(s_q).expand(B, s_q).to(torch.int32))
    longest = lens[seq[:, 0].long()]
    assert bool((longest[:-1] >= longest[1:]).all())
    ties = [b for b in seq[:, 0].tolist() if b in (3, 9)]
    assert ties == sorted(ties)
