"""Shared TileLang plumbing for the kernel modules (imported only by them, so tilelang stays a lazy import)."""

from __future__ import annotations


def lower_to_cuda_source(func, pass_configs: dict | None = None, arch: str = "sm_90a") -> str:
    """Lower a TileLang prim_func to CUDA C++ source for ``arch`` on any machine (no GPU needed)."""
    import tilelang
    from tilelang import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(config=pass_configs or {}), target:
        return tilelang.lower(func, target=target).kernel_source
