"""The one registration pattern for ops: ``torch.library.custom_op`` + ``register_fake`` (+ autograd).

Each op family's ``api.py`` validates arguments in plain Python (shapes and dtypes only, never values), normalises
layouts, then calls one ``flashdsa::<name>`` custom op. The custom op picks kernel or reference at run time through
``_dispatch.resolve_backend``; its fake implementation gives output shapes so ``torch.compile(fullgraph=True)`` can
trace through it without running it.

Eager fast path: going through the PyTorch dispatcher costs tens of microseconds of host time per call, as much as
a decode-sized kernel. When nothing needs the dispatcher (not tracing under ``torch.compile``, no fake tensors, no
argument requiring grad), calling the op object runs its Python implementation directly. Same function, same
results; ``torch.ops.flashdsa.<name>`` always goes through the dispatcher.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

NAMESPACE = "flashdsa"


def _needs_dispatcher(args) -> bool:
    if torch.compiler.is_compiling():
        return True
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (isinstance(a, FakeTensor) or (grad and a.requires_grad)):
            return True
    return False


class Op:
    """A registered ``flashdsa::<name>`` op; calling it takes the eager fast path when it can (module docstring)."""

    def __init__(self, name: str, fn: Callable):
        self.name = name
        self.impl = fn
        self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)

    def register_fake(self, fn):
        return self.op.register_fake(fn)

    def register_autograd(self, backward, *, setup_context=None):
        return self.op.register_autograd(backward, setup_context=setup_context)

    def __call__(self, *args):
        return self.op(*args) if _needs_dispatcher(args) else self.impl(*args)


def custom_op(name: str):
    """Decorator: register a functional (non-mutating) op ``flashdsa::name`` and return it as an :class:`Op`."""
    return lambda fn: Op(name, fn)
