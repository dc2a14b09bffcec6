"""CPU: the dense decode's L2 eviction hint (narrow / fused kernels' TMA loads) reaches the generated code, and a
bad setting is a ValueError naming the variable."""

import pytest

pytest.importorskip("tilelang")

from flashdsa.decode import kernel_dense_narrow as narrow  # noqa: E402


def test_env_values(monkeypatch):
    monkeypatch.setenv(narrow.KV_EVICT_ENV, "evict_first")
    assert narrow.kv_evict() == "evict_first"
    monkeypatch.setenv(narrow.KV_EVICT_ENV, "bogus")
    with pytest.raises(ValueError, match=narrow.KV_EVICT_ENV):
        narrow.kv_evict()


def test_fused_decode_lowers_with_hint():
    from flashdsa._tilelang import lower_to_cuda_source
    from flashdsa.decode import kernel_dense_fused as fused

    kw = dict(heads=16, s_q=1, block_size=64, causal=True, sm_scale=576**-0.5, has_sink=False, num_sms=132)
    src = lower_to_cuda_source(fused.build_fused_kernel(**kw, kv_evict="evict_first"), fused._pass_configs(), "sm_90a")
    assert src.count("tma_load<tl::CacheHintSm90::EVICT_FIRST>") >= 2
    plain = lower_to_cuda_source(fused.build_fused_kernel(**kw), fused._pass_configs(), "sm_90a")
    assert "CacheHintSm90" not in plain and "tl::tma_load(" in plain
