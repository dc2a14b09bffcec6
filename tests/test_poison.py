"""CPU: the poisoned allocations that the GPU tests run under (tests/poison.py) poison what they should."""

import torch

from poison import _fill, poisoned_allocations


def test_poisoned_allocations_fill_every_entry_point():
    everywhere = lambda t: True  # noqa: E731 - the GPU default only matches CUDA tensors
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    base = torch.zeros(2, 3)
    with poisoned_allocations(where=everywhere):
        f32, bf16 = torch.empty(5), torch.empty((2, 3), dtype=torch.bfloat16)
        i32, like, new = torch.empty(4, dtype=torch.int32), torch.empty_like(base), base.new_empty(7, dtype=torch.int64)
        flag = torch.empty(3, dtype=torch.bool)
        assert torch.isnan(f32).all() and torch.isnan(bf16).all() and torch.isnan(like).all()
        assert (i32 == -1).all() and (new == -1).all()
        assert flag.shape == (3,)  # bool is left alone: 0xFF is no valid bool
        assert torch.equal(base, torch.zeros(2, 3))  # existing tensors untouched
    with poisoned_allocations(0x5A, where=everywhere):
        assert (torch.empty(3, dtype=torch.int32) == 0x5A5A5A5A).all()
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == (empty, empty_like, new_empty)


def test_poison_default_matches_only_cuda_tensors():
    cpu = torch.zeros(3)
    assert _fill(cpu, 0xFF, lambda t: t.is_cuda, torch.empty) is cpu and torch.equal(cpu, torch.zeros(3))
    assert torch.isnan(_fill(cpu, 0xFF, lambda t: True, torch.empty)).all()
