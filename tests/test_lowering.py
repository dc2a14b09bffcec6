"""Every TileLang kernel the package defines lowers to CUDA source for sm_90a on a machine without a GPU."""

import importlib
import pathlib

import pytest

import flashdsa

tilelang = pytest.importorskip("tilelang")

PKG = pathlib.Path(flashdsa.__file__).parent


def kernel_modules():
    """Every ``flashdsa/<op>/kernel*.py`` module."""
    return sorted(f"flashdsa.{p.parent.name}.{p.stem}" for p in PKG.glob("*/kernel*.py"))


def _cases():
    out = []
    for modname in kernel_modules():
        mod = importlib.import_module(modname)
        wgmma = getattr(mod, "EXPECTS_WGMMA", True)
        for name, func in mod.lowering_cases():
            out.append(pytest.param(mod, func, wgmma, id=f"{modname.removeprefix('flashdsa.')}-{name}"))
        # helper kernels without matrix products (e.g. the split-KV combine)
        for name, func in getattr(mod, "combine_lowering_cases", list)():
            out.append(pytest.param(mod, func, False, id=f"{modname.removeprefix('flashdsa.')}-{name}"))
    return out


def test_every_dispatched_kernel_module_exists():
    from flashdsa import _dispatch

    assert set(_dispatch.KERNEL_MODULES.values()) <= set(kernel_modules())


def _lower(mod, func) -> str:
    """Lower with the pass configs the module compiles with."""
    from flashdsa._tilelang import lower_to_cuda_source

    return lower_to_cuda_source(func, mod._pass_configs() if hasattr(mod, "_pass_configs") else None, "sm_90a")


def _role_barrier_ids(mod) -> set:
    """Named barriers that two warpgroups of ``mod``'s kernels reach from their own code: they must be the unaligned
    ``barrier.sync`` (``_tl_common.role_barrier``), never TileLang's ``bar.sync`` (``tl::__sync_thread_partial``),
    which promises one static instruction per barrier generation (compute-sanitizer synccheck: "Divergent
    thread(s) in block", session 56)."""
    from flashdsa.sparse import _pair_parts, kernel_fwd_narrow656_dual

    pair = {"sparse.kernel_fwd_pair", "sparse.kernel_fwd_pair_cache", "sparse.kernel_fwd_pair_fp8",
            "decode.kernel_pair_paged"}
    name = mod.__name__.removeprefix("flashdsa.")
    if name in pair:
        return {_pair_parts.BAR_BOTH}
    if name == "sparse.kernel_fwd_narrow656_dual":
        return {kernel_fwd_narrow656_dual.BAR_ALL}
    return set()


@pytest.mark.parametrize("mod,func,wgmma", _cases())
def test_lowers_to_sm90a_cuda(mod, func, wgmma):
    src = _lower(mod, func)
    assert "__global__" in src
    if wgmma:  # matrix kernels must be on the Hopper wgmma path
        assert "wgmma" in src, "the Hopper path must issue wgmma"
    for bar in _role_barrier_ids(mod):
        assert f"tl::__sync_thread_partial({bar}, " not in src, f"barrier {bar} emitted aligned (bar.sync)"


def test_pair_q_next_build_loads_q_ahead():
    """The pair kernel's q_gate "next" build (persistent grid): the producer waits q_dead and loads Q by TMA, and O
    goes from the fragments to Out (no staging through the Q halves); the default persistent build has neither."""
    from flashdsa.sparse import kernel_fwd_pair as k

    kw = dict(heads=64, dqk=512, topk=128, sm_scale=0.04, persistent=132, row_gather=True)
    ahead, default = (_lower(k, k.build_sparse_mla_fwd(**kw, **extra)) for extra in (dict(q_gate="next"), {}))
    # the two 256-dim halves, at two call sites (an item's first pair; an item without pairs)
    assert "q_dead[0].wait" in ahead and ahead.count("tma_load(Q_desc") == 4
    assert "Out_local_cast" in ahead  # bf16 pairs from the fp32 fragments
    assert "q_dead" not in default and "tma_load(Q_desc" not in default and "Out_local_cast" not in default


def test_bwd_reducer_rows_outlive_the_reducers_reads():
    """The Dqk 512 backward's reducer warpgroup reads block i's slot rows for its last dKV chunk while the compute
    warpgroups may already gather block i+2's rows (nothing orders the two): that build keeps three row buffers,
    the others two (session 57: with two, compute-sanitizer initcheck's timing gave wrong dkv in the last chunk)."""
    from flashdsa.sparse import kernel_bwd as k

    kw = dict(heads=64, dqk=512, topk=640, sm_scale=0.04, has_sink=True)
    reducer, plain = (k.build_sparse_mla_bwd(**kw, reducer=r).script() for r in (True, False))
    assert 'rows_s = T.sblock_alloc_buffer((3, 64), "int32"' in reducer
    assert "fdsa_reduce_half" in reducer and "rows_s[it % 3, 0]" in reducer
    assert "(it + 1) % 3" in reducer and "1 - rb" not in reducer  # block it+1's rows: the buffer after it's
    assert 'rows_s = T.sblock_alloc_buffer((2, 64), "int32"' in plain and "fdsa_reduce_half" not in plain
    assert "1 - rb" in plain


def _module_pass_configs(mod) -> list:
    """Every pass-config dict ``mod`` compiles with (one per variant for ``indexer.kernel_paged``)."""
    import inspect

    if not hasattr(mod, "_pass_configs"):
        return []
    if "variant" in inspect.signature(mod._pass_configs).parameters:
        return [mod._pass_configs(v) for v in mod.VARIANTS]
    return [mod._pass_configs()]


def test_pass_configs_are_not_deprecated():
    """TileLang deprecates the global ``tl.disable_tma_lower`` (a DeprecationWarning on every compile) for the
    per-copy ``T.copy(..., disable_tma=True)``: no kernel module compiles with a deprecated pass config."""
    import warnings

    from tilelang.transform.pass_config import normalize_pass_configs

    seen = 0
    for modname in kernel_modules():
        for cfg in _module_pass_configs(importlib.import_module(modname)):
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                normalize_pass_configs(cfg)
            seen += 1
    assert seen >= 20
