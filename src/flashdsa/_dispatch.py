"""The one dispatch rule: kernel when it exists and supports the inputs, otherwise the reference.

``backend`` (a keyword of every op) or the ``FLASHDSA_BACKEND`` environment variable picks the path:

* ``"auto"`` (default): the TileLang kernel when the inputs are CUDA tensors on a GPU the kernel supports
  (Hopper, sm_90) and a kernel for this op and these arguments exists; else the PyTorch reference.
* ``"reference"``: always the reference (CPU or CUDA).
* ``"kernel"``: always the kernel; raises ``NotImplementedError`` with the reason when it cannot run.

An explicit ``backend="kernel"|"reference"`` wins over the environment variable; ``backend="auto"`` defers to it.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch

BACKENDS = ("auto", "kernel", "reference")
ENV_VAR = "FLASHDSA_BACKEND"

#: ops that have a TileLang kernel, mapped to the module that holds its ``kernel_unsupported`` check.
#: A kernel module is imported only when a CUDA tensor reaches the op (tilelang is imported lazily).
KERNEL_MODULES: dict[str, str] = {
    "indexer_logits": "flashdsa.indexer.kernel_prefill",
    "indexer_logits_paged": "flashdsa.indexer.kernel_paged",
    "topk_indices": "flashdsa.topk.kernel_radix",
    "sparse_mla_fwd": "flashdsa.sparse.kernel_fwd",
    "sparse_mla_fwd_cache656": "flashdsa.sparse.kernel_fwd_fp8cache",  # 656-byte FP8 cache rows, bf16 compute
    "sparse_mla_fwd_fp8": "flashdsa.sparse.kernel_fwd_fp8",  # e4m3 q/kv + scales, FP8 wgmma
    "sparse_mla_bwd": "flashdsa.sparse.kernel_bwd",  # H padded to a multiple of 64 by sparse/api.py
    "mla_decode": "flashdsa.decode.kernel_dense",  # dense bf16 cache only; sparse / FP8 run the reference
}


def kernel_module(op: str):
    """Import and return the kernel module of ``op`` (imports tilelang)."""
    import importlib

    return importlib.import_module(KERNEL_MODULES[op])

OPS = (
    "indexer_logits",
    "indexer_logits_paged",
    "topk_indices",
    "dsa_topk",
    "sparse_mla_fwd",
    "sparse_mla_fwd_cache656",
    "sparse_mla_fwd_fp8",
    "sparse_mla_bwd",
    "mla_decode",
)


@functools.lru_cache(maxsize=None)
def device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The SM count of CUDA device ``index`` (the persistent grids and split plans size themselves with it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1)
def tilelang_import_error() -> Optional[str]:
    """None when ``import tilelang`` works, else the reason (cached: imported at most once)."""
    try:
        import tilelang  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"tilelang cannot be imported ({type(e).__name__}: {e})"
    return None


def requested_backend(backend: str) -> str:
    """Validate ``backend`` and apply ``FLASHDSA_BACKEND`` to ``"auto"``; returns the effective request."""
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected one of 'auto', 'kernel', 'reference', got {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of 'auto', 'kernel', 'reference', got {backend!r}")
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"{ENV_VAR}: expected one of 'auto', 'kernel', 'reference', got {env!r}")
            backend = env
    return backend


def kernel_unavailable_reason(op: str, device: torch.device, check: Optional[Callable[[], Optional[str]]] = None):
    """None when the kernel for ``op`` can run on ``device`` (and ``check()`` accepts the arguments), else why not."""
    if op not in KERNEL_MODULES:
        return f"no TileLang kernel for {op} yet"
    if device.type != "cuda":
        return f"inputs are on {device.type}, kernels need CUDA tensors"
    cap = device_capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        return f"GPU sm_{cap[0]}{cap[1]} is not supported (kernels target Hopper sm_90a)"
    err = tilelang_import_error()
    if err:
        return err
    return check() if check is not None else None


def call_signature(*args) -> tuple:
    """A hashable key of everything argument validation and dispatch read from one call: each tensor's shape,
    strides, dtype, device and data-pointer alignment (mod 16), every other argument with its type (``True`` and
    ``1`` differ), and ``$FLASHDSA_BACKEND``.  Two calls with equal signatures pass or fail validation alike and
    take the same path (validation never reads tensor values), which is what lets :class:`PlanCache` skip both."""
    key = [os.environ.get(ENV_VAR)]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16))
        else:
            key.append((type(a), a))
    return tuple(key)


class PlanCache:
    """Call signature (:func:`call_signature`) -> a prepared kernel launch: the eager fast path of decode-sized
    calls, whose host time (validation, dispatch, kernel selection: ~100 Python calls) is otherwise as long as the
    kernel.  A plan is stored only after the plain path accepted the call and chose the kernel; it is used only
    when nothing needs the PyTorch dispatcher (``_library``'s rule: no tracing, no fake tensors, no gradient).
    Bounded: cleared when ``size`` signatures are stored."""

    def __init__(self, size: int = 64):
        self._plans: dict = {}
        self._size = size

    def get(self, key):
        """The plan stored under ``key``, or None (also for a key with an unhashable argument: the plain path
        then reports that argument)."""
        try:
            return self._plans.get(key)
        except TypeError:
            return None

    def put(self, key, plan) -> None:
        try:
            hash(key)
        except TypeError:
            return
        if len(self._plans) >= self._size:
            self._plans.clear()
        self._plans[key] = plan

    def __len__(self) -> int:
        return len(self._plans)


_LAST_CHOICE: dict[str, str] = {}


def resolve_backend(op: str, backend: Optional[str], device: torch.device,
                    check: Optional[Callable[[], Optional[str]]] = None) -> str:
    """Return ``"kernel"`` or ``"reference"`` for this call; raise if ``"kernel"`` was forced but cannot run."""
    want = requested_backend(backend)
    reason = None if want == "reference" else kernel_unavailable_reason(op, device, check)
    if want == "kernel" and reason is not None:
        raise NotImplementedError(f"{op}: backend='kernel' was requested but cannot run: {reason}")
    path = "kernel" if want != "reference" and reason is None else "reference"
    _LAST_CHOICE[op] = path
    return path


def record_choice(op: str, path: Optional[str]) -> None:
    """Record the path of an op that delegates to another op (``mla_decode`` -> the sparse forward)."""
    if path is not None:
        _LAST_CHOICE[op] = path


def last_choice(op: str) -> Optional[str]:
    """The path the most recent call of ``op`` in this process took (for bench and demo reports)."""
    return _LAST_CHOICE.get(op)


#: ops with no kernel of their own that run other ops in sequence (each stage dispatched on its own)
COMPOSED: dict[str, tuple[str, ...]] = {"dsa_topk": ("indexer_logits", "topk_indices")}


def describe(op: str, device: torch.device) -> tuple[str, str]:
    """(backend that ``auto`` picks for typical inputs on ``device``, reason) for ``flashdsa info``."""
    want = requested_backend("auto")
    if want == "reference":
        return "reference", f"forced by {ENV_VAR}"
    if op in COMPOSED:
        stages = [describe(s, device) for s in COMPOSED[op]]
        if all(b == "kernel" for b, _ in stages):
            return "kernel", " + ".join(COMPOSED[op]) + " kernels, stage by stage"
        return next((b, f"{s}: {r}") for s, (b, r) in zip(COMPOSED[op], stages) if b != "kernel")
    reason = kernel_unavailable_reason(op, device)
    if reason is None:
        return "kernel", "TileLang kernel"
    return ("reference", reason) if want == "auto" else ("error", reason)
