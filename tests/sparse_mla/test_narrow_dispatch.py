"""CPU: which forward kernel the launchers pick for a head count (kernels replaced by recorders; nothing runs)."""

import pytest
import torch

pytest.importorskip("tilelang")

from flashdsa import _dispatch  # noqa: E402
from flashdsa.sparse import (  # noqa: E402
    kernel_dequant656, kernel_fwd, kernel_fwd_fp8cache, kernel_fwd_mma, kernel_fwd_mma656, kernel_fwd_narrow,
    kernel_fwd_narrow656, kernel_fwd_narrow656_dual, kernel_fwd_pair, kernel_fwd_pair_cache,
)


def _fake_kernel(record, name):
    def build(*key, **kw):
        record.append((name, key))
        return lambda *args: None
    return build


@pytest.fixture
def record(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel_fwd, "kernel_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(kernel_fwd, "_compiled", _fake_kernel(calls, "padded"))
    monkeypatch.setattr(kernel_fwd_narrow, "_compiled", _fake_kernel(calls, "narrow"))
    monkeypatch.setattr(kernel_fwd_mma, "_compiled", _fake_kernel(calls, "mma"))
    monkeypatch.setattr(_dispatch, "sm_count", lambda index: 4)
    monkeypatch.setattr(kernel_fwd_pair, "_compiled", _fake_kernel(calls, "pair"))
    monkeypatch.setattr(kernel_fwd_fp8cache, "kernel_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(kernel_fwd_fp8cache, "_compiled", _fake_kernel(calls, "padded656"))
    monkeypatch.setattr(kernel_fwd_narrow656, "compiled", _fake_kernel(calls, "narrow656"))
    monkeypatch.setattr(kernel_fwd_narrow656_dual, "compiled", _fake_kernel(calls, "narrow656_dual"))
    monkeypatch.setattr(kernel_fwd_mma656, "compiled", _fake_kernel(calls, "mma656"))
    monkeypatch.setattr(kernel_fwd_pair_cache, "kernel_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(kernel_fwd_pair_cache, "_compiled", _fake_kernel(calls, "pair656"))

    def fake_dequantize(kv):
        calls.append(("dequant656", ()))
        return torch.zeros(kv.shape[0], 576, dtype=torch.bfloat16)

    monkeypatch.setattr(kernel_dequant656, "dequantize_cache", fake_dequantize)
    monkeypatch.delenv(kernel_dequant656.DEQUANT_ONCE_ENV, raising=False)
    return calls


@pytest.mark.parametrize("heads,narrow,pair,expect", [
    (1, None, None, "mma"), (16, None, None, "mma"), (17, None, None, "mma"), (32, None, None, "mma"),
    (33, None, None, "padded"),
    (96, None, None, "padded"), (127, None, None, "padded"), (128, None, None, "pair"), (64, None, None, "pair"),
    (64, False, None, "pair"), (128, None, False, "padded"), (16, False, None, "padded"), (64, True, None, "narrow"),
    (16, True, None, "narrow"),
])
def test_bf16_forward_picks_kernel(record, heads, narrow, pair, expect):
    q = torch.zeros(3, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    idx = torch.zeros(3, 100, dtype=torch.int32)
    kernel_fwd.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, narrow=narrow, pair=pair)
    assert [name for name, _ in record] == [expect]


@pytest.mark.parametrize("n_tok,form", [(1, kernel_fwd_mma.FEW_TOKEN_FORM), (7, kernel_fwd_mma.FEW_TOKEN_FORM),
                                         (8, kernel_fwd_mma.TWO_PER_SM_FORM), (15, kernel_fwd_mma.TWO_PER_SM_FORM),
                                         (16, kernel_fwd_mma.MANY_TOKEN_FORM), (300, kernel_fwd_mma.MANY_TOKEN_FORM)])
def test_bf16_few_head_form_by_tokens(record, n_tok, form):
    """H <= 16 (the fake device has 4 SMs): ``kernel_fwd_mma_ws`` (four token groups per CTA) from 4 tokens per SM
    on, two CTAs per SM from 2, else four key groups per token."""
    q = torch.zeros(n_tok, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    idx = torch.zeros(n_tok, 100, dtype=torch.int32)
    kernel_fwd.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512)
    assert record == [("mma", (16, 576, 512, 2, 0.1, False, False))]
    assert kernel_fwd_mma.dispatched(n_tok, 0).keywords == {"form": form}
    assert kernel_fwd_mma.dispatched(n_tok, 0, 17).keywords == {"form": kernel_fwd_mma.TWO_TILE_FORM}


def test_bf16_few_head_form_env(record, monkeypatch):
    """$FLASHDSA_MMA_MANY_TOKEN_FORM replaces the many-token form (timing runs); fewer tokens keep theirs."""
    monkeypatch.setenv("FLASHDSA_MMA_MANY_TOKEN_FORM", "mma_c2q6")
    assert kernel_fwd_mma.dispatched(16, 0).keywords == {"form": "mma_c2q6"}
    assert kernel_fwd_mma.dispatched(15, 0).keywords == {"form": kernel_fwd_mma.TWO_PER_SM_FORM}


@pytest.mark.parametrize("env,heads,pair,expect", [
    ("", 16, None, "mma656"), ("0", 16, None, "padded656"),  # 3 x 100 slots over 1000 rows: read once
    ("", 1, None, "mma656"), ("mma", 9, None, "mma656"), ("mma", 17, None, "narrow656"),
    ("", 17, None, "narrow656"), ("", 32, None, "narrow656"), ("1", 16, None, "narrow656"),
    ("narrow656", 9, None, "narrow656"), ("", 33, None, "padded656"), ("", 64, None, "pair656"),
    ("", 128, None, "pair656"), ("", 96, None, "padded656"), ("", 128, False, "padded656"),
    ("regs", 9, None, "narrow656_dual:regs"), ("ring16", 16, None, "narrow656_dual:ring16"),
    ("ring", 16, None, "narrow656_dual:ring"), ("ring_er", 16, None, "narrow656_dual:ring_er"),
    ("ring", 17, None, "narrow656"), ("ring_er_f16", 3, None, "narrow656_dual:ring_er_f16"),
])
def test_cache656_forward_picks_kernel(record, monkeypatch, env, heads, pair, expect):
    monkeypatch.setenv(kernel_fwd_fp8cache.NARROW_ENV, env)
    q = torch.zeros(3, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1000, 656, dtype=torch.uint8)  # 3 x 100 gathered rows: no whole-cache copy
    idx = torch.zeros(3, 100, dtype=torch.int32)
    kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, pair=pair)
    assert [_named(name, key) for name, key in record] == [expect]


def test_cache656_few_head_prefill_picks_mma(record, monkeypatch):
    """H <= 16 over the 656-byte cache: the per-warp mma.sync kernel also where rows are reused (prefill; session 33
    measured it faster than the two-warpgroup form at S 256 and 4096 as well as in decode)."""
    monkeypatch.delenv(kernel_fwd_fp8cache.NARROW_ENV, raising=False)
    q = torch.zeros(30, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1000, 656, dtype=torch.uint8)  # 30 x 100 slots over 1000 rows: reused
    kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv, torch.zeros(30, 100, dtype=torch.int32), sm_scale=0.1, d_v=512)
    assert [_named(n, k) for n, k in record] == ["mma656"]


def test_cache656_mma_rejects_wide_heads(record):
    q = torch.zeros(3, 17, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="H=17"):
        kernel_fwd_fp8cache.run_sparse_mla_fwd(q, torch.zeros(10, 656, dtype=torch.uint8),
                                               torch.zeros(3, 100, dtype=torch.int32), sm_scale=0.1, d_v=512,
                                               narrow="mma")


@pytest.mark.parametrize("name,expect", [
    ("mma", (0, False, False)), ("mma_a64", (64, False, False)), ("mma_par", (0, True, False)),
    ("mma_par_a48", (48, True, False)), ("mma_ws", (0, False, True)), ("mma_ws_par", (0, True, True)),
    ("mma_ws_a16", (16, False, True)), ("mma_ws_par_a64", (64, True, True))])
def test_mma656_form_names(name, expect):
    assert kernel_fwd_mma656.form(name) == expect


@pytest.mark.parametrize("name", ["mma_parity", "mma_a", "mma_a6x", "mmax", "mma_a8_par", "ring", "mma_par_ws",
                                  "mma_wsx"])
def test_mma656_form_names_rejected(name):
    with pytest.raises(ValueError, match=repr(name)):
        kernel_fwd_mma656.form(name)


def _named(name, key):
    return f"{name}:{key[-1]}" if name == "narrow656_dual" else name  # the dual form's last key is its prefetch


def test_cache656_explicit_forms(record):
    q = torch.zeros(3, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 656, dtype=torch.uint8)
    idx = torch.zeros(3, 100, dtype=torch.int32)
    for narrow in (None, True, "regs", False):
        kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, narrow=narrow)
    assert [_named(n, k) for n, k in record] == ["mma656", "narrow656", "narrow656_dual:regs", "padded656"]


@pytest.mark.parametrize("n_tok,heads,tkv,env,choice,expect", [
    (3, 128, 1000, "", None, ["pair656"]),  # 3 * 100 * 128 < 8 * 64 * 1000
    (40, 128, 1000, "", None, ["dequant656", "pair"]),  # 40 * 100 * 128 >= 8 * 64 * 1000
    (80, 64, 1000, "", None, ["dequant656", "pair"]), (79, 64, 1000, "", None, ["pair656"]),
    (40, 128, 1000, "0", None, ["pair656"]), (3, 64, 1000, "1", None, ["dequant656", "pair"]),
    (3, 64, 1000, "0", True, ["dequant656", "pair"]), (40, 128, 1000, "1", False, ["pair656"]),
    (40, 128, 1000, "", None, ["dequant656", "pair"]),
    (10**6, 128, (1 << 30) // 1152 + 1, "", None, ["pair656"]),  # the copy would exceed DEQUANT_ONCE_MAX_BYTES
])
def test_cache656_dequant_once_rule(record, monkeypatch, n_tok, heads, tkv, env, choice, expect):
    """H 64 / 128 over the cache: a bf16 copy of the whole cache + the bf16 pair kernel where the rows are reused
    (``kernel_dequant656.use_dequant_once``), else the pair cache kernel; ``$FLASHDSA_DEQUANT_ONCE`` / the
    ``dequant_once`` argument override the rule."""
    if env:
        monkeypatch.setenv(kernel_dequant656.DEQUANT_ONCE_ENV, env)
    assert kernel_dequant656.use_dequant_once(n_tok, 100, heads, tkv, choice) == (expect[0] == "dequant656")
    if n_tok * heads > 10**6:
        return  # the rule only: the tensors would be too large to build here
    q = torch.zeros(n_tok, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(tkv, 656, dtype=torch.uint8)
    idx = torch.zeros(n_tok, 100, dtype=torch.int32)
    kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, dequant_once=choice)
    assert [name for name, _ in record] == expect


@pytest.mark.parametrize("n_tok,topk,heads,n_rows,expect", [
    (4096, 2048, 128, 8192, True), (4096, 2048, 128, 131072, True), (4096, 2048, 64, 8192, True),  # prefill
    (256, 2048, 128, 128 * 32768, False), (128, 2048, 64, 128 * 32768, False),  # the decode suite's sparse rows
    (1, 65536, 128, 65536, False),  # one long request's dense decode over the FP8 cache
])
def test_dequant_once_rule_on_issue_shapes(monkeypatch, n_tok, topk, heads, n_rows, expect):
    monkeypatch.delenv(kernel_dequant656.DEQUANT_ONCE_ENV, raising=False)
    assert kernel_dequant656.use_dequant_once(n_tok, topk, heads, n_rows) is expect


def test_narrow_rejects_wide_heads():
    with pytest.raises(ValueError, match="H=33"):
        kernel_fwd_narrow.rows_tile(33)


@pytest.mark.parametrize("form", ["ring", "ring_er_f16"])
def test_cache656_few_head_forms_reject_wide_heads(record, form):
    q = torch.zeros(3, 17, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 656, dtype=torch.uint8)
    idx = torch.zeros(3, 100, dtype=torch.int32)
    with pytest.raises(ValueError, match="H=17"):
        kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, narrow=form)


_ROWS = (("row_gather", True),)
_TMA = (("q_gate", "tma"),)


@pytest.fixture(autouse=True)
def _no_grid_switches(monkeypatch):
    """The grid rules below are the defaults: the A / B switches of the pair grid (and the paged kernel's) set in
    the calling shell must not leak in."""
    from flashdsa.decode import kernel_pair_paged

    for var in (kernel_fwd_pair.QTMA_ENV, kernel_fwd_pair.QNEXT_ENV, kernel_fwd_pair.PERSISTENT_MAX_ENV,
                kernel_pair_paged.QTMA_ENV):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("n_blocks,n_sm,expect", [(10, 132, (("persistent", 132),) + _ROWS),
                                                   (1, 78, (("persistent", 78),) + _ROWS),
                                                   (11, 132, _ROWS + _TMA), (32, 132, _ROWS + _TMA),
                                                   (5, 0, _ROWS + _TMA)])
def test_pair_grid_rule(monkeypatch, n_blocks, n_sm, expect):
    """The pair kernel's grid: persistent (one CTA per SM looping over the items) up to 10 blocks of 64 slots, else
    one CTA per item loading Q by TMA (``$FLASHDSA_PAIR_QTMA=0``: by 16-byte loads); both gather by rows."""
    monkeypatch.delenv(kernel_fwd_pair.QTMA_ENV, raising=False)
    assert kernel_fwd_pair._persistent_kw(n_blocks, n_sm) == expect
    monkeypatch.setenv(kernel_fwd_pair.QTMA_ENV, "0")
    assert kernel_fwd_pair._persistent_kw(n_blocks, n_sm) == tuple(kv for kv in expect if kv not in _TMA)


def test_pair_grid_q_next_and_persistent_bound(monkeypatch):
    """``$FLASHDSA_PAIR_QNEXT=1`` gives the persistent grid Q loaded ahead by the producer ("next"; unset or "0":
    the consumers' loads), and only the persistent grid; ``$FLASHDSA_PAIR_PERSISTENT_MAX`` moves the block count up
    to which the grid is persistent (A / B runs)."""
    persistent = (("persistent", 132),) + _ROWS
    assert kernel_fwd_pair._persistent_kw(10, 132) == persistent
    monkeypatch.setenv(kernel_fwd_pair.QNEXT_ENV, "1")
    assert kernel_fwd_pair._persistent_kw(10, 132) == persistent + (("q_gate", "next"),)
    assert kernel_fwd_pair._persistent_kw(11, 132) == _ROWS + _TMA
    assert kernel_fwd_pair._persistent_kw(10, 132, single_use=True) == persistent + (("evict_first", True),)
    monkeypatch.setenv(kernel_fwd_pair.PERSISTENT_MAX_ENV, "32")
    assert kernel_fwd_pair._persistent_kw(32, 132) == persistent + (("q_gate", "next"),)
    monkeypatch.setenv(kernel_fwd_pair.PERSISTENT_MAX_ENV, "0")
    assert kernel_fwd_pair._persistent_kw(1, 132) == _ROWS + _TMA


@pytest.mark.parametrize("var,value", [("QNEXT_ENV", "yes"), ("QNEXT_ENV", "2"), ("PERSISTENT_MAX_ENV", "-1"),
                                       ("PERSISTENT_MAX_ENV", "ten"), ("PERSISTENT_MAX_ENV", "\u00b2")])
def test_pair_grid_switches_reject_other_values(monkeypatch, var, value):
    """The grid switches' other values are a ValueError naming the variable, not a silent default."""
    name = getattr(kernel_fwd_pair, var)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        kernel_fwd_pair._persistent_kw(10, 132)


@pytest.mark.parametrize("n_tok,heads,n_blocks,kv_rows,single_use", [
    (128, 64, 10, 128 * 8192, True),  # DeepSeek-V4 decode shape (b 128, m 1): each row read ~0.08 times
    (64, 128, 32, 64 * 4096, True),  # 2 head groups x 2048 slots over 4096 rows each: exactly once
    (65, 128, 32, 64 * 4096, False),
    (4096, 64, 10, 8192, False),  # V4 prefill: 320 reads per row
    (4096, 128, 32, 131072, False),  # prefill over a 128K cache: 128 reads per row
])
def test_pair_evict_first_rule(n_tok, heads, n_blocks, kv_rows, single_use):
    """The pair kernel's gather takes the L2 evict_first policy exactly when the call reads a KV row at most once
    on average (T * H / 64 * topk <= Tkv), H is 64 (one head group) and Dqk 512 (DeepSeek-V4)."""
    assert (kernel_fwd_pair.reads_per_row(n_tok, heads, n_blocks, kv_rows) <= 1) == single_use
    for dqk in (512, 576):
        q = torch.zeros(n_tok, heads, dqk, dtype=torch.bfloat16)  # a CPU tensor: no SM count, one CTA per item
        kw = kernel_fwd_pair.dispatched_kw(q, n_blocks, kv_rows)
        assert (("evict_first", True) in kw) == (single_use and heads == 64 and dqk == 512)
        assert ("row_gather", True) in kw
        assert (("q_gate", "tma") in kw) == (("evict_first", True) not in kw)  # Q by TMA: prefill grids only


@pytest.mark.parametrize("value", ["yes", "off", "2"])
def test_q_tma_switches_reject_other_values(monkeypatch, value):
    """``$FLASHDSA_PAIR_QTMA`` / ``$FLASHDSA_DECODE_PAIR_QTMA`` take "0" or "1" (unset: the default); any other value
    is a ValueError naming the variable, not a silent default."""
    from flashdsa.decode import kernel_pair_paged

    monkeypatch.setenv(kernel_fwd_pair.QTMA_ENV, value)
    with pytest.raises(ValueError, match="FLASHDSA_PAIR_QTMA"):
        kernel_fwd_pair._persistent_kw(32, 132)
    monkeypatch.setenv(kernel_pair_paged.QTMA_ENV, value)
    with pytest.raises(ValueError, match="FLASHDSA_DECODE_PAIR_QTMA"):
        kernel_pair_paged.use_q_tma(64)


@pytest.mark.parametrize("n_tok,heads,tkv,expect", [
    (40, 128, 1000, None),  # rows reused: the whole-cache copy + the bf16 pair kernel, two launches: no single launch
    (3, 128, 1000, "pair656"), (3, 16, 1000, "mma656"), (3, 33, 1000, "padded656"),
])
def test_cache656_launcher(record, monkeypatch, n_tok, heads, tkv, expect):
    """``kernel_fwd_fp8cache.launcher`` (what ``mla_decode``'s eager plans store): the kernel ``run_sparse_mla_fwd``
    would launch, or None where that call is not one launch."""
    monkeypatch.delenv(kernel_fwd_fp8cache.NARROW_ENV, raising=False)
    q = torch.zeros(n_tok, heads, 576, dtype=torch.bfloat16)
    launch = kernel_fwd_fp8cache.launcher(q, torch.zeros(tkv, 656, dtype=torch.uint8),
                                          torch.zeros(n_tok, 100, dtype=torch.int32), sm_scale=0.1, d_v=512)
    assert (launch is None) == (expect is None)
    assert [name for name, _ in record] == ([] if expect is None else [expect])


@pytest.mark.parametrize("heads,n_tok,kw,env,gate", [
    (64, 3, {}, None, "al"), (64, 4, {}, None, "al"), (64, 5, {}, None, "tma"), (64, 2, {}, None, ""),
    (128, 2, {}, None, "al"), (128, 3, {}, None, "tma"), (64, 3, dict(out_f32=True), None, ""),
    (64, 9, dict(out_f32=True), None, ""), (64, 3, dict(staging="consumer"), None, ""),
    (64, 9, dict(staging="consumer"), None, ""), (64, 3, dict(persistent=2), None, ""),
    (64, 9, dict(persistent=2), None, ""), (64, 3, {}, "off", ""), (64, 9, {}, "off", ""), (64, 9, {}, "ar", "ar"),
    (64, 3, dict(staging="consumer"), "al", ""), (64, 3, dict(staging="consumer"), "tma", "tma"),
    (64, 3, dict(staging="consumer"), "tma_al", ""), (64, 3, dict(persistent=2), "tma", ""),
    (64, 9, dict(q_gate="al"), None, "al"), (64, 3, dict(q_gate="tma"), None, "tma"), (64, None, {}, None, "")])
def test_pair_cache_auto_q_gate(record, monkeypatch, heads, n_tok, kw, env, gate):
    """The pair-cache launcher's Q load (4 SMs here): "auto" gates a launch whose CTAs (tokens x 64-head groups)
    fill more than half of the SMs and fit on them at once ("al") and loads Q by TMA where they take more than one
    wave ("tma"), with a converter staging, one item per CTA and bf16 outputs; the environment's values reach only
    launches that can take them ("tma": one item per CTA; the gated ones also a converter), an explicit one
    always."""
    monkeypatch.delenv(kernel_fwd_pair_cache.PERSISTENT_ENV, raising=False)
    if env is None:
        monkeypatch.delenv(kernel_fwd_pair_cache.QGATE_ENV, raising=False)
    else:
        monkeypatch.setenv(kernel_fwd_pair_cache.QGATE_ENV, env)
    kernel_fwd_pair_cache.launcher(heads, 2, 0.1, False, False, n_tok=n_tok, device_index=0, **kw)
    assert record[-1][0] == "pair656" and record[-1][1][-1] == gate
