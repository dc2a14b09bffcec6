"""Every TileLang kernel the package defines lowers to CUDA source for sm_90a on a machine without a GPU."""

import importlib

import pytest

from flashdsa import _dispatch

tilelang = pytest.importorskip("tilelang")


def _cases():
    out = []
    for op, modname in sorted(_dispatch.KERNEL_MODULES.items()):
        mod = importlib.import_module(modname)
        for name, func in mod.lowering_cases():
            out.append(pytest.param(func, id=f"{op}-{name}"))
    return out


@pytest.mark.parametrize("func", _cases())
def test_lowers_to_sm90a_cuda(func):
    from tilelang import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        artifact = tilelang.lower(func, target=target)
    src = artifact.kernel_source
    assert "__global__" in src
    assert "wgmma" in src, "the Hopper path must issue wgmma"
