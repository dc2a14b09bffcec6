"""Poisoned allocations for the GPU tests: unwritten output elements must show up, not read as plausible values.

Inside :func:`poisoned_allocations` every ``torch.empty`` / ``torch.empty_like`` / ``Tensor.new_empty`` whose result
matches ``where`` (default: on a CUDA device) comes back with every byte ``byte``; the default 0xFF is NaN in every
float format (fp32 0xFFFFFFFF, bf16 / fp16 0xFFFF, e4m3 0xFF) and -1 in signed integers. The patch covers the
library's own allocations (outputs, split-KV partials, workspaces) and TileLang's, so an output element a kernel
never writes, or a workspace word it reads before writing, is NaN / -1 deterministically -- unlike filling a block
and freeing it, which the caching allocator may or may not hand out next. ``tests/conftest.py`` applies it to every
test marked ``gpu``, with the byte its module names in ``POISON_BYTE`` (the top-k tests use 0x5A: -1 is a legitimate
top-k output) or none where that is ``None`` or ``FLASHDSA_TEST_POISON=0`` is set.
"""

from __future__ import annotations

import contextlib

import torch


def _fill(t, byte, where, empty):
    # plain tensors outside torch.compile only: a traced graph or a FakeTensor has no memory to fill
    if torch.compiler.is_compiling() or type(t) is not torch.Tensor or t.dtype == torch.bool or not where(t):
        return t
    nbytes = t.untyped_storage().nbytes()
    if type(nbytes) is int and nbytes > 0:  # a symbolic size (tracing with dynamic shapes) has no memory either
        raw = empty(0, dtype=torch.uint8, device=t.device)  # no host copy: legal inside a CUDA-graph capture
        raw.set_(t.untyped_storage())
        raw.fill_(byte)
    return t


@contextlib.contextmanager
def poisoned_allocations(byte=0xFF, where=lambda t: t.is_cuda):
    """Patch the three empty-allocation entry points for the duration of the block (restored on exit)."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty = lambda *a, **k: _fill(empty(*a, **k), byte, where, empty)
    torch.empty_like = lambda *a, **k: _fill(empty_like(*a, **k), byte, where, empty)
    torch.Tensor.new_empty = lambda self, *a, **k: _fill(new_empty(self, *a, **k), byte, where, empty)
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty
