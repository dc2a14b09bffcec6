"""Shared TileLang plumbing for the kernel modules (imported only by them, so tilelang stays a lazy import)."""

from __future__ import annotations

import warnings


def lower_to_cuda_source(func, pass_configs: dict | None = None, arch: str = "sm_90a") -> str:
    """Lower a TileLang prim_func to CUDA C++ source for ``arch`` on any machine (no GPU needed)."""
    import tilelang
    from tilelang import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(config=pass_configs or {}), target:
        return tilelang.lower(func, target=target).kernel_source


def plain_pass_configs(extra: dict | None = None) -> dict:
    """Pass configs of the hand-scheduled kernels: no automatic warp specialisation (+ ``extra``).  Their
    global <-> shared ``T.copy`` calls pass ``disable_tma=True`` (TileLang deprecated the global
    ``tl.disable_tma_lower`` for that per-copy flag): the schedules issue their own cp.async / ``T.tma_copy``."""
    import tilelang

    cfg = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    cfg.update(extra or {})
    return cfg


def direct_launcher(kernel):
    """What to call to launch a compiled TileLang kernel with the least host time.

    For the TVM-FFI adapter with no TileLang-allocated outputs (every kernel here: outputs are passed in), this is
    the adapter's executable itself: the adapter's Python wrapper only re-stitches the same positional arguments
    (a few microseconds per launch, which decode-sized calls notice). The executable's host function still checks
    every argument's dtype, shape, strides and device. Any other adapter: the kernel object."""
    adapter = getattr(kernel, "adapter", None)
    get = getattr(adapter, "_get_executable", None)
    if (get is None or getattr(adapter, "result_idx", None)
            or getattr(adapter, "_ffi_callee_allocated_output_abi", True)):
        return kernel
    return get()


# A copy this large (a KV cache passed as a strided view) is worth telling the caller about: it happens per call.
COPY_WARN_BYTES = 64 << 20


def aligned(x):
    """``x`` contiguous with a 16-byte aligned base address: ``x`` itself where it already is, else a copy.  The
    kernels read their inputs in 16-byte pieces (cp.async, vector loads, TMA boxes), which a contiguous view
    starting at another offset would fault on.  A copy of ``COPY_WARN_BYTES`` or more warns (once per message)."""
    y = x.contiguous()
    if y.data_ptr() % 16:
        y = y.clone()
    if y is not x and y.nbytes >= COPY_WARN_BYTES:
        warnings.warn(f"flashdsa: an input of shape {tuple(x.shape)}, dtype {x.dtype}, strides {x.stride()}, storage "
                      f"offset {x.storage_offset()} is copied for the kernel ({y.nbytes / 2**20:.0f} MiB on every "
                      "call): the kernels read it contiguous and 16-byte aligned; pass it so to avoid the copy",
                      UserWarning, stacklevel=3)
    return y


def any_misaligned(*tensors) -> bool:
    """Whether a given tensor (None skipped) starts off a 16-byte boundary: a stored launch plan, which passes its
    inputs on as they are, must not take such a call (``aligned`` copies them on the plain path)."""
    return any(t is not None and t.data_ptr() % 16 for t in tensors)


def pad_heads(x, heads: int, value: float = 0.0):
    """x [T, H, ...] with dim 1 (heads) padded to ``heads`` >= H with ``value``: x itself where H == heads.  For
    kernels that tile heads (the backward's 64, the split decode forward's 64 / 128-head pair forms)."""
    import torch

    if x.shape[1] == heads:
        return x
    pad = x.new_full((x.shape[0], heads - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


_DUMMIES: dict = {}


def dummy(dtype, device):
    """A cached 1-element zero tensor of ``dtype`` on ``device``: the argument a kernel is given for an optional
    input it is built not to read (no allocation per call)."""
    import torch

    key = (dtype, device)
    t = _DUMMIES.get(key)
    if t is None:
        t = _DUMMIES[key] = torch.zeros(1, dtype=dtype, device=device)
    return t
