"""GPU: ``kernel_split_slots.split_slots`` (the chunk rows of split dense decode over the FP8 cache in one launch)
equals the PyTorch ops it replaces, ``kernel_split.split_inputs`` of ``_pair_path.slot_rows``, exactly: any
``cache_seqlens`` value (negative, past the table, INT_MIN / INT_MAX), bad block ids (-1, >= num_blocks, INT_MIN /
INT_MAX), s_q > 1 causal and not, chunks that overrun the table, a strided block table; outputs poisoned first."""

import pytest
import torch

from flashdsa.decode import _pair_path, kernel_split

from .test_kernel_gpu import _kernel

pytestmark = pytest.mark.gpu

I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def _case(B, max_blocks, nb, seed, strided):
    g = torch.Generator(device="cpu").manual_seed(seed)
    table = torch.randint(0, nb, (B, max_blocks * (2 if strided else 1)), generator=g, dtype=torch.int32)
    bad = torch.rand(table.shape, generator=g) < 0.2
    table[bad] = torch.tensor([-1, nb, I32_MIN, I32_MAX], dtype=torch.int32)[
        torch.randint(0, 4, (int(bad.sum()),), generator=g)]
    table = table.cuda()
    if strided:
        table = table[:, ::2]
    return table


# (B, s_q, block_size, max_blocks, causal, n_split, chunk)
CASES = [
    (1, 1, 64, 128, True, 4, 2048),
    (2, 2, 16, 300, True, 10, 512),  # n_split * chunk > L: the last chunk overruns the table
    (3, 3, 32, 40, False, 2, 640),
    (1, 4, 256, 9, True, 4, 1024),  # the last chunk lies wholly past the table (L 2304)
]


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("B,s_q,bs,max_blocks,causal,n_split,chunk", CASES)
def test_split_slots_equal_torch_ops(B, s_q, bs, max_blocks, causal, n_split, chunk, strided):
    _kernel()
    from flashdsa.decode import kernel_split_slots

    L = max_blocks * bs
    assert n_split * chunk >= L
    nb = max_blocks + 5
    table = _case(B, max_blocks, nb, seed=B * 7 + bs, strided=strided)
    lens = [L // 3, 0, -5, L + 7, I32_MIN, I32_MAX, 1, L, L - 3, I32_MIN + 1, I32_MAX - 1]
    for shift in range(len(lens)):  # every value reaches every sequence position, through one compiled kernel
        seqlens = torch.tensor([lens[(i + shift) % len(lens)] for i in range(B)], dtype=torch.int32, device="cuda")
        slots, tl = _pair_path.slot_rows(table, seqlens, nb, bs, s_q, causal)
        want_slots, want_tl = kernel_split.split_inputs(slots, tl, n_split, chunk)
        poison = (torch.full_like(want_slots, 0x5A5A5A5A), torch.full_like(want_tl, 0x5A5A5A5A))
        got_slots, got_tl = kernel_split_slots.split_slots(table, seqlens, nb, bs, s_q, causal, n_split, chunk,
                                                           out=poison)
        assert torch.equal(got_slots, want_slots), "slots differ from slot_rows + split_inputs"
        assert torch.equal(got_tl, want_tl), "lengths differ from slot_rows + split_inputs"
    new_slots, new_tl = kernel_split_slots.split_slots(table, seqlens, nb, bs, s_q, causal, n_split, chunk)
    assert torch.equal(new_slots, want_slots) and torch.equal(new_tl, want_tl), "the out=None path differs"
