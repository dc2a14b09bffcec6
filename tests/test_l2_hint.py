"""CPU: the L2 eviction hints of the streamed KV copies (decode TMA loads, the row gather's cp.async, the paged
indexer's cp.async ring) reach the generated code, and a bad setting is a ValueError naming the variable."""

import pytest

pytest.importorskip("tilelang")

from flashdsa.decode import kernel_dense_narrow as narrow  # noqa: E402
from flashdsa.indexer import kernel_paged  # noqa: E402
from flashdsa.sparse import _tl_common as tc  # noqa: E402


def test_row_gather_prelude_hint():
    assert tc.row_gather_prelude("") == tc.ROW_GATHER_PRELUDE
    for ev in ("evict_first", "evict_last"):
        src = tc.row_gather_prelude(ev)
        assert "cp.async.cg.shared.global.L2::cache_hint" in src and tc.L2_POLICY[ev] in src
        assert "cp.async.cg.shared.global [" not in src  # the plain copy is gone
        assert src.replace(tc.L2_POLICY[ev], "") != tc.ROW_GATHER_PRELUDE


def test_paged_hint_prelude():
    assert kernel_paged._hint_prelude("") is None
    src = kernel_paged._hint_prelude("evict_first")
    assert "#define cp_async_gs_conditional fdsa_cp_async_hinted" in src
    assert src.count(tc.L2_POLICY["evict_first"]) == 2


@pytest.mark.parametrize("mod,env_fn", [(narrow, narrow.kv_evict), (kernel_paged, kernel_paged.kv_evict),
                                        (tc, tc.kv_evict_env)])
def test_env_values(monkeypatch, mod, env_fn):
    monkeypatch.setenv(mod.KV_EVICT_ENV, "evict_first")
    assert env_fn() == "evict_first"
    monkeypatch.setenv(mod.KV_EVICT_ENV, "bogus")
    with pytest.raises(ValueError, match=mod.KV_EVICT_ENV):
        env_fn()


def test_fused_decode_lowers_with_hint():
    from flashdsa._tilelang import lower_to_cuda_source
    from flashdsa.decode import kernel_dense_fused as fused

    fn = fused.build_fused_kernel(heads=16, s_q=1, block_size=64, causal=True, sm_scale=576**-0.5, has_sink=False,
                                  num_sms=132, kv_evict="evict_first")
    src = lower_to_cuda_source(fn, fused._pass_configs(), "sm_90a")
    assert src.count("tma_load<tl::CacheHintSm90::EVICT_FIRST>") >= 2
