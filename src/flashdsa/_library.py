"""The one registration pattern for ops: ``torch.library.custom_op`` + ``register_fake`` (+ autograd).

Each op family's ``api.py`` validates arguments in plain Python (shapes and dtypes only, never values), normalises
layouts, then calls one ``flashdsa::<name>`` custom op. The custom op picks kernel or reference at run time through
``_dispatch.resolve_backend``; its fake implementation gives output shapes so ``torch.compile(fullgraph=True)`` can
trace through it without running it.
"""

from __future__ import annotations

import torch

NAMESPACE = "flashdsa"


def custom_op(name: str):
    """Decorator: register a functional (non-mutating) op ``flashdsa::name``."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())
